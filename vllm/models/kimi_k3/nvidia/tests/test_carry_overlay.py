"""`.ci/carry_overlay.sh` and `overlay_step` (.ci/h200_call.sh): a branch's code judged in a call
that makes HEAD's records, its files laid over a copy of the tree and its output kept out of the
evidence folder.

Both run here in a scratch repository, `overlay_step` with a `step` that runs its command as the
device's does (under `timeout`, its output in $W/NAME.log).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]
GIT = ("git", "-c", "user.email=t@t", "-c", "user.name=t")


def _sh(cwd: Path, *args: str, env: dict | None = None) -> str:
    return subprocess.run(args, cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    if shutil.which("bash") is None or shutil.which("git") is None:
        pytest.skip("needs bash and git")
    r = tmp_path / "repo"
    (r / "vllm/pkg").mkdir(parents=True)
    (r / "tools").mkdir()
    (r / "vllm/pkg/kernel.py").write_text("VERSION = 'head'\n")
    (r / "vllm/pkg/gone.py").write_text("x = 1\n")
    (r / "tools/t.py").write_text("")
    _sh(r, "git", "init", "-q", "-b", "main")
    _sh(r, *GIT, "add", "-A")
    _sh(r, *GIT, "commit", "-qm", "head")
    _sh(r, "git", "checkout", "-qb", "judged")
    (r / "vllm/pkg/kernel.py").write_text("VERSION = 'judged'\n")
    (r / "vllm/pkg/new.py").write_text("NEW = True\n")
    (r / "vllm/pkg/gone.py").unlink()
    _sh(r, *GIT, "add", "-A")
    _sh(r, *GIT, "commit", "-qm", "judged")
    _sh(r, "git", "checkout", "-q", "main")
    (r / "tools/t.py").write_text("# main moved on after the fork\n")
    _sh(r, *GIT, "commit", "-qam", "main after the fork")
    return r


def test_overlay_holds_what_the_branch_adds_or_changes(repo: Path):
    out = _sh(repo, "bash", str(ROOT / ".ci/carry_overlay.sh"), "judged")
    overlay = repo / ".nb9/overlay"
    assert (overlay / "vllm/pkg/kernel.py").read_text() == "VERSION = 'judged'\n"
    assert (overlay / "vllm/pkg/new.py").exists()
    # main's later change to tools/t.py is not undone by the branch's older copy
    assert not (overlay / "vllm/pkg/gone.py").exists() and not (overlay / "tools/t.py").exists()
    assert (overlay / "REV").read_text().strip() == _sh(repo, "git", "rev-parse", "judged").strip()
    assert "1 file(s) that" in out  # the deleted file is named as staying


def test_a_branch_kept_by_merge_ours_needs_its_base(repo: Path):
    fork = _sh(repo, "git", "merge-base", "main", "judged").strip()
    _sh(repo, *GIT, "merge", "-q", "-s", "ours", "--no-edit", "judged")
    refused = subprocess.run(["bash", str(ROOT / ".ci/carry_overlay.sh"), "judged"], cwd=repo, capture_output=True,
                             text=True)
    assert refused.returncode == 2 and "name the commit it forked from" in refused.stdout
    _sh(repo, "bash", str(ROOT / ".ci/carry_overlay.sh"), "judged", fork)
    assert (repo / ".nb9/overlay/vllm/pkg/kernel.py").read_text() == "VERSION = 'judged'\n"


def test_overlay_step_runs_the_branch_code_and_writes_outside_the_evidence(repo: Path, tmp_path: Path):
    _sh(repo, "bash", str(ROOT / ".ci/carry_overlay.sh"), "judged")
    w = tmp_path / "w"
    (w / "ev").mkdir(parents=True)
    functions = _sh(ROOT, "sed", "-n", "/^overlay_step() {/,/^}/p", ".ci/h200_call.sh")
    assert functions.strip(), "overlay_step is gone from .ci/h200_call.sh"
    script = ('step() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$W/$name.log" 2>&1; }\n'
              + functions + '\noverlay_step judge 60 python3 -c '
              '"import os, vllm.pkg.kernel as k; print(k.VERSION, os.environ[\'K3_EVIDENCE_DIR\'])"\n')
    env = dict(os.environ, W=str(w), K3_EVIDENCE_DIR=str(w / "ev"), PYTHONPATH="")
    _sh(repo, "bash", "-c", script, env=env)
    assert (w / "judge.log").read_text().split() == ["judged", str(w / "judge")]
    assert _sh(repo, "git", "status", "--porcelain", "--", "vllm") == ""  # the tree itself is untouched
