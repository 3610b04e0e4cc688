"""What the scope is matched against: the `Deployment` (once, at start-up) and `StepFacts` (every step).

A `Deployment` is the host-side description of one serving process: the GPU (name,
compute capability, SM count), tensor-parallel size, the dtypes of weights, routed
experts and the three decode states (MLA latent cache, KDA recurrent state, KDA conv
state; K3_MATH.md §4), max model length, speculative method and draft count, and
whether decode runs under CUDA graphs. It is built two ways:

- `Deployment.detect(...)` reads the GPU from torch.cuda on the running machine; with
  no CUDA device it says so (`cuda_present=False`) instead of failing, so the
  dispatcher can fall back to the standard path and explain why;
- `Deployment.describe(gpu="GB300", ...)` takes the GPU from a small table of known
  parts, for tests and for planning on hardware that is not here.

`StepFacts` are the per-step facts the router may look at: only host-side integers
that every TP rank knows identically, so every rank takes the same path.

Dtype names are canonical strings (`DTYPES`); common aliases (`bf16`, `fp32`,
`torch.bfloat16`, ...) are accepted and normalised so the scope compares like with like.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Canonical dtype names; SCOPE.yaml's schema enumerates exactly these (a test keeps them equal).
DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_ds_mla", "mxfp4", "nvfp4")

_DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "half": "float16",
    "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3",
}


@dataclass(frozen=True)
class KnownGpu:
    name: str  # as torch.cuda.get_device_name reports it, or its stem
    compute_capability: str
    sm_count: int


# Nominal SM counts of the shipping parts (planning only; detect() reads the real one).
KNOWN_GPUS: dict[str, KnownGpu] = {
    "GB300": KnownGpu("NVIDIA GB300", "10.3", 160),
    "B300": KnownGpu("NVIDIA B300", "10.3", 160),
    "GB200": KnownGpu("NVIDIA GB200", "10.0", 148),
    "B200": KnownGpu("NVIDIA B200", "10.0", 148),
    "H200": KnownGpu("NVIDIA H200", "9.0", 132),
    "H100": KnownGpu("NVIDIA H100", "9.0", 132),
    "A100": KnownGpu("NVIDIA A100", "8.0", 108),
}

NO_CUDA = "no CUDA device present (torch.cuda.is_available() is False)"


def known_gpu(name: str) -> KnownGpu | None:
    """The `KNOWN_GPUS` entry of 'H200', 'nvidia h200', ..., or None."""
    return KNOWN_GPUS.get(name.strip().upper().removeprefix("NVIDIA ").strip())


def canonical_dtype(value: Any, what: str) -> str:
    """The canonical name of a dtype given as a string alias or a torch.dtype."""
    text = str(value).strip().lower()
    text = text.removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPES:
        raise ValueError(
            f"{what}: unknown dtype {value!r}; use one of {', '.join(DTYPES)} "
            f"(aliases: {', '.join(sorted(_DTYPE_ALIASES))})"
        )
    return text


def parse_spec(spec: str | None) -> tuple[str | None, int]:
    """'dspark:7' -> ('dspark', 7); None, '' or 'none' -> (None, 0)."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return None, 0
    m = re.fullmatch(r"\s*([A-Za-z][A-Za-z0-9_]*)\s*:\s*([0-9]+)\s*", spec)
    if not m or int(m.group(2)) < 1:
        raise ValueError(
            f"speculative decoding {spec!r}: write METHOD:N with N >= 1 draft tokens "
            "(e.g. 'dspark:7'), or 'none'"
        )
    return m.group(1).lower(), int(m.group(2))


def sm_arch(compute_capability: str | None) -> str:
    """'10.3' -> 'sm_103'."""
    if compute_capability is None:
        return "no GPU"
    return "sm_" + compute_capability.replace(".", "")


@dataclass(frozen=True)
class Deployment:
    tensor_parallel: int
    max_model_len: int
    gpu_name: str | None = None
    compute_capability: str | None = None
    sm_count: int | None = None
    cuda_present: bool = True
    weight_dtype: str = "bfloat16"
    expert_dtype: str = "mxfp4"  # the K3 checkpoint stores routed experts as MXFP4
    mla_cache_dtype: str = "bfloat16"
    kda_recurrent_dtype: str = "float32"
    conv_dtype: str = "bfloat16"
    spec_method: str | None = None
    num_draft_tokens: int = 0
    cuda_graphs: bool = True
    # every step is routed at context max_model_len (vLLM: a captured graph replays at any
    # context up to it), so a max_model_len over an envelope's context admits no step there
    steps_at_max_model_len: bool = False
    source: str = field(default="described", compare=False)  # 'detected' or 'described'

    def __post_init__(self) -> None:
        for fld in ("tensor_parallel", "max_model_len"):
            v = getattr(self, fld)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Deployment.{fld} must be a positive integer, found {v!r}")
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or self.num_draft_tokens < 0:
            raise ValueError(
                f"Deployment.num_draft_tokens must be an integer >= 0, found {self.num_draft_tokens!r}"
            )
        if (self.spec_method is None) != (self.num_draft_tokens == 0):
            raise ValueError(
                "Deployment: spec_method and num_draft_tokens go together: give both "
                f"(e.g. 'dspark' and 7) or neither; found {self.spec_method!r} and "
                f"{self.num_draft_tokens}"
            )
        if self.cuda_present:
            if not self.gpu_name or self.compute_capability is None:
                raise ValueError(
                    "Deployment: a CUDA deployment needs gpu_name and compute_capability "
                    "(e.g. 'NVIDIA H200' and '9.0'); set cuda_present=False for a machine without CUDA"
                )
            if not re.fullmatch(r"[0-9]+\.[0-9]+", self.compute_capability):
                raise ValueError(
                    f"Deployment.compute_capability must look like '9.0', found {self.compute_capability!r}"
                )
        for fld in ("weight_dtype", "expert_dtype", "mla_cache_dtype", "kda_recurrent_dtype",
                    "conv_dtype"):
            object.__setattr__(self, fld, canonical_dtype(getattr(self, fld), f"Deployment.{fld}"))
        if self.spec_method is not None:
            object.__setattr__(self, "spec_method", self.spec_method.lower())

    # ---------------------------------------------------------------- construction

    @classmethod
    def detect(cls, *, tp: int = 1, max_model_len: int = 1048576, spec: str | None = None,
               cuda_graphs: bool = True, device: int | None = None, **dtypes: Any) -> "Deployment":
        """This process's deployment; the GPU comes from torch.cuda (or is absent)."""
        import torch

        method, drafts = parse_spec(spec)
        common = dict(tensor_parallel=tp, max_model_len=max_model_len, spec_method=method,
                      num_draft_tokens=drafts, cuda_graphs=cuda_graphs, source="detected",
                      **dtypes)
        if not torch.cuda.is_available():
            return cls(cuda_present=False, **common)
        index = torch.cuda.current_device() if device is None else device
        major, minor = torch.cuda.get_device_capability(index)
        props = torch.cuda.get_device_properties(index)
        return cls(gpu_name=torch.cuda.get_device_name(index),
                   compute_capability=f"{major}.{minor}",
                   sm_count=props.multi_processor_count, **common)

    @classmethod
    def describe(cls, *, gpu: str, tp: int, max_model_len: int = 1048576,
                 spec: str | None = None, cuda_graphs: bool = True,
                 compute_capability: str | None = None, sm_count: int | None = None,
                 **dtypes: Any) -> "Deployment":
        """A deployment on a named GPU (from `KNOWN_GPUS`, or any GPU given its capability)."""
        known = known_gpu(gpu)
        if known is None and compute_capability is None:
            raise ValueError(
                f"unknown GPU {gpu!r}: use one of {', '.join(KNOWN_GPUS)}, or give its "
                "compute_capability (e.g. '9.0') as well"
            )
        method, drafts = parse_spec(spec)
        return cls(
            gpu_name=known.name if known else gpu,
            compute_capability=compute_capability or known.compute_capability,
            sm_count=sm_count if sm_count is not None else (known.sm_count if known else None),
            tensor_parallel=tp, max_model_len=max_model_len, spec_method=method,
            num_draft_tokens=drafts, cuda_graphs=cuda_graphs, source="described", **dtypes,
        )

    # ---------------------------------------------------------------- derived facts

    @property
    def tokens_per_request(self) -> int:
        """Tokens of each request in a decode step: 1, or 1 + drafts in a verify step."""
        return 1 + self.num_draft_tokens

    @property
    def gpu_label(self) -> str:
        """'NVIDIA A100 (sm_80)', or the no-CUDA sentence."""
        if not self.cuda_present:
            return NO_CUDA
        return f"{self.gpu_name} ({sm_arch(self.compute_capability)})"

    @property
    def spec_label(self) -> str:
        if self.spec_method is None:
            return "none"
        return f"{self.spec_method}:{self.num_draft_tokens}"

    def summary(self) -> str:
        """One line for logs and the `scope` command."""
        gpu = self.gpu_label
        if self.cuda_present and self.sm_count is not None:
            gpu = f"{self.gpu_name} ({sm_arch(self.compute_capability)}, {self.sm_count} SMs)"
        return (
            f"{gpu}, tensor_parallel {self.tensor_parallel}, max_model_len {self.max_model_len}, "
            f"speculative {self.spec_label} ({self.tokens_per_request} "
            f"token{'s' if self.tokens_per_request > 1 else ''} per request), "
            f"CUDA graphs {'on' if self.cuda_graphs else 'off'}, dtypes: weights "
            f"{self.weight_dtype}, experts {self.expert_dtype}, MLA cache {self.mla_cache_dtype}, "
            f"KDA recurrent {self.kda_recurrent_dtype}, conv {self.conv_dtype}"
        )


@dataclass(frozen=True)
class StepFacts:
    """Host-side facts of one step, identical on every TP rank.

    rows: tokens in the step (after any padding to a CUDA-graph bucket);
    tokens_per_request: tokens each request carries (1 = plain decode, 1 + drafts = a
    verify step), or None when the requests carry different counts;
    max_context: the longest request's context, counting this step's tokens;
    pure_decode: no prefill or chunked-prefill row in the step.
    """

    rows: int
    tokens_per_request: int | None
    max_context: int
    pure_decode: bool

    def __post_init__(self) -> None:
        for fld in ("rows", "max_context"):
            v = getattr(self, fld)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"StepFacts.{fld} must be a positive integer, found {v!r}")
        q = self.tokens_per_request
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
            raise ValueError(
                f"StepFacts.tokens_per_request must be a positive integer, or None when the "
                f"requests carry different counts; found {q!r}"
            )
