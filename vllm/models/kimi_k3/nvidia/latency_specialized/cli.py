"""`k3-decode`: generate text with the K3 decoder, and show the backend's scope verdict.

    k3-decode generate --prompt "get k1:" --max-tokens 32 [--config tiny|mini|k3|PATH] [--temperature T]
        [--decode-backend latency_specialized] [--additional-config '{"allow_unvalidated": true}']
    torchrun --nproc-per-node 4 -m vllm.models.kimi_k3.nvidia.latency_specialized \
        generate --tp 4 --config mini ...   (mini splits over 2 or 4 ranks; tiny runs at TP 1 only)
    k3-decode scope [--gpu GB300 --tp 16 --max-model-len 262144 --spec dspark:7]
    k3-decode eval [--config tiny --tasks ... --lengths ...]   (long-context evals, both paths)
    k3-decode bench --out DIR [--quick] [--plot] ...              (decode-latency benchmark, GPU)
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time

import torch

from ..evals import cli as eval_cli
from . import scope_cli
from .config import ConfigError, preset
from .distributed import add_tp_arguments, tp_generate
from .host_memory import size_words, usable_memory
from .options import DECODE_BACKENDS, BackendOptions


def _plot_bench(bench_args: list[str]) -> int:
    """The step-time plot of every decode-bench record in the benchmark's --out folder (the one
    it just wrote among them), as NAME.png beside it: the model README's plot is this one."""
    from pathlib import Path

    from ..benchmarks import plot_decode
    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--out", required=True)
    opts.add_argument("--name", default="decode_bench")
    known, _ = opts.parse_known_args(bench_args)
    out = Path(known.out)
    mine = out / f"{known.name}.json"
    records = sorted(set(out.glob("decode_bench*.json")) | ({mine} if mine.exists() else set()))
    if not records:
        print(f"error: no decode-bench record in {out} to plot", file=sys.stderr)
        return 2
    return plot_decode.main([str(p) for p in records] + ["--out", str(out / f"{known.name}.png")])


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text from a prompt")
    g.add_argument("--config", default="tiny",
                   help="tiny (the shipped trained checkpoint; default), mini, k3, or a config.json path")
    g.add_argument("--weights", default=None,
                   help="safetensors file or directory; default: the shipped checkpoint for tiny, "
                        "seeded random weights otherwise")
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights and of sampling")
    g.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch of requests)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    g.add_argument("--additional-config", default="{}",
                   help='vLLM-style JSON, e.g. \'{"decode_backend": "latency_specialized", '
                        '"allow_unvalidated": true}\' (every SCOPE.yaml envelope is declared, not '
                        'yet validated: without allow_unvalidated the backend stays off)')
    g.add_argument("--decode-backend", choices=DECODE_BACKENDS, default=None,
                   help="the decode_backend key of --additional-config, given as a flag")
    g.add_argument("--stats", action="store_true", help="print the path counters after the run")
    add_tp_arguments(g)


def _weights_source(args: argparse.Namespace, cfg):
    """--weights, else the shipped tiny checkpoint for `--config tiny`, else seeded random weights."""
    from ..evals.tiny import shipped_weights
    from .weights import RandomSource, SafetensorsSource

    shipped = shipped_weights(args.config)
    if args.weights or shipped:
        return SafetensorsSource(args.weights or shipped)
    print(f"[k3-decode] config {cfg.name}: no checkpoint given, seeded random weights (seed {args.seed}); "
          "the text will be noise", file=sys.stderr)
    return RandomSource(cfg, seed=args.seed)


def _weights_too_big(cfg, device: str, tp: int) -> str | None:
    """Why `cfg`'s weights cannot be loaded here, or None. Counted as `load_rank` holds them (bf16
    experts): a config that cannot fit would otherwise be drawn until the process runs out of memory."""
    from .weights import expected_shapes

    shapes = expected_shapes(cfg).values()
    total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes)
    need = total if device == "cpu" else math.ceil(total / tp)  # CPU ranks share one host
    # a rank of a torchrun launch holds the GPU of its LOCAL_RANK
    have = usable_memory(device, int(os.environ.get("LOCAL_RANK", "0")) if device == "cuda" and tp > 1 else None)
    if have is None or need <= have[0]:
        return None
    room, what = have
    params = sum(math.prod(shape) for shape, _ in shapes)
    count = f"{params / 1e12:,.2f}T" if params >= 1e12 else f"{params / 1e9:,.1f}B"
    each = f", {size_words(need)} on each of {tp} GPUs" if device == "cuda" and tp > 1 else ""
    return (f"config {cfg.name}: its weights take about {size_words(total)} ({count} parameters, "
            f"loaded as bf16){each}, more than {what} ({size_words(room)}); k3-decode would run out of memory "
            "loading them. Use --config tiny or --config mini here, or serve the model under vLLM on "
            "GPUs that hold it (docs/fast_track/OPERATOR.md)")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object's pairs -> dict, refusing a repeated key (json keeps the last one silently)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"--additional-config gives the key {key!r} twice ({out[key]!r}, then "
                             f"{value!r}); give each key once")
        out[key] = value
    return out


def _generate(args: argparse.Namespace) -> int:
    from ..reference.model import ReferenceModel
    from .deployment import Deployment
    from .dispatch import Dispatcher
    from .engine import Engine, Request, build_specialized
    from .sampler import SamplingParams
    from .tokenizer import ByteTokenizer
    from .weights import load_rank

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but no CUDA device is present; use --device cpu",
              file=sys.stderr)
        return 2
    try:
        extra = json.loads(args.additional_config, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        print(f"error: --additional-config is not valid JSON ({e})", file=sys.stderr)
        return 2
    if args.decode_backend is not None and isinstance(extra, dict):
        given = extra.setdefault("decode_backend", args.decode_backend)
        if given != args.decode_backend:
            print(f"error: --decode-backend {args.decode_backend} and --additional-config's decode_backend "
                  f"{given!r} disagree; give one of them", file=sys.stderr)
            return 2
    options = BackendOptions.parse(extra)
    cfg = preset(args.config)
    tok = ByteTokenizer()
    if cfg.vocab_size < tok.vocab_size:
        print(f"error: config {cfg.name} has vocab_size {cfg.vocab_size} < {tok.vocab_size} "
              "needed by the byte tokenizer", file=sys.stderr)
        return 2
    too_big = _weights_too_big(cfg, args.device, args.tp)
    if too_big:
        print(f"error: {too_big}", file=sys.stderr)
        return 2
    prompts = [tok.encode(p) for p in args.prompt]
    max_len = max(len(p) for p in prompts) + args.max_tokens
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_tokens=args.max_tokens, stop_token_ids=(tok.EOS,))
    requests = [Request(p, params) for p in prompts]
    t0 = time.perf_counter()
    source = _weights_source(args, cfg)
    tp_note = ""
    if args.tp > 1:
        run = tp_generate(cfg, source, requests, tp=args.tp, options=options, max_len=max_len,
                          device=args.device)
        if run.rank != 0:
            return 0
        done, s, dispatcher, load_s = run.completions, run.stats, run.dispatcher, run.load_s
        tp_note = f"; {run.agreement}"
    else:
        weights = load_rank(source, cfg, device=args.device)
        model = ReferenceModel(cfg, weights)
        load_s = time.perf_counter() - t0
        deployment = Deployment.detect(tp=1, max_model_len=max_len, expert_dtype="bfloat16")
        dispatcher = Dispatcher(options, deployment)
        executor = build_specialized(model, dispatcher, len(prompts), max_len)
        engine = Engine(model, dispatcher=dispatcher, specialized=executor, max_requests=len(prompts),
                        max_len=max_len, state=None if executor is None else executor.state)
        done = engine.generate(requests)
        s = engine.stats
    for prompt, c in zip(args.prompt, done):
        print(f"{prompt!r} -> {tok.decode(c.output_ids)!r}")
    paths = ", ".join(f"{k} {v}" for k, v in sorted(s.paths.items()))
    print(f"[k3-decode] config {cfg.name}, {len(done)} request(s): {s.tokens} tokens in {s.seconds:.2f} s "
          f"({s.tokens_per_s:.1f} tokens/s; weights {load_s:.2f} s); steps: {s.prefill_steps} prefill + "
          f"{s.decode_steps} decode; served by: {paths}; backend {options.decode_backend}: "
          f"{dispatcher.counters.summary()}{tp_note}")
    if args.stats:
        print(dispatcher.counters.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(prog="k3-decode", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    _add_generate(sub)
    scope_cli.add_parser(sub)
    eval_cli.add_parser(sub)
    sub.add_parser("bench", add_help=False,
                   help="decode-latency benchmark on a GPU (benchmarks/decode_latency.py; --help for its flags); "
                        "--plot also draws NAME.png from every decode-bench record in --out")
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "bench":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "generate":
            return _generate(args)
        if args.cmd == "eval":
            return eval_cli.run(args)
        if args.cmd == "bench":
            # --help shows the flags on any machine; only a run needs the GPU
            if not torch.cuda.is_available() and not {"-h", "--help"} & set(rest):
                print("error: k3-decode bench times CuTe DSL kernels and needs a CUDA GPU; none is visible",
                      file=sys.stderr)
                return 2
            from ..benchmarks import decode_latency
            plot = "--plot" in rest
            rest = [a for a in rest if a != "--plot"]
            code = decode_latency.main(rest)
            return (_plot_bench(rest) or code) if plot else code
        return scope_cli.run(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
