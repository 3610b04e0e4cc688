"""A small JSON Schema (draft 2020-12) validator for the keywords a SCOPE schema uses.

Implemented: type, enum, const, properties, required, additionalProperties (boolean or
schema), items, minItems, uniqueItems, minimum, minLength, pattern and `$ref` into the
schema's own `$defs`; title, description, examples, $schema, $id and $defs are
annotations. A schema that uses any other keyword is refused (`SchemaUnsupported`)
rather than half-checked, so a schema change that this validator cannot follow is seen
at once. Errors carry the key path of the offending value (`envelopes[1].gpu.name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

ANNOTATIONS = frozenset({"$schema", "$id", "$defs", "title", "description", "examples"})
ASSERTIONS = frozenset({"$ref", "type", "enum", "const", "properties", "required",
                        "additionalProperties", "items", "minItems", "uniqueItems", "minimum",
                        "minLength", "pattern"})

_PY_TYPES = {"string": (str,), "boolean": (bool,), "array": (list,), "object": (dict,),
             "null": (type(None),), "integer": (int,), "number": (int, float)}


class SchemaUnsupported(ValueError):
    """The schema uses a keyword or a $ref form this validator does not implement."""


@dataclass(frozen=True)
class SchemaError:
    path: str  # key path of the value, "" for the document
    message: str


def join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _has_type(value: Any, name: str) -> bool:
    # YAML true/false load as bool, which Python counts as int; JSON Schema does not
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _PY_TYPES[name])


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _equal(a: Any, b: Any) -> bool:
    # 1 and True are different JSON values
    return type(a) is type(b) and a == b if isinstance(a, bool) or isinstance(b, bool) else a == b


class Validator:
    def __init__(self, schema: dict[str, Any]) -> None:
        self.schema = schema
        self._check_keywords(schema, "#")

    def _check_keywords(self, node: Any, where: str) -> None:
        if not isinstance(node, dict):
            return
        unknown = set(node) - ANNOTATIONS - ASSERTIONS
        if unknown:
            raise SchemaUnsupported(f"schema {where} uses {sorted(unknown)}, which this validator "
                                    f"does not implement (it knows {sorted(ASSERTIONS)})")
        for name, sub in node.get("$defs", {}).items():
            self._check_keywords(sub, f"{where}/$defs/{name}")
        for name, sub in node.get("properties", {}).items():
            self._check_keywords(sub, f"{where}/properties/{name}")
        for key in ("items", "additionalProperties"):
            self._check_keywords(node.get(key), f"{where}/{key}")

    def _resolve(self, ref: str) -> dict[str, Any]:
        prefix = "#/$defs/"
        if not ref.startswith(prefix) or ref[len(prefix):] not in self.schema.get("$defs", {}):
            raise SchemaUnsupported(f"$ref {ref!r}: only references into this schema's own "
                                    "$defs are supported")
        return self.schema["$defs"][ref[len(prefix):]]

    def errors(self, value: Any) -> list[SchemaError]:
        found: list[SchemaError] = []
        self._walk(self.schema, value, "", found)
        return found

    def _walk(self, node: dict[str, Any], value: Any, path: str, out: list[SchemaError]) -> None:
        if "$ref" in node:
            self._walk(self._resolve(node["$ref"]), value, path, out)
        if "type" in node:
            names = node["type"] if isinstance(node["type"], list) else [node["type"]]
            if not any(_has_type(value, n) for n in names):
                out.append(SchemaError(path, f"expected {' or '.join(names)}, found "
                                             f"{type(value).__name__} {_show(value)}"))
                return  # the remaining keywords would only repeat the type error
        if "const" in node and not _equal(value, node["const"]):
            out.append(SchemaError(path, f"expected {node['const']!r}, found {_show(value)}"))
        if "enum" in node and not any(_equal(value, v) for v in node["enum"]):
            out.append(SchemaError(path, f"expected one of {node['enum']}, found {_show(value)}"))
        if isinstance(value, str):
            if "minLength" in node and len(value) < node["minLength"]:
                out.append(SchemaError(path, f"expected at least {node['minLength']} characters, "
                                             f"found {_show(value)}"))
            if "pattern" in node and re.search(node["pattern"], value) is None:
                out.append(SchemaError(path, f"expected a string matching {node['pattern']}, "
                                             f"found {_show(value)}"))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if "minimum" in node and value < node["minimum"]:
                out.append(SchemaError(path, f"expected at least {node['minimum']}, found {value}"))
        if isinstance(value, list):
            self._walk_list(node, value, path, out)
        if isinstance(value, dict):
            self._walk_mapping(node, value, path, out)

    def _walk_list(self, node: dict[str, Any], value: list, path: str,
                   out: list[SchemaError]) -> None:
        if "minItems" in node and len(value) < node["minItems"]:
            out.append(SchemaError(path, f"expected at least {node['minItems']} item(s), found "
                                         f"{len(value)}"))
        if node.get("uniqueItems"):
            repeated = sorted({_show(v) for i, v in enumerate(value)
                               if any(_equal(v, w) for w in value[:i])})
            if repeated:
                out.append(SchemaError(path, f"expected unique items, found repeated {', '.join(repeated)}"))
        if isinstance(node.get("items"), dict):
            for i, item in enumerate(value):
                self._walk(node["items"], item, join(path, i), out)

    def _walk_mapping(self, node: dict[str, Any], value: dict, path: str,
                      out: list[SchemaError]) -> None:
        for key in node.get("required", []):
            if key not in value:
                out.append(SchemaError(path, f"missing required key {key!r}"))
        properties = node.get("properties", {})
        extra = node.get("additionalProperties", True)
        for key, item in value.items():
            if key in properties:
                self._walk(properties[key], item, join(path, str(key)), out)
            elif extra is False:
                allowed = ", ".join(properties) or "none"
                out.append(SchemaError(join(path, str(key)), f"unknown key {key!r} (allowed: {allowed})"))
            elif isinstance(extra, dict):
                self._walk(extra, item, join(path, str(key)), out)
