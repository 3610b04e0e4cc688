"""Evidence records: the JSON that GPU tests, benchmarks and evals leave behind (ARCHITECTURE.md §7).

One format for every record, so one checker reads them all: what ran (`command`), where (GPU
name, compute capability, driver), with what (torch and nvidia-cutlass-dsl versions, git commit),
over which sources (`sources` and `source_hash`, the sha256 of their bytes, so a record goes
stale when they change), how long its process had run when it was written (`wall_s`: what a
refresh on a lent GPU must budget, .ci/h200_refresh.py) and what came out (`results`,
`targets`). The git commit comes from the checkout, unless the environment variable K3_COMMIT
names it (the device copy of the tree carries a .git that may point at an older commit than its
files), else "unknown".
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Iterable, Sequence

KINDS = ("kernel-test", "kernel-bench", "decode-bench", "parity", "eval", "sanitizer")

# the repository root: vllm/models/kimi_k3/nvidia/latency_specialized/evidence.py -> 5 levels up
REPO_ROOT = Path(__file__).resolve().parents[5]


def source_hash(paths: Iterable[str | Path], root: Path = REPO_ROOT) -> str:
    """sha256 over the sources in sorted (repo-relative) path order: each path, then its bytes."""
    h = hashlib.sha256()
    for rel in sorted(str(p) for p in paths):
        h.update(rel.encode() + b"\0")
        h.update((root / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _git_commit(root: Path) -> str:
    """K3_COMMIT when the caller names the commit (a copied tree's own .git, if it has one, may
    still point at an older commit than the files it runs), else the checkout's HEAD."""
    if os.environ.get("K3_COMMIT"):
        return os.environ["K3_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _driver() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def process_wall_s() -> float | None:
    """Seconds since this process started (Linux /proc), None where that cannot be read."""
    try:
        # field 22 of /proc/self/stat, counted after the parenthesised command name (field 2)
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 1)
    except (OSError, ValueError, IndexError):
        return None


def _gpu() -> tuple[str, str]:
    import torch

    if not torch.cuda.is_available():
        return "none", "none"
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), f"{major}.{minor}"


def write_record(path: str | Path, kind: str, family: str, command: str,
                 sources: Sequence[str | Path], results: list[dict[str, Any]],
                 targets: Sequence[dict[str, Any]] = (), copy_bandwidth_TBps: float | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write one evidence record to `path` (JSON) and return it.

    `sources` are repo-relative paths of the code measured; `results` and `targets` follow §7
    (each result has at least `name` and `status`).
    """
    if kind not in KINDS:
        raise ValueError(f"evidence kind {kind!r} is not one of {KINDS}")
    for r in results:
        if "name" not in r or r.get("status") not in ("pass", "fail"):
            raise ValueError(f"every result needs a 'name' and a 'status' of 'pass' or 'fail': {r}")
    import torch

    gpu, cc = _gpu()
    sources = sorted(str(p) for p in sources)
    record: dict[str, Any] = {
        "kind": kind,
        "family": family,
        "command": command,
        "gpu": gpu,
        "compute_capability": cc,
        "driver": _driver(),
        "versions": {"torch": torch.__version__, "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
                     "cuda": str(torch.version.cuda)},
        "commit": _git_commit(REPO_ROOT),
        "sources": sources,
        "source_hash": source_hash(sources),
        "copy_bandwidth_TBps": copy_bandwidth_TBps,
        "results": results,
        "targets": list(targets),
    }
    if extra:
        record.update(extra)
    record.setdefault("wall_s", process_wall_s())
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return record
