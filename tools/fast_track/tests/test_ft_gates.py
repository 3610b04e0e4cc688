"""Items `evals` (fresh, passing, gates met) and `benchmarks` (fresh, with its command)."""

import json

from ..items import FAIL, PASS
from .conftest import KERNEL, MODEL, edit_code, review_items

EVAL = f"{MODEL}/evidence/h200/eval.json"
BENCH = f"{MODEL}/evidence/h200/decode.json"


def _patch(repo, rel, **fields):
    record = json.loads((repo.root / rel).read_text())
    record.update(fields)
    (repo.root / rel).write_text(json.dumps(record))


def test_evals_report_the_longest_context(repo):
    item = review_items(repo.root)["evals"]
    assert item.status == PASS and "longest context recorded 65536" in item.summary


def test_a_missed_gate_or_failing_eval_fails(repo):
    _patch(repo, EVAL, targets=[{"name": "greedy agreement", "target": ">= 0.99", "value": 0.97,
                                 "met": False}])
    item = review_items(repo.root)["evals"]
    assert item.status == FAIL
    assert item.findings[0].message == "target greedy agreement: 0.97 against '>= 0.99' (missed)"
    met = [{"name": "accuracy within 1 point", "target": "<= 1", "value": 0.4, "met": True}]
    _patch(repo, EVAL, targets=met, results=[{"name": "mrcr@64k", "status": "fail"}])
    assert "failing result(s): mrcr@64k" in review_items(repo.root)["evals"].findings[0].message


def test_no_eval_record_fails(repo):
    (repo.root / EVAL).unlink()
    item = review_items(repo.root)["evals"]
    assert item.status == FAIL and item.summary.startswith("no eval record")


def test_a_benchmark_needs_its_command_but_may_miss_a_target(repo):
    _patch(repo, BENCH, targets=[{"name": "at the HBM floor", "target": "<= 1.1x", "value": 1.6,
                                  "met": False}])
    item = review_items(repo.root)["benchmarks"]
    assert item.status == PASS and "1 target(s) missed" in item.summary
    _patch(repo, BENCH, command="")
    item = review_items(repo.root)["benchmarks"]
    assert item.status == FAIL and "no `command`" in item.findings[0].message
    (repo.root / BENCH).unlink()
    assert review_items(repo.root)["benchmarks"].summary.startswith("no decode-bench record")


def test_an_edited_source_makes_evals_and_benchmarks_stale(repo):
    """Both records hash the kernel: editing it fails both items, naming the record and the kernel."""
    edit_code(repo.root / KERNEL)
    items = review_items(repo.root)
    for key, rel in (("evals", EVAL), ("benchmarks", BENCH)):
        item = items[key]
        assert item.status == FAIL
        first, second = item.findings[:2]
        assert first.path == rel and first.message.startswith("stale: sources changed since commit")
        assert (second.path, second.message) == (KERNEL, f"changed since {rel} was recorded")


def test_a_benchmark_whose_parity_failed_fails_and_says_why_a_point_is_unjudged(repo):
    """A decode-bench result's status is its parity verdict: a failing one fails the item, and a
    point without its yardstick (`unjudged`) shows the reason."""
    _patch(repo, BENCH, results=[
        {"name": "rows=1", "status": "fail", "time_us": 41.5},
        {"name": "rows=8", "status": "fail", "time_us": 52.0,
         "unjudged": "the rounding-noise yardstick is missing: OutOfMemoryError"}])
    item = review_items(repo.root)["benchmarks"]
    assert item.status == FAIL and "failing parity" in item.summary
    messages = [f.message for f in item.findings]
    assert messages[0].startswith("2 failing result(s)") and messages[0].endswith(": rows=1, rows=8")
    assert item.findings[0].path == BENCH
    assert "rows=8: unjudged: the rounding-noise yardstick is missing: OutOfMemoryError" in messages


def test_an_eval_with_no_results_or_no_targets_fails(repo):
    """An eval record that measured nothing, or judged nothing, proves nothing."""
    _patch(repo, EVAL, results=[], targets=[])
    item = review_items(repo.root)["evals"]
    assert item.status == FAIL
    messages = [(f.path, f.message) for f in item.findings]
    assert any(p == EVAL and m.startswith("no `results`") for p, m in messages)
    assert any(p == EVAL and m.startswith("no `targets`") for p, m in messages)


def test_a_shape_that_is_not_an_object_is_a_finding_not_a_traceback(repo):
    """An eval result's `shape` is an object of named dimensions; a string or a list names the
    record, the result and the field instead of crashing the review."""
    for shape, what in (("65536", "a string"), ([65536], "a list")):
        _patch(repo, EVAL, results=[{"name": "mrcr", "shape": shape, "status": "pass"}])
        item = review_items(repo.root)["evals"]
        assert item.status == FAIL and "no context length recorded" in item.summary
        found = [f for f in item.findings if f.path == EVAL]
        assert found and found[0].message.startswith(f"result 'mrcr': `shape` is {what}, not an object")
