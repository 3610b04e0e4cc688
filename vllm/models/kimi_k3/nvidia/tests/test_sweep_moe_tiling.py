"""benchmarks/sweep_moe_tiling.py on the CPU: its candidates are launchable tilings that include
`choose_tiling`'s pick at every K3 per-rank shape and row bucket, a candidate the pick is not
compiles for sm_90a, and the sweep calls a compiled pass with what it takes (the sweep itself
needs the GPU)."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

import cuda.bindings.driver as cuda  # noqa: E402

from vllm.models.kimi_k3.nvidia.benchmarks.sweep_moe_tiling import candidates  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels import moe_experts  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.config import PRESETS  # noqa: E402

K3 = PRESETS["k3"]
H = K3.routed_expert_hidden_size


@pytest.mark.parametrize("tp", [16, 8, 1])
def test_candidates_are_launchable_and_hold_the_pick(tp):
    inter = K3.shard(tp, 0).moe_inter
    for gate_up, n_out, k in ((True, inter, H), (False, H, inter)):
        for m_atoms in range(1, 9):
            found = candidates(gate_up, n_out, k, m_atoms)
            assert moe_experts.choose_tiling(gate_up, n_out, k, m_atoms) in found, (tp, gate_up, m_atoms)
            for rows in (8 * m_atoms - 7, 8 * m_atoms):  # the picks the launch makes at those rows
                experts = min(rows * K3.num_experts_per_token, K3.num_experts)
                assert moe_experts.choose_tiling(gate_up, n_out, k, m_atoms, experts, 132) in found, (tp, rows)
            assert len(found) == len(set(found)) > 1, "nothing to compare the pick with"
            for t in found:
                assert n_out % t.block_out(gate_up) == 0 and k % t.chunk_k == 0
                assert t.warps_k <= k // t.chunk_k and 64 <= 32 * t.warps_n * t.warps_k <= 256


def test_a_candidate_other_than_the_pick_compiles(tmp_path):
    inter = K3.shard(16, 0).moe_inter
    pick = moe_experts.choose_tiling(True, inter, H, 1)
    other = next(t for t in candidates(True, inter, H, 1) if t != pick)
    ptx = moe_experts.compile_expert_gemv(True, K3.num_experts, K3.num_experts_per_token, inter, H, 1, 4.0, 25.0,
                                          other, "sm_90a", ptx_dir=str(tmp_path)).artifacts.PTX
    assert "mma.sync.aligned.m16n8k16" in ptx


def test_pass_args_match_the_compiled_pass():
    """The launcher and the sweep both build a compiled pass's arguments with `pass_args`; these
    must be the host function's runtime parameters, one each, in number (the sweep once called
    the pass with the arguments it took before the combine moved into the down pass)."""
    runtime = [p for p in inspect.signature(moe_experts._expert_gemv_host).parameters.values()
               if p.annotation != "Constexpr"]
    t = torch.zeros(8, dtype=torch.int32)
    args = moe_experts.pass_args(t, t, t, t, t, t, t, 1, cuda.CUstream(0))
    assert len(args) == len(runtime) == 9, [p.name for p in runtime]
    assert [p.name for p in runtime][-2:] == ["m", "stream"]
