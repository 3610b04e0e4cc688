"""What the tiling sweeps (`sweep_moe_tiling`, `sweep_skinny_tiling`) share: their closing report,
and `--replay`, which judges a tree's tiling rule by a finished sweep on the CPU.

A sweep's `results` are dicts whose "candidates" list holds one dict per tiling ("tiling": the
tiling as JSON), with "skipped" set on those the compile/time budget left out and "ok" on those
timed and checked.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch


def finish(results: list[dict], budget_s: float, out: str | None, **header: object) -> None:
    """Say how many candidates the budget skipped, and write every result to `out` (JSON)."""
    skipped = sum(1 for r in results for c in r["candidates"] if c.get("skipped"))
    if skipped:
        print(f"{skipped} candidates skipped: the {budget_s:.0f} s budget ran out (--budget-s)")
    if out:
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), **header, "results": results}, f, indent=1)


def load(path: str) -> dict:
    """A finished sweep's JSON for `--replay`, with the device it ran on: sweeps before
    2026-12-05 did not record it, and they all ran on the H200 (sm_90a, 132 SMs)."""
    with open(path) as f:
        return {"arch": "sm_90a", "sm_count": 132, **json.load(f)}


def replay(results: list[dict], pick_of: Callable[[dict], dict],
           stand_in: Callable[[dict, dict], bool] | None = None) -> list[dict]:
    """Per result with timed candidates: the tiling `pick_of(result)` gives now (this tree's rule)
    and its time among the sweep's timed candidates (None where the sweep did not time it), the
    sweep's own pick's time and the fastest candidate's. Where no candidate is the pick exactly, one
    that `stand_in(candidate_tiling, pick)` accepts stands in for it, marked `stand_in`."""
    rows = []
    for r in results:
        timed = [c for c in r["candidates"] if c.get("ok")]
        if not timed:
            continue
        pick = pick_of(r)
        same = [c for c in timed if c["tiling"] == pick]
        near = [c for c in timed if stand_in is not None and stand_in(c["tiling"], pick)]
        found = (same or near or [None])[0]
        rows.append({"case": r, "pick": pick, "time_us": found and found["time_us"], "stand_in": not same and bool(near),
                     "swept_pick_us": r["pick"].get("time_us"), "best_us": min(c["time_us"] for c in timed)})
    return rows


def print_replay(rows: list[dict], case_name: Callable[[dict], str], label: Callable[[dict], str]) -> None:
    """The replay's table, then how this tree's picks compare with the fastest candidates."""
    print(f"{'case':30s} {'pick now':>30s} {'us':>8s} {'swept':>8s} {'best':>8s} {'now/best':>8s}")
    for r in rows:
        now = f"{r['time_us']:8.2f}" if r["time_us"] is not None else " untimed"
        ratio = f"{r['time_us'] / r['best_us']:8.3f}" if r["time_us"] is not None else ""
        swept = f"{r['swept_pick_us']:8.2f}" if r["swept_pick_us"] is not None else "       -"
        print(f"{case_name(r['case']):30s} {label(r['pick']) + ('*' if r['stand_in'] else ''):>30s} {now} {swept} "
              f"{r['best_us']:8.2f} {ratio}")
    judged = [r for r in rows if r["time_us"] is not None]
    if not judged:
        print(f"none of the {len(rows)} picks was timed by this sweep")
        return
    now = [r["time_us"] / r["best_us"] for r in judged]
    swept = [r["swept_pick_us"] / r["best_us"] for r in judged if r["swept_pick_us"]]
    print(f"{len(judged)} of {len(rows)} picks timed (* = a stand-in): now {sum(now) / len(now):.3f}x the fastest on "
          f"average (worst {max(now):.3f}x, the fastest on {sum(x == 1 for x in now)}); the sweep's own picks on those "
          f"cases {sum(swept) / max(len(swept), 1):.3f}x")
