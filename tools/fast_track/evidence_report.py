"""The evidence report a reviewer reads: every record under `evidence/` as markdown tables.

`render(model, out)` is a pure function of the evidence JSON (and the PNG plots beside
it, linked relative to `out`), so the committed report can be compared with a fresh
rendering: item `evidence-report` fails when docs/fast_track/<model>_evidence.md is
missing or differs. Freshness is not rendered (it changes with every source edit);
`fast-track check` judges it. Per record: what ran and where, then one row per result
with every figure the results carry, then the targets met or missed. A kernel test of more
than MAX_CASE_ROWS cases instead lists the cases that did not pass and, per figure, its
least and most value with the case of each (the record keeps every case). The summary counts
results by status: pass, fail, and, where present, skip and other, never lumped together.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .evidence import EvidenceSet, Record
from .items import FAIL, PASS, Finding, ItemResult
from .model import ModelFolder

FIXED_COLUMNS = ("name", "shape", "status")
# hundreds of passing rows (1144 in the skinny-GEMM test) hide the few that matter, and listing
# them made the report 682 KB of the repository's 8 MiB; benchmarks, parity and evals keep every row
MAX_CASE_ROWS = 40


def report_path(model: ModelFolder) -> str:
    return f"docs/fast_track/{model.model_name()}_evidence.md"


def render_command(model: ModelFolder, out: str) -> str:
    return f"fast-track render-evidence --model {model.rel} --out {out}"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, dict):
        text = ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    elif isinstance(value, list):
        text = ", ".join(_cell(v) for v in value)
    elif value is None:
        text = "—"
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def _status_counts(record: Record) -> str:
    """`N pass / M fail`, then `K skip` and `J other` (any other or no status) where there are
    some: a skipped test neither passed nor failed, so it is not counted as a failure; records
    without skips read as they always have, so their rendering does not change."""
    statuses = [r.get("status") for r in record.results]
    counts = {s: sum(x == s for x in statuses) for s in ("pass", "fail", "skip")}
    other = len(statuses) - sum(counts.values())
    text = f"{counts['pass']} pass / {counts['fail']} fail"
    text += f" / {counts['skip']} skip" if counts["skip"] else ""
    return text + (f" / {other} other" if other else "")


def _summary_row(record: Record) -> list[Any]:
    met = sum(t.get("met") is True for t in record.targets)
    return [f"`{record.label}`", record.kind, record.data.get("family"), record.data.get("gpu"),
            record.data.get("compute_capability"), str(record.data.get("commit", ""))[:12],
            len(record.sources), _status_counts(record),
            f"{met} met / {len(record.targets) - met} missed" if record.targets else "—"]


def _figure_ranges(results: list[dict[str, Any]], columns: list[str]) -> list[str]:
    """Per numeric column: how many cases carry it, its least and most value and the case of
    each, and how many are NaN (no order puts those anywhere)."""
    rows = []
    for col in columns:
        values = [(r[col], r.get("name")) for r in results
                  if isinstance(r.get(col), (int, float)) and not isinstance(r.get(col), bool)]
        if not values:
            continue
        ordered = [v for v in values if v[0] == v[0]]
        least = min(ordered, key=lambda v: v[0]) if ordered else (None, None)
        most = max(ordered, key=lambda v: v[0]) if ordered else (None, None)
        rows.append([col, len(values), least[0], least[1], most[0], most[1], len(values) - len(ordered)])
    return _table(["figure", "cases", "least", "at", "most", "at", "NaN"], rows) if rows else []


def _record_section(record: Record) -> list[str]:
    data = record.data
    versions = data.get("versions") or {}
    lines = [f"## {record.kind}: `{record.label}`", ""]
    lines.append(f"- command: `{record.command or 'not recorded'}`")
    lines.append(f"- GPU: {_cell(data.get('gpu'))} (compute capability "
                 f"{_cell(data.get('compute_capability'))}), driver {_cell(data.get('driver'))}")
    if versions:
        lines.append(f"- versions: {_cell(versions)}")
    lines.append(f"- commit `{_cell(data.get('commit'))}`, source hash "
                 f"`{str(data.get('source_hash', ''))[:16]}` over {len(record.sources)} file(s)")
    if data.get("copy_bandwidth_TBps") is not None:
        lines.append(f"- measured copy bandwidth: {_cell(data['copy_bandwidth_TBps'])} TB/s")
    if record.results:
        extra: list[str] = []
        for result in record.results:
            extra += [k for k in result if k not in FIXED_COLUMNS and k not in extra]
        header = [c for c in FIXED_COLUMNS if any(c in r for r in record.results)] + extra
        if record.kind == "kernel-test" and len(record.results) > MAX_CASE_ROWS:
            shown = [r for r in record.results if r.get("status") != "pass"]
            which = f"the {len(shown)} not passing listed" if shown else "all passing"
            lines += ["", f"{len(record.results)} cases, {which}; each figure's range over all of them "
                      "(the record keeps every case)."]
            if shown:
                lines += ["", *_table(header, [[r.get(c) for c in header] for r in shown])]
            ranges = _figure_ranges(record.results, extra)
            if ranges:
                lines += ["", *ranges]
        else:
            lines += ["", *_table(header, [[r.get(c) for c in header] for r in record.results])]
    if record.targets:
        rows = [[t.get("name"), t.get("target"), t.get("value"),
                 "met" if t.get("met") is True else "**missed**"] for t in record.targets]
        lines += ["", "Targets:", "", *_table(["target", "wanted", "value", "met"], rows)]
    return lines + [""]


def render(model: ModelFolder, out: Path) -> str:
    """The report as it would be written to `out` (absolute; plots are linked relative to it)."""
    evidence = EvidenceSet.load(model)
    folder = f"{model.rel}/evidence"
    lines = [f"# Evidence: {model.model_name()} ({model.rel})", "",
             f"Rendered by `{render_command(model, _shown(model, out))}` from the JSON "
             f"records under `{folder}/`; edit the records, never this file. Whether each record "
             "is still fresh for today's sources is judged by `fast-track check`.", ""]
    if not evidence.records:
        lines += [f"No evidence records yet under `{folder}/`. GPU runs (tests, sanitizer, "
                  "benchmarks, evals) write them there; until then every evidence item of "
                  "`fast-track check` fails and says so.", ""]
    else:
        header = ["record", "kind", "family", "GPU", "cc", "commit", "sources", "results",
                  "targets"]
        lines += ["## Records", "", *_table(header, [_summary_row(r) for r in evidence.records]), ""]
        for record in evidence.records:
            lines += _record_section(record)
    if evidence.problems:
        lines += ["## Files that are not records", ""]
        lines += [f"- `{p.path}`: {p.message}" for p in evidence.problems] + [""]
    plots = sorted((model.path / "evidence").rglob("*.png")) if (model.path / "evidence").is_dir() else []
    if plots:
        lines += ["## Plots", ""]
        for plot in plots:
            target = Path(os.path.relpath(plot, out.parent)).as_posix()
            lines += [f"![{plot.stem}]({target})", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _shown(model: ModelFolder, out: Path) -> str:
    try:
        return out.relative_to(model.root).as_posix()
    except ValueError:
        return out.as_posix()


def check_evidence_report(model: ModelFolder) -> ItemResult:
    title = "docs/fast_track/<model>_evidence.md is rendered from the current evidence"
    rel = report_path(model)
    command = render_command(model, rel)
    path = model.root / rel
    if not path.is_file():
        return ItemResult("evidence-report", title, FAIL, f"{rel} is missing: run `{command}`",
                          [Finding("missing", rel)])
    if path.read_text() != render(model, path):
        return ItemResult("evidence-report", title, FAIL,
                          f"{rel} differs from the evidence: run `{command}`",
                          [Finding("out of date", rel)])
    return ItemResult("evidence-report", title, PASS, f"{rel} matches the evidence records")
