"""A minimal generation harness: prefill, decode loop, sampling, stop rules, batching.

Not a server: it exists so the CLI, tests, evals and benchmarks drive both decode paths
the way vLLM would. Each step is described by host-side facts (`StepFacts`) and handed to
the dispatcher's `route`; the returned path serves it. Prefill always runs the standard
path. The sampler never knows which path produced the logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..reference.model import ReferenceModel
from ..reference.state import DecodeState
from .deployment import StepFacts
from .sampler import SamplingParams, sample


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" | "length"


@dataclass
class RunStats:
    prefill_steps: int = 0
    decode_steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    paths: dict[str, int] = field(default_factory=dict)  # step count per path that served it

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


DecodeFn = Callable[[torch.Tensor, list, DecodeState], torch.Tensor]


class Engine:
    """Drives a model over batches of requests; `dispatcher` picks the path per decode step."""

    def __init__(self, model: ReferenceModel, *, dispatcher=None, specialized: Optional[DecodeFn] = None,
                 max_requests: int = 8, max_len: int = 4096, state: Optional[DecodeState] = None):
        # state: serve requests in this DecodeState (the specialized executor's, whose CUDA
        # graphs point at its pools) instead of a fresh one per generate call
        self.model, self.dispatcher, self.specialized = model, dispatcher, specialized
        self.max_requests, self.max_len, self.state = max_requests, max_len, state
        if state is not None:
            self.max_requests, self.max_len = min(max_requests, state.max_requests), min(max_len, state.max_len)
        self.stats = RunStats()

    def _standard(self, ids: torch.Tensor, segs: list, state: DecodeState) -> torch.Tensor:
        return self.model.logits(self.model.forward(ids, segs, state))

    def _route(self, facts: StepFacts) -> tuple[str, DecodeFn]:
        if self.dispatcher is None:
            return "standard", self._standard
        route = self.dispatcher.route(facts)
        if route.path == "specialized" and self.specialized is not None:
            launches = getattr(self.specialized, "launches", None)  # the executor lists its graph's kernels
            counters = getattr(self.dispatcher, "counters", None)
            if launches is not None and counters is not None and route.plan is not None:
                counters.record_kernels(launches(route.plan))
            return "specialized", self.specialized
        return "standard", self._standard

    def generate(self, requests: Sequence[Request], progress: Optional[Callable[[int, int], None]] = None
                 ) -> list[Completion]:
        if not requests:
            return []
        if len(requests) > self.max_requests:
            raise ValueError(f"{len(requests)} requests exceed max_requests={self.max_requests}")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError("every request needs at least one prompt token")
        longest = max(len(r.prompt_ids) + r.params.max_tokens for r in requests)
        if longest > self.max_len:
            raise ValueError(f"prompt + max_tokens = {longest} tokens exceeds max_len={self.max_len}; "
                             "raise max_len or shorten the request")
        device = self.model.w.embed.device
        state = self.state if self.state is not None else self.model.new_state(
            max_requests=len(requests), max_len=longest, device=device)
        slots = [state.allocate() for _ in requests]
        try:
            return self._generate(requests, state, slots, progress)
        finally:
            for slot in slots:
                state.free(slot)

    def _generate(self, requests: Sequence[Request], state: DecodeState, slots: list[int],
                  progress: Optional[Callable[[int, int], None]]) -> list[Completion]:
        device = self.model.w.embed.device
        gens = [None if r.params.seed is None else torch.Generator().manual_seed(r.params.seed) for r in requests]
        outs: list[list[int]] = [[] for _ in requests]
        finish: list[Optional[str]] = [None] * len(requests)
        t0 = time.perf_counter()

        # prefill: all prompts in one standard-path step
        segs, row, ids = [], 0, []
        for r, slot in zip(requests, slots):
            segs.append(state.segment(slot, row, len(r.prompt_ids), prefill=True))
            ids += r.prompt_ids
            row += len(r.prompt_ids)
        logits = self._standard(torch.tensor(ids, device=device), segs, state)
        last = [s.row0 + s.n - 1 for s in segs]
        self._emit(logits[last], list(range(len(requests))), requests, gens, outs, finish)
        self.stats.prefill_steps += 1
        self.stats.paths["standard"] = self.stats.paths.get("standard", 0) + 1

        total = sum(r.params.max_tokens for r in requests)
        while True:
            live = [i for i, f in enumerate(finish) if f is None]
            if progress:
                progress(sum(len(o) for o in outs), total)
            if not live:
                break
            segs = [state.segment(slots[i], j, 1, prefill=False) for j, i in enumerate(live)]
            facts = StepFacts(rows=len(live), tokens_per_request=1,
                              max_context=max(s.pos0 + 1 for s in segs), pure_decode=True)
            path, fn = self._route(facts)
            ids_t = torch.tensor([outs[i][-1] for i in live], device=device)
            self._emit(fn(ids_t, segs, state), live, requests, gens, outs, finish)
            self.stats.decode_steps += 1
            self.stats.paths[path] = self.stats.paths.get(path, 0) + 1
        self.stats.seconds += time.perf_counter() - t0
        self.stats.tokens += sum(len(o) for o in outs)
        return [Completion(r.prompt_ids, o, f or "length") for r, o, f in zip(requests, outs, finish)]

    @staticmethod
    def _emit(logits: torch.Tensor, which: list[int], requests: Sequence[Request], gens, outs, finish) -> None:
        toks = sample(logits, [requests[i].params for i in which], [gens[i] for i in which],
                      [outs[i] for i in which])
        for i, t in zip(which, toks):
            outs[i].append(t)
            p = requests[i].params
            # a grammar's own stop token (EOS) ends the request too: after it the grammar allows nothing
            if t in p.stop_token_ids or t in getattr(p.token_mask, "stop_token_ids", ()):
                finish[i] = "stop"
            elif len(outs[i]) >= p.max_tokens:
                finish[i] = "length"


def build_specialized(model: ReferenceModel, dispatcher, requests: int, max_len: int, *,
                      reference_on_cpu: bool = False):
    """The specialized executor for an enabled dispatcher, attached to it: plain decode buckets of
    its envelope up to the first that holds every request. None, with the reason logged, when the
    dispatcher is off, the weights are not on a CUDA device (unless `reference_on_cpu`: then the
    executor runs the reference ops, which checks its step plumbing but not its kernels), or a
    kernel's envelope refuses the model's shapes; the standard path then serves every step."""
    from .dispatch import BACKEND_LOG
    from .executor import ExecutorError, SpecializedDecode

    if not dispatcher.enabled:
        return None
    if model.w.embed.device.type != "cuda" and not reference_on_cpu:
        BACKEND_LOG.warning("specialized executor not built: its CuTe DSL kernels need a CUDA device "
                            "(--device cuda); the standard path serves every step")
        return None
    rows = sorted(dispatcher.envelopes[0].rows_per_step)
    cap = next((r for r in rows if r >= requests), rows[-1])
    try:
        executor = SpecializedDecode(model, max_requests=requests, max_len=max_len,
                                     buckets=[(r, 1) for r in rows if r <= cap])
    except (ValueError, ExecutorError) as e:  # a kernel's envelope refuses this model's shapes
        BACKEND_LOG.warning("specialized executor not built (%s); the standard path serves every step", e)
        return None
    dispatcher.executor = executor
    return executor
