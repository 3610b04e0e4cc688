"""The record a GPU test module leaves behind when K3_EVIDENCE_DIR is set: kernel-test or parity."""

from __future__ import annotations

import os
from typing import Any, Sequence

import pytest

from vllm.models.kimi_k3.nvidia.latency_specialized.evidence import write_record


def partial_selection(option: Any, args: Sequence[str]) -> str | None:
    """What makes a pytest run (its parsed `option`s and file `args`) run only part of its files'
    GPU tests, or None. A record's command is `pytest -m gpu <file>`: the whole file; a record
    written by a part (a sanitizer's `-k`, one test id, `-x`) would stand for tests that never ran."""
    why = []
    if getattr(option, "keyword", ""):
        why.append(f"-k {option.keyword!r}")
    if getattr(option, "markexpr", "") not in ("", "gpu"):
        why.append(f"-m {option.markexpr!r}")
    if any("::" in str(a) for a in args):
        why.append("test ids")
    if getattr(option, "deselect", None):
        why.append("--deselect")
    if getattr(option, "lf", False):
        why.append("--lf")
    if getattr(option, "maxfail", 0):
        why.append(f"--maxfail {option.maxfail} / -x")
    return ", ".join(why) or None


def record_kernel_test(filename: str, family: str, test_file: str, sources: Sequence[str],
                       results: list[dict], target: str, extra: dict[str, Any] | None = None) -> str | None:
    """Write `results` as one kernel-test record into $K3_EVIDENCE_DIR; returns its path (None: not asked)."""
    where = os.environ.get("K3_EVIDENCE_DIR")
    if not (where and results):
        return None
    passed = [r["status"] == "pass" for r in results]
    path = os.path.join(where, filename)
    write_record(path, "kernel-test", family, f"K3_EVIDENCE_DIR=<dir> python -m pytest -q -m gpu {test_file}",
                 list(sources), results,
                 targets=[{"name": target, "target": "all pass", "value": sum(passed) / len(passed),
                           "met": all(passed)}],
                 extra=extra)
    return path


def record_parity(filename: str, family: str, test_file: str, sources: Sequence[str],
                  results: list[dict]) -> str | None:
    """Write `results` as one parity record into $K3_EVIDENCE_DIR; returns its path (None: not asked)."""
    where = os.environ.get("K3_EVIDENCE_DIR")
    if not (where and results):
        return None
    path = os.path.join(where, filename)
    write_record(path, "parity", family, f"pytest -m gpu {test_file}", [*sources, test_file], results)
    return path


def parity_record(filename: str, family: str, test_file: str, sources: Sequence[str], results: list[dict]):
    """The autouse module fixture that writes `results` as `filename` (record_parity) once every
    test of the module has run: a test module binds it to a module name so pytest collects it."""
    @pytest.fixture(scope="module", autouse=True)
    def record():
        yield
        record_parity(filename, family, test_file, sources, results)
    return record
