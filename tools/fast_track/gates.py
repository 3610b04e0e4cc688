"""Checklist items `evals` and `benchmarks`: the end-to-end evidence exists, is fresh, and says what it ran.

`evals`: at least one `eval` record (long-context accuracy of the specialized path
against the standard path), every such record fresh, every result passing and every
target met: its targets are the gates. Kernel tests with random inputs miss the errors
these find, so a missing or failing eval fails the item, and so does an eval record with
no results (it measured nothing) or no targets (nothing was judged).

`benchmarks`: at least one `decode-bench` record, every such record fresh, carrying the
command that reproduces it, and every result passing: a decode-bench result's status is
its parity verdict (the specialized step against the standard one), so a fast step that
computes the wrong thing fails the item; a result with no verdict (its `unjudged` field
says why, e.g. the yardstick was lost) is not a pass either, and its reason is shown.
Missed performance targets are listed with their figure but do not fail the item: a
slower-than-hoped kernel is a fact to report, not a defect.
"""

from __future__ import annotations

from .evidence import EvidenceSet, Record, json_type, stale_findings
from .items import FAIL, PASS, Finding, ItemResult

TITLE_EVALS = "Long-context eval evidence exists and passed its gates"
TITLE_BENCH = "Decode benchmark evidence exists with its command and passed parity"


def _target_text(target: dict) -> str:
    return (f"target {target.get('name', '?')}: {target.get('value')!r} against "
            f"{target.get('target')!r} ({'met' if target.get('met') is True else 'missed'})")


def _longest_context(records: list[Record]) -> int | None:
    shapes = [res["shape"] for r in records for res in r.results if isinstance(res.get("shape"), dict)]
    lengths = [v for shape in shapes for k, v in shape.items()
               if type(v) is int and ("context" in k or k in ("ctx", "seq_len"))]  # a bool is no length
    return max(lengths) if lengths else None


def _malformed_shapes(record: Record) -> list[Finding]:
    """A result whose `shape` is not an object: its dimensions (the context length among them)
    cannot be read, so the record says less than it seems to; named, never a traceback."""
    return [Finding(f"result {str(r.get('name', '?'))!r}: `shape` is {json_type(r['shape'])}, not an object "
                    "of named dimensions (e.g. {\"context\": 32768}): fix the record", record.rel)
            for r in record.results if r.get("shape") is not None and not isinstance(r["shape"], dict)]


def _failing_parity(record: Record) -> list[Finding]:
    """The failing results of a decode-bench record, then why each unjudged one had no verdict
    (without the reason a reviewer cannot tell a wrong result from a missing yardstick)."""
    failed = record.failed_results()
    if not failed:
        return []
    found = [Finding(f"{len(failed)} failing result(s) (status is the parity verdict): "
                     f"{', '.join(failed[:8])}", record.rel)]
    found += [Finding(f"{r.get('name', '?')}: unjudged: {r['unjudged']}", record.rel)
              for r in record.results if r.get("status") != "pass" and r.get("unjudged")]
    return found


def _empty_eval(record: Record) -> list[Finding]:
    """An eval record with nothing measured or nothing judged would otherwise pass vacuously."""
    found = []
    if not record.results:
        found.append(Finding("no `results`: an eval record carries what it measured, one result "
                             "per eval; rerun it and commit the full record", record.rel))
    if not record.targets:
        found.append(Finding("no `targets`: an eval record's targets are its gates; without one "
                             "nothing was judged; give it the gates it must meet", record.rel))
    return found


def check_evals(evidence: EvidenceSet) -> ItemResult:
    records = evidence.of_kind("eval")
    if not records:
        return ItemResult("evals", TITLE_EVALS, FAIL,
                          "no eval record in evidence/: run the long-context evals on the GPU and "
                          "commit their JSON")
    findings: list[Finding] = []
    for record in records:
        findings += stale_findings(evidence, record)
        findings += _empty_eval(record)
        findings += _malformed_shapes(record)
        failed = record.failed_results()
        if failed:
            findings.append(Finding(f"{len(failed)} failing result(s): {', '.join(failed[:8])}",
                                    record.rel))
        findings += [Finding(_target_text(t), record.rel) for t in record.missed_targets()]
    longest = _longest_context(records)
    reach = f"; longest context recorded {longest}" if longest else "; no context length recorded"
    if findings:
        return ItemResult("evals", TITLE_EVALS, FAIL,
                          f"{len(records)} eval record(s); stale, failing or missing a gate" + reach,
                          findings)
    met = sum(len(r.targets) for r in records)
    return ItemResult("evals", TITLE_EVALS, PASS,
                      f"{len(records)} fresh eval record(s), {met} gate(s) met" + reach,
                      [Finding(f"{r.kind}: {r.command}", r.rel) for r in records])


def check_benchmarks(evidence: EvidenceSet) -> ItemResult:
    records = evidence.of_kind("decode-bench")
    if not records:
        return ItemResult("benchmarks", TITLE_BENCH, FAIL,
                          "no decode-bench record in evidence/: run the decode benchmark on the GPU "
                          "and commit its JSON")
    findings: list[Finding] = []
    notes: list[Finding] = []
    for record in records:
        findings += stale_findings(evidence, record)
        if not record.command.strip():
            findings.append(Finding("no `command`: a reviewer cannot reproduce it", record.rel))
        findings += _failing_parity(record)
        notes += [Finding(_target_text(t), record.rel) for t in record.missed_targets()]
    if findings:
        return ItemResult("benchmarks", TITLE_BENCH, FAIL,
                          f"{len(records)} decode-bench record(s); stale, without command or "
                          "failing parity", findings + notes)
    missed = f"; {len(notes)} target(s) missed (listed)" if notes else ""
    return ItemResult("benchmarks", TITLE_BENCH, PASS,
                      f"{len(records)} fresh decode-bench record(s) with their command" + missed,
                      [Finding(f"command: {r.command}", r.rel) for r in records] + notes)
