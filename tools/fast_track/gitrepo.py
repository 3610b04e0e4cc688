"""What the change is: the files that differ between a base and the working tree, from git.

The change under review is everything between the merge-base of `--base` and HEAD, and
the working tree: committed, staged, unstaged and untracked (not ignored) files alike, so
the check reads the same before and after `git commit`. Without a base the change is the
whole tree against git's empty tree: a review of everything the repository holds, as for
a patch series that brings a model folder in whole. Renames are listed as a deletion and
an addition, so both paths are judged.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


class GitError(RuntimeError):
    """git refused: not a repository, or a ref that does not resolve."""


def git(root: Path, *args: str, check: bool = True) -> str:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=60)
    except FileNotFoundError:
        raise GitError("git is not installed; fast-track needs git to see the change") from None
    if check and out.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed in {root}: {out.stderr.strip()}")
    return out.stdout


def repo_root(start: Path) -> Path:
    out = subprocess.run(["git", "-C", str(start), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise GitError(f"{start} is not inside a git repository; run fast-track from the "
                       "checkout under review")
    return Path(out.stdout.strip())


def commit_of(root: Path, ref: str) -> str | None:
    out = git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False).strip()
    return out or None


def files_at(root: Path, commit: str, paths: list[str]) -> dict[str, bytes] | None:
    """Each of `paths` as its bytes stood at `commit`; None when git cannot show one of them (no
    such commit, as in a shallow clone, or a path the commit did not hold)."""
    if not paths or not commit or commit_of(root, commit) is None:
        return None
    query = "".join(f"{commit}:{p}\n" for p in paths).encode()
    try:
        out = subprocess.run(["git", "-C", str(root), "cat-file", "--batch"], input=query,
                             capture_output=True, timeout=60).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    found: dict[str, bytes] = {}
    at = 0
    for path in paths:  # each answer: "<sha> blob <size>\n<bytes>\n", or "<name> missing\n"
        end = out.find(b"\n", at)
        header = out[at:end].split()
        if end < 0 or len(header) != 3 or header[1] != b"blob":
            return None
        size = int(header[2])
        found[path] = out[end + 1:end + 1 + size]
        at = end + 1 + size + 1
    return found


def _empty_tree(root: Path) -> str:
    return git(root, "hash-object", "-t", "tree", "/dev/null").strip()


@dataclass(frozen=True)
class Change:
    status: str  # A added, M modified, D deleted, T type changed, ? untracked
    path: str  # repository-relative, forward slashes


@dataclass(frozen=True)
class ChangeSet:
    base_label: str  # what the user asked for, or "the empty tree"
    base: str  # the commit (merge-base) or tree compared against
    head: str | None
    changes: tuple[Change, ...]

    @property
    def paths(self) -> list[str]:
        return [c.path for c in self.changes]

    def present(self) -> list[str]:
        """Changed paths that still exist (a deleted file needs no test)."""
        return [c.path for c in self.changes if c.status != "D"]


def _parse_name_status(text: str) -> list[Change]:
    fields = [f for f in text.split("\0") if f]
    return [Change(fields[i][0], fields[i + 1]) for i in range(0, len(fields) - 1, 2)]


def untracked(root: Path) -> list[str]:
    return [p for p in git(root, "ls-files", "--others", "--exclude-standard", "-z").split("\0") if p]


def change_set(root: Path, base: str | None) -> ChangeSet:
    head = commit_of(root, "HEAD")
    if base is None:
        label, against = "the empty tree (the whole repository is the change)", _empty_tree(root)
    else:
        base_commit = commit_of(root, base)
        if base_commit is None:
            raise GitError(f"--base {base!r} is not a commit in {root}; pass a branch, tag or "
                           "sha that exists (fetch it first in CI: actions/checkout with "
                           "fetch-depth: 0)")
        against = base_commit
        if head is not None:
            merge_base = git(root, "merge-base", base_commit, head, check=False).strip()
            against = merge_base or base_commit
        label = base
    listed = _parse_name_status(git(root, "diff", "--name-status", "--no-renames", "-z", against))
    seen = {c.path for c in listed}
    listed += [Change("?", p) for p in untracked(root) if p not in seen]
    return ChangeSet(label, against, head, tuple(sorted(listed, key=lambda c: c.path)))


def changed_since(root: Path, commit: str, paths: list[str]) -> list[str] | None:
    """Which of `paths` differ in the working tree from `commit`; None if git cannot say."""
    if not commit or commit_of(root, commit) is None:
        return None
    out = git(root, "diff", "--name-only", "-z", commit, "--", *paths, check=False)
    changed = {p for p in out.split("\0") if p}
    wanted = set(paths)
    changed |= {p for p in untracked(root) if p in wanted}
    return sorted(changed)
