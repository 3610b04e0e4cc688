"""`VllmCollective` (our cross-rank sums over vLLM's tensor-parallel group) on the CPU: over a
stand-in for vLLM's GroupCoordinator whose `all_gather` is the in-process `ThreadGroup`'s, its
sums and gathers, and whole TP ranks of the executor, equal `ThreadGroup`'s bit for bit; over
vLLM's real group (two gloo processes; `needs_vllm`, run by .ci/vllm_cpu_job.sh) the sums equal
the rank-ordered fp32 sum."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from vllm.models.kimi_k3.nvidia.latency_specialized.vllm_collective import VllmCollective
from vllm.models.kimi_k3.nvidia.reference.collective import ThreadGroup, ordered_sum

from ._util import executor_rank_steps, needs_vllm


class Coordinator:
    """vLLM's GroupCoordinator as the collective sees it: world_size, rank_in_group, all_gather."""

    def __init__(self, peers: ThreadGroup):
        self.peers, self.world_size, self.rank_in_group = peers, peers.tp, peers.rank
        self.gathers = 0

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.gathers += 1
        return self.peers.all_gather(x, dim)


@pytest.mark.parametrize("tp", [2, 4])
def test_sums_and_gathers_equal_the_thread_groups(tp):
    def rank(peers):
        coll = VllmCollective(Coordinator(peers))
        g = torch.Generator().manual_seed(peers.rank)
        x = (torch.randn(3, 64, generator=g) * 10 ** torch.randint(-3, 4, (3, 64), generator=g)).to(torch.bfloat16)
        got = (coll.all_reduce(x), coll.all_gather(x, 0), coll.all_gather(x, -1))
        want = (peers.all_reduce(x), peers.all_gather(x, 0), peers.all_gather(x, -1))
        return [torch.equal(a, b) for a, b in zip(got, want)], coll.group.gathers, (coll.tp, coll.rank)

    out = ThreadGroup.run(tp, rank)
    assert all(all(same) for same, _, _ in out), out
    assert all(n == 3 for _, n, _ in out)  # every sum and gather went through vLLM's all_gather
    assert [r for _, _, r in out] == [(tp, i) for i in range(tp)]


def test_tensor_parallel_ranks_over_vllms_group_equal_the_thread_groups():
    """Each TP2 rank of the executor (reference ops) with its sums over vLLM's group gives that
    rank's reference logits bit for bit, and the same logits as over the ThreadGroup."""
    over_vllm = ThreadGroup.run(2, lambda peers: executor_rank_steps(VllmCollective(Coordinator(peers)), 2))
    direct = ThreadGroup.run(2, lambda peers: executor_rank_steps(peers, 2))
    assert all(all(same) for same, _ in over_vllm), [same for same, _ in over_vllm]
    assert all(torch.equal(a[1], b[1]) for a, b in zip(over_vllm, direct))


def test_a_group_without_the_coordinators_interface_is_named():
    with pytest.raises(TypeError, match="lacks rank_in_group, all_gather"):
        VllmCollective(type("Group", (), {"world_size": 2})())


def _vllm_rank(rank: int, world: int, port: int, results) -> None:
    """One process of a vLLM TP group on gloo: our sums and gathers over vLLM's own coordinator."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized, get_tp_group,
                                                 init_distributed_environment)
    os.environ["VLLM_DIST_IDENT"] = str(port)  # as vLLM's CPU worker sets it: its shared-memory group's name
    try:
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            ensure_model_parallel_initialized(world, 1)
            coll = VllmCollective(get_tp_group())
            xs = [(torch.randn(3, 64, generator=torch.Generator().manual_seed(r)) * 100).to(torch.bfloat16)
                  for r in range(world)]
            results.put((rank, (coll.tp, coll.rank), torch.equal(coll.all_reduce(xs[rank]), ordered_sum(xs)),
                         torch.equal(coll.all_gather(xs[rank], 0), torch.cat(xs, 0))))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails with it
        results.put((rank, repr(e), False, False))


@needs_vllm
def test_over_vllms_own_tensor_parallel_group_the_sums_are_rank_ordered():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_vllm_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert got == [(0, (2, 0), True, True), (1, (2, 1), True, True)], got
