"""The MLA benchmark's torch baselines compute the absorbed attention they claim to (CPU)."""

import math

import torch

from vllm.models.kimi_k3.nvidia.benchmarks.bench_mla_decode import LATENT, ROW, TAU, absorbed_core, gathered_core


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


def test_absorbed_core_is_the_masked_softmax_attention():
    gen = torch.Generator().manual_seed(0)
    requests, q, heads, length = 3, 4, 2, 37
    q_lat = (3 * torch.randn(requests, q, heads, ROW, generator=gen)).to(torch.bfloat16)  # peaked scores
    kv = torch.randn(requests, length, ROW, generator=gen).to(torch.bfloat16)
    masked = causal_mask(q, length)
    got = absorbed_core(q_lat, kv, masked)
    assert got.shape == (requests, q, heads, LATENT) and got.dtype == torch.bfloat16
    assert rel(got, attention_fp64(q_lat, kv, masked)) < 5e-3  # bf16 output rounding
    # request by request (the eager baseline) as all at once (the compiled one)
    one_by_one = torch.cat([absorbed_core(q_lat[r:r + 1], kv[r:r + 1], masked) for r in range(requests)])
    assert rel(one_by_one, got) < 5e-3


def test_gathered_core_under_torch_compile_matches_eager():
    """One compiled graph over every request, the cache gather inside it, equals the eager core
    on rows scattered over a paged pool."""
    gen = torch.Generator().manual_seed(1)
    requests, q, heads, length = 2, 2, 3, 50
    flat = torch.randn(4 * requests * length, ROW, generator=gen).to(torch.bfloat16)
    slot_rows = torch.randperm(flat.shape[0], generator=gen)[:requests * length].view(requests, length)
    q_lat = torch.randn(requests * q, heads, ROW, generator=gen).to(torch.bfloat16)
    masked = causal_mask(q, length)
    eager = torch.full((requests * q, heads, LATENT), math.nan, dtype=torch.bfloat16)
    compiled = eager.clone()
    gathered_core(q_lat, flat, slot_rows, masked, eager)
    torch._dynamo.reset()
    torch.compile(gathered_core, dynamic=False)(q_lat, flat, slot_rows, masked, compiled)
    want = attention_fp64(q_lat.view(requests, q, heads, ROW), flat[slot_rows], masked).flatten(0, 1)
    assert rel(eager, want) < 5e-3 and rel(compiled, want) < 5e-3
