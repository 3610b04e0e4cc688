"""The checklist items only a reviewer can judge, with the places to read for each.

They never fail the check; the report lists them as needs-human so the reviewer's
reading is as short as the checker can make it.

- `sync-order`: every read of data another CTA or rank produced comes after the wait
  that protects it, and every write another one reads comes before the release. A
  sanitizer run shows races that happened, not the ones a reordering could create, so
  the order is read in the code: the synchronising lines are listed.
- `numerics`: the changed kernels round and accumulate where the model's math says
  (accumulation dtype, the points where values are rounded to the storage dtype).
  Relative errors against a reference bound the error on the tested inputs only; long
  contexts amplify a wrong rounding point, which is why evals exist.
- `routing`: the per-step route uses host-side facts that every rank knows identically
  (so ranks never take different paths), and outside the envelope the standard path
  serves unchanged.
"""

from __future__ import annotations

from pathlib import Path

from .gitrepo import ChangeSet
from .items import NEEDS_HUMAN, PASS, Finding, ItemResult
from .kernel_tests import kernel_files
from .model import ModelFolder
from .sanitizer import synchronising_kernels

ROUTING_WORDS = ("dispatch", "route", "router", "scope")


def check_sync_order(model: ModelFolder) -> ItemResult:
    title = "Reads of another CTA's or rank's data come after the wait that protects them"
    kernels = synchronising_kernels(model)
    if not kernels:
        return ItemResult("sync-order", title, PASS, "no synchronising kernel: nothing to read",
                          automatic=False)
    findings = [Finding(f"uses {name}", rel, line) for rel, sites in kernels.items()
                for line, name in sites]
    return ItemResult("sync-order", title, NEEDS_HUMAN,
                      f"read the {len(findings)} synchronising line(s) in {len(kernels)} file(s) "
                      "and the loads around them", findings, automatic=False)


def check_numerics(model: ModelFolder, changes: ChangeSet) -> ItemResult:
    title = "Changed kernels round and accumulate where the model's math specifies"
    changed = sorted(set(kernel_files(model)) & set(changes.present()))
    if not changed:
        return ItemResult("numerics", title, PASS, "no kernel changed: nothing to read",
                          automatic=False)
    return ItemResult("numerics", title, NEEDS_HUMAN,
                      f"compare {len(changed)} changed kernel(s) with the math specification",
                      [Finding("accumulation dtype and rounding points", rel) for rel in changed],
                      automatic=False)


def check_routing(model: ModelFolder, changes: ChangeSet) -> ItemResult:
    title = "Routing uses host-side facts identical on every rank; outside the envelope, the standard path"
    inside = [p for p in changes.present() if p.startswith(model.rel + "/")
              and p.endswith(".py") and "/tests/" not in p
              and any(w in Path(p).stem for w in ROUTING_WORDS)]
    findings = [Finding("the envelope the router enforces", model.scope_rel)]
    findings += [Finding("what the route depends on", p) for p in inside]
    return ItemResult("routing", title, NEEDS_HUMAN,
                      f"read {len(inside)} changed routing file(s) against SCOPE.yaml", findings,
                      automatic=False)
