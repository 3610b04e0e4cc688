"""The vLLM plugin: `register()`, and the adapter between vLLM's model and our dispatcher.

    pip install .   # adds the `vllm.general_plugins` entry point `kimi_k3_latency_specialized`
    vllm serve ... --additional-config '{"decode_backend": "latency_specialized"}'

How the plugin decides. vLLM runs general plugins in every process (API server, engine
core, workers, the registry's inspection subprocess), and in most of them before the
configuration exists: the API server loads them while building its argument parser, a
worker's `load_general_plugins()` takes no config. Whether the operator asked for this
backend is therefore known only where the model is built, from
`vllm_config.additional_config`. So `register()` only points vLLM's registry at a lazily
imported subclass of the Kimi K3 text model (`KimiLinearForCausalLM`, which Kimi K3's
multimodal model builds its text model through), on the platforms where vLLM resolves
that architecture to the NVIDIA implementation; it imports no model code. The subclass
(`vllm_model.py`) decides when it is built:

| `decode_backend` | what vLLM builds |
|---|---|
| unset or `auto` | vLLM's own `KimiLinearForCausalLM` instance (the subclass hands it back from `__new__`) |
| `latency_specialized` | the subclass: upstream builds with our keys hidden (it sees `auto`), then the verdict below; each forward is routed |

Start-up verdict: vLLM features this backend does not cover (pipeline or expert
parallelism, DBO, decode context parallelism, LoRA, ReplaySSM / RecoverSSM, a text config
that is not Kimi K3, quantized routed experts, which the weight binding cannot view) turn it
OFF first, with every such
feature in one warning line; otherwise `Dispatcher` matches the deployment against
SCOPE.yaml. Every step is routed at context max_model_len (`step_facts`), so a max_model_len
over an envelope's context is OFF too, not ON with no step ever admitted. `strict_scope`
turns either OFF into a `ScopeError`.

Per forward: `StepRouter` reads host-side facts only (padded token count, each layer's
attention metadata counts, the CUDA-graph mode), identical on every TP rank. Under FULL
CUDA graphs vLLM calls the model's forward only while capturing a graph, and replays run
what was captured; a route decided during a capture therefore holds for every later step
of that size, and is counted apart from forward passes that run outside a graph (eager
and PIECEWISE steps). Until the specialized executor exists every admitted step runs
vLLM's own forward, and the counters say so ("admitted; specialized executor not built").
The counters reach vLLM's log (TP rank 0, at most once a minute, when they changed):
vLLM's Prometheus metrics live in the API server process and offer workers no hook.

Weights: at the first forward pass (vLLM's profiling run, after the weights are loaded
and processed) `VllmBackend.bind` makes our per-rank `ModelWeights` as views of vLLM's
parameters (`vllm_weights.py`); a layout it cannot view turns the backend OFF, naming
the tensor or the MoE backend that repacked the experts.

Executor: at the first forward outside a capture after vLLM bound its caches (the warm-up
run vLLM makes before it captures each graph size), `VllmBackend.prepare` builds the
`VllmExecutor` over those caches (`vllm_executor.py`) and gives it to the dispatcher; from
then on an admitted step, captured into vLLM's FULL graph, runs our kernels
(`VllmBackend.run`). Above TP 1 the executor's sums run over vLLM's tensor-parallel group
(`vllm_collective.py`); every rank builds at the same forward, and the build's warm-up step
meets its peers in those collectives, so a build that fails must fail on every rank alike (it
does for what it checks: shapes, dtypes and caches are the same on every rank).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Mapping

from .config import ConfigError, K3TextConfig
from .deployment import Deployment, StepFacts
from .dispatch import (BACKEND_LOG, OUT_OF_SCOPE_REASON, STANDARD, Dispatcher, PathCounters,
                       Route)
from .options import ACCEPTED_KEYS, BackendOptions, refuse_misspelt_keys
from .scope import ScopeError
from ..reference.collective import Collective, SingleRank
from ..reference.model import ReferenceModel
from ..reference.state import StateError
from .executor import ExecutorError
from .vllm_collective import VllmCollective
from .vllm_executor import VllmExecutor
from .vllm_pools import CachesNotBound, PoolsError
from .vllm_weights import BOUND_EXPERT_DTYPES, BindingError, bind_vllm_weights, repacked_experts

TEXT_ARCHITECTURE = "KimiLinearForCausalLM"
MODEL_CLASS = f"{__package__}.vllm_model:KimiK3LatencySpecializedForCausalLM"

NO_METADATA_REASON = "no attention metadata (profiling or warm-up run)"
NOT_FULL_GRAPH_REASON = "admitted, but outside a FULL CUDA graph (eager or PIECEWISE step)"
INPUTS_REASON = "admitted, but the step's inputs (token ids or embeddings) are not those the executor was built for"
VLLM_FEATURES_REASON = "vLLM features outside the backend"
BINDING_REASON = "vLLM's loaded weights are not in the backend's layout"
EXECUTOR_REASON = "the specialized executor could not be built over vLLM's caches"
STEP_REASON = "a step vLLM brought does not fit the specialized executor"
LOG_EVERY_S = 60.0


def register(registry: Any = None, platform: Any = None) -> None:
    """The `vllm.general_plugins` entry point: cheap, idempotent, safe in every process.

    `registry` and `platform` default to vLLM's `ModelRegistry` and `current_platform`.
    """
    if platform is None:
        from vllm.platforms import current_platform as platform
    # mirrors vllm/models/kimi_k3/__init__.py: ROCm and XPU build their own Kimi-Linear
    # text model, TPU plugins register theirs; everywhere else it is the NVIDIA one
    if platform.is_rocm() or platform.is_xpu() or platform.device_type == "tpu":
        BACKEND_LOG.debug("Kimi K3 latency_specialized: not registered on %s (NVIDIA only)",
                          platform.device_type)
        return
    if registry is None:
        from vllm import ModelRegistry as registry
    registry.register_model(TEXT_ARCHITECTURE, MODEL_CLASS)


# ---------------------------------------------------------------------------- start-up


def tp_group() -> Any:
    """vLLM's tensor-parallel GroupCoordinator of this process (formed before the model is built)."""
    from vllm.distributed import get_tp_group
    return get_tp_group()


def split_additional_config(extra: Any) -> tuple[BackendOptions, Any]:
    """vLLM's `additional_config` -> (our options, what upstream's model may see).

    Only this backend's keys are parsed (vLLM's own, e.g. `kda_decode_backend`, pass
    through untouched); they are removed from upstream's view, so upstream's model
    reads `decode_backend` as `auto`. A key that looks like one of ours misspelt is
    refused: passed through, it would leave the backend off without a word.
    """
    if not isinstance(extra, Mapping):
        return BackendOptions(), extra
    refuse_misspelt_keys(extra)
    options = BackendOptions.parse({k: extra[k] for k in ACCEPTED_KEYS if k in extra})
    return options, {k: v for k, v in extra.items() if k not in ACCEPTED_KEYS}


def vllm_blockers(vllm_config: Any) -> list[str]:
    """vLLM features switched on that this backend does not cover, in words."""
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    out = []
    if parallel.pipeline_parallel_size != 1:
        out.append(f"pipeline parallel size {parallel.pipeline_parallel_size}")
    if parallel.enable_expert_parallel:
        out.append("expert parallelism")
    if getattr(parallel, "use_ubatching", False):
        out.append("dual-batch overlap (DBO)")
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    if dcp != 1:
        out.append(f"decode context parallel size {dcp}")
    if vllm_config.lora_config is not None:
        out.append("LoRA")
    if getattr(cache, "use_replayssm", False) or getattr(cache, "use_kda_recoverssm", False):
        out.append("ReplaySSM / RecoverSSM")
    graphs = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if getattr(graphs, "name", None) == "FULL":  # one routine: mixed batches replay the decode-captured graphs
        out.append("cudagraph_mode FULL, whose graphs also serve mixed prefill and decode batches of their size "
                   "(use FULL_AND_PIECEWISE, vLLM's default, or FULL_DECODE_ONLY)")
    return out


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def expert_dtype(vllm_config: Any) -> str:
    """The routed experts' storage dtype, from the quantization config."""
    quant = vllm_config.quant_config
    if quant is None:
        return _dtype_name(vllm_config.model_config.dtype)
    name = str(quant.get_name())
    if "mxfp4" in name.lower():
        return "mxfp4"
    raw = getattr(vllm_config.model_config.hf_config, "quantization_config", None)
    groups = raw.get("config_groups") if isinstance(raw, Mapping) else None
    for group in (groups or {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits") == 4 and w.get("type") == "float":
            fp4 = {32: "mxfp4", 16: "nvfp4"}.get(w.get("group_size"))
            if fp4:
                return fp4
    raise ValueError(f"routed experts quantized with {name} (the backend knows unquantized, "
                     "MXFP4 and NVFP4 experts)")


def mla_cache_dtype(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    return _dtype_name(vllm_config.model_config.dtype) if cache_dtype == "auto" else cache_dtype


def deployment_from_vllm_config(vllm_config: Any, kda_dtypes: tuple[Any, Any]) -> Deployment:
    """This worker's `Deployment`: the GPU from torch.cuda, the rest from vLLM's config.

    `kda_dtypes`: (conv, recurrent) KDA state dtypes as vLLM's model class computes them.
    """
    spec = vllm_config.speculative_config
    graphs = vllm_config.compilation_config.cudagraph_mode
    conv, recurrent = kda_dtypes
    return Deployment.detect(
        tp=vllm_config.parallel_config.tensor_parallel_size,
        max_model_len=vllm_config.model_config.max_model_len,
        spec=None if spec is None else f"{spec.method}:{spec.num_speculative_tokens}",
        # the decode path runs inside FULL decode graphs only (mixed-mode graphs included)
        cuda_graphs=graphs is not None and graphs.decode_mode().name == "FULL",
        weight_dtype=_dtype_name(vllm_config.model_config.dtype),
        expert_dtype=expert_dtype(vllm_config),
        mla_cache_dtype=mla_cache_dtype(vllm_config),
        kda_recurrent_dtype=_dtype_name(recurrent),
        conv_dtype=_dtype_name(conv),
    )


# ---------------------------------------------------------------------------- per step


def _uniform(md: Any, q: int) -> bool:
    """Whether one layer's metadata says every request of the step carries `q` tokens."""
    if hasattr(md, "num_spec_decodes"):  # KDA / GDN metadata keeps verify rows apart
        if q == 1:
            return md.num_spec_decodes == 0
        return md.num_decodes == 0 and md.num_spec_decode_tokens == md.num_spec_decodes * q
    if hasattr(md, "num_decodes") and hasattr(md, "num_decode_tokens"):
        return md.num_decode_tokens == md.num_decodes * q
    return True  # metadata without counts says nothing against it


def step_facts(rows: int, attn_metadata: Any, *, max_context: int,
               verify_tokens: int) -> StepFacts | None:
    """`StepFacts` from vLLM's per-layer attention metadata, or None when there is none.

    `max_context` is the longest context the step may carry: under FULL CUDA graphs the
    captured step is replayed at any context up to max_model_len, so that bound, not a
    batch's actual length, is what a route may rely on. `verify_tokens` is the tokens
    per request of the deployment's verify steps (1 without speculative decoding).
    """
    if not isinstance(attn_metadata, Mapping):
        return None  # profiling and dummy runs carry none; DBO's list is refused at start-up
    layers = [md for md in attn_metadata.values() if md is not None]
    if not layers:
        return None
    if any(getattr(md, "num_prefills", 0) for md in layers):
        return StepFacts(rows, None, max_context, pure_decode=False)
    q = next((c for c in dict.fromkeys((verify_tokens, 1))
              if all(_uniform(md, c) for md in layers)), None)
    return StepFacts(rows, q, max_context, pure_decode=True)


class StepRouter:
    """Routes each forward pass vLLM makes, counts it, and reports the counters."""

    def __init__(self, dispatcher: Dispatcher | None, *, off_reason: str | None = None,
                 max_context: int, verify_tokens: int, reporting: bool = True,
                 clock: Callable[[], float] = time.monotonic,
                 log: logging.Logger = BACKEND_LOG) -> None:
        if dispatcher is None and off_reason is None:
            raise ValueError("StepRouter needs a dispatcher, or the reason it has none")
        self.dispatcher, self.off_reason = dispatcher, off_reason
        self.max_context, self.verify_tokens = max_context, verify_tokens
        self.captures = PathCounters()  # routes fixed into CUDA graphs
        self.steps = PathCounters()  # forward passes outside a CUDA graph
        self.reporting, self.clock, self.log = reporting, clock, log
        self._last_report = clock()
        self._reported_at = (0, 0)

    @property
    def enabled(self) -> bool:
        return self.off_reason is None and self.dispatcher is not None and self.dispatcher.enabled

    def turn_off(self, reason: str) -> None:
        """From now on every step runs the standard path, counted under `reason`."""
        self.off_reason = reason

    def route(self, rows: int, attn_metadata: Any, *, graph_mode: str, capturing: bool,
              inputs_mismatch: bool = False) -> Route:
        route = self._decide(rows, attn_metadata, graph_mode, inputs_mismatch)
        (self.captures if capturing else self.steps).record_route(route)
        return route

    def _decide(self, rows: int, attn_metadata: Any, graph_mode: str, inputs_mismatch: bool) -> Route:
        if self.off_reason is not None:
            return Route(STANDARD, self.off_reason)
        assert self.dispatcher is not None
        if not self.dispatcher.enabled:
            return Route(STANDARD, OUT_OF_SCOPE_REASON)
        facts = step_facts(rows, attn_metadata, max_context=self.max_context,
                           verify_tokens=self.verify_tokens)
        if facts is None:
            return Route(STANDARD, NO_METADATA_REASON)
        route = self.dispatcher.route(facts)
        if route.admitted and graph_mode != "FULL":
            # the specialized path is a replayed FULL graph; an eager or PIECEWISE run of
            # an admitted step has none to replay
            return Route(STANDARD, NOT_FULL_GRAPH_REASON)
        if route.admitted and inputs_mismatch:
            return Route(STANDARD, INPUTS_REASON)
        return route

    def summary(self) -> str:
        return ("Kimi K3 latency_specialized path counters: CUDA-graph captures (each "
                f"replayed for every later step of its size): {self.captures.summary()} | "
                f"forward passes outside a CUDA graph: {self.steps.summary()}")

    def maybe_report(self) -> bool:
        """Log the counters if this rank reports, a minute has passed, and they changed."""
        now = self.clock()
        seen = (self.captures.total_steps, self.steps.total_steps)
        if not self.reporting or now - self._last_report < LOG_EVERY_S or seen == self._reported_at:
            return False
        self._last_report, self._reported_at = now, seen
        self.log.info(self.summary())
        return True


class VllmBackend:
    """This backend inside one vLLM Kimi K3 text model: verdict, router, weight binding."""

    def __init__(self, vllm_config: Any, options: BackendOptions, *, tp: int, rank: int,
                 kda_dtypes: tuple[Any, Any], log: logging.Logger = BACKEND_LOG) -> None:
        self.options, self.tp, self.rank, self.log = options, tp, rank, log
        self.weights = None
        self._bound = False
        self.vllm_config = vllm_config
        self.executor: VllmExecutor | None = None
        blockers = vllm_blockers(vllm_config)
        self.cfg: K3TextConfig | None = None
        try:
            self.cfg = K3TextConfig.from_dict(vllm_config.model_config.hf_text_config.to_dict(),
                                              source="vLLM's text config")
        except ConfigError as e:
            blockers.append(f"not a Kimi K3 text config ({e})")
        deployment = None
        try:
            deployment = deployment_from_vllm_config(vllm_config, kda_dtypes)
        except ValueError as e:
            blockers.append(str(e))
        if deployment is not None and deployment.expert_dtype not in BOUND_EXPERT_DTYPES:
            # said now rather than at the first forward, where the weight binding would refuse them
            blockers.append(f"routed experts stored as {deployment.expert_dtype}, which the weight binding "
                            "cannot view (it holds bfloat16 experts): serve a checkpoint whose experts are "
                            "dequantized to BF16")
        max_len = vllm_config.model_config.max_model_len
        verify = 1 if deployment is None else deployment.tokens_per_request
        if blockers:
            self.startup_line = ("Kimi K3 latency_specialized decode OFF, the standard path "
                                 "serves every step: vLLM runs " + "; ".join(blockers))
            if options.strict_scope:
                raise ScopeError(self.startup_line + " (strict_scope is set)")
            log.warning(self.startup_line)
            self.router = StepRouter(None, off_reason=VLLM_FEATURES_REASON, max_context=max_len,
                                     verify_tokens=verify, reporting=rank == 0, log=log)
            return
        assert deployment is not None
        # the router counts; the dispatcher's own counters would count every pass twice
        dispatcher = Dispatcher(options, dataclasses.replace(deployment, steps_at_max_model_len=True),
                                counters=PathCounters(enabled=False), log=log)
        self.startup_line = dispatcher.startup_line
        self.router = StepRouter(dispatcher, max_context=max_len, verify_tokens=verify,
                                 reporting=rank == 0, log=log)
        if dispatcher.enabled:
            log.info("Kimi K3 latency_specialized: the specialized executor is built once vLLM's caches "
                     "exist; until then admitted steps run vLLM's own forward and are counted as such")

    def bind(self, language_model: Any) -> None:
        """Bind vLLM's loaded weights as `ModelWeights` views, once, if the backend is on."""
        if self._bound or not self.router.enabled:
            return
        self._bound = True
        assert self.cfg is not None
        reason = repacked_experts(language_model)
        if reason is None:
            try:
                self.weights = bind_vllm_weights(language_model, self.cfg, self.tp, self.rank)
            except BindingError as e:
                reason = str(e)
        if reason is not None:
            self._turn_off(BINDING_REASON, reason)
            return
        self.log.info("Kimi K3 latency_specialized: vLLM's loaded weights bound as views "
                      "(no copies) for tensor-parallel rank %d of %d", self.rank, self.tp)

    def _turn_off(self, reason: str, detail: str) -> None:
        """Every later step runs the standard path, counted under `reason`; one warning says why
        (a ScopeError under strict_scope)."""
        line = f"Kimi K3 latency_specialized decode OFF: {reason}: {detail}"
        if self.options.strict_scope:
            raise ScopeError(line + " (strict_scope is set)")
        self.log.warning(line)
        self.router.turn_off(reason)

    def prepare(self, capturing: bool, embeddings_in: bool = False) -> None:
        """Build the executor over vLLM's caches once they are bound, outside any graph capture; its
        steps start from what this forward brings (token ids, or embeddings from a multimodal runner)."""
        if self.executor is not None or capturing or not self.router.enabled or self.weights is None:
            return
        assert self.cfg is not None and self.router.dispatcher is not None
        why = None
        try:
            self.executor = VllmExecutor.build(
                ReferenceModel(self.cfg, self.weights, coll=self._collective()),
                self.vllm_config.compilation_config.static_forward_context,
                max_model_len=self.router.max_context,
                rows=sorted(self.router.dispatcher.envelopes[0].rows_per_step),
                verify_tokens=self.router.verify_tokens, inputs="embeddings" if embeddings_in else "ids",
                log=self.log.info)
        except CachesNotBound:
            return  # vLLM's profiling run: the caches come later
        except (PoolsError, ExecutorError, StateError, ValueError) as e:
            why = str(e)
        if why is not None:
            self._turn_off(EXECUTOR_REASON, why)
            return
        self.router.dispatcher.executor = self.executor.executor
        self.log.info("Kimi K3 latency_specialized: the specialized executor runs admitted steps "
                      f"({self.executor.executor.report.line()})")

    def _collective(self) -> Collective:
        """This rank's cross-rank sums: identities at TP 1, vLLM's tensor-parallel group above."""
        if self.tp == 1:
            return SingleRank()
        coll = VllmCollective(tp_group())
        if (coll.tp, coll.rank) != (self.tp, self.rank):
            raise ValueError(f"vLLM's tensor-parallel group is rank {coll.rank} of {coll.tp}, but the model was "
                             f"built for rank {self.rank} of {self.tp}")
        return coll

    def run(self, route: Route, attn_metadata: Any, input_ids: Any, slot_mapping: Any, rows: int,
            inputs_embeds: Any = None) -> Any:
        """The hidden states of an admitted step (`route.plan` is its bucket) from our kernels, or
        None, with the backend turned off and a warning saying why, when vLLM's step metadata does
        not fit the executor: the caller then runs vLLM's own forward (inside a capture too; the
        executor refuses before any device work), never a crash in vLLM's start-up."""
        assert self.executor is not None and route.plan is not None
        try:
            return self.executor.run(route.plan, attn_metadata, input_ids, slot_mapping, rows, inputs_embeds)
        except ExecutorError as e:
            self._turn_off(STEP_REASON, str(e))
            return None

    def on_forward(self, language_model: Any, rows: int, attn_metadata: Any, *,
                   graph_mode: str, capturing: bool, embeddings_in: bool = False) -> Route:
        """Route one forward pass; weights bind on the first (they are final by then), the
        executor is built on the first outside a capture once vLLM's caches exist."""
        self.bind(language_model)
        self.prepare(capturing, embeddings_in)
        built_for = None if self.executor is None else self.executor.executor.inputs
        route = self.router.route(rows, attn_metadata, graph_mode=graph_mode, capturing=capturing,
                                  inputs_mismatch=built_for not in (None, "embeddings" if embeddings_in else "ids"))
        if not capturing:
            self.router.maybe_report()
        return route
