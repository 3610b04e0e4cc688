"""Checklist item `kernel-tests`: every changed kernel runs in a GPU test that asserts the path counters.

A kernel is a `kernels/**.py` file of the model folder that defines a top-level
`launch` (the kernel contract); other files there are helpers. For each kernel the
change adds or modifies, both must hold:

- static: a test function under `tests/` that is marked `gpu` (by decorator, class
  decorator or module `pytestmark`), names the kernel (its module name appears in the
  test's source as a word, in code or in a string) and asserts the path counters (an
  `assert` mentioning a name that contains `counter`, or a call to an
  `assert*`/`check*`/`expect*` helper whose name contains `counter`), so the test fails
  when the dispatcher quietly takes the standard path instead;
- dynamic: fresh committed evidence carries line coverage of the kernel file from the
  GPU run: a record's `coverage.files[<path>].executed_lines` is not empty (the
  `coverage json` shape; `fast-track record-coverage` writes such a record).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .evidence import EvidenceSet, json_type
from .gitrepo import ChangeSet
from .items import FAIL, PASS, Finding, ItemResult
from .model import ModelFolder

TITLE = "Every changed kernel runs in a GPU test that asserts the path counters, with GPU coverage"


def defines_launch(path: Path) -> bool:
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, UnicodeDecodeError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "launch"
               for n in tree.body)


def kernel_files(model: ModelFolder) -> list[str]:
    folder = model.path / "kernels"
    if not folder.is_dir():
        return []
    return sorted(p.relative_to(model.root).as_posix() for p in folder.rglob("*.py")
                  if p.name != "__init__.py" and defines_launch(p))


def _is_gpu_mark(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "gpu"
               and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
               for n in ast.walk(node))


def _names_in(node: ast.AST) -> list[str]:
    return [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))]


def _asserts_counters(func: ast.AST) -> bool:
    for node in ast.walk(func):
        if isinstance(node, ast.Assert) and any("counter" in n.lower() for n in _names_in(node.test)):
            return True
        if isinstance(node, ast.Call):
            callee = _names_in(node.func)[:1]
            name = callee[0].lower() if callee else ""
            if "counter" in name and name.startswith(("assert", "check", "expect")):
                return True
    return False


def gpu_tests_naming(model: ModelFolder, stem: str) -> tuple[list[Finding], list[Finding]]:
    """(tests that name `stem`, are gpu-marked and assert counters; near misses, with what lacks)."""
    good: list[Finding] = []
    near: list[Finding] = []
    word = re.compile(rf"\b{re.escape(stem)}\b")
    folder = model.path / "tests"
    for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
        text = path.read_text()
        if not word.search(text):
            continue
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError:
            continue
        rel = path.relative_to(model.root).as_posix()
        module_gpu = any(isinstance(s, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                           for t in s.targets) and _is_gpu_mark(s.value)
                         for s in tree.body)
        for owner, func in _test_functions(tree):
            if not word.search(ast.get_source_segment(text, func) or ""):
                continue
            gpu = module_gpu or any(_is_gpu_mark(d) for d in func.decorator_list) or (
                owner is not None and any(_is_gpu_mark(d) for d in owner.decorator_list))
            counters = _asserts_counters(func)
            node_id = f"{rel}::{owner.name + '::' if owner else ''}{func.name}"
            if gpu and counters:
                good.append(Finding(f"{node_id} runs it on the GPU and asserts the path counters",
                                    rel, func.lineno))
            else:
                lacks = [w for w, ok in (("a gpu mark", gpu), ("an assert on the path counters",
                                                                counters)) if not ok]
                near.append(Finding(f"{node_id} names it but lacks {' and '.join(lacks)}", rel,
                                    func.lineno))
    return good, near


def _test_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield None, node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and item.name.startswith("test"):
                    yield node, item


def _malformed_entry(key: str, entry: object) -> str | None:
    """Why a `coverage.files` entry cannot be read, or None; a wrong type would otherwise
    crash the review or count as no coverage without a word."""
    if not isinstance(entry, dict):
        return f"`coverage.files[{key}]` is {json_type(entry)}, not an object with `executed_lines`"
    executed = entry.get("executed_lines", [])
    if not isinstance(executed, list):
        return f"`coverage.files[{key}].executed_lines` is {json_type(executed)}, not a list of line numbers"
    return None


def covered_lines(evidence: EvidenceSet, rel: str) -> tuple[int, list[str], list[str], list[Finding]]:
    """(executed lines in fresh coverage, fresh records carrying it, stale records carrying it,
    malformed coverage entries of it)."""
    best, fresh, stale, malformed = 0, [], [], []
    for record in evidence.records:
        files = record.data.get("coverage", {})
        files = files.get("files", {}) if isinstance(files, dict) else {}
        for key, entry in files.items() if isinstance(files, dict) else []:
            if key != rel and not str(key).endswith("/" + rel):
                continue
            why = _malformed_entry(key, entry)
            if why:
                malformed.append(Finding(f"{why}: rewrite the record (fast-track record-coverage writes "
                                         "the `coverage json` shape)", record.rel))
            elif evidence.freshness(record).fresh:
                fresh.append(record.label)
                best = max(best, len(entry.get("executed_lines", [])))
            else:
                stale.append(record.label)
    return best, fresh, stale, malformed


def check_kernel_tests(model: ModelFolder, changes: ChangeSet, evidence: EvidenceSet) -> ItemResult:
    kernels = kernel_files(model)
    changed = sorted(set(kernels) & set(changes.present()))
    if not changed:
        return ItemResult("kernel-tests", TITLE, PASS,
                          f"no kernel changed ({len(kernels)} kernel file(s) in {model.sub('kernels')}/)")
    findings: list[Finding] = []
    failing = 0
    for rel in changed:
        stem = Path(rel).stem
        good, near = gpu_tests_naming(model, stem)
        executed, fresh, stale, malformed = covered_lines(evidence, rel)
        problems = list(malformed)
        if not good:
            problems.append(Finding("no GPU test names this kernel and asserts the path counters"
                                    + ("; near misses follow" if near else ""), rel))
        if executed == 0:
            why = (f"coverage only in stale evidence ({', '.join(stale)})" if stale else
                   "no evidence record carries GPU line coverage of it" if not fresh else
                   f"fresh coverage ({', '.join(fresh)}) shows no executed line")
            problems.append(Finding(f"{why}: run the GPU tests under coverage and record it "
                                    "(fast-track record-coverage)", rel))
        failing += bool(problems)
        findings += problems + (near if not good else []) + good
        if executed:
            findings.append(Finding(f"{executed} line(s) executed on the GPU ({', '.join(fresh)})", rel))
    if failing:
        return ItemResult("kernel-tests", TITLE, FAIL,
                          f"{failing} of {len(changed)} changed kernel(s) lack a counter-asserting "
                          "GPU test or GPU coverage", findings)
    return ItemResult("kernel-tests", TITLE, PASS,
                      f"all {len(changed)} changed kernel(s) have a counter-asserting GPU test and "
                      "fresh GPU coverage", findings)
