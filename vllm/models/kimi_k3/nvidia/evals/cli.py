"""`k3-decode eval`: the long-context evals on both decode paths, as a table and JSON evidence.

    k3-decode eval                                     # tiny checkpoint, all tasks, 1K..64K
    k3-decode eval --device cuda --out vllm/models/kimi_k3/nvidia/evidence/<card>/eval_tiny.json \\
                   --table vllm/models/kimi_k3/nvidia/evidence/<card>/eval_tiny_<card>.md   # h200, h100
    k3-decode eval --config mini --random-weights 0 --lengths 256 --samples 2   # wiring only

Exit status: 0 when every gate is met, 1 when one is not, 2 for a bad argument or a
missing checkpoint. `add_parser` / `run` plug into latency_specialized/cli.py; `main`
runs it alone (`python -m vllm.models.kimi_k3.nvidia.evals.cli eval ...`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..latency_specialized.config import ConfigError, K3TextConfig
from ..latency_specialized.tokenizer import ByteTokenizer
from . import tasks
from .tiny import TINY_DIR, config_named, shipped_weights


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in tasks.TASKS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown task(s) {bad or text!r}; choose from {', '.join(tasks.TASKS)}")
    return names


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval", help="run the long-context evals on both decode paths",
                              description=__doc__.split("\n")[0])
    p.add_argument("--config", default="tiny", help="tiny (default), another preset, or a config.json path")
    p.add_argument("--weights", default=None,
                   help="safetensors file or folder (default for tiny: the shipped checkpoint)")
    p.add_argument("--random-weights", type=int, default=None, metavar="SEED",
                   help="seeded random weights instead of a checkpoint (checks wiring, scores ~0)")
    p.add_argument("--tasks", type=_names, default=tuple(tasks.TASKS), help="comma-separated: mrcr,kv,arith")
    p.add_argument("--lengths", type=_ints, default=tasks.LENGTHS, help="context lengths in tokens")
    p.add_argument("--samples", type=int, default=16, help="samples per task and length")
    p.add_argument("--seed", type=int, default=0, help="seed of the task generators")
    p.add_argument("--batch", type=int, default=4, help="requests per generate call")
    p.add_argument("--logit-samples", type=int, default=4,
                   help="samples per task and length teacher-forced on both paths for the logit divergence")
    p.add_argument("--parity-runs", type=int, default=8, help="sampling-parity runs (0: skip)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--yardstick", action=argparse.BooleanOptionalAction, default=None,
                   help="also generate with the rounding-noise yardstick and judge greedy agreement against it "
                        "(default: when the specialized side runs the kernels)")
    p.add_argument("--out", default=None, help="write the JSON evidence record here")
    p.add_argument("--table", default=None, help="write the Markdown table here")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    p.set_defaults(func=run)
    return p


def _shown(path: Path) -> str:
    """A path as records and tables show it: relative to the repository when inside it."""
    from ..latency_specialized.evidence import REPO_ROOT

    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _source(args: argparse.Namespace, cfg: K3TextConfig):
    from ..latency_specialized.weights import RandomSource, SafetensorsSource

    if args.random_weights is not None:
        return RandomSource(cfg, seed=args.random_weights), f"random seed {args.random_weights}"
    if args.weights:
        return SafetensorsSource(args.weights), _shown(Path(args.weights))
    shipped = shipped_weights(args.config)
    if shipped:
        return SafetensorsSource(shipped), _shown(shipped)
    raise ConfigError(
        f"no weights for config {cfg.name}: pass --weights PATH, or --random-weights SEED to check "
        f"the wiring only (the tiny checkpoint is not in {TINY_DIR} yet: train it with "
        "python -m vllm.models.kimi_k3.nvidia.evals.train_tiny)")


def run(args: argparse.Namespace) -> int:
    from ..latency_specialized.engine import build_specialized
    from ..latency_specialized.weights import load_rank
    from ..reference.model import ReferenceModel
    from . import harness

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but no CUDA device is present; use --device cpu", file=sys.stderr)
        return 2
    try:
        cfg = config_named(args.config)
        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ConfigError(f"config {cfg.name} has vocab_size {cfg.vocab_size} < {ByteTokenizer.vocab_size} "
                              "needed by the byte tokenizer")
        source, weights = _source(args, cfg)
        spec = harness.EvalSpec(tasks=args.tasks, lengths=args.lengths, samples=args.samples, seed=args.seed,
                                batch=args.batch, logit_samples=args.logit_samples)
        for length in spec.lengths:  # a too-short length fails here, before any weights load
            for task in spec.tasks:
                tasks.make(task, length, 0)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model = ReferenceModel(cfg, load_rank(source, cfg, device=args.device))
    longest = max(spec.lengths) + 256
    paths = harness.Paths(model, harness.default_deployment(longest))
    # the executor on the specialized side: its CuTe DSL kernels on a GPU, its plumbing with the
    # reference ops on a CPU; None (the standard path serves, the record says so) outside its envelope
    executor = build_specialized(model, paths.dispatchers["specialized"], spec.batch, longest, reference_on_cpu=True)
    if executor is not None:
        paths.specialized = paths.executor = executor
        if args.yardstick or (args.yardstick is None and executor.ops.impl == "cute"):
            from ..latency_specialized.executor import SpecializedDecode
            from ..latency_specialized.torch_ops import RoundingNoiseOps
            torch.manual_seed(args.seed)  # the yardstick's noise draws
            paths.use_yardstick(SpecializedDecode(model, max_requests=spec.batch, max_len=longest,
                                                  buckets=executor.buckets, ops=RoundingNoiseOps(), graphs=False,
                                                  log=lambda _: None))
    command = "k3-decode eval " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["eval"] else sys.argv[1:])
    record = harness.evaluate(paths, spec, out=args.out, command=command, weights=weights,
                              parity_runs=args.parity_runs, progress=args.progress)
    text = harness.table(record)
    print(text)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(f"# Long-context evals: {cfg.name} ({weights})\n\n{text}\n")
    unmet = [t["name"] for t in record["targets"] if not t["met"]]
    served = record["paths_served"]["specialized"]
    print(f"[k3-decode eval] specialized side served by: {served or 'nothing'}; "
          f"{len(record['targets']) - len(unmet)}/{len(record['targets'])} gates met"
          + (f"; unmet: {', '.join(unmet)}" if unmet else ""))
    return 1 if unmet else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="k3-decode")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
