"""Item `features`: each preserved feature's test exists (by ast) and passed in fresh evidence."""

import json
import sys

from ..cli import main
from ..features import find_test
from ..items import FAIL, PASS
from ..model import ModelFolder
from .conftest import FEATURE_TEST, KERNEL, MODEL, edit_code, review_items

PARITY = f"{MODEL}/evidence/h200/parity.json"


def _set_results(repo, results):
    record = json.loads((repo.root / PARITY).read_text())
    record["results"] = results
    (repo.root / PARITY).write_text(json.dumps(record))


def _features(repo):
    return review_items(repo.root)["features"]


def test_a_missing_file_or_function_is_named(repo):
    path = repo.root / FEATURE_TEST
    path.write_text(path.read_text().replace("test_sampling_same_on_both_paths", "test_renamed"))
    item = _features(repo)
    assert item.status == FAIL
    assert "has no function 'test_sampling_same_on_both_paths'" in item.findings[0].message
    assert item.findings[0].line == 5  # the `test:` line in SCOPE.yaml
    path.unlink()
    assert f"{FEATURE_TEST} does not exist" in _features(repo).findings[0].message


def test_a_failed_or_absent_result_fails(repo):
    _set_results(repo, [{"name": "test_sampling_same_on_both_paths", "status": "fail"}])
    assert "FAILED in the evidence" in _features(repo).findings[0].message
    _set_results(repo, [{"name": "test_something_else", "status": "pass"}])
    assert "no parity or kernel-test record has its result" in _features(repo).findings[0].message


def test_parametrized_results_all_must_pass(repo):
    node = f"{FEATURE_TEST}::test_sampling_same_on_both_paths"
    _set_results(repo, [{"name": node + "[greedy]", "status": "pass"},
                        {"name": node + "[top_p]", "status": "pass"}])
    assert _features(repo).status == PASS
    _set_results(repo, [{"name": node + "[greedy]", "status": "pass"},
                        {"name": node + "[top_p]", "status": "fail"}])
    assert _features(repo).status == FAIL


def test_a_pass_in_stale_evidence_does_not_count(repo):
    edit_code(repo.root / KERNEL)
    assert "passed only in stale evidence" in _features(repo).findings[0].message


def test_find_test_follows_classes(repo):
    repo.write(f"{MODEL}/tests/test_cls.py", "class TestA:\n    def test_b(self):\n        pass\n")
    model = ModelFolder(repo.root, MODEL)
    assert find_test(model, f"{MODEL}/tests/test_cls.py::TestA::test_b") == (True, "")
    assert find_test(model, f"{MODEL}/tests/test_cls.py::test_b")[0] is False
    assert find_test(model, f"{MODEL}/tests/test_cls.py::TestZ::test_b")[1].endswith(
        "has no class 'TestZ'")


def test_record_tests_writes_each_outcome_and_the_item_reads_it(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo.root)
    out = repo.root / PARITY
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"{FEATURE_TEST}::test_sampling_same_on_both_paths"]
    assert main(["record-tests", "--out", PARITY, "--family", "features", "--source", KERNEL,
                 "--", *cmd]) == 0
    assert "1 pass, 0 fail, 0 skip" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["kind"] == "parity" and record["sources"] == [KERNEL]
    assert 0 < record["wall_s"] < 120  # the run's own time, which a refresh plans for
    assert [(r["name"], r["status"]) for r in record["results"]] == [
        ("test_sampling_same_on_both_paths", "pass")]
    assert _features(repo).status == PASS
    # a skipped test is not a pass, and neither the record nor the item says otherwise
    path = repo.root / FEATURE_TEST
    path.write_text("import pytest\n\n\n@pytest.mark.skip(reason='no GPU')\n" + path.read_text())
    assert main(["record-tests", "--out", PARITY, "--family", "features", "--source", KERNEL,
                 "--", *cmd]) == 1
    record = json.loads(out.read_text())
    assert [(r["status"], r["reason"]) for r in record["results"]] == [("skip", "no GPU")]
    assert _features(repo).status == FAIL
    # a failure keeps its assertion message, in the record and on the terminal
    path.write_text(path.read_text().replace("@pytest.mark.skip(reason='no GPU')\n", "")
                    .replace("def test_sampling_same_on_both_paths():",
                             "def test_sampling_same_on_both_paths():\n    assert 1 == 2, 'rel err 0.5'"))
    capsys.readouterr()
    assert main(["record-tests", "--out", PARITY, "--family", "features", "--source", KERNEL,
                 "--", *cmd]) == 1
    (result,) = json.loads(out.read_text())["results"]
    assert result["status"] == "fail" and "rel err 0.5" in result["reason"]
    assert "fail test_sampling_same_on_both_paths: " in capsys.readouterr().out


def test_record_tests_refuses_a_command_that_is_not_pytest(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo.root)
    assert main(["record-tests", "--out", PARITY, "--family", "f", "--source", KERNEL, "--", "true"]) == 2
    assert "must run pytest" in capsys.readouterr().err


def test_a_source_folder_stands_for_every_python_file_below_it(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo.root)
    folder = KERNEL.rsplit("/", 1)[0]
    repo.write(f"{folder}/nested/mul.py", "def mul(a, b):\n    return a * b\n")
    repo.write(f"{folder}/README.md", "not code\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           f"{FEATURE_TEST}::test_sampling_same_on_both_paths"]
    assert main(["record-tests", "--out", PARITY, "--family", "features", "--source", folder,
                 "--", *cmd]) == 0
    record = json.loads((repo.root / PARITY).read_text())
    assert {KERNEL, f"{folder}/nested/mul.py"} <= set(record["sources"])
    assert all(src.startswith(folder + "/") and src.endswith(".py") for src in record["sources"])
    assert len(record["sources"]) == sum(1 for _ in (repo.root / folder).rglob("*.py"))  # README.md left out
    assert set(record["source_hashes"]) == set(record["sources"])
    assert record["source_args"] == [folder]  # as given, so a refresh names files added to it since
    assert _features(repo).status == PASS
    # a change to any file of the folder stales the record
    (repo.root / folder / "nested" / "mul.py").write_text("def mul(a, b):\n    return b * a\n")
    assert "passed only in stale evidence" in _features(repo).findings[0].message
    repo.write(f"{MODEL}/empty/notes.md", "nothing to run\n")
    capsys.readouterr()
    assert main(["record-tests", "--out", PARITY, "--family", "f", "--source", f"{MODEL}/empty",
                 "--", *cmd]) == 2
    assert "a folder with no .py file" in capsys.readouterr().err


def test_a_result_from_another_test_file_with_the_same_name_does_not_count(repo):
    """A result's `module` (pytest's JUnit classname) must be the node id's file: a test of the
    same name in another file proves nothing about the feature."""
    name = "test_sampling_same_on_both_paths"
    _set_results(repo, [{"name": name, "module": f"{MODEL.replace('/', '.')}.tests.test_other",
                         "status": "pass"}])
    assert "no parity or kernel-test record has its result" in _features(repo).findings[0].message
    for module in (f"{MODEL.replace('/', '.')}.tests.test_features", "tests.test_features", ""):
        _set_results(repo, [{"name": name, "module": module, "status": "pass"}])
        assert _features(repo).status == PASS, module  # the full path, one below a deeper rootdir, or none
    _set_results(repo, [{"name": name, "module": "tests.test_features.TestOther", "status": "pass"}])
    assert _features(repo).status == FAIL  # a method of a class is not the module-level test
