"""SCOPE.yaml: load it, validate it, and decide what it admits.

The file declares envelopes (GPU, TP sizes, rows per step, tokens per request, longest
context, speculative methods, CUDA-graph mode, weight and state dtypes, status,
evidence); docs/fast_track/SCOPE.md describes every key. Validation has two layers:

1. `scope.schema.json` (JSON Schema draft 2020-12, shipped beside this module) checked
   by a small walker here, which implements the keywords the schema uses (type, enum,
   const, properties, required, additionalProperties, items, minItems, uniqueItems,
   minimum, minLength, pattern, $ref into $defs) and refuses a schema that uses any other,
   so the schema and the checker cannot drift apart silently;
2. the facts a schema cannot state: lists ascending, envelope names unique, a
   `validated` envelope has evidence files that exist, and no two envelopes overlap.
   Two envelopes overlap when one deployment step could match both: same GPU and
   compute capability, same dtypes and CUDA-graph mode, a shared speculative method, and
   shared TP sizes, row counts and tokens-per-request counts.

Every failure is a `ScopeError` naming the file, the key path (`envelopes[1].rows_per_step`),
what was expected and what was found. Duplicate YAML keys are refused too.

Admission: `Scope.admits(deployment)` matches a deployment against every envelope and
returns the admitting envelopes, or every unmet requirement of every envelope (for a
deployment with `steps_at_max_model_len`, as under vLLM, a max_model_len over an envelope's
context is one);
`Envelope.admits(step)` decides one step from host-side facts only (rows, tokens per
request, longest context, pure decode).
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import yaml

from .deployment import NO_CUDA, Deployment, StepFacts, sm_arch

DEFAULT_SCOPE_PATH = Path(__file__).parent.parent / "SCOPE.yaml"
SCHEMA_PATH = Path(__file__).with_name("scope.schema.json")


class ScopeError(ValueError):
    """SCOPE.yaml is malformed, or a deployment is out of scope under strict_scope."""

    def __init__(self, message: str, *, file: str | None = None, key_path: str | None = None,
                 expected: str | None = None, found: str | None = None) -> None:
        super().__init__(message)
        self.file = file
        self.key_path = key_path
        self.expected = expected
        self.found = found

    @classmethod
    def at(cls, file: str, key_path: str, expected: str, found: str) -> "ScopeError":
        return cls(f"{file}: {key_path}: expected {expected}; found {found}",
                   file=file, key_path=key_path, expected=expected, found=found)


def format_ints(values: Sequence[int]) -> str:
    """[1, 2, ..., 8, 16, 32, 64] -> '[1..8, 16, 32, 64]' (runs of three or more collapse)."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{values[i]}..{values[j]}")
        else:
            parts.extend(str(v) for v in values[i:j + 1])
        i = j + 1
    return "[" + ", ".join(parts) + "]"


# ---------------------------------------------------------------------------- YAML


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int) -> None:
        self.key, self.line = key, line


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key repeated in one mapping (PyYAML keeps the last silently)."""


def _construct_strict_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise _DuplicateKey(key, key_node.start_mark.line + 1)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _construct_strict_mapping)


def _read_yaml(path: Path) -> Any:
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScopeError(f"{file}: no such scope file; pass the path of a SCOPE.yaml",
                         file=file) from None
    except IsADirectoryError:
        inside = path / "SCOPE.yaml"
        hint = f" ({inside} is one)" if inside.is_file() else ""
        raise ScopeError(f"{file}: a directory, not a scope file; pass the path of a SCOPE.yaml{hint}",
                         file=file) from None
    except UnicodeDecodeError as e:
        raise ScopeError.at(file, f"byte {e.start}", "UTF-8 text",
                            f"a byte that is not UTF-8 ({e.reason})") from None
    except OSError as e:  # no permission, an I/O error
        raise ScopeError(f"{file}: cannot read the scope file ({e.strerror or e})", file=file) from None
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except _DuplicateKey as e:
        raise ScopeError.at(file, f"line {e.line}", "each key once per mapping",
                            f"key {e.key!r} repeated") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "<document>"
        problem = getattr(e, "problem", None) or str(e)
        raise ScopeError.at(file, where, "valid YAML", f"a syntax error ({problem})") from None


# ---------------------------------------------------------------------------- schema walker

_SCHEMA_KEYWORDS = frozenset({
    "$schema", "$id", "$defs", "$ref", "title", "description", "examples",
    "type", "enum", "const", "properties", "required", "additionalProperties",
    "items", "minItems", "uniqueItems", "minimum", "minLength", "pattern",
})

_TYPE_WORDS = {"string": "a string", "integer": "an integer", "number": "a number",
               "boolean": "true or false", "array": "a list", "object": "a mapping",
               "null": "null"}


def _is_type(value: Any, name: str) -> bool:
    # bool is an int in Python, never in the schema
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"string": str, "boolean": bool, "array": list, "object": dict,
                              "null": type(None)}[name])


def _found(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, dict):
        return ("a mapping with keys " + ", ".join(map(str, value))) if value else "an empty mapping"
    if isinstance(value, list) and not value:
        return "an empty list"
    kind = {int: "integer", float: "float", str: "string", list: "list"}.get(type(value),
                                                                           type(value).__name__)
    text = repr(value)
    return f"{kind} {text if len(text) <= 80 else text[:77] + '...'}"


def _same_json_value(a: Any, b: Any) -> bool:
    # JSON equality: true is not 1
    return type(a) is type(b) and a == b


def _audit_schema(node: Any, where: str) -> None:
    """Refuse a schema keyword the walker does not implement."""
    if not isinstance(node, dict):
        raise RuntimeError(f"{SCHEMA_PATH}: {where}: a schema must be an object")
    unknown = set(node) - _SCHEMA_KEYWORDS
    if unknown:
        raise RuntimeError(
            f"{SCHEMA_PATH}: {where}: keyword(s) {sorted(unknown)} are not implemented by "
            "scope.py's schema walker; implement them there or do without"
        )
    for name, sub in node.get("$defs", {}).items():
        _audit_schema(sub, f"{where}/$defs/{name}")
    for name, sub in node.get("properties", {}).items():
        _audit_schema(sub, f"{where}/properties/{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _audit_schema(node[key], f"{where}/{key}")


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA_PATH.read_text())
    _audit_schema(schema, "#")
    return schema


class _SchemaWalker:
    def __init__(self, schema: dict[str, Any], file: str) -> None:
        self.root = schema
        self.file = file

    def fail(self, path: str, expected: str, value: Any) -> ScopeError:
        return ScopeError.at(self.file, path, expected, _found(value))

    def resolve(self, ref: str) -> dict[str, Any]:
        if not ref.startswith("#/$defs/"):
            raise RuntimeError(f"{SCHEMA_PATH}: only '#/$defs/...' references are supported, found {ref!r}")
        return self.root["$defs"][ref.removeprefix("#/$defs/")]

    def check(self, value: Any, node: dict[str, Any], path: str) -> None:
        if "$ref" in node:
            self.check(value, self.resolve(node["$ref"]), path)
        example = f" such as {json.dumps(node['examples'][0])}" if node.get("examples") else ""
        if "const" in node and not _same_json_value(value, node["const"]):
            raise self.fail(path, json.dumps(node["const"]), value)
        if "enum" in node and not any(_same_json_value(value, v) for v in node["enum"]):
            raise self.fail(path, "one of " + ", ".join(map(json.dumps, node["enum"])), value)
        if "type" in node:
            types = node["type"] if isinstance(node["type"], list) else [node["type"]]
            if not any(_is_type(value, t) for t in types):
                raise self.fail(path, " or ".join(_TYPE_WORDS[t] for t in types) + example, value)
        if isinstance(value, str):
            if len(value) < node.get("minLength", 0):
                raise self.fail(path, f"a string of at least {node['minLength']} character(s)", value)
            if "pattern" in node and not re.search(node["pattern"], value):
                raise self.fail(path, f"a string matching {node['pattern']}{example}", value)
        if _is_type(value, "number") and "minimum" in node and value < node["minimum"]:
            raise self.fail(path, f"a number >= {node['minimum']}", value)
        if isinstance(value, list):
            self.check_list(value, node, path)
        if isinstance(value, dict):
            self.check_mapping(value, node, path)

    def check_list(self, value: list, node: dict[str, Any], path: str) -> None:
        if len(value) < node.get("minItems", 0):
            raise self.fail(path, f"a list of at least {node['minItems']} item(s)", value)
        if node.get("uniqueItems"):
            seen: list[Any] = []
            for item in value:
                if any(_same_json_value(item, s) for s in seen):
                    raise self.fail(path, f"a list without repeated items ({item!r} repeats)", value)
                seen.append(item)
        if "items" in node:
            for i, item in enumerate(value):
                self.check(item, node["items"], f"{path}[{i}]")

    def check_mapping(self, value: dict, node: dict[str, Any], path: str) -> None:
        props = node.get("properties", {})
        extra = node.get("additionalProperties", True)
        prefix = f"{path}." if path != "<top level>" else ""
        if extra is False:
            for key in value:
                if key not in props:
                    close = difflib.get_close_matches(str(key), props, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ScopeError.at(self.file, f"{prefix}{key}",
                                        f"one of the keys {', '.join(props)}",
                                        f"unknown key {key!r}{hint}")
        for key in node.get("required", []):
            if key not in value:
                raise ScopeError.at(self.file, f"{prefix}{key}", f"the required key {key!r}",
                                    f"no such key (keys present: {', '.join(map(str, value)) or 'none'})")
        for key, item in value.items():
            if not isinstance(key, str):
                raise self.fail(f"{prefix}{key}", "a string key", key)
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                self.check(item, sub, f"{prefix}{key}")


# ---------------------------------------------------------------------------- the scope as data

_DTYPE_KEYS = (
    # (SCOPE.yaml key, Deployment field, words for messages)
    ("weights", "weight_dtype", "weight dtype"),
    ("experts", "expert_dtype", "expert dtype"),
    ("mla_latent_cache", "mla_cache_dtype", "MLA latent cache dtype"),
    ("kda_recurrent_state", "kda_recurrent_dtype", "KDA recurrent state dtype"),
    ("kda_conv_state", "conv_dtype", "KDA conv state dtype"),
)


@dataclass(frozen=True)
class Verdict:
    """Admitted (with the envelopes that admit, and any caveats) or not (with every reason)."""

    admitted: bool
    envelopes: tuple["Envelope", ...] = ()
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.admitted

    @property
    def envelope(self) -> "Envelope | None":
        return self.envelopes[0] if self.envelopes else None

    def summary(self) -> str:
        """One line: the admitting envelopes, or every reason."""
        if self.admitted:
            return ", ".join(e.name for e in self.envelopes)
        return "; ".join(self.reasons)


@dataclass(frozen=True)
class PreservedFeature:
    name: str
    test: str
    description: str = ""


@dataclass(frozen=True)
class Envelope:
    name: str
    gpu_name: str
    compute_capability: str
    tensor_parallel: tuple[int, ...]
    rows_per_step: tuple[int, ...]
    tokens_per_request: tuple[int, ...]
    max_context: int
    speculative_methods: tuple[str, ...]
    cuda_graphs: bool
    dtypes: tuple[tuple[str, str], ...]  # (SCOPE.yaml dtype key, dtype), in _DTYPE_KEYS order
    status: str
    evidence: tuple[str, ...]
    description: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Envelope":
        return cls(
            name=raw["name"], gpu_name=raw["gpu"]["name"],
            compute_capability=raw["gpu"]["compute_capability"],
            tensor_parallel=tuple(raw["tensor_parallel"]),
            rows_per_step=tuple(raw["rows_per_step"]),
            tokens_per_request=tuple(raw["tokens_per_request"]),
            max_context=raw["max_context"],
            speculative_methods=tuple(raw["speculative_methods"]),
            cuda_graphs=raw["cuda_graphs"],
            dtypes=tuple((key, raw["dtypes"][key]) for key, _, _ in _DTYPE_KEYS),
            status=raw["status"], evidence=tuple(raw["evidence"]),
            description=raw.get("description", ""),
        )

    @property
    def gpu_label(self) -> str:
        return f"{self.gpu_name} {sm_arch(self.compute_capability)}"

    def dtype(self, key: str) -> str:
        return dict(self.dtypes)[key]

    def limits(self) -> str:
        """The envelope in one line, for the start-up log."""
        return (
            f"{self.gpu_label}, tensor_parallel {format_ints(self.tensor_parallel)}, rows "
            f"{format_ints(self.rows_per_step)}, tokens/request {format_ints(self.tokens_per_request)}, "
            f"context <= {self.max_context}, speculative {'/'.join(self.speculative_methods)}, "
            f"status {self.status}"
        )

    # ------------------------------------------------------------ deployment

    def gpu_matches(self, d: Deployment) -> bool:
        if not d.cuda_present:
            return False
        words = re.split(r"[^A-Z0-9]+", d.gpu_name.upper())
        return self.gpu_name.upper() in words and d.compute_capability == self.compute_capability

    def unmet(self, d: Deployment, allow_unvalidated: bool) -> list[str]:
        """Every requirement other than the GPU that `d` does not meet."""
        out = []
        if d.steps_at_max_model_len and d.max_model_len > self.max_context:
            out.append(f"max_model_len {d.max_model_len} over context {self.max_context} (every step is "
                       f"routed at max_model_len, so none would run specialized; serve with --max-model-len "
                       f"{self.max_context} or less)")
        if d.tensor_parallel not in self.tensor_parallel:
            out.append(f"tensor_parallel {d.tensor_parallel} not in {format_ints(self.tensor_parallel)}")
        method = d.spec_method or "none"
        if method not in self.speculative_methods:
            out.append(f"speculative method {method} not in [{', '.join(self.speculative_methods)}]")
        if d.tokens_per_request not in self.tokens_per_request:
            out.append(f"speculative {d.spec_label} needs {d.tokens_per_request} tokens per request, "
                       f"not in {format_ints(self.tokens_per_request)}")
        if d.cuda_graphs != self.cuda_graphs:
            out.append("CUDA graphs off (the envelope needs them on)" if self.cuda_graphs
                       else "CUDA graphs on (the envelope was validated eager)")
        for key, fld, words in _DTYPE_KEYS:
            if getattr(d, fld) != self.dtype(key):
                out.append(f"{words} {getattr(d, fld)} is not {self.dtype(key)}")
        if self.status != "validated" and not allow_unvalidated:
            out.append(f"status {self.status} (not validated; set allow_unvalidated to admit it)")
        return out

    def caveats(self, d: Deployment) -> list[str]:
        """What an operator must know about an admitted deployment."""
        out = []
        if self.status != "validated":
            out.append(f"envelope {self.name} is {self.status}, not validated; "
                       "admitted because allow_unvalidated is set")
        if d.max_model_len > self.max_context:
            out.append(f"steps with context over {self.max_context} run the standard path "
                       f"(max_model_len {d.max_model_len}); under vLLM that is every step (it routes "
                       f"each at max_model_len): serve with --max-model-len {self.max_context} or less")
        return out

    # ------------------------------------------------------------ step

    def admits(self, step: StepFacts) -> Verdict:
        """Whether this envelope serves `step`; only host-side facts, identical on every rank."""
        reasons = []
        if not step.pure_decode:
            reasons.append("step has prefill rows (prefill runs the standard path)")
        q = step.tokens_per_request
        if q is None:
            reasons.append("requests carry different token counts")
        elif q not in self.tokens_per_request:
            reasons.append(f"tokens_per_request {q} not in {format_ints(self.tokens_per_request)}")
        elif step.rows % q:
            reasons.append(f"rows {step.rows} not a multiple of tokens_per_request {q}")
        if step.rows not in self.rows_per_step:
            reasons.append(f"rows {step.rows} not in {format_ints(self.rows_per_step)}")
        if step.max_context > self.max_context:
            # the bound, not the value: fall-back reasons are counted, and must stay few
            reasons.append(f"context over {self.max_context}")
        if reasons:
            return Verdict(False, reasons=tuple(reasons))
        return Verdict(True, envelopes=(self,))


def _overlap(a: Envelope, b: Envelope) -> str | None:
    """Where one deployment step could match both envelopes, or None."""
    if (a.gpu_name.upper(), a.compute_capability) != (b.gpu_name.upper(), b.compute_capability):
        return None
    if a.dtypes != b.dtypes or a.cuda_graphs != b.cuda_graphs:
        return None
    shared = [sorted(set(x) & set(y)) for x, y in (
        (a.speculative_methods, b.speculative_methods), (a.tensor_parallel, b.tensor_parallel),
        (a.rows_per_step, b.rows_per_step), (a.tokens_per_request, b.tokens_per_request))]
    if not all(shared):
        return None
    methods, tp, rows, tokens = shared
    return (f"GPU {a.gpu_label}, speculative [{', '.join(methods)}], tensor_parallel "
            f"{format_ints(tp)}, rows {format_ints(rows)}, tokens_per_request {format_ints(tokens)}")


def _check_facts(raw: dict[str, Any], file: str, base: Path) -> None:
    """The checks the schema cannot express."""
    names: dict[str, int] = {}
    for i, env in enumerate(raw["envelopes"]):
        where = f"envelopes[{i}]"
        for key in ("tensor_parallel", "rows_per_step", "tokens_per_request"):
            if env[key] != sorted(env[key]):
                raise ScopeError.at(file, f"{where}.{key}", "integers in ascending order",
                                    _found(env[key]))
        if env["name"] in names:
            raise ScopeError.at(file, f"{where}.name", "a name no other envelope uses",
                                f"{env['name']!r}, already the name of envelopes[{names[env['name']]}]")
        names[env["name"]] = i
        if env["status"] == "validated":
            if not env["evidence"]:
                raise ScopeError.at(file, f"{where}.evidence",
                                    "at least one evidence file for a validated envelope "
                                    "(or status: declared)", "an empty list")
            for j, rel in enumerate(env["evidence"]):
                if not (base / rel).is_file():
                    raise ScopeError.at(file, f"{where}.evidence[{j}]",
                                        f"an existing file relative to {base}",
                                        f"{rel!r}, which does not exist")
    envelopes = [Envelope.from_dict(e) for e in raw["envelopes"]]
    for j, b in enumerate(envelopes):
        for i, a in enumerate(envelopes[:j]):
            where = _overlap(a, b)
            if where:
                raise ScopeError.at(
                    file, f"envelopes[{j}]",
                    "envelopes no deployment step can match twice (two envelopes of one GPU, "
                    "dtypes and CUDA-graph mode must share no TP size, rows count, tokens-per-"
                    "request count or speculative method)",
                    f"{b.name!r} overlaps envelopes[{i}] {a.name!r} on {where}")


@dataclass(frozen=True)
class Scope:
    path: Path
    schema_version: int
    model: str
    backend: str
    envelopes: tuple[Envelope, ...]
    preserved_features: tuple[PreservedFeature, ...]

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Scope":
        """Load and validate SCOPE.yaml (default: the one shipped with the package)."""
        path = Path(path) if path is not None else DEFAULT_SCOPE_PATH
        file = str(path)
        raw = _read_yaml(path)
        schema = load_schema()
        _SchemaWalker(schema, file).check(raw, schema, "<top level>")
        _check_facts(raw, file, path.parent)
        return cls(
            path=path, schema_version=raw["schema_version"], model=raw["model"],
            backend=raw["backend"],
            envelopes=tuple(Envelope.from_dict(e) for e in raw["envelopes"]),
            preserved_features=tuple(
                PreservedFeature(name, f["test"], f.get("description", ""))
                for name, f in raw["preserved_features"].items()),
        )

    def envelope(self, name: str) -> Envelope:
        for e in self.envelopes:
            if e.name == name:
                return e
        raise KeyError(f"no envelope {name!r} in {self.path}; envelopes: "
                       f"{', '.join(e.name for e in self.envelopes)}")

    def admits(self, deployment: Deployment, allow_unvalidated: bool = False) -> Verdict:
        """The envelopes that admit `deployment`, or every unmet requirement of every envelope."""
        d = deployment
        gpu_known = any(e.gpu_matches(d) for e in self.envelopes)
        reasons: list[str] = []
        if not d.cuda_present:
            reasons.append(NO_CUDA)
        elif not gpu_known:
            gpus = list(dict.fromkeys(e.gpu_label for e in self.envelopes))
            reasons.append(f"GPU {d.gpu_label} not in scope [{', '.join(gpus)}]")
        admitted: list[Envelope] = []
        warnings: list[str] = []
        for e in self.envelopes:
            unmet = e.unmet(d, allow_unvalidated)
            if e.gpu_matches(d):
                if not unmet:
                    admitted.append(e)
                    warnings.extend(e.caveats(d))
                    continue
            elif gpu_known:
                # the GPU-level reason above covers it only when no envelope has this GPU
                unmet.insert(0, f"GPU {d.gpu_label} is not {e.gpu_label}")
            if unmet:
                reasons.append(f"{e.name}: {', '.join(unmet)}")
        if admitted:
            return Verdict(True, envelopes=tuple(admitted), warnings=tuple(warnings))
        return Verdict(False, reasons=tuple(reasons))
