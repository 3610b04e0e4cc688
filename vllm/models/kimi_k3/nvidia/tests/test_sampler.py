"""The standard sampler: filters, seeds and masks behave as documented."""

import pytest
import torch

from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import (MIN_TEMPERATURE, SamplingParams, filter_logits,
                                                                     sample)


def _logits(v=50, seed=0):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3


def test_top_k_keeps_exactly_k():
    x = _logits()
    kept = torch.isfinite(filter_logits(x, SamplingParams(temperature=1.0, top_k=7)))
    assert kept.sum() == 7 and set(kept.nonzero().flatten().tolist()) == set(torch.topk(x, 7).indices.tolist())


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = _logits(seed=1)
    p = 0.6
    kept = torch.isfinite(filter_logits(x, SamplingParams(temperature=1.0, top_p=p)))
    probs = torch.softmax(x, -1)
    order = torch.argsort(probs, descending=True)
    need = int((probs[order].cumsum(0) < p).sum()) + 1  # tokens until the mass reaches p
    assert kept.sum() == need and kept[order[:need]].all()


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    x = torch.stack([_logits(seed=s) for s in range(4)])
    p = SamplingParams(temperature=1.3, top_k=20, top_p=0.9)

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        return [sample(x[i:i + 1], [p], [g], [[]])[0] for i in range(4) for _ in range(5)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


def test_temperature_zero_is_argmax_and_mask_is_applied_first():
    x = _logits(seed=2)
    assert sample(x[None], [SamplingParams()], [None], [[]]) == [int(x.argmax())]
    allowed = torch.zeros(50, dtype=torch.bool)
    allowed[[3, 9]] = True
    p = SamplingParams(temperature=1.0, token_mask=lambda out: allowed)
    g = torch.Generator().manual_seed(0)
    assert {sample(x[None], [p], [g], [[]])[0] for _ in range(20)} <= {3, 9}
    # the mask comes before top-k / top-p: the one token the grammar allows, though outside the
    # top 5, is the one drawn (filtered first, nothing would be left to draw from)
    only = torch.zeros(50, dtype=torch.bool)
    only[int(x.argmin())] = True
    p = SamplingParams(temperature=1.0, top_k=5, top_p=0.5, token_mask=lambda out: only)
    assert int(x.argmin()) not in torch.topk(x, 5).indices.tolist()
    assert sample(x[None], [p], [torch.Generator().manual_seed(0)], [[]]) == [int(x.argmin())]
    with pytest.raises(RuntimeError, match="grammar allows no token"):
        sample(x[None], [SamplingParams(token_mask=lambda out: torch.zeros(50, dtype=torch.bool))], [None], [[]])


@pytest.mark.parametrize("kw, msg", [({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "finite"),
                                     ({"temperature": float("inf")}, "finite"), ({"top_p": 0.0}, "top_p"),
                                     ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens")])
def test_bad_params_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_a_tiny_temperature_is_raised_as_vllm_raises_it_and_samples():
    """Below vLLM's 1e-2 the softmax of the scaled logits overflows (a traceback from multinomial
    at 1e-39); vLLM raises such a temperature to 1e-2, and so does this sampler."""
    p = SamplingParams(temperature=1e-39, seed=0)
    assert p.temperature == MIN_TEMPERATURE == 1e-2
    x = torch.randn(50) * 30
    assert sample(x[None], [p], [torch.Generator().manual_seed(0)], [[]]) == [int(torch.argmax(x))]


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_temperature_divides_the_logits_before_the_softmax(t):
    """With top-k and top-p off, the distribution drawn from is softmax(logits / T): a filter
    test at T = 1 cannot tell a forgotten division."""
    x = _logits(seed=3)
    got = torch.softmax(filter_logits(x, SamplingParams(temperature=t)), -1)
    assert torch.allclose(got, torch.softmax(x / t, -1), atol=1e-6)
    assert not torch.allclose(got, torch.softmax(x, -1), atol=1e-3)


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_top_p_counts_the_mass_of_the_tempered_distribution(t):
    """Top-p keeps the smallest prefix reaching p of softmax(logits / T), not of softmax(logits):
    at T = 2 the flatter distribution needs more tokens, at T = 0.5 fewer."""
    x, p = _logits(seed=1), 0.6

    def prefix(probs):
        order = torch.argsort(probs, descending=True)
        return order[:int((probs[order].cumsum(0) < p).sum()) + 1]

    want = prefix(torch.softmax(x / t, -1))
    assert len(want) != len(prefix(torch.softmax(x, -1)))  # else this T would not tell them apart
    kept = torch.isfinite(filter_logits(x, SamplingParams(temperature=t, top_p=p)))
    assert kept.sum() == len(want) and kept[want].all()


def test_a_tiny_temperature_samples_rather_than_taking_the_argmax():
    """A positive temperature below 1e-2 is raised to it, not treated as greedy: two logits
    0.005 apart are 0.5 apart once divided by 1e-2, so over a few seeds both are drawn."""
    x = torch.full((50,), -10.0)
    x[3], x[7] = 1.0, 1.005
    p = SamplingParams(temperature=1e-5)
    drawn = {sample(x[None], [p], [torch.Generator().manual_seed(s)], [[]])[0] for s in range(20)}
    assert drawn == {3, 7}
