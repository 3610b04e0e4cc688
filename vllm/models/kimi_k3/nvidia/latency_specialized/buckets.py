"""Row buckets of the CUDA-graph decode executor, and the padding that fills a step to one.

A decode step of R requests × q tokens runs the graph captured for the smallest bucket of
the envelope's `rows_per_step` that is a multiple of q and holds R·q rows; the missing
rows are dummy requests on the null slot and null block (`DecodeState.padding`), whose
outputs are discarded and whose state writes land in scratch only.
"""

from __future__ import annotations

from typing import Sequence

from ..reference.state import DecodeState, Segment


def buckets_for(rows_per_step: Sequence[int], q: int) -> list[int]:
    """The graph buckets of a step with q tokens per request: envelope row counts divisible by q."""
    if q < 1:
        raise ValueError(f"tokens per request must be >= 1, found {q}")
    return sorted(r for r in rows_per_step if r % q == 0)


def bucket_for(rows: int, q: int, rows_per_step: Sequence[int]) -> int | None:
    """The smallest bucket holding `rows` rows of q-token requests, or None (standard path)."""
    fits = [b for b in buckets_for(rows_per_step, q) if b >= rows]
    return fits[0] if fits else None


def pad_to_bucket(segments: list[Segment], q: int, bucket: int, state: DecodeState) -> list[Segment]:
    """`segments` (pure decode, q tokens each, rows 0..R·q−1) plus dummy requests up to `bucket` rows."""
    rows = sum(s.n for s in segments)
    if any(s.prefill or s.n != q for s in segments):
        raise ValueError(f"only pure decode steps of {q} tokens per request are padded to a bucket")
    if rows > bucket or (bucket - rows) % q:
        raise ValueError(f"{rows} rows cannot be padded to a bucket of {bucket} with {q}-token requests")
    return segments + [state.padding(row0, q) for row0 in range(rows, bucket, q)]
