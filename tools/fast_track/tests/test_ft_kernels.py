"""Item `kernel-tests` (static test + GPU coverage) and `fast-track record-coverage`."""

import json
import os

from ..cli import main
from ..items import FAIL, PASS
from .conftest import GPU_TEST, GPU_TEST_SRC, KERNEL, MODEL, edit_code, review_items

COVERAGE = f"{MODEL}/evidence/h200/coverage.json"


def test_an_unchanged_kernel_needs_nothing(repo):
    repo.git("branch", "-f", "base", "HEAD")
    item = review_items(repo.root)["kernel-tests"]
    assert item.status == PASS and item.summary.startswith("no kernel changed")


def test_a_helper_without_launch_is_not_a_kernel(repo):
    repo.write(f"{MODEL}/kernels/rows.py", "ROWS = (1, 2, 4, 8)\n")
    item = review_items(repo.root)["kernel-tests"]
    assert item.status == PASS and "all 1 changed kernel(s)" in item.summary


def test_a_test_without_gpu_mark_or_counter_assert_is_a_near_miss(repo):
    path = repo.root / GPU_TEST
    path.write_text(path.read_text().replace("@pytest.mark.gpu\n", "")
                    .replace('assert counters.kernels["add"] == 1', "assert add is not None"))
    item = review_items(repo.root)["kernel-tests"]
    assert item.status == FAIL
    near = [f for f in item.findings if "names it but lacks" in f.message]
    assert len(near) == 1 and near[0].line == 6  # the def, once the mark is gone
    assert "lacks a gpu mark and an assert on the path counters" in near[0].message


def test_each_requirement_alone_makes_a_near_miss(repo):
    """Dropping only the gpu mark, or only the counter assert, fails and names just that lack."""
    path = repo.root / GPU_TEST
    node = f"{GPU_TEST}::test_add_runs_on_gpu_and_counts"
    for old, new, lack in (("@pytest.mark.gpu\n", "", "a gpu mark"),
                           ('assert counters.kernels["add"] == 1', "assert add is not None",
                            "an assert on the path counters")):
        path.write_text(GPU_TEST_SRC.replace(old, new))
        item = review_items(repo.root)["kernel-tests"]
        assert item.status == FAIL
        near = [f.message for f in item.findings if "names it but lacks" in f.message]
        assert near == [f"{node} names it but lacks {lack}"]


def test_a_module_pytestmark_and_a_counter_helper_count(repo):
    repo.write(GPU_TEST, "import pytest\n\npytestmark = [pytest.mark.gpu]\n\n\n"
                         "class TestAdd:\n    def test_it(self, run):\n"
                         "        expect_counters(run('add'), kernels=['add'])\n")
    assert review_items(repo.root)["kernel-tests"].status == PASS


def test_coverage_missing_stale_or_empty_fails(repo):
    (repo.root / COVERAGE).unlink()
    item = review_items(repo.root)["kernel-tests"]
    assert item.status == FAIL
    assert any("no evidence record carries GPU line coverage" in f.message for f in item.findings)
    repo.git("checkout", "--", COVERAGE)
    edit_code(repo.root / KERNEL)  # the coverage record goes stale
    item = review_items(repo.root)["kernel-tests"]
    assert any("coverage only in stale evidence" in f.message for f in item.findings)


def test_record_coverage_turns_a_coverage_report_into_evidence_the_item_accepts(repo, capsys):
    (repo.root / COVERAGE).unlink()
    report = {"meta": {"version": "7.6.0"}, "files": {
        str(repo.root / KERNEL): {"executed_lines": [1, 2, 5, 7, 8], "missing_lines": []},
        f"{MODEL}/options.py": {"executed_lines": [1], "missing_lines": []},  # not a kernel
    }}
    (repo.root / "cov.json").write_text(json.dumps(report))
    cwd = os.getcwd()
    os.chdir(repo.root)
    try:
        assert main(["record-coverage", "--coverage", "cov.json", "--out", COVERAGE,
                     "--command", "coverage run -m pytest -m gpu"]) == 0
    finally:
        os.chdir(cwd)
    assert "1 of 1 kernel file(s) executed" in capsys.readouterr().out
    record = json.loads((repo.root / COVERAGE).read_text())
    assert record["sources"] == [KERNEL]
    assert record["coverage"]["files"][KERNEL]["executed_lines"] == [1, 2, 5, 7, 8]
    assert record["results"][0]["percent"] == 100.0
    assert review_items(repo.root)["kernel-tests"].status == PASS


def test_the_test_that_ran_is_a_source_of_the_coverage_record(repo, capsys):
    """Which kernel lines run depends on the test too: a changed test stales the coverage it made."""
    report = {"files": {str(repo.root / KERNEL): {"executed_lines": [1], "missing_lines": []}}}
    (repo.root / "cov.json").write_text(json.dumps(report))
    command = f"coverage run -m pytest -q -m gpu {GPU_TEST}::test_add_runs_on_gpu_and_counts missing.py"
    cwd = os.getcwd()
    os.chdir(repo.root)
    try:
        args = ["record-coverage", "--coverage", "cov.json", "--out", COVERAGE, "--command", command]
        assert main(args) == 0
    finally:
        os.chdir(cwd)
    record = json.loads((repo.root / COVERAGE).read_text())
    assert record["sources"] == sorted([KERNEL, GPU_TEST])
    assert [r["name"] for r in record["results"]] == [f"coverage:{KERNEL}"]
    repo.git("add", "-A")
    repo.git("commit", "-qm", "coverage")
    assert "stale" not in review_items(repo.root)["kernel-tests"].summary
    edit_code(repo.root / GPU_TEST)
    item = review_items(repo.root)["kernel-tests"]
    assert any("coverage only in stale evidence" in f.message for f in item.findings)


def test_record_coverage_refuses_a_report_without_kernels(repo, capsys):
    (repo.root / "cov.json").write_text(json.dumps({"files": {"elsewhere.py": {}}}))
    cwd = os.getcwd()
    os.chdir(repo.root)
    try:
        assert main(["record-coverage", "--coverage", "cov.json", "--out", "x.json",
                     "--command", "c"]) == 2
    finally:
        os.chdir(cwd)
    assert "covers no file under vllm/models/toy/acme/kernels/" in capsys.readouterr().err


def test_malformed_executed_lines_is_a_finding_not_a_traceback(repo):
    """`executed_lines` must be a list of line numbers; anything else names the record and field."""
    record = json.loads((repo.root / COVERAGE).read_text())
    record["coverage"]["files"][KERNEL]["executed_lines"] = 7
    (repo.root / COVERAGE).write_text(json.dumps(record))
    item = review_items(repo.root)["kernel-tests"]
    assert item.status == FAIL
    found = [f for f in item.findings if f.path == COVERAGE]
    assert found and f"`coverage.files[{KERNEL}].executed_lines` is a number" in found[0].message


def test_a_comment_in_a_covered_kernel_stales_its_coverage(repo):
    """Coverage holds line numbers, which a moved line makes wrong: judged by text, not by code."""
    path = repo.root / KERNEL
    path.write_text("# a new first line\n" + path.read_text())
    item = review_items(repo.root)["kernel-tests"]
    assert any("coverage only in stale evidence" in f.message for f in item.findings)
