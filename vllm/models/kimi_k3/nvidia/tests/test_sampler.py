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
