"""`.ci/carry_size.py`: what a device call carries (tracked, untracked-not-ignored, carried paths)
against the limit, and what to hold back when over, in a throwaway git repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[5] / ".ci" / "carry_size.py"


def _repo(tmp_path: Path) -> Path:
    if shutil.which("git") is None:
        pytest.skip("no git")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text(".devwheels/\nbuild/\n")
    (tmp_path / "docs/fast_track").mkdir(parents=True)
    (tmp_path / "docs/fast_track/m_evidence.md").write_bytes(b"r" * 300_000)
    (tmp_path / "src.py").write_bytes(b"x" * 100_000)
    (tmp_path / "vllm/models/m/nvidia/kernels").mkdir(parents=True)
    (tmp_path / "vllm/models/m/nvidia/kernels/MEASURED.md").write_bytes(b"m" * 120_000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    (tmp_path / "new.txt").write_bytes(b"n" * 50_000)  # untracked, not ignored: travels too
    (tmp_path / "build").mkdir()
    (tmp_path / "build/blob").write_bytes(b"b" * 10**6)  # ignored and not carried: stays
    (tmp_path / ".devwheels").mkdir()
    (tmp_path / ".devwheels/cutedsl.tar.xz").write_bytes(b"c" * 400_000)
    (tmp_path / ".devwheels/xgrammar-0.2.9-cp312.tar.xz").write_bytes(b"g" * 200_000)
    return tmp_path


def _run(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=repo, capture_output=True, text=True)


def test_it_sums_what_travels_and_passes_under_the_limit(tmp_path):
    r = _run(_repo(tmp_path), ".devwheels", "--limit-mib", "1.2")
    assert r.returncode == 0, r.stdout + r.stderr
    # each file in whole 4 KiB blocks, as the device tool counts them: .gitignore's 19 bytes take one
    total = sum(-(-n // 4096) * 4096 for n in (300_000, 100_000, 120_000, 50_000, 400_000, 200_000, 19))
    assert f"total {'':34s} {total / 2**20:8.2f} MiB of 1.2" in r.stdout, r.stdout


def test_over_the_limit_it_names_what_to_hold_back_in_order_and_fails(tmp_path):
    r = _run(_repo(tmp_path), ".devwheels", "--limit-mib", "0.7")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    held = [line.split()[0] for line in lines[lines.index(next(x for x in lines if x.startswith("over by"))) + 1:]]
    assert held == ["docs/fast_track/m_evidence.md", "vllm/models/m/nvidia/kernels/MEASURED.md",
                    ".devwheels/xgrammar-0.2.9-cp312.tar.xz"], r.stdout
    r = _run(tmp_path, ".devwheels", "--limit-mib", "0.1")
    assert r.returncode == 1 and "MiB more: nothing above is enough" in r.stdout


def test_a_carried_path_that_is_not_here_is_named(tmp_path):
    r = _run(_repo(tmp_path), ".nb9")
    assert r.returncode != 0 and "carry_size: .nb9: no such file or folder here" in r.stderr
