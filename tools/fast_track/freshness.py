"""Checklist item `evidence-fresh`: every `validated` envelope has fresh, passing evidence of its GPU.

For each envelope with `status: validated`, each file in its `evidence` list (relative
to SCOPE.yaml's folder) must exist and hold records that are fresh (their recorded
source hash equals the hash of today's sources, or only comments, docstrings or layout
changed since; see evidence.py), were run on the
envelope's GPU (its name a word of the record's `gpu`, and the same compute capability)
and have no failing result. A scope with no validated envelope passes vacuously, and the
summary says so: `declared` envelopes claim nothing yet. A JSON file under evidence/ that
is not a record fails the item wherever it is. Stale records elsewhere in
evidence/ are listed for information; the items that rely on them judge them.
"""

from __future__ import annotations

import re
from typing import Any

from .evidence import EvidenceSet, Record, stale_findings
from .items import FAIL, PASS, Finding, ItemResult
from .model import ModelFolder

TITLE = ("Every envelope marked validated has evidence of the current code (its source hash matches, "
         "or only comments, docstrings or layout changed)")


def _gpu_mismatch(record: Record, gpu: Any) -> str | None:
    if not isinstance(gpu, dict):
        return None
    name, cc = str(gpu.get("name", "")), str(gpu.get("compute_capability", ""))
    ran_on = str(record.data.get("gpu", ""))
    if not re.search(rf"\b{re.escape(name)}\b", ran_on, re.IGNORECASE):
        return f"ran on {ran_on or 'an unrecorded GPU'}, not {name}"
    if str(record.data.get("compute_capability", "")) != cc:
        return (f"ran at compute capability {record.data.get('compute_capability')!r}, "
                f"the envelope is {cc}")
    return None


def check_evidence_fresh(model: ModelFolder, evidence: EvidenceSet) -> ItemResult:
    loaded = model.scope()
    data = loaded.data if isinstance(loaded.data, dict) else {}
    envelopes = [e for e in data.get("envelopes") or [] if isinstance(e, dict)]
    validated = [(i, e) for i, e in enumerate(envelopes) if e.get("status") == "validated"]
    findings: list[Finding] = list(evidence.problems)  # an unreadable evidence file is a defect too
    for i, env in validated:
        line = loaded.lines.get(f"envelopes[{i}].evidence")
        files = env.get("evidence") or []
        if not files:
            findings.append(Finding(f"envelope {env.get('name')!r} is validated but lists no "
                                    "evidence", model.scope_rel, line))
        for name in files:
            rel = f"{model.rel}/{name}"
            records = evidence.in_file(rel)
            if not records:
                findings.append(Finding(f"envelope {env.get('name')!r}: evidence {name} is missing "
                                        "or holds no record", model.scope_rel, line))
            for record in records:
                findings += stale_findings(evidence, record)
                mismatch = _gpu_mismatch(record, env.get("gpu"))
                if mismatch:
                    findings.append(Finding(f"envelope {env.get('name')!r}: {mismatch}", rel))
                failed = record.failed_results()
                if failed:
                    findings.append(Finding(f"{len(failed)} failing result(s): "
                                            f"{', '.join(failed[:5])}", rel))
    stale_elsewhere = [r.label for r in evidence.records if not evidence.freshness(r).fresh
                       and all(r.rel != f"{model.rel}/{n}" for _, e in validated
                               for n in e.get("evidence") or [])]
    note = f"; stale records elsewhere in evidence/: {', '.join(stale_elsewhere)}" \
        if stale_elsewhere else ""
    if findings:
        return ItemResult("evidence-fresh", TITLE, FAIL,
                          f"{len(validated)} validated envelope(s); their evidence does not hold"
                          + note, findings)
    if not validated:
        return ItemResult("evidence-fresh", TITLE, PASS,
                          f"no envelope is validated ({len(envelopes)} declared): nothing is "
                          "claimed yet" + note)
    return ItemResult("evidence-fresh", TITLE, PASS,
                      f"{len(validated)} validated envelope(s), all evidence fresh and passing" + note)
