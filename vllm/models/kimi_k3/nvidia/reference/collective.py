"""`Collective`: the cross-rank sums of tensor parallelism behind one small interface.

Every reference layer computes one rank's shard and calls `all_reduce` / `all_gather`
where vLLM's stock TP layout reduces (K3_MATH.md §5.1). A sum adds the ranks' BF16
partials in rank order in FP32 and rounds once (§8 item 5), so every implementation of
this interface gives bit-identical results.

- `SingleRank`: one rank (TP1, or one rank of TP8/TP16 simulated on one GPU: then the
  sums are identities and collectives are not timed).
- `ThreadGroup`: all ranks of a TP group in one process, one thread per rank, meeting at
  a barrier; used by CPU tests to check that TP-sharded math equals TP1.
- `GatheredCollective`: the rank-ordered sum over any transport that gathers partials;
  `TorchDistributed` (torch.distributed, NCCL or gloo; latency_specialized/distributed.py) and
  `VllmCollective` (vLLM's tensor-parallel group; latency_specialized/vllm_collective.py).
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch


class Collective:
    tp: int = 1
    rank: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise NotImplementedError


class SingleRank(Collective):
    """Identity collectives: the step sees only this rank's contribution."""

    def __init__(self, tp: int = 1, rank: int = 0):
        self.tp, self.rank = tp, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


def ordered_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Σ parts in rank order, fp32 accumulation, one rounding to the parts' dtype."""
    acc = parts[0].to(torch.float32)
    for p in parts[1:]:
        acc = acc + p.to(torch.float32)
    return acc.to(parts[0].dtype)


class GatheredCollective(Collective):
    """A collective that moves every rank's raw partial to every rank (`_gather`: [tp, *x.shape],
    in rank order) and sums them there with `ordered_sum`: bit-identical to `ThreadGroup`
    whatever the transport, since a gather only moves bytes."""

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return ordered_sum(self._gather(x).unbind(0))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._gather(x).unbind(0), dim=dim)


class _Exchange:
    def __init__(self, tp: int):
        self.tp = tp
        self.slots: list[torch.Tensor | None] = [None] * tp
        self.barrier = threading.Barrier(tp)


class ThreadGroup(Collective):
    """One rank of a TP group whose ranks run as threads of this process."""

    def __init__(self, exchange: _Exchange, rank: int):
        self._ex, self.tp, self.rank = exchange, exchange.tp, rank

    def _exchange(self, x: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        self._ex.slots[self.rank] = x
        self._ex.barrier.wait()
        out = combine(list(self._ex.slots))  # type: ignore[arg-type]
        # nobody returns before all have combined: a rank may then reuse its input's memory (as
        # NCCL's in-place all-reduce lets it), and a peer still reading it would sum new values
        self._ex.barrier.wait()
        return out

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self._exchange(x, ordered_sum)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self._exchange(x, lambda parts: torch.cat(parts, dim=dim))

    @staticmethod
    def run(tp: int, fn: Callable[["ThreadGroup"], object]) -> list[object]:
        """Run fn(collective) on tp threads; returns each rank's result (re-raises errors)."""
        ex = _Exchange(tp)
        results: list[object] = [None] * tp
        errors: list[BaseException] = []

        def work(r: int) -> None:
            try:
                results[r] = fn(ThreadGroup(ex, r))
            except BaseException as e:  # surface the first failing rank's error
                errors.append(e)
                ex.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results
