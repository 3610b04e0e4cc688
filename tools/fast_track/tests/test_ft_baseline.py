"""The synthetic repository passes every automatic item: the baseline every other test breaks."""

from ..items import NEEDS_HUMAN, PASS
from .conftest import review_items

AUTOMATIC = ["changes", "scope-valid", "default-unchanged", "kernel-tests", "evidence-fresh",
             "features", "evals", "benchmarks", "sanitizer", "evidence-report"]


def test_every_automatic_item_passes_on_the_toy_repo(repo):
    items = review_items(repo.root)
    assert [k for k in items if items[k].automatic] == AUTOMATIC
    failing = {k: (i.summary, [f.message for f in i.findings]) for k, i in items.items()
               if i.automatic and i.status != PASS}
    assert failing == {}


def test_reviewer_items_point_at_the_synchronising_line(repo):
    items = review_items(repo.root)
    sync = items["sync-order"]
    assert sync.status == NEEDS_HUMAN and not sync.automatic
    # the atomic is on line 7 of the kernel; the comment above it mentions nothing synchronising
    assert [(f.path, f.line) for f in sync.findings] == [("vllm/models/toy/acme/kernels/add.py", 7)]
    assert items["numerics"].status == NEEDS_HUMAN
