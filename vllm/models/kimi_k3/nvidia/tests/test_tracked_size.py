"""The tracked tree stays small enough to travel to the lent GPU.

Every tracked file goes with each device call, inside a 64 MiB limit of which the packed CuTe DSL
takes 52, xgrammar (for the structured-output test) 3.7 and the coverage wheel 0.25: the tracked
files get 8 MiB at most, and `.ci/carry_size.py` says before a call whether it fits and what to
hold back (the rendered evidence report first). A large blob committed by mistake fails here, on
the CPU, rather than as a refused device call.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tools.fast_track.gitrepo import git

ROOT = Path(__file__).resolve().parents[5]
TRACKED_LIMIT = 8 * 2**20
CHECKPOINT_LIMIT = 4 * 10**6  # the tiny eval checkpoint (evals/tiny/model.safetensors)


def _tracked() -> dict[str, int]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    sizes = {}
    for name in git(ROOT, "ls-files", "-z").split("\0"):
        path = ROOT / name
        if name and path.is_file():
            sizes[name] = path.stat().st_size
    return sizes


def test_tracked_files_fit_the_device_carry():
    sizes = _tracked()
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total <= TRACKED_LIMIT, (
        f"tracked files take {total / 2**20:.2f} MiB, over the {TRACKED_LIMIT / 2**20:.0f} MiB a device call "
        f"leaves them; the largest: " + ", ".join(f"{n} ({sizes[n] / 2**20:.2f} MiB)" for n in largest))


def test_tiny_checkpoint_stays_small():
    sizes = _tracked()
    name = "vllm/models/kimi_k3/nvidia/evals/tiny/model.safetensors"
    assert name in sizes, f"{name} is not tracked"
    assert sizes[name] <= CHECKPOINT_LIMIT, f"{name} is {sizes[name]} bytes, over {CHECKPOINT_LIMIT}"
