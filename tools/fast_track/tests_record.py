"""`fast-track record-tests`: run pytest, and record each test's outcome as evidence.

    fast-track record-tests --out FILE --kind parity --family F --source PATH [--source ...]
                            -- python -m pytest [ARGS...] NODE_IDS...

The command must be a pytest run; `--junitxml` is added to it, and each test case of the
report becomes a result named after the test (`test_name` or `test_name[param]`, the form
item `features` matches against SCOPE.yaml's preserved features), with status `pass`,
`fail` or `skip` (a skipped test proves nothing, so it does not count as a pass); a failure
keeps the first lines of its message, and a skip its reason, so the record says why. The record
(kind `parity` or `kernel-test`) lists `--source`: the files whose behaviour the tests
prove, so that its freshness follows them. The GPU runners use it for the preserved-feature
tests on the specialized path.
"""

from __future__ import annotations

import shlex
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .records import record_head, write_json

KINDS = ("parity", "kernel-test")
MESSAGE_LINES = 8


def outcomes(junit_xml: Path) -> list[dict[str, Any]]:
    """One result per test case of a pytest JUnit report."""
    results = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        verdicts = {child.tag for child in case} & {"failure", "error", "skipped"}
        status = "fail" if verdicts & {"failure", "error"} else "skip" if verdicts else "pass"
        result = {"name": case.get("name", ""), "module": case.get("classname", ""), "status": status,
                  "seconds": float(case.get("time", 0.0))}
        for tag in ("failure", "error", "skipped"):
            verdict = case.find(tag)
            if verdict is not None:
                # pytest's message is the exception's first line; the report text holds its assertion
                text = verdict.get("message") or (verdict.text or "")
                result["reason"] = "\n".join(text.strip().splitlines()[:MESSAGE_LINES])
                break
        results.append(result)
    return results


def record_tests(root: Path, out: Path, kind: str, family: str, sources: list[str],
                 command: list[str], timeout_s: int = 3600) -> dict[str, Any]:
    if kind not in KINDS:
        raise ValueError(f"--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if "pytest" not in " ".join(command[:3]):
        raise ValueError("the command after `--` must run pytest (e.g. `python -m pytest -q NODE_ID ...`): "
                         "its JUnit report is what is recorded")
    record = record_head(root, kind, family, shlex.join(command), sources)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        run = subprocess.run([*command, f"--junitxml={report}"], capture_output=True, text=True,
                             timeout=timeout_s)
        if not report.is_file():
            tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
            raise ValueError(f"pytest wrote no report (exit {run.returncode}): {' | '.join(tail)}")
        results = outcomes(report)
    if not results:
        raise ValueError("the command ran no test: check the node ids and the -m/-k selection")
    record["results"] = results
    record["exit_code"] = run.returncode
    record["wall_s"] = round(time.monotonic() - start, 1)  # what a refresh of this record plans for
    record["targets"] = [{"name": "every recorded test passed", "target": "all pass",
                          "value": sum(r["status"] == "pass" for r in results) / len(results),
                          "met": all(r["status"] == "pass" for r in results)}]
    write_json(out, record)
    return record
