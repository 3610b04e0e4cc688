"""`KimiK3LatencySpecializedForCausalLM`: vLLM's Kimi K3 text model with this backend's hooks.

Registered by `vllm_hook.register()` for the `KimiLinearForCausalLM` architecture and
imported only when vLLM builds that model (this module imports vLLM's model code).

- `decode_backend` unset or `auto`: `__new__` builds and returns vLLM's own
  `KimiLinearForCausalLM`; nothing of this backend is in the model.
- `latency_specialized`: upstream's `__init__` runs with our keys taken out of
  `additional_config` (vLLM 0.33.0's model would otherwise start its own specialized
  decode, or raise outside its SM100 scope), then `VllmBackend` gives the start-up
  verdict. Each forward is routed and counted from host-side facts of vLLM's forward
  context: an admitted step with a bucket runs the specialized executor (inside vLLM's FULL
  graph capture) and returns its hidden states; every other step runs upstream's forward.
"""

from __future__ import annotations

import torch

from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

from .vllm_hook import VllmBackend, split_additional_config


class KimiK3LatencySpecializedForCausalLM(KimiLinearForCausalLM):
    def __new__(cls, *, vllm_config, prefix: str = ""):
        options, _ = split_additional_config(vllm_config.additional_config)
        if not options.requested:
            # Python skips __init__ for an object that is not an instance of cls
            return KimiLinearForCausalLM(vllm_config=vllm_config, prefix=prefix)
        return super().__new__(cls)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        options, upstream_view = split_additional_config(vllm_config.additional_config)
        operator_view = vllm_config.additional_config
        vllm_config.additional_config = upstream_view
        try:
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        finally:
            vllm_config.additional_config = operator_view
        conv, recurrent = type(self).get_mamba_state_dtype_from_config(vllm_config)[:2]
        self.latency_specialized = VllmBackend(
            vllm_config, options, tp=get_tensor_model_parallel_world_size(),
            rank=get_tensor_model_parallel_rank(), kda_dtypes=(conv, recurrent))

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        context = get_forward_context() if is_forward_context_available() else None
        rows = positions.shape[-1]
        route = self.latency_specialized.on_forward(
            self, rows=rows,
            attn_metadata=None if context is None else context.attn_metadata,
            graph_mode="NONE" if context is None else context.cudagraph_runtime_mode.name,
            capturing=torch.cuda.is_available() and torch.cuda.is_current_stream_capturing(),
            embeddings_in=inputs_embeds is not None,
        )
        if route.plan is not None and context is not None:
            hidden = self.latency_specialized.run(route, context.attn_metadata, input_ids,
                                                  getattr(context, "slot_mapping", None), rows, inputs_embeds)
            if hidden is not None:
                return hidden
        return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
