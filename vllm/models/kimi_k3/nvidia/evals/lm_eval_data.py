"""Write the synthetic tasks as JSONL for the lm-eval task configs (offline, deterministic).

    python -m vllm.models.kimi_k3.nvidia.evals.lm_eval_data [--out DIR] [--lengths 1024,4096] [--samples 16]

One file per task, `DIR/k3_<task>_synthetic.jsonl`, one sample a line: `prompt` (the text
after BOS: the adapter's tokenizer adds BOS back), `answer`, `task`, `length`, `seed`.
`lm_eval_tasks/utils.py` reads them from `$K3_EVAL_DATA`, else from `DATA_DIR`; `--out`
defaults to the same folder, so the two meet without flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .tasks import LENGTHS, TASKS, suite

DATA_DIR = Path(__file__).resolve().parent / "lm_eval_tasks" / "data"


def file_name(task: str) -> str:
    return f"k3_{task}_synthetic.jsonl"


def write(folder: str | Path = DATA_DIR, *, tasks: tuple[str, ...] = tuple(TASKS),
          lengths: tuple[int, ...] = LENGTHS, samples: int = 16, seed: int = 0) -> list[Path]:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for task in tasks:
        path = folder / file_name(task)
        with path.open("w") as f:
            for length in lengths:
                for s in suite(task, length, samples, seed=seed):
                    f.write(json.dumps({"prompt": s.prompt, "answer": s.answer, "task": task,
                                        "length": length, "seed": s.seed}) + "\n")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="lm_eval_data", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("K3_EVAL_DATA", str(DATA_DIR)),
                    help="folder for the JSONL files (default: $K3_EVAL_DATA, else lm_eval_tasks/data)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--lengths", default=",".join(str(n) for n in LENGTHS))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        paths = write(args.out, tasks=tuple(t for t in args.tasks.split(",") if t),
                      lengths=tuple(int(x) for x in args.lengths.split(",") if x),
                      samples=args.samples, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
