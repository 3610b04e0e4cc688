"""A synthetic repository per test: a toy model folder that passes every automatic item.

`repo` starts as a committed git repository holding vllm/models/toy/acme/ (SCOPE.yaml,
an options module defaulting to auto, one kernel with a counter-asserting GPU test, a
helper), docs/fast_track/ (a small schema and the rendered evidence report) and fresh
evidence for every item. Tests then break one thing and look at one item. Hashes are
computed here from the documented formula, not with the checker's code.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

MODEL = "vllm/models/toy/acme"
KERNEL = f"{MODEL}/kernels/add.py"
GPU_TEST = f"{MODEL}/tests/test_add.py"
FEATURE_TEST = f"{MODEL}/tests/test_features.py"

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["model", "backend", "preserved_features", "envelopes"],
    "properties": {
        "model": {"type": "string"},
        "backend": {"type": "string", "pattern": "^[a-z_]+$"},
        "preserved_features": {"type": "object",
                               "additionalProperties": {"$ref": "#/$defs/feature"}},
        "envelopes": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/envelope"}},
    },
    "$defs": {
        "feature": {"type": "object", "required": ["test"], "additionalProperties": False,
                    "properties": {"test": {"type": "string"}}},
        "envelope": {
            "type": "object", "additionalProperties": False,
            "required": ["name", "gpu", "rows", "status", "evidence"],
            "properties": {
                "name": {"type": "string"},
                "gpu": {"type": "object", "required": ["name", "compute_capability"],
                        "properties": {"name": {"type": "string"},
                                       "compute_capability": {"type": "string"}}},
                "rows": {"type": "array", "uniqueItems": True,
                         "items": {"type": "integer", "minimum": 1}},
                "status": {"enum": ["validated", "declared"]},
                "evidence": {"type": "array", "items": {"type": "string"}},
            },
        },
    },
}

SCOPE = """\
model: toy
backend: fast_path
preserved_features:
  sampling:
    test: vllm/models/toy/acme/tests/test_features.py::test_sampling_same_on_both_paths
envelopes:
  - name: h200
    gpu: {name: H200, compute_capability: "9.0"}
    rows: [1, 2, 4]
    status: validated
    evidence: [evidence/h200/parity.json]
"""

OPTIONS = '''\
"""Options of the toy backend."""
from dataclasses import dataclass


@dataclass
class Options:
    decode_backend: str = "auto"
'''

KERNEL_SRC = '''\
"""Adds two vectors; split across CTAs that meet at an atomic counter."""
import cute


def launch(x, y, counter):
    # the last CTA to arrive publishes the result
    arrived = cute.arch.atomic_add(counter, 1)
    return x + y, arrived
'''

HELPER_SRC = '''\
"""Shapes the kernels share."""
ROWS = (1, 2, 4)
'''

GPU_TEST_SRC = '''\
import pytest

from ..kernels import add


@pytest.mark.gpu
def test_add_runs_on_gpu_and_counts():
    counters = add.launch(1, 2, 0)
    assert counters.kernels["add"] == 1
'''

FEATURE_TEST_SRC = '''\
def test_sampling_same_on_both_paths():
    assert 1 + 1 == 2
'''


def sha256_of_sources(root: Path, sources: list[str]) -> str:
    """The documented source hash: sorted paths, each path + NUL + bytes + NUL."""
    digest = hashlib.sha256()
    for rel in sorted(sources):
        digest.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return digest.hexdigest()


def edit_code(path: Path) -> None:
    """Change a source's code: an edit of comments, docstrings or layout alone leaves its records
    fresh (evidence.py), so tests that need a stale record change a statement."""
    path.write_text(path.read_text() + "\nLATER_EDIT = 1\n")


class Repo:
    def __init__(self, root: Path) -> None:
        self.root = root

    def git(self, *args: str) -> str:
        env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.invalid",
                   GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.invalid")
        out = subprocess.run(["git", "-C", str(self.root), *args], capture_output=True,
                             text=True, env=env)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def write(self, rel: str, text: str) -> Path:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text) if text.startswith("\n") else text)
        return path

    def commit(self, message: str = "change") -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.git("rev-parse", "HEAD")

    def record(self, rel: str, kind: str, sources: list[str], results: list[dict],
               **fields) -> dict:
        """Write a fresh evidence record under the model's evidence/ folder."""
        record = {"kind": kind, "family": "toy", "command": f"run {kind}", "gpu": "NVIDIA H200",
                  "compute_capability": "9.0", "commit": self.git("rev-parse", "HEAD"),
                  "sources": sources, "source_hash": sha256_of_sources(self.root, sources),
                  "results": results, "targets": []}
        record.update(fields)
        self.write(f"{MODEL}/evidence/{rel}", json.dumps(record, indent=1))
        return record

    def render_report(self) -> None:
        from ..cli import main

        cwd = Path.cwd()
        os.chdir(self.root)
        try:
            assert main(["render-evidence", "--model", MODEL,
                         "--out", "docs/fast_track/toy_evidence.md"]) == 0
        finally:
            os.chdir(cwd)


def build_passing_repo(root: Path) -> Repo:
    repo = Repo(root)
    repo.git("init", "-q", "-b", "main")
    repo.write("docs/fast_track/scope.schema.json", json.dumps(SCHEMA, indent=1))
    repo.write(f"{MODEL}/SCOPE.yaml", SCOPE)
    repo.write(f"{MODEL}/options.py", OPTIONS)
    repo.write(f"{MODEL}/kernels/__init__.py", "")
    repo.write(f"{MODEL}/kernels/rows.py", HELPER_SRC)
    repo.write(f"{MODEL}/tests/__init__.py", "")
    repo.write(f"{MODEL}/tests/test_features.py", FEATURE_TEST_SRC)
    repo.commit("base: the toy model without its kernel")
    repo.git("branch", "base")
    repo.write(KERNEL, KERNEL_SRC)
    repo.write(GPU_TEST, GPU_TEST_SRC)
    repo.commit("add the kernel and its GPU test")
    repo.record("h200/parity.json", "parity", [KERNEL, f"{MODEL}/options.py"],
                [{"name": "test_sampling_same_on_both_paths", "status": "pass"}])
    lines = len(KERNEL_SRC.splitlines())
    repo.record("h200/coverage.json", "kernel-test", [KERNEL],
                [{"name": f"coverage:{KERNEL}", "status": "pass"}],
                coverage={"files": {KERNEL: {"executed_lines": list(range(1, lines + 1)),
                                             "missing_lines": []}}})
    repo.record("h200/sanitizer.json", "sanitizer", [KERNEL],
                [{"name": "racecheck", "status": "pass"}, {"name": "synccheck", "status": "pass"}])
    repo.record("h200/eval.json", "eval", [KERNEL],
                [{"name": "mrcr", "shape": {"context": 65536}, "status": "pass"}],
                targets=[{"name": "accuracy within 1 point", "target": "<= 1", "value": 0.4,
                          "met": True}])
    repo.record("h200/decode.json", "decode-bench", [KERNEL],
                [{"name": "rows=1", "status": "pass", "time_us": 41.5}],
                targets=[{"name": "faster than standard", "target": "> 1.0x", "value": 1.7,
                          "met": True}])
    repo.render_report()
    repo.commit("evidence")
    return repo


@pytest.fixture(scope="session")
def _template(tmp_path_factory) -> Path:
    # built once; each test gets a copy, so the git work is paid for once
    root = tmp_path_factory.mktemp("template")
    build_passing_repo(root)
    return root


@pytest.fixture
def repo(_template, tmp_path) -> Repo:
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(_template, root, symlinks=True)
    return Repo(root)


def review_items(root: Path, base: str | None = "base", model: str | None = None) -> dict:
    """key -> ItemResult of a full review of `root`."""
    from ..review import run_review

    review = run_review(root, base, model)
    return {item.key: item for item in review.all_items()}
