"""Item `evidence-fresh`: validated envelopes need fresh, passing evidence from their GPU."""

import hashlib
import json

from ..cli import main
from ..evidence import code_form
from ..items import FAIL, PASS
from .conftest import KERNEL, MODEL, edit_code, review_items, sha256_of_sources

PARITY = f"{MODEL}/evidence/h200/parity.json"


def _edit_kernel(repo):
    edit_code(repo.root / KERNEL)


def _load(repo, rel):
    return json.loads((repo.root / rel).read_text())


def _store(repo, rel, record):
    (repo.root / rel).write_text(json.dumps(record))


def test_a_source_edit_makes_the_record_stale_and_git_names_the_file(repo):
    _edit_kernel(repo)
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    changed = [f.path for f in item.findings if f.message.startswith("changed since")]
    assert changed == [KERNEL]  # options.py is a source too, but unchanged
    stale = [f.message for f in item.findings if f.path == PARITY and f.message.startswith("stale")]
    assert stale and stale[0].endswith(f"; refresh it with: {_load(repo, PARITY)['command']}")


def test_per_file_hashes_name_the_changed_file_without_git(repo):
    record = _load(repo, PARITY)
    record["source_hashes"] = {s: hashlib.sha256((repo.root / s).read_bytes()).hexdigest()
                               for s in record["sources"]}
    record["commit"] = "unknown"
    _store(repo, PARITY, record)
    _edit_kernel(repo)
    item = review_items(repo.root)["evidence-fresh"]
    assert [f.path for f in item.findings if f.message.startswith("changed since")] == [KERNEL]


def test_without_git_or_per_file_hashes_every_source_is_a_candidate(repo):
    record = _load(repo, PARITY)
    record["source_hash"] = "0" * 64  # measured on code that was never committed
    _store(repo, PARITY, record)
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    assert "every source is a candidate" in item.findings[0].message
    assert {f.path for f in item.findings[1:]} == set(record["sources"])


def test_a_deleted_source_or_a_record_without_sources(repo):
    (repo.root / f"{MODEL}/options.py").unlink()
    item = review_items(repo.root)["evidence-fresh"]
    assert "no longer exist" in item.findings[0].message
    assert item.findings[1].path == f"{MODEL}/options.py"
    record = _load(repo, PARITY)
    del record["sources"]
    _store(repo, PARITY, record)
    assert "tied to no code" in review_items(repo.root)["evidence-fresh"].findings[0].message


def test_missing_evidence_file_wrong_gpu_and_failing_results(repo):
    record = _load(repo, PARITY)
    record.update(gpu="NVIDIA H100 80GB HBM3", compute_capability="9.0",
                  results=[{"name": "a", "status": "pass"}, {"name": "b", "status": "fail"}])
    _store(repo, PARITY, record)
    messages = [f.message for f in review_items(repo.root)["evidence-fresh"].findings]
    assert messages == ["envelope 'h200': ran on NVIDIA H100 80GB HBM3, not H200",
                        "1 failing result(s): b"]
    (repo.root / PARITY).unlink()
    (finding,) = review_items(repo.root)["evidence-fresh"].findings
    assert "evidence/h200/parity.json is missing" in finding.message
    assert finding.line == 11  # the evidence key of the envelope in SCOPE.yaml


def test_the_right_gpu_name_at_the_wrong_compute_capability_fails(repo):
    """The GPU name alone is not enough: the compute capability must match the envelope's too."""
    record = _load(repo, PARITY)
    record["compute_capability"] = "10.0"
    _store(repo, PARITY, record)
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    assert [f.message for f in item.findings] == [
        "envelope 'h200': ran at compute capability '10.0', the envelope is 9.0"]


def test_declared_envelopes_claim_nothing(repo):
    path = repo.root / MODEL / "SCOPE.yaml"
    path.write_text(path.read_text().replace("status: validated", "status: declared"))
    (repo.root / PARITY).unlink()
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == PASS and item.summary.startswith("no envelope is validated")


def test_an_unreadable_evidence_file_fails(repo):
    repo.write(f"{MODEL}/evidence/broken.json", "{not json")
    repo.write(f"{MODEL}/evidence/nokind.json", json.dumps({"results": []}))
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    assert {f.path for f in item.findings} == {f"{MODEL}/evidence/broken.json",
                                               f"{MODEL}/evidence/nokind.json"}


def test_the_documented_hash_is_what_fresh_means(repo):
    # independent of the fixture: rewrite the record's hash from the formula over new content
    _edit_kernel(repo)
    record = _load(repo, PARITY)
    record["source_hash"] = sha256_of_sources(repo.root, record["sources"])
    _store(repo, PARITY, record)
    assert review_items(repo.root)["evidence-fresh"].status == PASS


def test_a_json_that_is_not_an_object_is_not_a_record(repo):
    """An empty list or a bare value holds no record: reported, not silently skipped."""
    repo.write(f"{MODEL}/evidence/empty.json", "[]")
    repo.write(f"{MODEL}/evidence/number.json", "5")
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    found = {f.path: f.message for f in item.findings}
    assert found[f"{MODEL}/evidence/empty.json"].startswith("not a record: an empty list")
    assert found[f"{MODEL}/evidence/number.json"].startswith("not a record: a JSON number")


def test_a_file_added_to_a_source_folder_makes_the_record_stale(repo):
    """A folder in `source_args` stands for every .py file in it, today's included: a file added
    since the run was not measured, so the record is stale and the file is named."""
    folder = f"{MODEL}/kernels"
    files = sorted(p.relative_to(repo.root).as_posix() for p in (repo.root / folder).rglob("*.py"))
    files.append(f"{MODEL}/options.py")
    record = _load(repo, PARITY)
    record.update(sources=files, source_args=[folder, f"{MODEL}/options.py"],
                  source_hash=sha256_of_sources(repo.root, files))
    _store(repo, PARITY, record)
    assert review_items(repo.root)["evidence-fresh"].status == PASS
    repo.write(f"{folder}/nested/mul.py", "def mul(a, b):\n    return a * b\n")
    repo.write(f"{folder}/notes.md", "not code\n")  # not a .py file: not a source
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    stale = [f.message for f in item.findings if f.path == PARITY]
    assert stale and stale[0].startswith("stale:") and f"added: {folder}/nested/mul.py" in stale[0]
    assert [f.path for f in item.findings if f.message.startswith("changed since")] == [
        f"{folder}/nested/mul.py"]


def _kernel_imports_rows(repo):
    """The kernel imports the helper rows.py from its folder; parity made again and committed."""
    kernel = repo.root / KERNEL
    kernel.write_text(kernel.read_text() + "\nfrom .rows import ROWS  # noqa: E402\n")
    repo.commit("the kernel takes its rows from the shared helper")
    record = _load(repo, PARITY)
    record.update(commit=repo.git("rev-parse", "HEAD"),
                  source_hash=sha256_of_sources(repo.root, record["sources"]))
    _store(repo, PARITY, record)
    repo.render_report()
    repo.commit("parity made again")
    return repo.root / f"{MODEL}/kernels/rows.py"


def test_a_changed_import_of_a_kernel_stales_its_records(repo):
    """A record lists the kernel file; the helper it imports from its own folder is measured too."""
    helper = _kernel_imports_rows(repo)
    assert review_items(repo.root)["evidence-fresh"].status == PASS
    helper.write_text(helper.read_text() + "ROWS = (1, 2)\n")
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    stale = [f for f in item.findings if f.path == PARITY and f.message.startswith("stale")]
    assert stale and "files its kernels import changed" in stale[0].message
    changed = [f.path for f in item.findings if f.message.startswith("changed since")]
    assert changed == [f"{MODEL}/kernels/rows.py"]


def test_comments_docstrings_and_layout_keep_the_record_fresh_and_are_listed(repo, monkeypatch, capsys):
    """The bytes at the record's commit hash to its source_hash, so they are what ran; today's file
    has the same syntax tree less docstrings, so the same code runs: fresh, and `stale` says which
    files changed in text."""
    kernel = repo.root / KERNEL
    kernel.write_text(kernel.read_text()
                      .replace('"""Adds two vectors;', '"""Adds two vectors (see MEASURED.md);')
                      .replace("# the last CTA", "# why: the last CTA")
                      .replace("def launch(x, y, counter):\n", "def launch(x, y, counter):\n"
                               '    """One launch."""\n\n')
                      + "\n\n# a later note\n")
    assert review_items(repo.root)["evidence-fresh"].status == PASS
    monkeypatch.chdir(repo.root)
    main(["stale"])
    out = capsys.readouterr().out
    assert "fresh record(s) whose sources changed in text only" in out and f"  {PARITY}: {KERNEL}\n" in out
    # only the coverage record goes stale: its line numbers are of the text (test_ft_kernels.py)
    stale = [line.split(":")[0].strip() for line in out.splitlines() if ": stale" in line]
    assert stale == [f"{MODEL}/evidence/h200/coverage.json"]


def test_a_changed_string_or_statement_is_code_and_stales_naming_only_that_file(repo):
    kernel = repo.root / KERNEL
    kernel.write_text(kernel.read_text().replace("return x + y, arrived", "return x + y, 'arrived'"))
    options = repo.root / f"{MODEL}/options.py"
    options.write_text(options.read_text() + "# a comment: no change of code\n")
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL
    assert [f.path for f in item.findings if f.message.startswith("changed since")] == [KERNEL]


def test_without_the_measured_bytes_in_git_a_comment_stales(repo):
    """A record whose commit git does not hold (or whose bytes there do not hash to its
    source_hash) cannot show that only text changed."""
    record = _load(repo, PARITY)
    record["commit"] = "0" * 40
    _store(repo, PARITY, record)
    assert review_items(repo.root)["evidence-fresh"].status == PASS
    kernel = repo.root / KERNEL
    kernel.write_text(kernel.read_text() + "# a comment\n")
    item = review_items(repo.root)["evidence-fresh"]
    assert item.status == FAIL and "every source is a candidate" in item.findings[0].message


def test_a_kernel_import_changed_in_comments_alone_keeps_the_record_fresh(repo):
    helper = _kernel_imports_rows(repo)
    helper.write_text(helper.read_text().replace('"""Shapes', '"""The shapes') + "# (1, 2, 4): K3's rows\n")
    assert review_items(repo.root)["evidence-fresh"].status == PASS


def test_code_form_drops_docstrings_comments_and_layout_and_keeps_everything_else():
    base = (b'"""Doc."""\nimport a\n\n\nclass C:\n    """Doc."""\n    x = "s"\n\n\n'
            b'def f():\n    """Doc."""\n    return 1\n')
    same = b'"""Other doc."""\nimport a  # why\nclass C:\n    x = "s"\n# note\ndef f():\n    return 1\n'
    assert code_form("m.py", base) == code_form("m.py", same)
    for changed in (base.replace(b'"s"', b'"t"'), base.replace(b"return 1", b"return 2"),
                    base + b'"a string after code is code"\n'):
        assert code_form("m.py", changed) != code_form("m.py", base)
    assert code_form("w.safetensors", b"# x") == b"# x"  # not Python: its bytes
    assert code_form("bad.py", b"def (:") == b"def (:"  # does not parse: its bytes
