"""The common head of the evidence records fast-track writes itself (ARCHITECTURE §7).

What ran and where: kind, family, command, the GPU, compute capability and driver (from
nvidia-smi; "none" without it, and the tools never import torch), the git commit
($FAST_TRACK_COMMIT when set: a copy of the tree on a GPU machine may have no .git, or
one that points at an older commit than its files; else the checkout's HEAD, else
$GITHUB_SHA), and the sources with their hash as evidence.py computes it,
plus per-file `source_hashes` so a stale record names the file that changed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from .evidence import file_hash, py_files_under, source_hash
from .gitrepo import GitError, commit_of


def gpu_facts() -> tuple[str, str, str]:
    """(name, compute capability, driver) of the first GPU, from nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "none", "none", "none"
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    parts = [p.strip() for p in lines[0].split(",")] if lines else []
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("none", "none", "none")


def commit(root: Path) -> str:
    if os.environ.get("FAST_TRACK_COMMIT"):
        return os.environ["FAST_TRACK_COMMIT"]
    fallback = os.environ.get("GITHUB_SHA") or "unknown"
    try:
        return commit_of(root, "HEAD") or fallback
    except GitError:
        return fallback


def expand_sources(root: Path, sources: list[str]) -> list[str]:
    """Repository-relative files, a folder standing for every `.py` file below it (so a record of
    tests that run a whole package, e.g. the kernels, goes stale with any file of it)."""
    files: set[str] = set()
    missing = []
    for s in sources:
        path = root / s
        if path.is_dir():
            found = py_files_under(root, s)
            if not found:
                missing.append(f"{s} (a folder with no .py file)")
            files.update(found)
        elif path.is_file():
            files.add(Path(s).as_posix())
        else:
            missing.append(s)
    if missing:
        raise ValueError(f"sources not found under {root}: {missing}; pass repository-relative "
                         "paths of files (or folders of .py files) that exist")
    return sorted(files)


def record_head(root: Path, kind: str, family: str, command: str,
                sources: list[str]) -> dict[str, Any]:
    given = [Path(s).as_posix() for s in sources]
    sources = expand_sources(root, sources)
    gpu, cc, driver = gpu_facts()
    # source_args: the sources as given, folders unexpanded, so freshness (evidence.py) expands
    # them again and a file added to such a folder since stales the record, named (`sources`
    # lists the files the folders held at the run)
    return {"kind": kind, "family": family, "command": command, "gpu": gpu,
            "compute_capability": cc, "driver": driver, "commit": commit(root),
            "sources": sources, "source_args": given, "source_hash": source_hash(root, sources),
            "source_hashes": {s: file_hash(root / s) for s in sources}}


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
