"""The synthetic repository passes every automatic item: the baseline every other test breaks."""

from ..items import NEEDS_HUMAN, PASS
from .conftest import MODEL, review_items

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


def test_routing_lists_each_changed_routing_file(repo):
    """A changed dispatch module is named in the routing item; a test named for dispatch is not."""
    repo.write(f"{MODEL}/dispatch.py", "def route(rows):\n    return rows <= 4\n")
    repo.write(f"{MODEL}/tests/test_dispatch.py", "def test_route():\n    pass\n")
    routing = review_items(repo.root)["routing"]
    assert routing.status == NEEDS_HUMAN and not routing.automatic
    assert [(f.path, f.message) for f in routing.findings] == [
        (f"{MODEL}/SCOPE.yaml", "the envelope the router enforces"),
        (f"{MODEL}/dispatch.py", "what the route depends on")]
    assert routing.summary.startswith("read 1 changed routing file(s)")
