"""`fast-track record-coverage`: a coverage.py JSON report of a GPU run -> an evidence record.

The GPU workflow runs the GPU tests under `coverage run --source=<model>/kernels` and
`coverage json`; this turns that report into one record (kind `kernel-test`, family
`coverage`) so item `kernel-tests` can see which kernel lines ran on the GPU. Its
`sources` are the kernel files the report covers and the test files the command runs (which
lines run depends on both); one result per kernel file passes when at least one of its lines
ran; `coverage.files` keeps the executed and missing lines.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from .model import ModelFolder
from .records import record_head, write_json


def _repo_relative(root: Path, key: str) -> str:
    path = Path(key)
    if path.is_absolute():
        try:
            return path.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            return path.as_posix()
    return path.as_posix()


def _test_files(root: Path, command: str) -> list[str]:
    """The .py files of the repository that `command` names (the tests coverage ran)."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    paths = (w.split("::")[0] for w in words)  # a pytest node id names its file before "::"
    return sorted({Path(p).as_posix() for p in paths if p.endswith(".py") and (root / p).is_file()})


def coverage_record(model: ModelFolder, report: dict[str, Any], command: str) -> dict[str, Any]:
    files = report.get("files")
    if not isinstance(files, dict):
        raise ValueError("the coverage file has no 'files' mapping: pass the output of "
                         "`coverage json`, not the .coverage database")
    kernels = model.sub("kernels") + "/"
    covered: dict[str, dict[str, list[int]]] = {}
    for key, entry in files.items():
        rel = _repo_relative(model.root, key)
        if rel.startswith(kernels) and (model.root / rel).is_file():
            covered[rel] = {"executed_lines": list(entry.get("executed_lines", [])),
                            "missing_lines": list(entry.get("missing_lines", []))}
    if not covered:
        raise ValueError(f"the coverage report covers no file under {kernels}: run the tests with "
                         f"`coverage run --source={model.sub('kernels')}`")
    record = record_head(model.root, "kernel-test", "coverage", command,
                         sorted(covered) + _test_files(model.root, command))
    results = []
    for rel in sorted(covered):
        executed, missing = covered[rel]["executed_lines"], covered[rel]["missing_lines"]
        statements = len(executed) + len(missing)
        results.append({"name": f"coverage:{rel}", "status": "pass" if executed else "fail",
                        "executed": len(executed), "statements": statements,
                        "percent": round(100.0 * len(executed) / statements, 1) if statements else 0.0})
    record["versions"] = {"coverage": str((report.get("meta") or {}).get("version", "unknown"))}
    record.update(results=results, targets=[], coverage={"files": covered})
    return record


def write_coverage_record(model: ModelFolder, coverage_json: Path, out: Path, command: str) -> dict:
    try:
        report = json.loads(coverage_json.read_text())
    except FileNotFoundError:
        raise ValueError(f"{coverage_json}: no such file; write it with `coverage json -o "
                         f"{coverage_json}` after `coverage run`") from None
    record = coverage_record(model, report, command)
    write_json(out, record)
    return record
