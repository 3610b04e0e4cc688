"""`Lanes`: side streams on which ops of a step that do not depend on each other overlap.

| call | what it does |
| --- | --- |
| `with lanes.beside(i):` | the ops issued inside run on side stream i, after everything issued on the current stream so far (a fork) |
| `lanes.join(i)` | the current stream waits for side stream i (a join): issue it before reading what the lane wrote |

Inside a CUDA-graph capture a fork and a join are edges of the graph, so a replay runs a lane's
kernels beside those of the current stream: a latency-bound GEMM of a few µs then fills SMs
that a bandwidth-bound one leaves idle. Off (no CUDA, or `Lanes(None)`), `beside` runs on the
current stream and `join` does nothing, so the step issues the same ops in the same order
either way and CPU tests see the sequential step.

What a step must keep for this to be safe: a lane reads only tensors its fork orders after
their writers and writes only tensors nothing reads before the join; collectives stay on the
current stream (every rank must issue them in one order); two ops that share a kernel's
scratch (`DeviceFacts.scratch`: the skinny GEMM's split-K workspace is per output width and
tiling) never run at once. Blocks the caching allocator hands a lane are freed back to that
lane and reused only after its next fork, which waits for the current stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class Lanes:
    def __init__(self, device: torch.device | None, count: int = 2):
        self.streams = [torch.cuda.Stream(device) for _ in range(count)] if device is not None else []

    @property
    def on(self) -> bool:
        return bool(self.streams)

    @contextmanager
    def beside(self, lane: int) -> Iterator[None]:
        if not self.streams:
            yield
            return
        side = self.streams[lane]
        side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side):
            yield

    def join(self, lane: int) -> None:
        if self.streams:
            side = self.streams[lane]
            torch.cuda.current_stream(side.device).wait_stream(side)
