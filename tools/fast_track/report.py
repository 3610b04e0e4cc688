"""The review as markdown, fit for a PR comment or a CI job summary.

A header (what was compared with what), the verdict, one table row per checklist item
(✓ / ✗ / needs-human and its summary), then a section per item that is not ✓ — and,
for ✓ items, their supporting findings — listing each finding with its file and line.
Long finding lists are cut at MAX_FINDINGS with the count of the rest, so a comment
stays readable.
"""

from __future__ import annotations

from .items import PASS, ItemResult
from .review import Review

MAX_FINDINGS = 60
CHECKLIST = "docs/fast_track/CHECKLIST.md"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _numbered(review: Review) -> list[tuple[str, str, ItemResult]]:
    """(number, section title, item): automatic items 1.., reviewer items H1..; per model."""
    out = [("1", "", review.change_item)]
    for model_review in review.models:
        auto = [i for i in model_review.items if i.automatic]
        human = [i for i in model_review.items if not i.automatic]
        out += [(str(n), model_review.model.rel, i) for n, i in enumerate(auto, start=2)]
        out += [(f"H{n}", model_review.model.rel, i) for n, i in enumerate(human, start=1)]
    return out


def _findings(item: ItemResult) -> list[str]:
    lines = []
    for finding in item.findings[:MAX_FINDINGS]:
        where = f"`{finding.where()}`: " if finding.path else ""
        lines.append(f"- {where}{finding.message}")
    if len(item.findings) > MAX_FINDINGS:
        lines.append(f"- … and {len(item.findings) - MAX_FINDINGS} more")
    return lines


def render_report(review: Review) -> str:
    changes = review.changes
    head = changes.head[:12] if changes.head else "no commit yet"
    failing = review.failing()
    automatic = [i for i in review.all_items() if i.automatic]
    human = [i for i in review.all_items() if not i.automatic and i.status != PASS]
    verdict = ("✓ every automatic item holds" if not failing else
               f"✗ {len(failing)} of {len(automatic)} automatic items do not hold")
    lines = [
        "# Fast-track review", "",
        f"- change: {len(changes.changes)} file(s), working tree at `{head}` against "
        f"{changes.base_label} (`{changes.base[:12]}`)",
        f"- model folder(s): {', '.join(f'`{m.model.rel}`' for m in review.models)}",
        f"- checklist: `{CHECKLIST}`; every item below says how it was judged", "",
        f"**Result: {verdict}.** {len(human)} item(s) need a reviewer.", "",
    ]
    numbered = _numbered(review)
    several = len(review.models) > 1
    header = ["#", "key", "item", "status", "summary"] + (["model"] if several else [])
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for number, model_rel, item in numbered:
        row = [number, f"`{item.key}`", _escape(item.title), item.mark, _escape(item.summary)]
        lines.append("| " + " | ".join(row + ([f"`{model_rel}`"] if several else [])) + " |")
    for number, model_rel, item in numbered:
        if not item.findings and item.status == PASS:
            continue
        lines += ["", f"## {number}. {item.mark} {item.title} (`{item.key}`)", "",
                  item.summary + (f" — `{model_rel}`" if several and model_rel else "")]
        if item.findings:
            lines += ["", *_findings(item)]
    return "\n".join(lines) + "\n"
