"""Which models the kernels take, checked on the CPU: every kernel op of real decode and verify steps
goes through its launcher's envelope checks (they all run before any GPU work, the CUDA-device
check last), so on CPU tensors an op inside the envelope fails only that device check. The step
then continues on the reference op, so every layer's shapes are checked."""

from __future__ import annotations

import dataclasses

from vllm.models.kimi_k3.nvidia.evals.tiny import config_named
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import KernelOps, ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import RandomSource, load_rank
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel

KERNEL_OPS = ("situ_and_mul", "linear", "rms_norm", "embed", "attn_res", "kda_core", "mla_cache_write",
              "mla_absorb", "mla_attend", "mla_unabsorb", "route", "routed_experts")


class EnvelopeProbe(KernelOps):
    """KernelOps whose launches stop at the device check; the reference op then computes the result."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: dict[str, set[str]] = {}
        self.probed: set[str] = set()
        self.ref = ReferenceOps()


def _probe(name: str):
    kernel_op = getattr(KernelOps, name)
    ref_op = getattr(ReferenceOps, name)

    def op(self, *args, **kw):
        self.probed.add(name)
        try:
            kernel_op(self, *args, **kw)
        except ValueError as e:
            if "CUDA" not in str(e):
                self.refused.setdefault(name, set()).add(str(e))
        else:
            raise AssertionError(f"{name} launched on CPU tensors")
        return ref_op(self.ref, *args, **kw)
    return op


for _name in KERNEL_OPS:
    setattr(EnvelopeProbe, _name, _probe(_name))


def _refusals(cfg) -> tuple[dict[str, set[str]], set[str]]:
    model = ReferenceModel(cfg, load_rank(RandomSource(cfg, seed=0), cfg, tp=1, rank=0))
    ops = EnvelopeProbe()
    SpecializedDecode(model, max_requests=8, max_len=64, buckets=[(1, 1), (8, 1), (16, 8)], ops=ops, graphs=False,
                      log=lambda _: None)
    return ops.refused, ops.probed


def test_the_tiny_eval_model_fits_every_kernel():
    refused, probed = _refusals(config_named("tiny"))
    assert probed == set(KERNEL_OPS)
    assert not refused, refused


def test_a_model_outside_the_envelope_is_refused_by_name():
    """The mini preset's MLA (latent 32, heads of 16 + 8) is not K3's: the probe must say so."""
    refused, _ = _refusals(config_named("mini"))
    assert any("576" in msg for msg in refused.get("mla_attend", ())), refused
    assert any("kv_c must be [" in msg for msg in refused.get("mla_cache_write", ())), refused


def test_a_router_other_than_k3s_is_refused_not_run():
    """The router kernel computes K3's sigmoid scores over one expert group: a model with softmax
    scores or grouped routing (both valid configs, both in the reference) must not get them."""
    tiny = config_named("tiny")
    for change, said in ((dict(moe_router_activation_func="softmax"), "scoring='softmax'"),
                         (dict(num_expert_group=2, topk_group=1), "2 expert group(s)")):
        refused, _ = _refusals(dataclasses.replace(tiny, **change))
        assert set(refused) == {"route"} and any(said in msg for msg in refused["route"]), (change, refused)
    # groups that select nothing away (grouping off, or every group kept) route as one group
    for change in (dict(num_expert_group=2, topk_group=2), dict(num_expert_group=2, topk_group=1,
                                                               use_grouped_topk=False)):
        refused, _ = _refusals(dataclasses.replace(tiny, **change))
        assert not refused, (change, refused)
