"""Checklist item `changes`: the change touches only the folders a fast-track change may touch.

Allowed: each model folder under review, docs/fast_track/, .github/workflows/ and
tools/fast_track/. Anything else (a shared vLLM module, the build files, another
model) takes the change out of the fast track into ordinary review, so every such
path is listed with how it changed.
"""

from __future__ import annotations

from .gitrepo import ChangeSet
from .items import FAIL, PASS, Finding, ItemResult
from .model import ModelFolder

FIXED_ALLOWED = ("docs/fast_track/", ".github/workflows/", "tools/fast_track/")

_VERB = {"A": "added", "M": "modified", "D": "deleted", "T": "type changed", "?": "untracked (new)"}

TITLE = "The change touches only the model folder, docs/fast_track/, .github/workflows/, tools/fast_track/"


def allowed_prefixes(models: list[ModelFolder]) -> list[str]:
    return [m.rel.rstrip("/") + "/" for m in models] + list(FIXED_ALLOWED)


def check_changes(changes: ChangeSet, models: list[ModelFolder]) -> ItemResult:
    allowed = allowed_prefixes(models)
    outside = [c for c in changes.changes if not c.path.startswith(tuple(allowed))]
    if not outside:
        return ItemResult("changes", TITLE, PASS,
                          f"{len(changes.changes)} changed file(s) against {changes.base_label}, "
                          "all inside the allowed folders")
    findings = [Finding(f"{_VERB.get(c.status, c.status)}: outside the allowed folders", c.path)
                for c in outside]
    return ItemResult("changes", TITLE, FAIL,
                      f"{len(outside)} of {len(changes.changes)} changed file(s) against "
                      f"{changes.base_label} are outside the allowed folders", findings)
