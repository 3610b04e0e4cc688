"""`fast-track stale`: the evidence records whose sources changed, and the commands that refresh them.

    fast-track stale [--model DIR]

One line per record that is not fresh (its file, why, which sources changed), then each
distinct command of those records once, in record order: what to rerun on the GPU before
committing the records again. Exit 0 when every record is fresh, 1 when one is not.
"""

from __future__ import annotations

from .evidence import EvidenceSet, Record
from .model import ModelFolder


def stale_records(model: ModelFolder) -> list[tuple[Record, str]]:
    """(record, why) for every record of the model folder that is not fresh."""
    evidence = EvidenceSet.load(model)
    found = []
    for record in evidence.records:
        state = evidence.freshness(record)
        if not state.fresh:
            changed = f" ({', '.join(state.changed)})" if state.changed else ""
            found.append((record, state.reason + changed))
    return found


def refresh_commands(stale: list[tuple[Record, str]]) -> list[str]:
    """The distinct commands of the stale records, first seen first; a record without one adds none."""
    return list(dict.fromkeys(r.command.strip() for r, _ in stale if r.command.strip()))


def render(stale: list[tuple[Record, str]]) -> str:
    if not stale:
        return "every evidence record is fresh\n"
    lines = [f"{len(stale)} stale record(s):"] + [f"  {r.label}: {why}" for r, why in stale]
    commands = refresh_commands(stale)
    lines += [f"{len(commands)} command(s) refresh them:"] + [f"  {c}" for c in commands]
    without = [r.label for r, _ in stale if not r.command.strip()]
    if without:
        lines.append(f"no command recorded for: {', '.join(without)}")
    return "\n".join(lines) + "\n"
