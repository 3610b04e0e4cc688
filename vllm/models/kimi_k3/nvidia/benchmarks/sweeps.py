"""What the tiling sweeps (`sweep_moe_tiling`, `sweep_skinny_tiling`) share: their closing report.

A sweep's `results` are dicts whose "candidates" list holds one dict per tiling, with "skipped"
set on those the compile/time budget left out.
"""

from __future__ import annotations

import json

import torch


def finish(results: list[dict], budget_s: float, out: str | None, **header: object) -> None:
    """Say how many candidates the budget skipped, and write every result to `out` (JSON)."""
    skipped = sum(1 for r in results for c in r["candidates"] if c.get("skipped"))
    if skipped:
        print(f"{skipped} candidates skipped: the {budget_s:.0f} s budget ran out (--budget-s)")
    if out:
        with open(out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), **header, "results": results}, f, indent=1)
