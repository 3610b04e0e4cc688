"""`fast-track check` end to end: exit codes, the markdown report, and the report for this repository."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..cli import main
from .conftest import KERNEL, MODEL

ROOT = Path(__file__).resolve().parents[3]
ITEM_KEYS = ["changes", "scope-valid", "default-unchanged", "kernel-tests", "evidence-fresh",
             "features", "evals", "benchmarks", "sanitizer", "evidence-report", "sync-order",
             "numerics", "routing"]


def _check(root, *args):
    cwd = os.getcwd()
    os.chdir(root)
    try:
        return main(["check", *args])
    finally:
        os.chdir(cwd)


def test_passing_repo_exits_0_and_the_report_says_why(repo, capsys, tmp_path):
    out = tmp_path / "summary.md"
    assert _check(repo.root, "--base", "base", "--report", str(out)) == 0
    text = out.read_text()
    assert text == capsys.readouterr().out
    assert "**Result: ✓ every automatic item holds.**" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][2:]
    assert [r[3] for r in rows[:10]] == ["✓"] * 10
    assert "| H1 |" in text and "needs-human" in text


def test_a_failing_item_exits_1_and_names_file_and_line(repo, capsys):
    repo.write(f"{MODEL}/kernels/reduce.py", "def launch(x, sem):\n    grid_barrier(sem)\n")
    assert _check(repo.root, "--base", "base") == 1
    text = capsys.readouterr().out
    assert "**Result: ✗" in text
    assert f"`{MODEL}/kernels/reduce.py:2`" in text
    assert "## 9. ✗" in text  # the sanitizer item, numbered as in CHECKLIST.md


def test_inputs_that_are_wrong_exit_2_with_the_reason(repo, tmp_path, capsys):
    assert _check(repo.root, "--base", "nope") == 2
    assert "--base 'nope' is not a commit" in capsys.readouterr().err
    assert _check(repo.root, "--model", "vllm/models/toy") == 2
    assert "no SCOPE.yaml there" in capsys.readouterr().err
    (tmp_path / "plain").mkdir()
    assert _check(tmp_path / "plain") == 2
    assert "not inside a git repository" in capsys.readouterr().err


def test_the_evidence_report_renders_tables_and_goes_stale(repo, capsys):
    text = (repo.root / "docs/fast_track/toy_evidence.md").read_text()
    assert "| `vllm/models/toy/acme/evidence/h200/decode.json` | decode-bench |" in text
    assert "| rows=1 | pass | 41.5 |" in text  # the bench's result row, every figure
    assert "| faster than standard | > 1.0x | 1.7 | met |" in text
    repo.write(f"{MODEL}/evidence/h200/plot.png", "png")
    assert _check(repo.root, "--base", "base") == 1
    assert "toy_evidence.md differs from the evidence" in capsys.readouterr().out
    repo.render_report()
    assert "![plot](../../vllm/models/toy/acme/evidence/h200/plot.png)" in \
        (repo.root / "docs/fast_track/toy_evidence.md").read_text()


def test_the_console_script_module_runs(repo):
    out = subprocess.run([sys.executable, "-m", "tools.fast_track.cli", "check", "--base", "base"],
                         cwd=repo.root, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# Fast-track review")


@pytest.mark.skipif(not (ROOT / ".git").exists()
                    or not (ROOT / "vllm/models/kimi_k3/nvidia/SCOPE.yaml").exists(),
                    reason="needs this repository's checkout with its model folder")
def test_the_report_for_this_repository_lists_every_item(capsys):
    code = _check(ROOT)
    text = capsys.readouterr().out
    assert code in (0, 1)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][2:]
    assert [r[1] for r in rows] == [f"`{key}`" for key in ITEM_KEYS]
    # every item that does not hold has its own section with the reason
    for number, key, _title, mark, _summary in rows:
        if mark != "✓":
            assert f"## {number.lstrip('| ')}. {mark} " in text and f"(`{key.strip('`')}`)" in text
    assert KERNEL not in text  # the toy repo's paths never leak into the real report


def test_the_checker_imports_nothing_of_any_model_nor_torch():
    import ast

    package = ROOT / "tools" / "fast_track"
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0]
        assert not [n for n in names if n.split(".")[0] in ("vllm", "torch")], path.name


def test_the_evidence_report_counts_skips_and_other_statuses_apart_from_failures(repo):
    """A skipped test did not fail: the summary row counts pass, fail, skip and any other status
    apart (a record with only passes and failures reads as before)."""
    import json

    from ..evidence_report import render
    from ..model import ModelFolder

    rel = f"{MODEL}/evidence/h200/parity.json"
    record = json.loads((repo.root / rel).read_text())
    record["results"] = [{"name": "a", "status": "pass"}, {"name": "b", "status": "fail"},
                         {"name": "c", "status": "skip"}, {"name": "d", "status": "skip"},
                         {"name": "e", "status": "xfail"}, {"name": "f"}]
    (repo.root / rel).write_text(json.dumps(record))
    text = render(ModelFolder(repo.root, MODEL), repo.root / "docs/fast_track/toy_evidence.md")
    row = next(line for line in text.splitlines() if line.startswith(f"| `{rel}` |"))
    assert "| 1 pass / 1 fail / 2 skip / 2 other |" in row
    assert "| 1 pass / 0 fail |" in next(line for line in text.splitlines() if "decode.json` |" in line)


def test_a_kernel_test_of_many_cases_lists_what_did_not_pass_and_each_figures_range(repo):
    """Past MAX_CASE_ROWS a kernel test's passing cases are summed up, not listed: every case
    that did not pass keeps its row, and each figure its least and most value with their cases."""
    import json

    from ..evidence_report import MAX_CASE_ROWS, render
    from ..model import ModelFolder

    rel = f"{MODEL}/evidence/h200/kernel.json"
    cases = [{"name": f"case{i}", "status": "pass", "rel_err": 1e-3 * (i + 1), "ok": True}
             for i in range(MAX_CASE_ROWS)]
    cases += [{"name": "bad", "status": "fail", "rel_err": float("nan")},
              {"name": "tiny", "status": "pass", "rel_err": 1e-9}]
    (repo.root / rel).write_text(json.dumps({
        "kind": "kernel-test", "family": "add", "command": "pytest -m gpu t.py", "gpu": "NVIDIA H200",
        "sources": [], "source_hash": "", "results": cases, "targets": []}))
    text = render(ModelFolder(repo.root, MODEL), repo.root / "docs/fast_track/toy_evidence.md")
    section = text.split(f"## kernel-test: `{rel}`")[1].split("\n## ")[0]
    assert f"{MAX_CASE_ROWS + 2} cases, the 1 not passing listed;" in section
    assert "| bad | fail | nan |" in section and "| case3 |" not in section
    assert "| rel_err | 42 | 1e-09 | tiny | 0.04 | case39 | 1 |" in section
    assert "\n| ok | " not in section  # a flag is no figure: no range row
    # a benchmark keeps every row, however many
    rel = f"{MODEL}/evidence/h200/bench.json"
    (repo.root / rel).write_text(json.dumps({
        "kind": "kernel-bench", "family": "add", "command": "python -m b", "gpu": "NVIDIA H200",
        "sources": [], "source_hash": "", "results": cases, "targets": []}))
    text = render(ModelFolder(repo.root, MODEL), repo.root / "docs/fast_track/toy_evidence.md")
    assert "| case3 | pass |" in text.split(f"## kernel-bench: `{rel}`")[1]
