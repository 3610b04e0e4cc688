"""Checklist item `sanitizer`: kernels that synchronise across CTAs or ranks have a sanitizer record.

A file under `kernels/` synchronises when its code (not its comments or strings, read
with `tokenize`) uses a name containing one of SYNC_PATTERNS: atomics, semaphores,
flags, grid barriers, cluster barriers, acquire / release loads and stores, GPU-scope
fences, NVSHMEM or multimem. Intra-CTA barriers (`__syncthreads`, mbarriers) and proxy
fences are not counted: a race there is local to one CTA. Each such file needs a fresh
`sanitizer` record (compute-sanitizer racecheck / synccheck over its GPU and stress
tests: `fast-track record-sanitizer`) whose `sources` include it and whose results all
pass. The failure this guards against is the one kernel tests rarely catch: a read
of another CTA's or rank's data moved ahead of the wait that protects it.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

from .evidence import EvidenceSet
from .items import FAIL, PASS, Finding, ItemResult
from .model import ModelFolder

TITLE = "Every kernel that synchronises across CTAs or ranks has a clean sanitizer record"

SYNC_PATTERNS = re.compile(
    r"atomic|semaphore|flag|grid_?(barrier|sync|group)|cluster_?(arrive|wait|sync|barrier)"
    r"|(ld|st|red)_?(acquire|release)|fence_(acq_rel|sc)|threadfence|membar|nvshmem|multimem",
    re.IGNORECASE)


def sync_sites(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every synchronising name used in a Python file's code."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    except (tokenize.TokenError, SyntaxError, UnicodeDecodeError):
        return []
    return [(t.start[0], t.string) for t in tokens
            if t.type == tokenize.NAME and SYNC_PATTERNS.search(t.string)]


def synchronising_kernels(model: ModelFolder) -> dict[str, list[tuple[int, str]]]:
    folder = model.path / "kernels"
    found = {}
    for path in sorted(folder.rglob("*.py")) if folder.is_dir() else []:
        sites = sync_sites(path)
        if sites:
            found[path.relative_to(model.root).as_posix()] = sites
    return found


def check_sanitizer(model: ModelFolder, evidence: EvidenceSet) -> ItemResult:
    kernels = synchronising_kernels(model)
    if not kernels:
        return ItemResult("sanitizer", TITLE, PASS,
                          f"no file in {model.sub('kernels')}/ synchronises across CTAs or ranks")
    findings: list[Finding] = []
    missing = 0
    for rel, sites in kernels.items():
        records = [r for r in evidence.of_kind("sanitizer") if rel in r.sources]
        fresh = [r for r in records if evidence.freshness(r).fresh]
        passing = [r for r in fresh if not r.failed_results() and r.results]
        line, name = sites[0]
        uses = ", ".join(sorted({n for _, n in sites}))
        if passing:
            findings.append(Finding(f"synchronises ({uses}); sanitizer clean in "
                                    f"{', '.join(r.label for r in passing)}", rel, line))
            continue
        missing += 1
        if fresh:
            failed = sorted({n for r in fresh for n in r.failed_results()}) or ["no results recorded"]
            why = f"fresh sanitizer record(s) fail: {', '.join(failed)}"
        elif records:
            why = f"sanitizer record(s) stale: {', '.join(r.label for r in records)}"
        else:
            why = "no sanitizer record lists it in its sources"
        findings.append(Finding(f"synchronises ({uses}; first at line {line}: {name}); {why}",
                                rel, line))
    if missing:
        return ItemResult("sanitizer", TITLE, FAIL,
                          f"{missing} of {len(kernels)} synchronising kernel file(s) lack a clean, "
                          "fresh sanitizer record", findings)
    return ItemResult("sanitizer", TITLE, PASS,
                      f"all {len(kernels)} synchronising kernel file(s) are sanitizer-clean", findings)
