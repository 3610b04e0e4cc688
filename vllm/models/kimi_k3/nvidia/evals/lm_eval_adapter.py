"""lm-eval model `k3-decode`: our decoder on either decode path, through the eval harness.

    python -m vllm.models.kimi_k3.nvidia.evals.lm_eval_adapter --model k3-decode \\
        --model_args config=tiny,backend=specialized,device=cuda \\
        --tasks k3_mrcr_synthetic --include_path vllm/models/kimi_k3/nvidia/evals/lm_eval_tasks

(this module registers the model, then hands its arguments to lm-eval's own CLI; in
Python, importing it is enough for `lm_eval.simple_evaluate(model="k3-decode", ...)`).

model_args: `config` (tiny, a preset or a config.json path), `weights` (safetensors file or
folder; tiny defaults to its shipped checkpoint), `random_weights` (a seed: random weights,
for wiring checks), `backend` (`standard`/`auto` or `specialized`/`latency_specialized`),
`device`, `batch_size`.

| request | how it runs |
| --- | --- |
| `generate_until` | the harness's `Engine` on the chosen path: greedy, or sampled when `do_sample` (seeded), stopped at EOS, `max_gen_toks` or the first `until` string |
| `loglikelihood` | teacher-forced: the context is prefilled (standard path, as always), then the continuation is fed one token per decode step on the chosen path; returns (Σ log p, whether every token was the argmax) |
| `loglikelihood_rolling` | the same over the whole text after BOS |

Text is bytes on the byte tokenizer (BOS first); the context length is bounded by the
config's `max_position_embeddings`. `backend=specialized` routes through the specialized
dispatcher, but the adapter builds no executor (`k3-decode eval` does): admitted steps are
counted "admitted; specialized executor not built" and served by the standard path.
"""

from __future__ import annotations

import sys

import torch

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # the [eval] extra
    raise ImportError("the k3-decode lm-eval adapter needs lm-eval: pip install lm-eval "
                      "(this package's [eval] extra)") from e

from ..latency_specialized.engine import Request
from ..latency_specialized.sampler import SamplingParams
from ..latency_specialized.tokenizer import ByteTokenizer
from ..latency_specialized.weights import RandomSource, SafetensorsSource, load_rank
from ..reference.model import ReferenceModel
from .harness import Paths, default_deployment
from .tiny import config_named, shipped_weights

TOK = ByteTokenizer()
BACKEND_PATHS = {"standard": "standard", "auto": "standard",
                 "specialized": "specialized", "latency_specialized": "specialized"}


@register_model("k3-decode")
class K3DecodeLM(LM):
    def __init__(self, config: str = "tiny", weights: str | None = None, random_weights: int | None = None,
                 backend: str = "standard", device: str = "cpu", batch_size: int | str = 1,
                 seed: int = 0, **_ignored):
        super().__init__()
        if backend not in BACKEND_PATHS:
            raise ValueError(f"k3-decode: backend {backend!r} is not one of {', '.join(BACKEND_PATHS)}")
        device = str(device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"k3-decode: device {device} asked for (lm-eval's CLI defaults to cuda), but no "
                             "CUDA device is present; pass --device cpu")
        cfg = config_named(str(config))
        shipped = shipped_weights(str(config))
        if random_weights is not None:
            source = RandomSource(cfg, seed=int(random_weights))
        elif weights:
            source = SafetensorsSource(weights)
        elif shipped:
            source = SafetensorsSource(shipped)
        else:
            raise ValueError(f"k3-decode: no weights for config {cfg.name}; pass weights=PATH or "
                             "random_weights=SEED (wiring checks only)")
        self.cfg, self.path, self.seed = cfg, BACKEND_PATHS[backend], int(seed)
        self.batch = 1 if str(batch_size) == "auto" else max(1, int(batch_size))
        model = ReferenceModel(cfg, load_rank(source, cfg, device=device))
        self.paths = Paths(model, default_deployment(cfg.max_position_embeddings))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "K3DecodeLM":
        # lm-eval passes its own --device / --batch_size here too; what model_args name wins
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "K3DecodeLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def _fits(self, n: int) -> None:
        if n > self.cfg.max_position_embeddings:
            raise ValueError(f"k3-decode: a request of {n} tokens exceeds the model's "
                             f"max_position_embeddings {self.cfg.max_position_embeddings}")

    # ------------------------------------------------------------------ lm-eval API

    def generate_until(self, requests) -> list[str]:
        out: list[str] = []
        for i in range(0, len(requests), self.batch):
            chunk = requests[i:i + self.batch]
            reqs, stops = [], []
            for j, r in enumerate(chunk):
                context, kw = r.args
                until = kw.get("until", [])
                until = [until] if isinstance(until, str) else list(until)
                sampled = bool(kw.get("do_sample", False)) and float(kw.get("temperature", 1.0)) > 0
                params = SamplingParams(
                    temperature=float(kw.get("temperature", 1.0)) if sampled else 0.0,
                    top_p=float(kw.get("top_p", 1.0)), top_k=int(kw.get("top_k", 0) or 0),
                    seed=self.seed + i + j if sampled else None,
                    max_tokens=int(kw.get("max_gen_toks", 256)), stop_token_ids=(TOK.EOS,))
                ids = TOK.encode(context)
                self._fits(len(ids) + params.max_tokens)
                reqs.append(Request(ids, params))
                stops.append(until)
            for ids, until in zip(self.paths.generate(self.path, reqs), stops):
                text = TOK.decode(ids)
                cuts = [text.index(s) for s in until if s and s in text]
                out.append(text[:min(cuts)] if cuts else text)
        return out

    def _continuation(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        self._fits(len(context_ids) + len(continuation_ids))
        logits = self.paths.teacher_forced(self.path, context_ids, continuation_ids)
        logp = torch.log_softmax(logits.double(), -1)
        target = torch.tensor(continuation_ids)
        total = float(logp.gather(1, target[:, None]).sum())
        return total, bool((logits.argmax(-1) == target).all())

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for r in requests:
            context, continuation = r.args
            cont = list(continuation.encode("utf-8"))
            if not cont:
                raise ValueError("k3-decode: loglikelihood needs a non-empty continuation")
            out.append(self._continuation(TOK.encode(context), cont))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for r in requests:
            text = list(r.args[0].encode("utf-8"))
            out.append(self._continuation([TOK.BOS], text)[0] if text else 0.0)
        return out


def main(argv: list[str] | None = None) -> int:
    """lm-eval's CLI with `k3-decode` registered."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval"] + (sys.argv[1:] if argv is None else argv)
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
