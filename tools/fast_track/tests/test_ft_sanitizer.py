"""Item `sanitizer`: kernels with cross-CTA or cross-rank synchronisation need a clean, fresh record."""

import json
import os

from ..cli import main
from ..items import FAIL, PASS
from ..sanitizer import sync_sites
from .conftest import KERNEL, MODEL, edit_code, review_items

SANITIZER = f"{MODEL}/evidence/h200/sanitizer.json"


def test_only_code_counts_not_comments_or_strings(tmp_path):
    path = tmp_path / "k.py"
    path.write_text('"""Uses no atomic_add and no flag."""\n'
                    "# a grid_barrier would go here\n"
                    "x = 'semaphore'\n"
                    "cute.arch.barrier()  # intra-CTA: not counted\n"
                    "ready_flag = load_acquire(p)\n"
                    "cute.arch.fence_acq_rel_gpu()\n")
    assert sync_sites(path) == [(5, "ready_flag"), (6, "fence_acq_rel_gpu")]


def test_a_new_synchronising_kernel_without_record_fails_at_its_line(repo):
    repo.write(f"{MODEL}/kernels/reduce.py", "def launch(x, sem):\n    x = 1\n"
                                             "    grid_barrier(sem)\n    return x\n")
    item = review_items(repo.root)["sanitizer"]
    assert item.status == FAIL
    bad = [f for f in item.findings if "no sanitizer record" in f.message]
    assert [(f.path, f.line) for f in bad] == [(f"{MODEL}/kernels/reduce.py", 3)]


def test_a_failing_or_stale_sanitizer_record_fails(repo):
    record = json.loads((repo.root / SANITIZER).read_text())
    record["results"][0]["status"] = "fail"
    (repo.root / SANITIZER).write_text(json.dumps(record))
    item = review_items(repo.root)["sanitizer"]
    assert item.status == FAIL and "fail: racecheck" in item.findings[0].message
    repo.git("checkout", "--", SANITIZER)
    edit_code(repo.root / KERNEL)
    assert "stale" in review_items(repo.root)["sanitizer"].findings[0].message


def test_no_synchronisation_needs_no_record(repo):
    path = repo.root / KERNEL
    path.write_text(path.read_text().replace("cute.arch.atomic_add(counter, 1)", "counter + 1"))
    (repo.root / SANITIZER).unlink()
    assert review_items(repo.root)["sanitizer"].status == PASS


def test_record_sanitizer_runs_each_tool_and_the_item_accepts_the_record(repo, tmp_path,
                                                                         monkeypatch, capsys):
    # a stand-in compute-sanitizer: a clean racecheck (in racecheck's own summary format, as
    # compute-sanitizer 2025+ prints it), one error under synccheck
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nshift; tool="$1"; shift 3\n"$@" || exit $?\n'
                    'if [ "$tool" = synccheck ]; then echo "========= ERROR SUMMARY: 1 error"; '
                    'exit 1; fi\n'
                    'echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.chdir(repo.root)
    args = ["record-sanitizer", "--out", SANITIZER, "--source", KERNEL, "--", "true"]
    assert main(args) == 1
    assert "racecheck pass, synccheck fail" in capsys.readouterr().out
    record = json.loads((repo.root / SANITIZER).read_text())
    assert [(r["name"], r["errors"]) for r in record["results"]] == [("racecheck", 0), ("synccheck", 1)]
    assert record["wall_s"] >= 0
    assert review_items(repo.root)["sanitizer"].status == FAIL
    assert main([*args[:5], "--tool", "racecheck", "--", "true"]) == 0
    assert review_items(repo.root)["sanitizer"].status == PASS


def test_kernel_name_filter_reaches_compute_sanitizer_and_the_record(repo, tmp_path, monkeypatch):
    # a stand-in compute-sanitizer that logs its arguments and reports a clean run
    log = tmp_path / "argv"
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                    'echo "=========     Write access at _reduce_kernel_0+0x3200 [4 hazards]"\n'
                    'echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.chdir(repo.root)
    assert main(["record-sanitizer", "--out", SANITIZER, "--source", KERNEL, "--tool", "racecheck",
                 "--kernel-name", "_reduce_kernel", "--", "true"]) == 0
    assert log.read_text().split() == ["--kernel-name", "kns=_reduce_kernel", "--tool", "racecheck",
                                       "--error-exitcode", "1", "true"]
    record = json.loads((repo.root / SANITIZER).read_text())
    assert record["kernels_checked"] == "names containing '_reduce_kernel'"
    assert record["results"][0]["reported_in"] == ["_reduce_kernel_0"]
    assert record["command"].startswith(
        "compute-sanitizer --kernel-name kns=_reduce_kernel --tool {racecheck}")
