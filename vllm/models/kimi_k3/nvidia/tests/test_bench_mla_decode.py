"""The MLA benchmark's torch baselines compute the absorbed attention they claim to, and its
sweep judges and picks variants as it says (CPU)."""

import math

import torch

from vllm.models.kimi_k3.nvidia.benchmarks.bench_mla_decode import (LATENT, ROW, TAU, fastest, gathered_core, judged,
                                                                    plan_label)
from vllm.models.kimi_k3.nvidia.kernels import mla_decode
from vllm.models.kimi_k3.nvidia.reference.mla import attend_latent


def causal_mask(q: int, length: int) -> torch.Tensor:
    """[q, L], True where verify token i may not look (positions after L - q + i), as `Case`."""
    return torch.arange(length)[None, :] > torch.arange(length - q, length)[:, None]


def attention_fp64(q_lat: torch.Tensor, kv: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """The same attention, one request, head and token at a time, in float64."""
    out = torch.empty(*q_lat.shape[:3], LATENT, dtype=torch.float64)
    for r in range(q_lat.shape[0]):
        for n in range(q_lat.shape[1]):
            keep = ~masked[n]
            rows = kv[r].double()[keep]
            for h in range(q_lat.shape[2]):
                w = torch.softmax(TAU * rows @ q_lat[r, n, h].double(), dim=0)
                out[r, n, h] = w @ rows[:, :LATENT]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def paged_problem(seed: int, requests: int, q: int, heads: int, length: int, scale: float = 1.0):
    """Queries and a pool of cache rows, each request's rows scattered over the pool."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(4 * requests * length, ROW, generator=gen).to(torch.bfloat16)
    slot_rows = torch.randperm(flat.shape[0], generator=gen)[:requests * length].view(requests, length)
    q_lat = (scale * torch.randn(requests * q, heads, ROW, generator=gen)).to(torch.bfloat16)
    return q_lat, flat, slot_rows


def test_the_batched_core_is_the_reference_request_by_request():
    """All requests at once (the compiled baseline's form) equal `attend_latent` request by request
    (the eager baseline's), and both the masked softmax attention in float64."""
    requests, q, heads, length = 3, 4, 2, 37
    q_lat, flat, slot_rows = paged_problem(0, requests, q, heads, length, scale=3.0)  # peaked scores
    got = torch.full((requests * q, heads, LATENT), math.nan, dtype=torch.bfloat16)
    gathered_core(q_lat, flat, slot_rows, got)
    assert got.dtype == torch.bfloat16
    want = attention_fp64(q_lat.view(requests, q, heads, ROW), flat[slot_rows], causal_mask(q, length))
    assert rel(got, want.flatten(0, 1)) < 5e-3  # bf16 output rounding
    one_by_one = torch.cat([attend_latent(q_lat[r * q:(r + 1) * q], flat[slot_rows[r]], LATENT, TAU)
                            for r in range(requests)])
    assert rel(one_by_one, got) < 5e-3


def test_gathered_core_under_torch_compile_matches_eager():
    """One compiled graph over every request, the cache gather inside it, equals the eager core
    on rows scattered over a paged pool."""
    requests, q, heads, length = 2, 2, 3, 50
    q_lat, flat, slot_rows = paged_problem(1, requests, q, heads, length)
    eager = torch.full((requests * q, heads, LATENT), math.nan, dtype=torch.bfloat16)
    compiled = eager.clone()
    gathered_core(q_lat, flat, slot_rows, eager)
    torch._dynamo.reset()
    torch.compile(gathered_core, dynamic=False)(q_lat, flat, slot_rows, compiled)
    want = attention_fp64(q_lat.view(requests, q, heads, ROW), flat[slot_rows], causal_mask(q, length)).flatten(0, 1)
    assert rel(eager, want) < 5e-3 and rel(compiled, want) < 5e-3


def test_sweep_judging_and_pick():
    """A variant passes only finite and within the bound of what it is judged against, the pick is
    the fastest that passed, and every variant of a sweep has its own label in the record."""
    judge = torch.randn(4, 6, LATENT, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    assert judged(judge.clone(), judge) == (0.0, "pass")
    assert judged(judge * 1.01, judge)[1] == "fail"  # 1e-2 relative: over the 5e-3 bound
    poisoned = judge.clone()
    poisoned[0, 0, 0] = math.nan
    assert judged(poisoned, judge)[1] == "fail"
    sweep = [{"plan": "a", "time_us": 9.0, "status": "pass"}, {"plan": "b", "time_us": 5.0, "status": "fail"},
             {"plan": "c", "time_us": 7.0, "status": "pass"}]
    assert fastest(sweep)["plan"] == "c"
    assert fastest(sweep[1:2]) is None
    for heads, q in ((6, 1), (12, 8)):
        plans = mla_decode.sweep_plans(heads, q, 64)
        assert len({plan_label(p) for p in plans}) == len(plans)
