"""`fast-track compare`: case-by-case ratios, the drift of the controls, refusals."""

import json
import re

import pytest

from ..cli import main
from ..compare import compare

BENCH = "vllm/models/toy/acme/evidence/h200/bench.json"


def record(times: dict[str, float], gpu: str = "NVIDIA H200", family: str = "moe", kind: str = "kernel-bench",
           status: dict[str, str] | None = None) -> dict:
    return {"kind": kind, "family": family, "gpu": gpu,
            "results": [{"name": n, "status": (status or {}).get(n, "pass"), "time_us": t}
                        for n, t in times.items()]}


BEFORE = {"a M=1": 20.0, "a M=8": 100.0, "a M=16": 200.0, "a M=64": 400.0, "gone M=2": 5.0}
# controls drift by +1% and +3% (median 1.02, spread 1%); M=1 by 2% (the drift), M=8 by 10%
AFTER = {"a M=1": 20.4, "a M=8": 110.0, "a M=16": 202.0, "a M=64": 412.0, "new M=4": 7.0}


def test_ratios_drift_and_flags():
    c = compare(record(BEFORE), record(AFTER), control=re.compile(r"M=(16|64)$"))
    ratios = {r.name: round(r.ratio, 4) for r in c.rows}
    assert ratios == {"a M=1": 1.02, "a M=8": 1.1, "a M=16": 1.01, "a M=64": 1.03}
    assert c.drift == pytest.approx(1.02) and c.spread == pytest.approx(0.0098, abs=1e-4)
    flagged = {r.name for r in c.rows if c.flagged(r)}
    assert flagged == {"a M=8"}  # M=1 moved by the drift only; controls are never flagged
    assert c.only_before == ["gone M=2"] and c.only_after == ["new M=4"]


def test_the_drift_is_the_controls_median_and_a_case_within_their_spread_is_not_flagged():
    """Three controls at 1.00, 1.01 and 1.06: the median 1.01, not the mean 1.023; their spread
    (1.06 / 1.01 - 1) about 0.0495; a case at 1.05 is within it, one at 1.07 beyond."""
    before = {"c1": 100.0, "c2": 100.0, "c3": 100.0, "in": 100.0, "out": 100.0}
    after = {"c1": 100.0, "c2": 101.0, "c3": 106.0, "in": 105.0, "out": 107.0}
    c = compare(record(before), record(after), control=re.compile("^c"))
    assert c.drift == pytest.approx(1.01) and c.spread == pytest.approx(1.06 / 1.01 - 1)
    assert {r.name for r in c.rows if c.flagged(r)} == {"out"}


def test_failed_or_timeless_cases_are_listed_not_compared():
    before = {"ok": 10.0, "failed": 10.0, "zero": 0.0, "inf": float("inf"), "c1": 1.0, "c2": 1.0}
    after = {"ok": 11.0, "failed": 5.0, "zero": 3.0, "inf": 2.0, "c1": 1.0, "c2": 1.0}
    c = compare(record(before), record(after, status={"failed": "fail"}), control=re.compile("^c"))
    assert [r.name for r in c.rows] == ["ok", "c1", "c2"]
    assert c.not_compared == {"failed": "fail in the second record",
                              "zero": "no finite positive `time_us` in the first record",
                              "inf": "no finite positive `time_us` in the first record"}
    assert c.only_before == [] and c.only_after == []  # named in both, so not "only in" either


@pytest.mark.parametrize("before, after, control, message", [
    (record({"x": 1.0, "y": 2.0}), record({"x": 1.0, "y": 2.0}), re.compile("x"), "matches 1 compared case"),
    ({**record({}), "results": [{"name": "x", "time_us": 1.0}] * 2}, record({"x": 1.0}), None,
     "names case 'x' twice"),
    ({**record({}), "results": [{"time_us": 1.0}]}, record({"x": 1.0}), None, "has no name"),
    (record({"x": 0.0}), record({"x": 1.0}), None, "no case has a usable"),
])
def test_what_cannot_be_judged_is_refused(before, after, control, message):
    with pytest.raises(ValueError, match=message):
        compare(before, after, control=control)


def test_without_controls_nothing_is_flagged():
    c = compare(record(BEFORE), record(AFTER))
    assert c.drift is None and not any(c.flagged(r) for r in c.rows)


@pytest.mark.parametrize("after, what", [
    (record(AFTER, gpu="NVIDIA H100 80GB HBM3"), "gpu"),
    (record(AFTER, family="gemm"), "family"),
    (record(AFTER, kind="decode-bench"), "kind"),
])
def test_records_of_another_gpu_or_family_are_refused(after, what):
    with pytest.raises(ValueError, match=f"differ in {what}"):
        compare(record(BEFORE), after)


def test_the_cli_reads_a_record_at_a_git_ref_and_prints_the_table(repo, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(repo.root)
    path = repo.root / BENCH
    path.write_text(json.dumps(record(BEFORE)))
    repo.commit("the record as it was")
    path.write_text(json.dumps(record({"a M=1": 1.0})))  # the working tree has moved on
    after = tmp_path / "after.json"
    after.write_text(json.dumps(record(AFTER)))
    assert main(["compare", f"HEAD:{BENCH}", str(after), "--control", "M=(16|64)$"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("a M=8 "))
    assert line.split()[2:6] == ["100.00", "110.00", "1.100", "1.078"] and "beyond every control" in line
    assert "drift (median of 2 control(s)): 1.020" in out and "only in the first record: gone M=2" in out


def test_the_cli_names_what_it_cannot_read(repo, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(repo.root)
    colon = tmp_path / "run:2.json"  # a file whose name has a colon is read as a file, not REF:PATH
    colon.write_text(json.dumps(record(AFTER)))
    assert main(["compare", str(colon), str(colon)]) == 0
    notes = tmp_path / "notes.json"
    notes.write_text(json.dumps({"kind": "kernel-bench"}))
    assert main(["compare", str(notes), str(colon)]) == 2
    assert "no `results` list" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["compare", str(bad), str(bad)]) == 2
    assert "bad.json is not JSON" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json"), str(bad)]) == 2
    assert "cannot read record" in capsys.readouterr().err
    assert main(["compare", f"HEAD:{BENCH}", str(bad)]) == 2  # not at that ref
    assert "git show" in capsys.readouterr().err


def test_a_boolean_time_is_not_a_time():
    """JSON `true` is a Python bool, which is an int: it must not compare as 1.0 µs."""
    before = {"ok": 10.0, "flag": True, "c1": 1.0, "c2": 1.0}
    after = {"ok": 11.0, "flag": 2.0, "c1": 1.0, "c2": 1.0}
    c = compare(record(before), record(after), control=re.compile("^c"))
    assert [r.name for r in c.rows] == ["ok", "c1", "c2"]
    assert c.not_compared == {"flag": "no finite positive `time_us` in the first record"}
