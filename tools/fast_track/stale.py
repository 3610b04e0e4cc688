"""`fast-track stale`: the evidence records whose sources changed, and the commands that refresh them.

    fast-track stale [--model DIR]

One line per record that is not fresh (its file, why, which sources changed), then each
distinct command of those records once, in record order: what to rerun on the GPU before
committing the records again, and how long their last runs took (the device time to plan
for; per evidence folder too when there are several, since each card's records are made on
that card). Files under evidence/ that hold no readable record (not JSON, not an object, no
`kind`) are listed first: nothing in them can be judged fresh, so they are never passed
over. Last, the fresh records whose sources changed in text but not in code (comments, docstrings,
layout: evidence.py), each with those files, so an edit that kept a record fresh is still seen.
Exit 0 when every file is a record and every record is fresh, 1 otherwise.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from .evidence import EvidenceSet, Record
from .items import Finding
from .model import ModelFolder


def stale_records(model: ModelFolder, evidence: EvidenceSet | None = None
                  ) -> tuple[list[tuple[Record, str]], list[Finding]]:
    """(record, why) for every record of the model folder that is not fresh, and the evidence
    files that hold no readable record (they cannot be fresh either)."""
    evidence = evidence or EvidenceSet.load(model)
    found = []
    for record in evidence.records:
        state = evidence.freshness(record)
        if not state.fresh:
            changed = f" ({', '.join(state.changed)})" if state.changed else ""
            found.append((record, state.reason + changed))
    return found, list(evidence.problems)


def text_only_records(evidence: EvidenceSet) -> list[tuple[Record, tuple[str, ...]]]:
    """(record, files) for every fresh record whose sources changed since its run in text only."""
    return [(r, state.text_only) for r in evidence.records
            if (state := evidence.freshness(r)).fresh and state.text_only]


def refresh_commands(stale: list[tuple[Record, str]]) -> list[str]:
    """The distinct commands of the stale records, first seen first; a record without one adds none."""
    return list(dict.fromkeys(r.command.strip() for r, _ in stale if r.command.strip()))


def refresh_seconds(stale: list[tuple[Record, str]]) -> tuple[float, int]:
    """The seconds the stale records' last runs took (`wall_s`), a command shared by several
    records counted once, and how many stale records do not say."""
    took: dict[str, float] = {}
    silent = 0
    for record, _ in stale:
        wall = record.data.get("wall_s")
        if isinstance(wall, (int, float)) and wall > 0:
            key = record.command.strip() or record.rel
            took[key] = max(took.get(key, 0.0), float(wall))
        else:
            silent += 1
    return sum(took.values()), silent


def by_folder(stale: list[tuple[Record, str]]) -> dict[str, list[tuple[Record, str]]]:
    """The stale records grouped by the folder that holds them (evidence/h200, evidence/h100, ...),
    in name order."""
    groups: dict[str, list[tuple[Record, str]]] = {}
    for item in stale:
        groups.setdefault(PurePosixPath(item[0].rel).parent.name, []).append(item)
    return dict(sorted(groups.items()))


def render(stale: list[tuple[Record, str]], problems: list[Finding] | None = None,
           text_only: list[tuple[Record, tuple[str, ...]]] | None = None) -> str:
    lines = []
    if problems:
        files = len({p.path for p in problems})
        lines += [f"{files} evidence file(s) hold no readable record (fix or remove them):"]
        lines += [f"  {p.path}: {p.message}" for p in problems]
    tail = []
    if text_only:
        tail = [f"{len(text_only)} fresh record(s) whose sources changed in text only (comments, "
                "docstrings, layout), not in code:"]
        tail += [f"  {r.label}: {', '.join(files)}" for r, files in text_only]
    if not stale:
        lines.append(f"every {'readable ' if problems else ''}evidence record is fresh")
        return "\n".join(lines + tail) + "\n"
    lines += [f"{len(stale)} stale record(s):"] + [f"  {r.label}: {why}" for r, why in stale]
    commands = refresh_commands(stale)
    lines += [f"{len(commands)} command(s) refresh them:"] + [f"  {c}" for c in commands]
    seconds, silent = refresh_seconds(stale)
    lines.append(f"their last runs took {seconds:.0f} s" +
                 (f", and {silent} record(s) do not say how long" if silent else ""))
    folders = by_folder(stale)
    if len(folders) > 1:  # each card's records are made on that card, so each is its own plan
        parts = [f"{name} {len(group)} record(s), {refresh_seconds(group)[0]:.0f} s"
                 for name, group in folders.items()]
        lines.append("by folder: " + "; ".join(parts))
    without = [r.label for r, _ in stale if not r.command.strip()]
    if without:
        lines.append(f"no command recorded for: {', '.join(without)}")
    return "\n".join(lines + tail) + "\n"
