"""The result of one checklist item: a status, a one-line summary and the findings behind it.

Status is one of three words: `pass` (the item holds, shown ✓), `fail` (it does not, ✗)
and `needs-human` (only a reviewer can judge it; the findings say where to look). A
finding points at a file and, where one exists, a line, so the report can name the
offending place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PASS = "pass"
FAIL = "fail"
NEEDS_HUMAN = "needs-human"
STATUSES = (PASS, FAIL, NEEDS_HUMAN)

MARKS = {PASS: "✓", FAIL: "✗", NEEDS_HUMAN: "needs-human"}


@dataclass(frozen=True)
class Finding:
    message: str
    path: str | None = None  # repository-relative
    line: int | None = None

    def where(self) -> str:
        if self.path is None:
            return ""
        return f"{self.path}:{self.line}" if self.line is not None else self.path


@dataclass
class ItemResult:
    key: str  # stable identifier, e.g. "changes"
    title: str  # the checklist item in one line
    status: str
    summary: str
    findings: list[Finding] = field(default_factory=list)
    automatic: bool = True  # False: listed for the reviewer, never fails the check

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"item {self.key}: status {self.status!r} is not one of {STATUSES}")

    @property
    def mark(self) -> str:
        return MARKS[self.status]
