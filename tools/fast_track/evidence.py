"""Evidence records (ARCHITECTURE §7) and whether each still describes the current sources.

Every `*.json` under the model's `evidence/` folder, at any depth, holds one record (a
JSON object) or a list of them; anything else (an empty list, a bare value, an object
without `kind`) is one of the set's `problems`, never silently skipped. A record names
the repository-relative `sources` it measured and their `source_hash`:

    sha256 over the sources in sorted path order, each contributing
        its path (UTF-8) + NUL + its bytes + NUL

recomputed here from the working tree. Equal: the record is fresh. Different, or a
source gone: stale, and the checker says which files changed — exactly, when the record
also carries `source_hashes` (path -> sha256 of that file's bytes); else from git, as
the sources that differ from the record's `commit`; else it lists every source as a
candidate and says it cannot tell. A record without sources or hash cannot be tied to
code and is never fresh.

A record written by fast-track itself also keeps `source_args`, the sources as given: a
folder there stands for every `.py` file below it, while `sources` lists the files it held
at the run. The folder is expanded again here, and a record whose folders now hold other
`.py` files (one added, or one removed) is stale and names them: the hash alone covers
only the files that existed at the run, so a new file would pass unmeasured.

A kernel source also stands for the files of its own folder it imports (`from .device import
facts`), transitively: records list the kernel files, while the device facts, the shared loaders
and the split-K store they import are part of what ran. Such an import that changed since the
record's `commit` stales the record and is named. Where git cannot tell (the commit is not in a
shallow clone), only the listed sources are judged.

A change of text that is no change of code leaves a record fresh. Git shows the sources as they
stood at the record's `commit`; where those bytes hash to the record's `source_hash`, they are
exactly what was measured, and each is compared with today's file by `code_form`: a Python file's
syntax tree less its docstrings, so comments, docstrings, blank lines and layout do not count,
while every statement, name and other string does; any other file by its bytes. Such a record is
fresh and names the files whose text alone changed (`Freshness.text_only`, which `fast-track
stale` lists); a stale one names only the files whose code changed. Where git cannot show the
measured bytes, or they do not hash to `source_hash` (a record of code never committed), any
change of text stales the record, as above; so does it for a record that holds line numbers (GPU
line coverage, `coverage`), which a moved line would make wrong.
"""

from __future__ import annotations

import ast
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from .gitrepo import changed_since, files_at
from .items import Finding
from .model import ModelFolder


def source_hash(root: Path, sources: list[str]) -> str:
    return hash_of({rel: (root / rel).read_bytes() for rel in sources})


def hash_of(files: dict[str, bytes]) -> str:
    """`source_hash` of bytes in hand (path -> bytes: today's files, or as they stood at a commit)."""
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + files[rel] + b"\0")
    return digest.hexdigest()


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def code_form(rel: str, data: bytes) -> bytes:
    """What a source contributes to its code's identity: a `.py` file's syntax tree less the
    docstrings of its module, classes and functions (comments and layout never reach the tree, and
    `ast.dump` leaves line numbers out); any other file, or Python that does not parse, its bytes."""
    if not rel.endswith(".py"):
        return data
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return data
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:]
    return ast.dump(tree).encode()


def py_files_under(root: Path, folder: str) -> list[str]:
    """The repository-relative `.py` files below a folder, as a folder source stands for them
    (records.py expands a folder with this at the run; freshness expands it again)."""
    return sorted(p.relative_to(root).as_posix() for p in (root / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def _package_imports(root: Path, rel: str) -> list[str]:
    """The repository-relative files of `rel`'s own folder that it imports relatively."""
    folder = Path(rel).parent
    try:
        tree = ast.parse((root / rel).read_text())
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names += [node.module] if node.module else [a.name for a in node.names]
    found = [(folder / name.replace(".", "/")).with_suffix(".py").as_posix() for name in names]
    return [f for f in found if (root / f).is_file()]


def kernel_imports(root: Path, sources: list[str]) -> list[str]:
    """The files the `kernels/` among `sources` import from their own folder, transitively, that
    `sources` does not list."""
    todo = [s for s in sources if Path(s).parent.name == "kernels" and s.endswith(".py")]
    seen = set(todo)
    while todo:
        for found in _package_imports(root, todo.pop()):
            if found not in seen:
                seen.add(found)
                todo.append(found)
    return sorted(seen - set(sources))


@dataclass(frozen=True)
class Freshness:
    fresh: bool
    reason: str = ""  # why not fresh, one line
    changed: tuple[str, ...] = ()  # sources known (or, see reason, suspected) to differ
    text_only: tuple[str, ...] = ()  # of a fresh record: files whose text, not code, changed since the run


@dataclass
class Record:
    rel: str  # repository-relative path of its JSON file
    data: dict[str, Any]
    position: int | None = None  # index inside a file that holds a list of records

    @property
    def label(self) -> str:
        return self.rel if self.position is None else f"{self.rel}[{self.position}]"

    @property
    def kind(self) -> str:
        return str(self.data.get("kind", ""))

    @property
    def command(self) -> str:
        return str(self.data.get("command") or "")

    @property
    def sources(self) -> list[str]:
        value = self.data.get("sources")
        return [str(s) for s in value] if isinstance(value, list) else []

    @property
    def source_args(self) -> list[str]:
        value = self.data.get("source_args")
        return [Path(str(s)).as_posix() for s in value] if isinstance(value, list) else []

    @property
    def results(self) -> list[dict[str, Any]]:
        value = self.data.get("results")
        return [r for r in value if isinstance(r, dict)] if isinstance(value, list) else []

    @property
    def targets(self) -> list[dict[str, Any]]:
        value = self.data.get("targets")
        return [t for t in value if isinstance(t, dict)] if isinstance(value, list) else []

    def failed_results(self) -> list[str]:
        return [str(r.get("name", "?")) for r in self.results if r.get("status") != "pass"]

    def missed_targets(self) -> list[dict[str, Any]]:
        return [t for t in self.targets if t.get("met") is not True]


def _folder_drift(root: Path, record: Record) -> tuple[list[str], list[str]]:
    """(added, removed): the `.py` files of the record's source folders today against those it
    measured. An entry of `source_args` that is not itself in `sources` was a folder."""
    sources = set(record.sources)
    now: set[str] = set()
    then: set[str] = set()
    for arg in record.source_args:
        if arg in sources:
            continue
        prefix = "" if arg == "." else arg.rstrip("/") + "/"
        then |= {s for s in sources if s.startswith(prefix) and s.endswith(".py")
                 and "__pycache__" not in s.split("/")}
        if (root / arg).is_dir():
            now |= set(py_files_under(root, arg))
    return sorted(now - then), sorted(then - now)


def _freshness(root: Path, record: Record) -> Freshness:
    sources, recorded = record.sources, record.data.get("source_hash")
    if not sources or not isinstance(recorded, str):
        return Freshness(False, "names no `sources` or no `source_hash`, so it is tied to no code")
    outside = [s for s in sources + record.source_args if Path(s).is_absolute() or ".." in Path(s).parts]
    if outside:
        return Freshness(False, f"sources must be repository-relative paths: {outside}")
    added, removed = _folder_drift(root, record)
    if added or removed:
        said = "; ".join(f"{what}: {', '.join(files)}" for what, files in (("added", added),
                                                                            ("removed", removed)) if files)
        return Freshness(False, f"stale: its source folders hold other .py files than at the run ({said})",
                         tuple(added + removed))
    missing = [s for s in sources if not (root / s).is_file()]
    if missing:
        return Freshness(False, "stale: sources no longer exist", tuple(missing))
    commit = str(record.data.get("commit", ""))
    by_code = "coverage" not in record.data  # line numbers hold only for the text they were taken on
    text_only: list[str] = []
    today = {s: (root / s).read_bytes() for s in sources}
    if hash_of(today) != recorded:
        measured = files_at(root, commit, sources) if by_code else None
        if measured is None or hash_of(measured) != recorded:
            return _stale_text(root, record)
        text_only = [s for s in sources if measured[s] != today[s]]
        changed = [s for s in text_only if code_form(s, measured[s]) != code_form(s, today[s])]
        if changed:
            return Freshness(False, f"stale: sources changed since commit {commit[:12]}",
                             tuple(changed))
    imported = kernel_imports(root, sources)
    changed = changed_since(root, commit, imported) if imported else None
    if changed:
        then = (files_at(root, commit, changed) if by_code else None) or {}
        code = [f for f in changed if f not in then or not (root / f).is_file()
                or code_form(f, then[f]) != code_form(f, (root / f).read_bytes())]
        if code:
            return Freshness(False, f"stale: files its kernels import changed since commit {commit[:12]}",
                             tuple(code))
        text_only += changed
    return Freshness(True, text_only=tuple(sorted(text_only)))


def _stale_text(root: Path, record: Record) -> Freshness:
    """A record whose sources' text changed, when git cannot show what it measured: which changed."""
    sources = record.sources
    per_file = record.data.get("source_hashes")
    if isinstance(per_file, dict):
        changed = [s for s in sources if per_file.get(s) != file_hash(root / s)]
        return Freshness(False, "stale: sources changed since the run", tuple(changed))
    changed = changed_since(root, str(record.data.get("commit", "")), sources)
    if changed:
        return Freshness(False, f"stale: sources changed since commit "
                                f"{str(record.data['commit'])[:12]}", tuple(changed))
    return Freshness(False, "stale: the sources differ from what was measured; the record has "
                            "no per-file `source_hashes` and git cannot tell which changed, so "
                            "every source is a candidate", tuple(sources))


def json_type(value: Any) -> str:
    """A JSON value's type in JSON's words, for findings that say what a malformed field holds."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
             float: "a number"}
    return names.get(type(value), "null")


def _not_a_record(item: Any) -> str | None:
    """Why a JSON value is not an evidence record, or None when it is one; a value that is not
    an object would otherwise be skipped without a word, hiding a broken file."""
    if not isinstance(item, dict):
        what = "JSON null" if item is None else json_type(item).replace("a ", "a JSON ", 1)
        return f"not a record: {what}, not an object with a `kind`"
    if not item.get("kind"):
        return "not an evidence record (no `kind`)"
    return None


@dataclass
class EvidenceSet:
    """All records of one model folder, read once; freshness computed once per record."""

    model: ModelFolder
    records: list[Record] = field(default_factory=list)
    problems: list[Finding] = field(default_factory=list)  # unreadable files, records with no kind

    @classmethod
    def load(cls, model: ModelFolder) -> "EvidenceSet":
        found = cls(model)
        folder = model.path / "evidence"
        for path in sorted(folder.rglob("*.json")) if folder.is_dir() else []:
            rel = path.relative_to(model.root).as_posix()
            try:
                data = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                found.problems.append(Finding(f"not readable as JSON: {e}", rel))
                continue
            if data == []:
                found.problems.append(Finding("not a record: an empty list holds no evidence record; "
                                              "write the record (a JSON object) or remove the file", rel))
            items = data if isinstance(data, list) else [data]
            for i, item in enumerate(items):
                position = i if isinstance(data, list) else None
                why = _not_a_record(item)
                if why:
                    at = f" (item {i})" if position is not None else ""
                    found.problems.append(Finding(why + at, rel))
                else:
                    found.records.append(Record(rel, item, position))
        return found

    @cached_property
    def _fresh(self) -> dict[int, Freshness]:
        return {id(r): _freshness(self.model.root, r) for r in self.records}

    def freshness(self, record: Record) -> Freshness:
        return self._fresh[id(record)]

    def of_kind(self, *kinds: str) -> list[Record]:
        return [r for r in self.records if r.kind in kinds]

    def in_file(self, rel: str) -> list[Record]:
        return [r for r in self.records if r.rel == rel]


def stale_findings(evidence: EvidenceSet, record: Record) -> list[Finding]:
    """One finding for the record and one per changed source, for a stale record."""
    state = evidence.freshness(record)
    if state.fresh:
        return []
    rerun = f"; refresh it with: {record.command}" if record.command.strip() else ""
    found = [Finding(state.reason + rerun, record.rel)]
    found += [Finding(f"changed since {record.label} was recorded", s) for s in state.changed]
    return found
