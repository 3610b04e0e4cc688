"""Checklist items `scope-valid` and `default-unchanged`.

`scope-valid`: SCOPE.yaml parses (no repeated keys) and validates against the shared
JSON Schema, docs/fast_track/scope.schema.json (falling back to the one
`scope.schema.json` inside the model folder; when both exist they must be identical),
and its envelope names are unique. Rules that only the model's own loader knows (order
of lists, overlapping envelopes) are that loader's tests' business, not this item's.

`default-unchanged`: the backend stays opt-in. SCOPE.yaml's `backend` is not `auto`, and
every default the model folder gives `decode_backend`, found statically with `ast`
outside tests/ (a class attribute or parameter named `decode_backend`, or
`<mapping>.get("decode_backend", default)`), is `"auto"` or None (unset). A default that
is not a literal cannot be judged statically and is left to a human, with its place.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

from .items import FAIL, NEEDS_HUMAN, PASS, Finding, ItemResult
from .model import ModelFolder
from .schema import SchemaUnsupported, Validator

SHARED_SCHEMA = "docs/fast_track/scope.schema.json"
OPTION = "decode_backend"
DEFAULT_VALUE = "auto"

TITLE_VALID = "SCOPE.yaml validates against the shared schema"
TITLE_DEFAULT = "The default (decode_backend unset or auto) is unchanged"


def find_schema(model: ModelFolder) -> tuple[str | None, list[Finding]]:
    """The schema to validate with (repository-relative), and any drift between copies."""
    local = sorted(p.relative_to(model.root).as_posix()
                   for p in model.path.rglob("scope.schema.json"))
    shared = SHARED_SCHEMA if (model.root / SHARED_SCHEMA).is_file() else None
    drift = [Finding(f"differs from {shared}; the copies must be identical", rel) for rel in local
             if shared and (model.root / rel).read_bytes() != (model.root / shared).read_bytes()]
    if shared:
        return shared, drift
    return (local[0] if len(local) == 1 else None), drift


def check_scope_valid(model: ModelFolder) -> ItemResult:
    scope_rel = model.scope_rel
    schema_rel, findings = find_schema(model)
    if schema_rel is None:
        return ItemResult("scope-valid", TITLE_VALID, FAIL,
                          f"no schema: add {SHARED_SCHEMA} (or one scope.schema.json in the model "
                          "folder)", findings)
    loaded = model.scope()
    if loaded.error:
        return ItemResult("scope-valid", TITLE_VALID, FAIL, "SCOPE.yaml is not valid YAML",
                          [Finding(loaded.error, scope_rel)])
    findings += [Finding(f"key {path!r} repeated (YAML keeps only the last)", scope_rel, line)
                 for path, line in loaded.duplicates]
    try:
        validator = Validator(json.loads((model.root / schema_rel).read_text()))
    except (SchemaUnsupported, json.JSONDecodeError) as e:
        return ItemResult("scope-valid", TITLE_VALID, FAIL, f"{schema_rel} cannot be used: {e}",
                          findings + [Finding(str(e), schema_rel)])
    for error in validator.errors(loaded.data):
        where = error.path or "<document>"
        findings.append(Finding(f"{where}: {error.message}", scope_rel, loaded.lines.get(error.path)))
    findings += _repeated_envelope_names(loaded.data, loaded.lines, scope_rel)
    if findings:
        return ItemResult("scope-valid", TITLE_VALID, FAIL,
                          f"{len(findings)} problem(s) against {schema_rel}", findings)
    count = len(loaded.data.get("envelopes", [])) if isinstance(loaded.data, dict) else 0
    return ItemResult("scope-valid", TITLE_VALID, PASS,
                      f"{scope_rel} validates against {schema_rel} ({count} envelope(s))")


def _repeated_envelope_names(data: Any, lines: dict[str, int], scope_rel: str) -> list[Finding]:
    envelopes = data.get("envelopes") if isinstance(data, dict) else None
    seen: set[str] = set()
    out = []
    for i, env in enumerate(envelopes if isinstance(envelopes, list) else []):
        name = env.get("name") if isinstance(env, dict) else None
        if isinstance(name, str) and name in seen:
            out.append(Finding(f"envelope name {name!r} used twice", scope_rel,
                               lines.get(f"envelopes[{i}].name")))
        seen.add(name)
    return out


def _literal(node: ast.expr | None) -> tuple[bool, Any]:
    if isinstance(node, ast.Constant):
        return True, node.value
    return False, None


def option_defaults(path: Path) -> list[tuple[int, bool, Any]]:
    """(line, is_literal, value) for every default given to `decode_backend` in one file."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, UnicodeDecodeError):
        return []
    found: list[tuple[int, bool, Any]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                targets = ([stmt.target] if isinstance(stmt, ast.AnnAssign) else
                           stmt.targets if isinstance(stmt, ast.Assign) else [])
                if _has_value(stmt) and any(getattr(t, "id", None) == OPTION for t in targets):
                    found.append((stmt.lineno, *_literal(stmt.value)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            found += [(d.lineno, *_literal(d)) for a, d in pairs if a.arg == OPTION]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "get" and node.args
              and _literal(node.args[0]) == (True, OPTION) and len(node.args) > 1):
            found.append((node.lineno, *_literal(node.args[1])))
    return found


def _has_value(stmt: ast.stmt) -> bool:
    return getattr(stmt, "value", None) is not None


def check_default_unchanged(model: ModelFolder) -> ItemResult:
    loaded = model.scope()
    data = loaded.data if isinstance(loaded.data, dict) else {}
    findings: list[Finding] = []
    backend = data.get("backend")
    if not isinstance(backend, str) or backend == DEFAULT_VALUE:
        findings.append(Finding(f"backend is {backend!r}: it must name the opt-in backend, never "
                                f"{DEFAULT_VALUE!r} (the default)", model.scope_rel,
                                loaded.lines.get("backend")))
    good, unclear = [], []
    tests = model.path / "tests"
    for path in sorted(model.path.rglob("*.py")):
        if tests in path.parents:
            continue
        rel = path.relative_to(model.root).as_posix()
        for line, literal, value in option_defaults(path):
            if not literal:
                unclear.append(Finding(f"{OPTION} defaults to an expression the checker cannot "
                                       "evaluate; a reviewer confirms it is 'auto'", rel, line))
            elif value in (DEFAULT_VALUE, None):
                good.append(Finding(f"{OPTION} defaults to {value!r}", rel, line))
            else:
                findings.append(Finding(f"{OPTION} defaults to {value!r}: the default must stay "
                                        f"{DEFAULT_VALUE!r} so the standard path is unchanged",
                                        rel, line))
    if not good and not unclear and not findings:
        findings.append(Finding(f"no default for {OPTION} found: declare it as a literal "
                                f"(e.g. `{OPTION}: str = \"{DEFAULT_VALUE}\"`) so it can be checked",
                                model.rel))
    if findings:
        return ItemResult("default-unchanged", TITLE_DEFAULT, FAIL,
                          "the backend is not provably opt-in", findings + unclear + good)
    if unclear:
        return ItemResult("default-unchanged", TITLE_DEFAULT, NEEDS_HUMAN,
                          f"{len(unclear)} default(s) are not literals", unclear + good)
    return ItemResult("default-unchanged", TITLE_DEFAULT, PASS,
                      f"backend {backend!r} is opt-in; {len(good)} default(s) of {OPTION} are "
                      f"{DEFAULT_VALUE!r} or unset", good)
