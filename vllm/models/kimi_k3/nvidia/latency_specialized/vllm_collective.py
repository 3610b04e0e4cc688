"""`VllmCollective`: our `Collective` over vLLM's tensor-parallel group (its `GroupCoordinator`).

    all_reduce(x)    = round_bf16( Σ_{r = 0 .. tp-1} fp32(x_r) )   summed in rank order
    all_gather(x, d) = cat(x_0, …, x_{tp-1}; dim = d)

vLLM's own all-reduce (custom all-reduce, NCCL ring or tree, symmetric memory) picks its
summation order by message size and algorithm and may round partial sums, so the executor
does not call it: every rank gathers the raw partials through the group's `all_gather`, which
moves bytes and rounds nothing, and sums them itself (`GatheredCollective`), as
`TorchDistributed` does over torch.distributed (distributed.py: what that costs). The sums are
then bit-identical to `SingleRank`/`ThreadGroup`, against which every TP test is judged, and
equal on every rank, so routing and sampling cannot drift apart. vLLM's `all_gather` is the
collective it captures in its own FULL CUDA graphs (its device communicator, not
torch.distributed), so a step that calls it stays capturable there.
"""

from __future__ import annotations

from typing import Any

import torch

from ..reference.collective import GatheredCollective


class VllmCollective(GatheredCollective):
    """One rank of vLLM's tensor-parallel group, e.g. `vllm.distributed.get_tp_group()`: anything
    with `world_size`, `rank_in_group` and `all_gather(x, dim)`."""

    def __init__(self, group: Any) -> None:
        missing = [a for a in ("world_size", "rank_in_group", "all_gather") if not hasattr(group, a)]
        if missing:
            raise TypeError(f"{type(group).__name__} is not a vLLM GroupCoordinator: it lacks {', '.join(missing)}")
        self.group, self.tp, self.rank = group, int(group.world_size), int(group.rank_in_group)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:  # vLLM's all_gather returns its input unchanged for one rank
            return x.unsqueeze(0)
        return self.group.all_gather(x.contiguous().unsqueeze(0), dim=0)
