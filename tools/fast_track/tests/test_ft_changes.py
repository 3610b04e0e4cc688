"""Item `changes`: only the model folder, docs/fast_track/, .github/workflows/ and tools/fast_track/."""

import pytest

from ..gitrepo import GitError, change_set
from ..items import FAIL, PASS
from .conftest import MODEL, review_items


def test_changes_inside_the_allowed_folders_pass(repo):
    repo.write(".github/workflows/extra.yml", "on: push\n")
    repo.write("tools/fast_track/notes.txt", "notes\n")
    repo.commit()
    item = review_items(repo.root)["changes"]
    assert item.status == PASS


def test_every_file_outside_is_listed_with_how_it_changed(repo):
    repo.write("setup.py", "print('build')\n")
    repo.commit("touch the build")
    repo.write("vllm/models/other/acme/layer.py", "x = 1\n")  # another model: untracked
    (repo.root / f"{MODEL}/options.py").unlink()  # inside: allowed even when deleted
    item = review_items(repo.root)["changes"]
    assert item.status == FAIL
    listed = {f.path: f.message for f in item.findings}
    assert set(listed) == {"setup.py", "vllm/models/other/acme/layer.py"}
    assert listed["setup.py"].startswith("added")
    assert listed["vllm/models/other/acme/layer.py"].startswith("untracked")


def test_a_prefix_lookalike_folder_is_outside(repo):
    repo.write("docs/fast_track_old/x.md", "# x\n")
    repo.write(MODEL + "_v2/y.py", "y = 2\n")
    item = review_items(repo.root)["changes"]
    assert {f.path for f in item.findings} == {"docs/fast_track_old/x.md", MODEL + "_v2/y.py"}


def test_the_base_is_the_merge_base(repo):
    # work on a branch, while the base branch gains a file outside: not part of this change
    repo.git("checkout", "-q", "-b", "feature")
    repo.write(f"{MODEL}/kernels/rows.py", "ROWS = (1, 2)\n")
    repo.commit("feature work")
    repo.git("checkout", "-q", "main")
    repo.write("unrelated.txt", "elsewhere\n")
    repo.commit("main moves on")
    repo.git("checkout", "-q", "feature")
    changes = change_set(repo.root, "main")
    assert changes.paths == [f"{MODEL}/kernels/rows.py"]


def test_without_a_base_the_whole_tree_is_the_change(repo):
    changes = change_set(repo.root, None)
    tracked = repo.git("ls-files").splitlines()
    assert changes.paths == sorted(tracked)
    assert all(c.status == "A" for c in changes.changes)


def test_a_base_that_does_not_resolve_is_refused(repo):
    with pytest.raises(GitError, match="--base 'no-such-branch' is not a commit"):
        change_set(repo.root, "no-such-branch")
