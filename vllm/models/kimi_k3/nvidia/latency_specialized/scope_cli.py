"""`k3-decode scope`: the scope verdict for this machine or a described deployment, and the envelope table.

    k3-decode scope                                   # this machine (torch.cuda)
    k3-decode scope --gpu GB300 --tp 16 --max-model-len 262144 --spec dspark:7 --allow-unvalidated
    k3-decode scope --gpu RTX4090 --compute-capability 8.9      # a GPU not in KNOWN_GPUS

Without `--gpu` the GPU is read from torch.cuda; on a machine without CUDA the verdict
says so and that the standard path serves. The other flags describe the rest of the
deployment either way. Exit status: 0 when a verdict was printed (admitted or not, or
a reader such as `head` closed the pipe early: that ends it quietly), 2 when the scope
file or an argument is invalid.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from .deployment import DTYPES, KNOWN_GPUS, Deployment, known_gpu, parse_spec
from .scope import Scope, ScopeError, Verdict, format_ints


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "scope", help="print the SCOPE.yaml verdict for this machine or a described deployment",
        description="Match a deployment against SCOPE.yaml and print the verdict and the envelope table.",
    )
    p.add_argument("--gpu", metavar="NAME",
                   help=f"describe a deployment on this GPU ({', '.join(KNOWN_GPUS)}, or any other "
                        "with --compute-capability) instead of reading this machine's")
    p.add_argument("--compute-capability", type=_capability, default=None, metavar="X.Y",
                   help="the --gpu's compute capability, e.g. 8.9; needed for a GPU not listed above")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size (default 1)")
    p.add_argument("--max-model-len", type=int, default=1048576, metavar="N",
                   help="max model length in tokens (default 1048576)")
    p.add_argument("--spec", default=None, metavar="METHOD:N",
                   help="speculative decoding, e.g. dspark:7 (default none)")
    p.add_argument("--expert-dtype", default="mxfp4", choices=DTYPES,
                   help="routed expert weight dtype (default mxfp4, as the checkpoint stores them)")
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--allow-unvalidated", action="store_true",
                   help="also admit envelopes whose status is declared")
    p.add_argument("--scope", default=None, metavar="PATH",
                   help="the SCOPE.yaml to read (default: the one shipped with the package)")
    p.set_defaults(func=run)
    return p


def _capability(text: str) -> str:
    if not re.fullmatch(r"[0-9]+\.[0-9]+", text.strip()):
        raise argparse.ArgumentTypeError(f"--compute-capability must look like 8.9 or 10.3, got {text!r}")
    return text.strip()


def _deployment(args: argparse.Namespace) -> Deployment:
    parse_spec(args.spec)  # a malformed --spec is an argument error before any GPU query
    common = dict(tp=args.tp, max_model_len=args.max_model_len, spec=args.spec,
                  cuda_graphs=not args.eager, expert_dtype=args.expert_dtype)
    cc = args.compute_capability
    if cc and not args.gpu:
        raise ValueError("--compute-capability describes the GPU named by --gpu; without --gpu the GPU "
                         "is this machine's (read from torch.cuda)")
    if args.gpu:
        if cc is None and known_gpu(args.gpu) is None:
            raise ValueError(f"unknown GPU {args.gpu!r}: use one of {', '.join(KNOWN_GPUS)}, or give its "
                             f"compute capability as well (e.g. --gpu {args.gpu} --compute-capability 8.9)")
        return Deployment.describe(gpu=args.gpu, compute_capability=cc, **common)
    return Deployment.detect(**common)


def envelope_table(scope: Scope) -> str:
    header = ("envelope", "GPU", "TP", "rows per step", "tokens/request", "max context",
              "speculative", "graphs", "weights/experts/MLA/KDA rec/conv", "status", "evidence")
    rows = [header]
    for e in scope.envelopes:
        rows.append((
            e.name, e.gpu_label, format_ints(e.tensor_parallel), format_ints(e.rows_per_step),
            format_ints(e.tokens_per_request), str(e.max_context), "/".join(e.speculative_methods),
            "on" if e.cuda_graphs else "off", "/".join(dtype for _, dtype in e.dtypes), e.status,
            str(len(e.evidence)),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _verdict_lines(verdict: Verdict) -> list[str]:
    if verdict:
        lines = [("verdict: IN SCOPE: the specialized path serves the steps the envelope admits; "
                 "every other step runs the standard path")]
        lines += [f"  envelope {e.name}: {e.limits()}" for e in verdict.envelopes]
        lines += [f"  warning: {w}" for w in verdict.warnings]
        return lines
    lines = ["verdict: OUT OF SCOPE: the standard path serves every step, because"]
    return lines + [f"  - {r}" for r in verdict.reasons]


def run(args: argparse.Namespace) -> int:
    try:
        scope = Scope.load(args.scope)
        deployment = _deployment(args)
    except (ScopeError, ValueError) as e:
        print(f"k3-decode scope: {e}", file=sys.stderr)
        return 2
    verdict = scope.admits(deployment, allow_unvalidated=args.allow_unvalidated)
    where = "described" if deployment.source == "described" else "this machine"
    out = [
        f"scope: {scope.path} (model {scope.model}, backend {scope.backend}, "
        f"schema_version {scope.schema_version})",
        f"deployment ({where}): {deployment.summary()}",
        *_verdict_lines(verdict),
        "",
        envelope_table(scope),
        "",
        "preserved features (each proven by its test):",
        *(f"  {f.name}: {f.test}" for f in scope.preserved_features),
    ]
    try:
        print("\n".join(out))
        sys.stdout.flush()
    except BrokenPipeError:
        # `k3-decode scope | head -3`: the reader has what it wanted; point stdout at devnull so
        # that Python's flush at exit does not report the closed pipe either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 0
