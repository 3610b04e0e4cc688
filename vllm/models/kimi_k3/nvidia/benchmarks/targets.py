"""A benchmark target judged on its worst case: the one shape a record's `targets` entry names."""

from __future__ import annotations


def worst(name: str, target: str, cases: list[dict], key: str, bound: float, better_high: bool = True) -> dict | None:
    """The target `name` ("target" the bound as the issue states it) over `cases`, judged by the
    worst value of `key` (the lowest when higher is better); None when no case applies."""
    if not cases:
        return None
    vals = [c[key] for c in cases]
    v = min(vals) if better_high else max(vals)
    return {"name": name, "target": target, "value": v, "met": v >= bound if better_high else v <= bound,
            "cases": len(cases), "worst_case": cases[vals.index(v)]["name"]}
