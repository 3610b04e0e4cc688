"""One review: the change, the model folders, and every checklist item's result, in checklist order.

The order is docs/fast_track/CHECKLIST.md's: the automatic items 1-10, then the items a
reviewer judges. The review holds (`passed`) only when every automatic item is ✓; an
automatic item that ends in needs-human (something the checker could not evaluate) does
not hold either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .changes import check_changes
from .evidence import EvidenceSet
from .evidence_report import check_evidence_report
from .features import check_features
from .freshness import check_evidence_fresh
from .gates import check_benchmarks, check_evals
from .gitrepo import ChangeSet, change_set
from .human import check_numerics, check_routing, check_sync_order
from .items import PASS, ItemResult
from .kernel_tests import check_kernel_tests
from .model import ModelFolder, discover
from .sanitizer import check_sanitizer
from .scope_check import check_default_unchanged, check_scope_valid


@dataclass
class ModelReview:
    model: ModelFolder
    items: list[ItemResult] = field(default_factory=list)


@dataclass
class Review:
    root: Path
    changes: ChangeSet
    change_item: ItemResult
    models: list[ModelReview]

    def all_items(self) -> list[ItemResult]:
        return [self.change_item] + [i for m in self.models for i in m.items]

    def failing(self) -> list[ItemResult]:
        return [i for i in self.all_items() if i.automatic and i.status != PASS]

    @property
    def passed(self) -> bool:
        return not self.failing()


def review_model(model: ModelFolder, changes: ChangeSet) -> ModelReview:
    evidence = EvidenceSet.load(model)
    return ModelReview(model, [
        check_scope_valid(model),
        check_default_unchanged(model),
        check_kernel_tests(model, changes, evidence),
        check_evidence_fresh(model, evidence),
        check_features(model, evidence),
        check_evals(evidence),
        check_benchmarks(evidence),
        check_sanitizer(model, evidence),
        check_evidence_report(model),
        check_sync_order(model),
        check_numerics(model, changes),
        check_routing(model, changes),
    ])


def run_review(root: Path, base: str | None, model: str | None) -> Review:
    models = discover(root, model)
    changes = change_set(root, base)
    return Review(root, changes, check_changes(changes, models),
                  [review_model(m, changes) for m in models])
