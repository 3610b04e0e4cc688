"""Checklist item `features`: every preserved feature names a test that exists and passed in the evidence.

SCOPE.yaml's `preserved_features` map a feature to a pytest node id,
`path::test_name` (or `path::TestClass::test_name`, with an optional `[param]`). The
test exists when the file does and `ast` finds that function in it (a module-level
function, or a method of that class). It passed when a fresh `parity` or `kernel-test`
record has results for it and all of them pass. A result counts for the test when its
`name` is the node id or the bare test name, either alone or with a `[param]` suffix, so
a parametrized test passes only when every recorded case passes; and, when the result
carries a `module` (pytest's JUnit classname, as `fast-track record-tests` writes it), that
module is the node id's file (and class): a test of the same name in another file proves
nothing about the feature. The module may be the node id's dotted path or a tail of it,
since pytest names modules from its rootdir, which may lie below the repository root.
"""

from __future__ import annotations

import ast

from .evidence import EvidenceSet
from .items import FAIL, PASS, Finding, ItemResult
from .model import ModelFolder

TITLE = "Every preserved feature in SCOPE.yaml names a test that exists and passed in the evidence"
RESULT_KINDS = ("parity", "kernel-test")


def find_test(model: ModelFolder, node_id: str) -> tuple[bool, str]:
    """(exists, why not) for a pytest node id, by parsing its file."""
    path_part, _, rest = node_id.partition("::")
    if not rest:
        return False, f"{node_id!r} is not a node id of the form path::test_name"
    path = model.root / path_part
    if not path.is_file():
        return False, f"{path_part} does not exist"
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except SyntaxError as e:
        return False, f"{path_part} does not parse: {e}"
    names = rest.split("[", 1)[0].split("::")
    scope: list[ast.stmt] = tree.body
    for i, name in enumerate(names):
        last = i == len(names) - 1
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef) if last else (ast.ClassDef,)
        match = next((n for n in scope if isinstance(n, kinds) and n.name == name), None)
        if match is None:
            what = "function" if last else "class"
            return False, f"{path_part} has no {what} {name!r}"
        scope = getattr(match, "body", [])
    return True, ""


def _dotted(node_id: str) -> str:
    """The node id as pytest's JUnit classname spells it: file path dotted, `.py` dropped,
    then its classes (`a/tests/test_x.py::TestA::test_b` -> `a.tests.test_x.TestA`)."""
    path_part, _, rest = node_id.partition("::")
    path = path_part[:-3] if path_part.endswith(".py") else path_part
    classes = rest.split("[", 1)[0].split("::")[:-1]
    return ".".join([p for p in path.split("/") if p] + classes)


def _same_module(module: str, node_id: str) -> bool:
    dotted = module.strip().replace("/", ".")
    dotted = dotted[:-3] if dotted.endswith(".py") else dotted
    wanted = _dotted(node_id)
    return dotted == wanted or wanted.endswith("." + dotted)


def _matches(result: dict, node_id: str) -> bool:
    """Whether a result is the node id's test: by name, and by module when it names one."""
    module = result.get("module")
    if module not in (None, "") and not _same_module(str(module), node_id):
        return False
    result_name = str(result.get("name", ""))
    bare = node_id.split("::")[-1]
    for wanted in (node_id, bare):
        if result_name == wanted:
            return True
        if "[" not in wanted and result_name.startswith(wanted + "["):
            return True
    return False


def test_outcome(evidence: EvidenceSet, node_id: str) -> tuple[str, list[str]]:
    """('pass' | 'fail' | 'stale' | 'absent', record labels that carry the test)."""
    fresh_statuses: list[str] = []
    carriers: list[str] = []
    stale = False
    for record in evidence.of_kind(*RESULT_KINDS):
        statuses = [r.get("status") for r in record.results if _matches(r, node_id)]
        if not statuses:
            continue
        carriers.append(record.label)
        if evidence.freshness(record).fresh:
            fresh_statuses += statuses
        else:
            stale = True
    if fresh_statuses:
        return ("pass" if all(s == "pass" for s in fresh_statuses) else "fail"), carriers
    return ("stale" if stale else "absent"), carriers


def check_features(model: ModelFolder, evidence: EvidenceSet) -> ItemResult:
    loaded = model.scope()
    data = loaded.data if isinstance(loaded.data, dict) else {}
    features = data.get("preserved_features")
    if not isinstance(features, dict) or not features:
        return ItemResult("features", TITLE, FAIL, "SCOPE.yaml declares no preserved_features",
                          [Finding("add preserved_features, each with the test that proves it",
                                   model.scope_rel)])
    findings: list[Finding] = []
    failing = 0
    for feature, spec in features.items():
        node_id = spec.get("test") if isinstance(spec, dict) else None
        line = loaded.lines.get(f"preserved_features.{feature}.test",
                                loaded.lines.get(f"preserved_features.{feature}"))
        if not isinstance(node_id, str):
            failing += 1
            findings.append(Finding(f"{feature}: names no test", model.scope_rel, line))
            continue
        exists, why = find_test(model, node_id)
        if not exists:
            failing += 1
            findings.append(Finding(f"{feature}: test {node_id} does not exist ({why})",
                                    model.scope_rel, line))
            continue
        outcome, carriers = test_outcome(evidence, node_id)
        message = {
            "pass": f"{feature}: {node_id} exists and passed ({', '.join(carriers)})",
            "fail": f"{feature}: {node_id} FAILED in the evidence ({', '.join(carriers)})",
            "stale": f"{feature}: {node_id} passed only in stale evidence ({', '.join(carriers)})",
            "absent": f"{feature}: {node_id} exists but no parity or kernel-test record has its "
                      "result: run it and record the outcome as evidence",
        }[outcome]
        failing += outcome != "pass"
        findings.append(Finding(message, model.scope_rel, line))
    if failing:
        return ItemResult("features", TITLE, FAIL,
                          f"{failing} of {len(features)} preserved feature(s) are not proven", findings)
    return ItemResult("features", TITLE, PASS,
                      f"all {len(features)} preserved feature(s) have a test that passed", findings)
