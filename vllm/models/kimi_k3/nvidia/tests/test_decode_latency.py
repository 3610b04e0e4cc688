"""decode_latency's block-parity verdict: the rounding-noise yardstick, with top-1 agreement judged
as a rate over the tokens it was counted on."""

from __future__ import annotations

import pytest

from vllm.models.kimi_k3.nvidia.benchmarks.decode_latency import parity_status


def _par(spec_err, spec_top1, base_err, base_top1, tokens):
    return {"specialized": {"steps": 8, "tokens": tokens, "rel_err_median": spec_err, "top1_agreement": spec_top1},
            "standard_rounding_noise": {"steps": 8, "tokens": tokens, "rel_err_median": base_err,
                                        "top1_agreement": base_top1}}


@pytest.mark.parametrize("par, verdict", [
    # H200 records of 2026-12-03 at one row (8 tokens): 0/8 and 1/8 against the yardstick's 2/8
    (_par(0.66, 0.0, 0.82, 0.25, 8), "pass"),
    (_par(0.74, 0.125, 0.73, 0.25, 8), "pass"),
    # the same rates over 512 tokens are a real difference
    (_par(0.66, 0.0, 0.82, 0.25, 512), "fail"),
    (_par(0.70, 0.10, 0.75, 0.30, 512), "fail"),
    (_par(0.70, 0.20, 0.75, 0.30, 512), "pass"),  # within 1/1.5 of the yardstick's rate
    # the logit error is judged as before, whatever the token count
    (_par(1.40, 0.30, 0.75, 0.30, 8), "fail"),
    (_par(1.10, 0.30, 0.75, 0.30, 512), "pass"),  # 1.10 <= 1.5 · 0.75 + 0.02
])
def test_the_verdict_weighs_top1_by_the_tokens_counted(par, verdict):
    assert parity_status(par) == verdict


def test_without_a_yardstick_the_absolute_bounds_apply():
    assert parity_status({"specialized": {"steps": 8, "rel_err_median": 1e-3, "top1_agreement": 1.0}}) == "pass"
    assert parity_status({"specialized": {"steps": 8, "rel_err_median": 5e-2, "top1_agreement": 1.0}}) == "fail"
