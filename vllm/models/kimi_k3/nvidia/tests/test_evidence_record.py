"""Evidence records follow ARCHITECTURE.md §7, hash exactly the sources they name, and come only
from whole-file test runs."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm.models.kimi_k3.nvidia.latency_specialized.evidence import source_hash
from vllm.models.kimi_k3.nvidia.tests._evidence import partial_selection, record_kernel_test

SOURCES = ["vllm/models/kimi_k3/nvidia/reference/ops.py", "vllm/models/kimi_k3/nvidia/tests/_evidence.py"]


def test_kernel_test_record_format(tmp_path, monkeypatch):
    results = [{"name": "a", "status": "pass", "rel_err": 1e-3}, {"name": "b", "status": "fail", "rel_err": 0.5}]
    monkeypatch.delenv("K3_EVIDENCE_DIR", raising=False)
    assert record_kernel_test("x.json", "demo", "tests/x.py", SOURCES, results, "all cases pass") is None
    monkeypatch.setenv("K3_EVIDENCE_DIR", str(tmp_path))
    assert record_kernel_test("x.json", "demo", "tests/x.py", SOURCES, [], "all cases pass") is None
    path = record_kernel_test("x.json", "demo", "tests/x.py", SOURCES, results, "all cases pass", extra={"bound": 1e-2})
    rec = json.loads(open(path).read())
    for key in ("kind", "family", "command", "gpu", "compute_capability", "driver", "versions", "commit",
                "sources", "source_hash", "wall_s", "results", "targets"):
        assert key in rec, key
    assert (rec["kind"], rec["family"]) == ("kernel-test", "demo")
    assert rec["source_hash"] == source_hash(SOURCES) and rec["sources"] == SOURCES
    assert rec["targets"] == [{"name": "all cases pass", "target": "all pass", "value": 0.5, "met": False}]
    assert rec["results"] == results and "tests/x.py" in rec["command"]


def test_source_hash_is_the_documented_formula_over_the_files_bytes(tmp_path):
    """sha256 over the sources in sorted path order, each path + NUL + its bytes + NUL (the form
    the checker recomputes, tools/fast_track/evidence.py): any edit of a source changes it, a
    reordered list does not."""
    (tmp_path / "b.py").write_text("two = 2\n")
    (tmp_path / "a.py").write_text("one = 1\n")
    want = hashlib.sha256(b"a.py\0one = 1\n\0b.py\0two = 2\n\0").hexdigest()
    assert source_hash(["b.py", "a.py"], root=tmp_path) == source_hash(["a.py", "b.py"], root=tmp_path) == want
    (tmp_path / "b.py").write_text("two = 3\n")
    assert source_hash(["a.py", "b.py"], root=tmp_path) != want


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="no /proc: wall_s is None there")
def test_wall_s_counts_from_the_process_start():
    """A record's wall_s is what a refresh budgets for (.ci/h200_refresh.py): the whole run,
    imports included, not the time since some later mark."""
    code = ("import time; time.sleep(1.5)\n"
            "from vllm.models.kimi_k3.nvidia.latency_specialized.evidence import process_wall_s\n"
            "print(process_wall_s())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(__file__) + "/../../../../..")
    assert 1.4 <= float(out.stdout) < 30


def test_partial_selection_names_what_narrows_the_run():
    whole = SimpleNamespace(keyword="", markexpr="gpu", deselect=None, lf=False, maxfail=0)
    assert partial_selection(whole, ["tests/test_x.py"]) is None
    assert partial_selection(SimpleNamespace(**{**vars(whole), "markexpr": ""}), ["tests/test_x.py"]) is None
    narrowed = SimpleNamespace(keyword="repeat", markexpr="gpu and not slow", deselect=["a"], lf=True, maxfail=1)
    why = partial_selection(narrowed, ["tests/test_x.py::test_a"])
    for part in ("-k 'repeat'", "-m 'gpu and not slow'", "test ids", "--deselect", "--lf", "-x"):
        assert part in why, (part, why)


@pytest.mark.slow
def test_a_partial_run_writes_no_records(tmp_path):
    """The real hook, loaded as a plugin into a pytest run of a probe file: with `-k` the tests no
    longer see K3_EVIDENCE_DIR and the run says why; the whole file sees it."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("import os\n\ndef test_probe():\n"
                     "    open(os.environ['K3_PROBE_OUT'], 'w').write(os.environ.get('K3_EVIDENCE_DIR', '<unset>'))\n\n"
                     "def test_other():\n    pass\n")
    seen = tmp_path / "seen"
    env = {**os.environ, "K3_EVIDENCE_DIR": str(tmp_path / "ev"), "K3_PROBE_OUT": str(seen)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "vllm.models.kimi_k3.nvidia.tests.conftest",
           "--rootdir", str(tmp_path), str(probe)]
    part = subprocess.run([*cmd, "-k", "probe"], env=env, capture_output=True, text=True, timeout=120)
    assert part.returncode == 0, part.stdout + part.stderr
    assert seen.read_text() == "<unset>" and "K3_EVIDENCE_DIR ignored" in part.stdout and "-k 'probe'" in part.stdout
    whole = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert seen.read_text() == str(tmp_path / "ev") and "K3_EVIDENCE_DIR ignored" not in whole.stdout


@pytest.mark.slow
def test_parity_record_is_written_once_the_module_ran(tmp_path):
    """The fixture `parity_record` gives a test module: bound to a module name it is collected,
    and after the module's tests it writes what they appended, as one parity record."""
    probe, named = tmp_path / "test_probe.py", "vllm/models/kimi_k3/nvidia/tests/test_evidence_record.py"
    probe.write_text("from vllm.models.kimi_k3.nvidia.tests._evidence import parity_record\n"
                     f"RESULTS = []\nrecord = parity_record('p.json', 'demo', {named!r}, {SOURCES!r}, RESULTS)\n\n"
                     "def test_a():\n    RESULTS.append({'name': 'a', 'status': 'pass'})\n\n"
                     "def test_b():\n    RESULTS.append({'name': 'b', 'status': 'pass'})\n")
    env = {**os.environ, "K3_EVIDENCE_DIR": str(tmp_path / "ev")}
    os.makedirs(tmp_path / "ev")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(probe)], env=env, capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(__file__) + "/../../../../..")
    assert run.returncode == 0, run.stdout + run.stderr
    rec = json.loads((tmp_path / "ev" / "p.json").read_text())
    assert (rec["kind"], rec["family"], rec["command"]) == ("parity", "demo", f"pytest -m gpu {named}")
    assert [r["name"] for r in rec["results"]] == ["a", "b"] and rec["sources"] == [*SOURCES, named]


def test_committed_records_sit_in_the_folder_of_the_machine_that_made_them():
    """evidence/h200/ holds what an H200 ran and evidence/cpu/ what ran with no GPU: on
    2026-12-05 an H100 was lent in place of the H200, and its records, copied by habit, would
    have passed for H200 evidence."""
    checked = 0
    for path in sorted((Path(__file__).parent.parent / "evidence").glob("*/*.json")):
        folder, data = path.parent.name, json.loads(path.read_text())
        for rec in data if isinstance(data, list) else [data]:
            gpu = str(rec.get("gpu") or "none")
            where = f"evidence/{folder}/{path.name} ran on {gpu!r}"
            if folder == "cpu":
                assert gpu.lower() in ("none", "cpu"), f"{where}: the cpu folder is for runs without a GPU"
            else:
                assert folder.lower() in gpu.lower(), f"{where}: move it to its GPU's folder"
            checked += 1
    assert checked >= 40  # the committed records, not an empty folder
