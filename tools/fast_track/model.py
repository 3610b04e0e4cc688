"""The model folder under review: `vllm/models/<model>/<vendor>/` holding a SCOPE.yaml.

Found by `--model DIR` or, without it, by every `vllm/models/*/*/SCOPE.yaml` in the
repository. SCOPE.yaml is read with the line of every key kept, so a finding can point
at the offending line, and with repeated keys reported (PyYAML would silently keep the
last one). The folder's parts are found by convention only: `kernels/`, `tests/` and
`evidence/` beside SCOPE.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .schema import join

SCOPE_FILE = "SCOPE.yaml"
DISCOVERY_GLOB = "vllm/models/*/*/" + SCOPE_FILE


class ModelError(ValueError):
    """No model folder to review, or one that is not a model folder."""


@dataclass
class LoadedYaml:
    data: Any = None
    lines: dict[str, int] = field(default_factory=dict)  # key path -> 1-based line
    duplicates: list[tuple[str, int]] = field(default_factory=list)
    error: str | None = None  # a YAML syntax error, with its line


def _walk_nodes(node: yaml.Node, path: str, out: LoadedYaml) -> None:
    out.lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = str(key_node.value)
            child = join(path, key)
            if key in seen:
                out.duplicates.append((child, key_node.start_mark.line + 1))
            seen.add(key)
            out.lines[child] = key_node.start_mark.line + 1
            _walk_nodes(value_node, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk_nodes(item, join(path, i), out)


def load_yaml(text: str) -> LoadedYaml:
    out = LoadedYaml()
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        out.data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        out.error = f"{where}{getattr(e, 'problem', None) or e}"
        return out
    if node is not None:
        _walk_nodes(node, "", out)
    return out


@dataclass
class ModelFolder:
    root: Path  # the repository
    rel: str  # the folder, repository-relative: vllm/models/kimi_k3/nvidia

    @property
    def path(self) -> Path:
        return self.root / self.rel

    @property
    def scope_rel(self) -> str:
        return f"{self.rel}/{SCOPE_FILE}"

    def sub(self, name: str) -> str:
        return f"{self.rel}/{name}"

    def scope(self) -> LoadedYaml:
        return load_yaml((self.path / SCOPE_FILE).read_text())

    def model_name(self) -> str:
        """SCOPE.yaml's `model`, else the folder name above the vendor folder."""
        data = self.scope().data
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            return data["model"]
        return Path(self.rel).parent.name


def discover(root: Path, model: str | None) -> list[ModelFolder]:
    if model is not None:
        path = (root / model).resolve() if not Path(model).is_absolute() else Path(model).resolve()
        try:
            rel = path.relative_to(root.resolve()).as_posix()
        except ValueError:
            raise ModelError(f"--model {model}: not inside the repository {root}") from None
        if not (path / SCOPE_FILE).is_file():
            raise ModelError(f"--model {model}: no {SCOPE_FILE} there; a model folder under "
                             f"review declares its envelope in {SCOPE_FILE}")
        return [ModelFolder(root, rel)]
    found = sorted(p.parent.relative_to(root).as_posix() for p in root.glob(DISCOVERY_GLOB))
    if not found:
        raise ModelError(f"no {DISCOVERY_GLOB} in {root}; pass --model DIR")
    return [ModelFolder(root, rel) for rel in found]
