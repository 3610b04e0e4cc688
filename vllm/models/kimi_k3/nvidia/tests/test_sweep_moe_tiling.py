"""benchmarks/sweep_moe_tiling.py on the CPU: its candidates are launchable tilings that include
`choose_tiling`'s pick at every K3 per-rank shape and row bucket, and a candidate the pick is
not compiles for sm_90a (the sweep itself needs the GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

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


def test_replay_asks_choose_tiling_for_the_steps_experts(capsys):
    """`--replay`: per case the pick `sweep_pass` would make (with the step's selected experts, so
    gate/up at TP16 and one row takes 8-output warps) is looked up among the timed candidates."""
    from dataclasses import asdict

    from vllm.models.kimi_k3.nvidia.benchmarks import sweep_moe_tiling as sweep

    inter = moe_experts.read_width(K3.moe_intermediate_size // 16)  # the 192 real columns the pass reads
    pick = moe_experts.choose_tiling(True, inter, H, 1, K3.num_experts_per_token, 132)
    assert pick.row_tiles == 1  # the step's experts change the pick: a replay without them would miss it
    other = next(t for t in candidates(True, inter, H, 1) if t != pick)
    result = {"results": [{"tp": 16, "m": 1, "pass": "gate_up", "n_out": inter, "k": H, "pick": {"time_us": 13.0},
                           "candidates": [{"tiling": asdict(pick), "time_us": 13.0, "ok": True},
                                          {"tiling": asdict(other), "time_us": 12.0, "ok": True}]}]}
    rows = sweep.replay_picks(result, 132)
    assert [(r["time_us"], r["best_us"]) for r in rows] == [(13.0, 12.0)]
    sweep.print_replay(rows, lambda r: "case", str)
    assert "1 of 1 picks timed" in capsys.readouterr().out
