"""The picture of decode-bench records: step time against rows per path, with the HBM floor.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.plot_decode RECORD.json [RECORD.json ...] --out FILE.png

One panel per TP size; per path (specialized, graphed standard, eager standard, floor) a line
over the rows of plain decode steps (q = 1) and hollow markers for verify steps (q > 1), per
context. Log-log, since rows and times span decades. Needs matplotlib (`pip install .[plot]`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PATHS = (("specialized", "specialized (CuTe DSL, graph)", "C0"),
         ("standard_graphed", "standard, torch in a CUDA graph", "C1"),
         ("standard_eager", "standard, eager reference", "C2"),
         ("floor", "HBM floor", "k"))


def _time_ms(result: dict, path: str) -> float | None:
    if path == "specialized":
        return result["time_us"] / 1e3
    if path == "floor":
        return result["floor_us"] / 1e3
    us = result["baseline_us"].get(path)
    return None if us is None else us / 1e3


def points(records: list[dict]) -> list[dict]:
    """The timed results of the records (build rows and the like carry no time)."""
    return [r for rec in records for r in rec["results"] if "time_us" in r]


def plot(records: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on CI or the GPU machine
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    from matplotlib.lines import Line2D

    results = points(records)
    if not results:
        raise ValueError("no timed results in the records given: pass decode-bench JSON files")
    tps = sorted({r["tp"] for r in results}, reverse=True)
    fig, axes = plt.subplots(1, len(tps), figsize=(6 * len(tps), 4.5), squeeze=False)
    contexts = sorted({r["context"] for r in results})
    styles = dict(zip(contexts, ("-", "--", ":", "-.")))  # context -> line style; path -> color
    for ax, tp in zip(axes[0], tps):
        for ctx in sorted({r["context"] for r in results if r["tp"] == tp}):
            mine = [r for r in results if r["tp"] == tp and r["context"] == ctx]
            for path, _, color in PATHS:
                plain = sorted((r["rows"], _time_ms(r, path)) for r in mine if r["q"] == 1)
                plain = [(x, y) for x, y in plain if y is not None]
                if plain:
                    ax.plot(*zip(*plain), marker="x" if path == "floor" else "o", linestyle=styles.get(ctx, "-"),
                            color=color)
                verify = [(r["rows"], _time_ms(r, path)) for r in mine if r["q"] > 1]
                verify = [(x, y) for x, y in verify if y is not None]
                if verify:
                    ax.plot(*zip(*verify), "s", mfc="none", color=color)
        shown = sorted({r["context"] for r in results if r["tp"] == tp})
        handles = [Line2D([], [], color=color, marker="x" if path == "floor" else "o", label=label)
                   for path, label, color in PATHS]
        handles += [Line2D([], [], color="gray", linestyle=styles[c], label=f"context {c}") for c in shown]
        ax.set(xscale="log", yscale="log", xlabel="rows per step (hollow squares: verify steps, q > 1)",
               ylabel="step time, ms (12-layer block)", title=f"TP{tp}, per rank, collectives not timed")
        rows = sorted({r["rows"] for r in results if r["tp"] == tp})
        ax.set_xticks(rows, [str(n) for n in rows])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(handles=handles, fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", nargs="+", type=Path, help="decode-bench JSON records")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: the plot needs matplotlib: pip install '.[plot]'", file=sys.stderr)
        return 2
    records = [json.loads(p.read_text()) for p in args.records]
    try:
        print(f"wrote {plot(records, args.out)}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
