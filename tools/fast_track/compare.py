"""`fast-track compare`: two benchmark records of one family, case by case.

    fast-track compare BEFORE AFTER [--control REGEX] [--field time_us]

BEFORE and AFTER are record files, or `REF:PATH` for a record as committed at a git ref
(`main:vllm/.../moe_bench.json`), so a fresh run can be judged against the record it would
replace. Cases are matched by name; each line gives both times and AFTER/BEFORE.

Two runs on one card differ by a percent or two even where nothing changed (the copy
bandwidth each measures shows it). `--control` names the cases the change cannot touch (a
regular expression on the case name, e.g. `M=(16|32|64)$` for a change at M <= 8; at least
two): their median ratio is that drift, each case's ratio is also given divided by it, and a
case is flagged only where it moved further than every control did. Without controls nothing
is flagged, since the drift is unknown. A diagnostic: it exits 0 whatever it flags.

Only passing cases with a finite positive time (a number, never a boolean) are compared;
the others are listed as not compared, with the record they failed in. Timings from
different GPUs, records of different kinds or families, and a record that names a case
twice are refused: their ratios would mean nothing.
"""

from __future__ import annotations

import json
import math
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
    not_compared: dict[str, str]  # case -> why (failed, or no usable time), in which record
    drift: float | None  # median ratio of the controls
    spread: float | None  # the largest distance of a control's ratio from the drift

    def flagged(self, row: Row) -> bool:
        if self.drift is None or self.spread is None:
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
        except UnicodeDecodeError:
            raise ValueError(f"{spec} is not a text file") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{spec} is not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{spec} is not an evidence record: it has no `results` list")
    return data


def _is_time(value: Any) -> bool:
    """A finite positive number; a JSON `true` is a Python bool, an int, and would read as 1."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def compare(before: dict[str, Any], after: dict[str, Any], field: str = "time_us",
            control: Pattern[str] | None = None) -> Comparison:
    for key in ("kind", "family", "gpu"):
        if before.get(key) != after.get(key):
            raise ValueError(f"the records differ in {key} ({before.get(key)!r} against {after.get(key)!r}); "
                             "compare two runs of one benchmark on one kind of GPU")

    def cases(record: dict[str, Any], which: str,
              unusable: dict[str, str]) -> tuple[dict[str, float], set[str]]:
        """(the usable times by case, every case named); why the others are unusable into `unusable`."""
        out: dict[str, float] = {}
        seen: set[str] = set()
        for r in record["results"]:
            name = r.get("name") if isinstance(r, dict) else None
            if not isinstance(name, str) or not name:
                raise ValueError(f"a result of the {which} record has no name; records name every case")
            if name in seen:
                raise ValueError(f"the {which} record names case {name!r} twice")
            seen.add(name)
            value = r.get(field)
            if r.get("status", "pass") != "pass":
                why = f"{r.get('status')} in the {which} record"
            elif not _is_time(value):
                why = f"no finite positive `{field}` in the {which} record"
            else:
                out[name] = float(value)
                continue
            unusable[name] = f"{unusable[name]}; {why}" if name in unusable else why
        return out, seen

    unusable: dict[str, str] = {}
    (b, named_b), (a, named_a) = cases(before, "first", unusable), cases(after, "second", unusable)
    rows = [Row(n, b[n], a[n], bool(control and control.search(n))) for n in b if n in a]
    if not rows:
        raise ValueError(f"no case has a usable `{field}` in both records")
    ratios = [r.ratio for r in rows if r.control]
    if control is not None and len(ratios) < 2:
        raise ValueError(f"--control {control.pattern!r} matches {len(ratios)} compared case(s); it needs "
                         "at least two, whose spread says how far runs drift")
    drift = statistics.median(ratios) if ratios else None
    spread = max(abs(x / drift - 1.0) for x in ratios) if drift else None
    return Comparison(rows, sorted(named_b - named_a), sorted(named_a - named_b), unusable, drift, spread)


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
    for name, why in c.not_compared.items():
        lines.append(f"not compared: {name} ({why})")
    return "\n".join(lines) + "\n"
