"""`fast-track compare`: two benchmark records of one family, case by case.

    fast-track compare BEFORE AFTER [--control REGEX] [--field time_us]

BEFORE and AFTER are record files, or `REF:PATH` for a record as committed at a git ref
(`main:vllm/.../moe_bench.json`), so a fresh run can be judged against the record it would
replace. Cases are matched by name; each line gives both times and AFTER/BEFORE.

Two runs on one card differ by a percent or two even where nothing changed (the copy
bandwidth each measures shows it). `--control` names the cases the change cannot touch (a
regular expression on the case name, e.g. `M=(16|32|64)$` for a change at M <= 8): their
median ratio is that drift, each case's ratio is also given divided by it, and a case is
flagged only where it moved further than every control did. Without controls nothing is
flagged, since the drift is unknown.

Timings from different GPUs, or records of different kinds or families, are refused: their
ratios would mean nothing.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from re import Pattern
from typing import Any

from .gitrepo import git


@dataclass(frozen=True)
class Row:
    name: str
    before: float
    after: float
    control: bool

    @property
    def ratio(self) -> float:
        return self.after / self.before


@dataclass(frozen=True)
class Comparison:
    rows: list[Row]
    only_before: list[str]
    only_after: list[str]
    drift: float | None  # median ratio of the controls
    spread: float | None  # the largest distance of a control's ratio from the drift

    def flagged(self, row: Row) -> bool:
        if self.drift is None or self.spread is None or row.control:
            return False
        return abs(row.ratio / self.drift - 1.0) > self.spread


def load(root: Path, spec: str) -> dict[str, Any]:
    """A record from a file, or from `REF:PATH` at a git ref; a clear error if neither reads."""
    ref, sep, rel = spec.partition(":")
    if sep and not Path(spec).exists():
        text = git(root, "show", f"{ref}:{rel}")
    else:
        try:
            text = Path(spec).read_text()
        except OSError as e:
            raise ValueError(f"cannot read record {spec}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{spec} is not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{spec} is not an evidence record: it has no `results` list")
    return data


def compare(before: dict[str, Any], after: dict[str, Any], field: str = "time_us",
            control: Pattern[str] | None = None) -> Comparison:
    for key in ("kind", "family", "gpu"):
        if before.get(key) != after.get(key):
            raise ValueError(f"the records differ in {key} ({before.get(key)!r} against {after.get(key)!r}); "
                             "compare two runs of one benchmark on one kind of GPU")

    def timed(record: dict[str, Any]) -> dict[str, float]:
        out = {}
        for r in record["results"]:
            value = r.get(field) if isinstance(r, dict) else None
            if isinstance(value, (int, float)) and value > 0:
                out[str(r.get("name"))] = float(value)
        return out

    b, a = timed(before), timed(after)
    if not b or not a:
        which = "the first" if not b else "the second"
        raise ValueError(f"no case has a positive `{field}` in {which} record")
    rows = [Row(n, b[n], a[n], bool(control and control.search(n))) for n in b if n in a]
    ratios = [r.ratio for r in rows if r.control]
    drift = statistics.median(ratios) if ratios else None
    spread = max(abs(x / drift - 1.0) for x in ratios) if drift else None
    return Comparison(rows, sorted(set(b) - set(a)), sorted(set(a) - set(b)), drift, spread)


def render(c: Comparison, field: str = "time_us") -> str:
    width = max([len(r.name) for r in c.rows] + [4])
    lines = [f"{'case':{width}s} {'before':>10s} {'after':>10s} {'ratio':>7s} {'/drift':>7s}"]
    for r in c.rows:
        adjusted = f"{r.ratio / c.drift:7.3f}" if c.drift else f"{'':7s}"
        mark = "  control" if r.control else ("  <- beyond every control" if c.flagged(r) else "")
        lines.append(f"{r.name:{width}s} {r.before:10.2f} {r.after:10.2f} {r.ratio:7.3f} {adjusted}{mark}")
    tested = [r.ratio for r in c.rows if not r.control]
    if c.drift is not None:
        lines.append(f"drift (median of {sum(r.control for r in c.rows)} control(s)): {c.drift:.3f}, "
                     f"their spread ±{c.spread:.3f}")
    else:
        lines.append("no control cases (--control): run-to-run drift unknown, nothing flagged")
    if tested:
        lines.append(f"{field} after/before over {len(tested)} other case(s): "
                     f"median {statistics.median(tested):.3f}, {min(tested):.3f}-{max(tested):.3f}")
    for label, names in (("only in the first record", c.only_before), ("only in the second", c.only_after)):
        if names:
            lines.append(f"{label}: {', '.join(names)}")
    return "\n".join(lines) + "\n"
