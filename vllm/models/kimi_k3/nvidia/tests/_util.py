"""Small helpers shared by the model-level tests (not tests themselves)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import RandomSource, load_rank
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel
from vllm.models.kimi_k3.nvidia.reference.state import DecodeState, KDALayerState, MLALayerState


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (METHOD.md's metric), computed in fp64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


DISTRIBUTIONS = ("normal", "heavy_tailed", "large", "tiny")


def draw(kind: str, shape: tuple[int, ...], gen: torch.Generator, device: str, scale: float = 1.0) -> torch.Tensor:
    """Random bf16 kernel inputs: normal, heavy-tailed (Student t, 3 dof), large-magnitude, near-zero."""
    z = torch.randn(shape, generator=gen, device=device)
    if kind == "heavy_tailed":  # t = z / sqrt(chi2_3 / 3)
        chi2 = sum(torch.randn(shape, generator=gen, device=device) ** 2 for _ in range(3))
        z = z / (chi2 / 3).sqrt().clamp_min(1e-3)
    elif kind == "large":
        z = z * 3e3
    elif kind == "tiny":
        z = z * 1e-4
    return (z * scale).to(torch.bfloat16)


def rand_w(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """A bf16 weight at a realistic scale: N(0, 1/fan_in)."""
    return (torch.randn(*shape, generator=gen) / math.sqrt(shape[-1])).to(torch.bfloat16)


def rand_norm(gen: torch.Generator, n: int) -> torch.Tensor:
    """A bf16 norm weight near 1."""
    return (1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)


def mini_model(seed: int = 0, tp: int = 1, rank: int = 0, coll=None, decode_forms_in_prefill: bool = False,
               **cfg_overrides) -> ReferenceModel:
    cfg = preset("mini").replace(**cfg_overrides) if cfg_overrides else preset("mini")
    w = load_rank(RandomSource(cfg, seed=seed), cfg, tp=tp, rank=rank)
    return ReferenceModel(cfg, w, tp=tp, rank=rank, coll=coll, decode_forms_in_prefill=decode_forms_in_prefill)


def prefill(model: ReferenceModel, state, prompts: list[list[int]]) -> list[int]:
    """Allocate a request per prompt in `state` and prefill them all in one standard step; the slots."""
    slots = [state.allocate() for _ in prompts]
    segs, row = [], 0
    for r, p in zip(slots, prompts):
        segs.append(state.segment(r, row, len(p), prefill=True))
        row += len(p)
    model.forward(torch.tensor(sum(prompts, []), device=state.device), segs, state)
    return slots


def run_steps(model: ReferenceModel, prompts: list[list[int]], steps: list[list[list[int]]],
              *, max_len: int = 256, max_q: int = 1, accept: list[list[int]] | None = None):
    """Prefill `prompts` in one step, then decode steps: steps[s][r] = token ids of request r.

    Returns (logits of each step as a list of [rows, V] tensors, state).
    """
    state = model.new_state(max_requests=len(prompts), max_len=max_len, max_q=max_q)
    slots = [state.allocate() for _ in prompts]
    segs, row = [], 0
    for r, p in zip(slots, prompts):
        segs.append(state.segment(r, row, len(p), prefill=True))
        row += len(p)
    out = [model.logits(model.forward(torch.tensor(sum(prompts, [])), segs, state))]
    for s, step in enumerate(steps):
        segs, row, ids = [], 0, []
        for r, toks in zip(slots, step):
            segs.append(state.segment(r, row, len(toks), prefill=False))
            row += len(toks)
            ids += toks
        out.append(model.logits(model.forward(torch.tensor(ids), segs, state)))
        if accept is not None and s < len(accept):
            for r, k in zip(slots, accept[s]):
                state.accept(r, k)
    return out, state


def executor_rank_steps(coll, tp: int) -> tuple[list[bool], torch.Tensor]:
    """One TP rank of the mini model through the executor (ReferenceOps, no graphs) and through
    the reference on the same prompts: whether each decode / verify step's logits are equal bit
    for bit, and the last step's (full-vocab) logits. `coll` joins the rank to its peers."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    m = mini_model(seed=0, tp=tp, rank=coll.rank, coll=coll)
    ex = SpecializedDecode(m, max_requests=2, max_len=32, buckets=[(2, 1), (4, 2)], ops=ReferenceOps(),
                           graphs=False, log=lambda _: None)
    ref = m.new_state(max_requests=2, max_len=32, max_q=2)
    slots = prefill(m, ex.state, prompts)
    prefill(m, ref, prompts)
    same = []
    for q, ids in ((1, [7, 8]), (2, [1, 2, 3, 4]), (1, [5, 6])):
        ids = torch.tensor(ids)
        got = ex(ids, [ex.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], ex.state)
        want = m.logits(m.forward(ids, [ref.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], ref))
        same.append(torch.equal(got, want))
    return same, got


def _vllm_importable() -> bool:
    try:
        import vllm.config  # noqa: F401
    except ImportError:
        return False
    return True


REQUIRE_VLLM = os.environ.get("K3_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(
    not (REQUIRE_VLLM or _vllm_importable()),
    reason="needs vLLM (import vllm.config failed); the optional job .ci/vllm_cpu_job.sh runs it")


def page_views(rec: torch.Tensor, conv: torch.Tensor, gap_bytes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KDA layer's pools as vLLM 0.33.0 holds them: one page per slot, the conv state at its start
    (16-byte rounded) and the recurrent state after it, views with the page as slot stride; the rest
    of each page (and `gap_bytes` more) is NaN. Returns (page buffer, rec view, conv view) holding
    rec's and conv's values."""
    slots = max(rec.shape[0], conv.shape[0])
    conv_bytes = -(-conv[0].numel() * 2 // 16) * 16
    page = conv_bytes + rec[0].numel() * 4 + gap_bytes
    buf = torch.full((slots * page // 4,), float("nan"), device=rec.device)
    conv_v = torch.as_strided(buf.view(torch.bfloat16), conv.shape, (page // 2, *conv.stride()[1:]))
    rec_v = torch.as_strided(buf, rec.shape, (page // 4, *rec.stride()[1:]), conv_bytes // 4)
    conv_v.copy_(conv)
    rec_v.copy_(rec)
    return buf, rec_v, conv_v


def paged_pools(state: DecodeState, gap_bytes: int = 256):
    """`state`'s pools for an executor, the KDA ones rebuilt by `page_views` (the MLA caches copied).
    Returns ((kda, mla) pools, the (page buffer, rec view, conv view) of each KDA layer)."""
    pages = {i: page_views(st.rec, st.conv, gap_bytes) for i, st in state.kda.items()}
    kda = {i: KDALayerState(rec=rec, conv=conv) for i, (_, rec, conv) in pages.items()}
    return (kda, {i: MLALayerState(st.cache.clone()) for i, st in state.mla.items()}), list(pages.values())


class _ExecutorAsModel:
    """An executor in the shape `block_parity.parity_lockstep` calls the eager model in (forward, logits)."""

    def __init__(self, ex: SpecializedDecode):
        self.ex, self.w = ex, ex.w

    def forward(self, ids, segments, state):
        return self.ex(ids, segments, state)

    def logits(self, x):
        return x


# this file, among the sources of every record that long_run_vs_graphed judges, so that a change
# of the verdict stales them
VERDICT = "vllm/models/kimi_k3/nvidia/tests/_util.py"

# a long run also fails when its last quarter's median error exceeds this × its first's, or × the
# yardstick's first (a path that starts nearer the graphed table than rounding noise would may
# still drift to where the noise starts: a CPU run of the exact reference ops went 0.0 -> 0.29
# over 8 verify steps, the yardstick 0.14 -> 0.34), or × the decode records' absolute tolerance
DRIFT_GROWTH = 3.0


def free_all(state) -> None:
    """Free every slot `state` holds: the previous bucket's requests, before the next is filled."""
    for r, used in enumerate(state.in_use):
        if used:
            state.free(r)


def long_run_max_len(context: int, runs: dict[tuple[int, int], int], anchor_steps: int) -> int:
    """Cache length for a long-run test: `context`, then per (rows, q) bucket its anchor (at
    least PARITY_MIN_TOKENS tokens, `parity_steps_at`) and its run of `runs[bucket]` steps."""
    from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import parity_steps_at  # lazily, as below

    return (context + max(steps * q for (_, q), steps in runs.items())
            + max(parity_steps_at(rows, anchor_steps) * q for rows, q in runs) + 8)


def long_run_vs_graphed(spec: SpecializedDecode, noisy: SpecializedDecode, graphed: SpecializedDecode,
                        slots: list[int], q: int, steps: int, gen: torch.Generator) -> tuple[dict, list[str]]:
    """`steps` steps of `spec` and of the rounding-noise yardstick `noisy`, in lockstep against the
    graphed standard table `graphed` (the eager path is too slow for thousands of steps), from
    `spec`'s state. Returns their parity summaries and what failed, if anything: the decode
    records' rule over the whole run, the same rule on the last quarter (state errors that
    accumulate would leave the yardstick behind there), and growth to the last quarter from the
    first (its own, or the yardstick's where that is higher). A random-weight model is chaotic, so the yardstick's own error grows too; a KDA state
    scaled by 1.03 a step leaves it behind while the growth ratio alone does not see it
    (tests/test_long_run_verdict.py)."""
    # imported here: block_parity pulls in the CuTe DSL kernels, which vLLM's environment
    # (.ci/vllm_cpu_job.sh imports this module there) does not have
    from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (PARITY_MEDIAN_REL, PARITY_VS_BASELINE,
                                                                      parity_lockstep, parity_status)

    runs, _ = parity_lockstep(_ExecutorAsModel(graphed), {"specialized": spec, "standard_rounding_noise": noisy},
                              graphed.state, slots, q, steps, gen, required="specialized")
    s, y = runs["specialized"], runs.get("standard_rounding_noise")
    failed = []
    if parity_status(runs) != "pass":
        failed.append("median error or top-1 agreement beyond the yardstick's (parity_status)")
    if y and s["rel_err_last_quarter"] > PARITY_VS_BASELINE * y["rel_err_last_quarter"] + 0.02:
        failed.append("last quarter's median error beyond the yardstick's last quarter")
    start = max(s["rel_err_first_quarter"], y["rel_err_first_quarter"] if y else 0.0, PARITY_MEDIAN_REL)
    if s["rel_err_last_quarter"] > DRIFT_GROWTH * start:
        failed.append(f"error grew more than {DRIFT_GROWTH}x from where it (or the rounding noise) started "
                      "to the last quarter")
    return runs, failed
