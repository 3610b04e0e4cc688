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

from .evidence import file_hash, source_hash
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


def record_head(root: Path, kind: str, family: str, command: str,
                sources: list[str]) -> dict[str, Any]:
    missing = [s for s in sources if not (root / s).is_file()]
    if missing:
        raise ValueError(f"sources not found under {root}: {missing}; pass repository-relative "
                         "paths of files that exist")
    gpu, cc, driver = gpu_facts()
    sources = sorted(sources)
    return {"kind": kind, "family": family, "command": command, "gpu": gpu,
            "compute_capability": cc, "driver": driver, "commit": commit(root),
            "sources": sources, "source_hash": source_hash(root, sources),
            "source_hashes": {s: file_hash(root / s) for s in sources}}


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
