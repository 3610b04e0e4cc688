"""The standard path compiled: the decode benchmark's "standard compiled with CUDA graphs" baseline.

`CompiledStandard` is `SpecializedDecode` on `TorchOps` (the standard path's capturable form)
whose step runs under torch.compile (inductor, static shapes: one compile per bucket, kept) and
is then captured in the bucket's CUDA graph like the other paths. It runs on one stream, because
torch.compile does not follow the lanes' stream switches.

A bucket past dynamo's recompile limit would silently run eager. The limit is therefore raised
to what a benchmark process builds, and hitting it raises instead: a figure labelled compiled is
compiled. `compile_stats()` reports the graphs dynamo made and the reasons it broke them.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch._dynamo

from ..latency_specialized.executor import SpecializedDecode
from ..latency_specialized.torch_ops import TorchOps
from ..reference.model import ReferenceModel

# compiles one process may hold: (TP sizes × contexts) executors × their buckets, with room
RECOMPILE_LIMIT = 256


class CompiledStandard(SpecializedDecode):
    """`SpecializedDecode(model, ops=TorchOps(), overlap=False, **kw)` with its step compiled by
    `backend` (inductor; "aot_eager" traces without generating kernels, which tests use to check
    the trace against the eager step exactly)."""

    def __init__(self, model: ReferenceModel, backend: str = "inductor", **kw):
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, RECOMPILE_LIMIT)
        cfg.fail_on_recompile_limit_hit = True
        self.backend, self.step_compiled = backend, None
        super().__init__(model, ops=TorchOps(), overlap=False, **kw)

    def _forward(self, meta):
        if self.step_compiled is None:
            # the unbound function, called with self: a compiled bound method would hold self
            # and make a cycle, so `del executor` would no longer free its caches and graphs
            self.step_compiled = torch.compile(SpecializedDecode._forward, dynamic=False, backend=self.backend)
        return self.step_compiled(self, meta)


def compile_stats(since: dict | None = None) -> dict:
    """What dynamo did in this process (since an earlier `compile_stats()`, when given): graphs
    made and graph breaks, counted by the first line of their reason."""
    counters = torch._dynamo.utils.counters
    breaks: Counter = Counter()
    for reason, n in counters["graph_break"].items():
        breaks[reason.splitlines()[0]] += n
    if since is not None:
        breaks.subtract(since["graph_breaks"])
        breaks = +breaks  # drops the reasons that did not occur since
    graphs = int(counters["stats"]["unique_graphs"]) - (since["unique_graphs"] if since else 0)
    return {"unique_graphs": graphs, "graph_breaks": dict(breaks)}
