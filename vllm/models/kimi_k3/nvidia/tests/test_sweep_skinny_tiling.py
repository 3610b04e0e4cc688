"""benchmarks/sweep_skinny_tiling.py on the CPU: its candidates are launchable tilings of every K3
per-rank shape, a candidate other than the pick compiles for sm_90a, and the two-stage sweep
(with the timing stood in for) finds the fastest correct tiling, reports the failing ones and
stops at its budget (the sweep itself needs the GPU); beyond 16 rows on sm_90a it also times the TMA + wgmma
kernel's candidates."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.benchmarks import sweep_skinny_tiling as sweep  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels import skinny_gemm  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.shapes import GemmShape, k3_gemm_shapes  # noqa: E402

SMS = 132  # the H200's


@pytest.mark.parametrize("tp", [16, 8, 1])
def test_candidates_fit_and_offer_alternatives(tp):
    for shape in k3_gemm_shapes((tp,)):
        for m_atoms in (1, 2, 8):
            stage_one = sweep.cta_shapes(shape.n, shape.k, m_atoms, SMS)
            assert len(stage_one) == len(set(stage_one)) > 1, (shape.name, m_atoms)
            for t in stage_one:
                assert sweep.fits(t, shape.k, m_atoms), (shape.name, t)
                assert t.warps_k * t.splits <= -(-shape.k // t.chunk_k)
                assert t.warps_k * 8 * m_atoms * (t.block_n + 4) * 4 < 150 * 1024  # the reduction's smem
                for v in sweep.split_variants(t, shape.n, shape.k, m_atoms, SMS):
                    assert sweep.fits(v, shape.k, m_atoms) and v != t
                    assert (v.row_tiles, v.chunk_atoms, v.warps_n, v.warps_k) == \
                        (t.row_tiles, t.chunk_atoms, t.warps_n, t.warps_k)


def test_fits_rejects_what_cannot_run_well():
    k = 7168
    assert not sweep.fits(skinny_gemm.Tiling(2, 16, 4, 2, 4, 1), k, 1)  # 256 W registers a lane
    assert not sweep.fits(skinny_gemm.Tiling(1, 16, 4, 2, 8, 1), k, 1)  # 16 warps: 64 of 128 at most
    assert not sweep.fits(skinny_gemm.Tiling(1, 8, 4, 1, 8, 8), k, 1)  # 64 warps×splits > 56 chunks
    assert sweep.fits(skinny_gemm.Tiling(1, 16, 4, 1, 8, 2), k, 1)  # 128 W registers of 255
    assert sweep.fits(skinny_gemm.Tiling(1, 8, 4, 2, 4, 2), k, 1)


def test_a_candidate_other_than_the_pick_compiles(tmp_path):
    n, k = 3216, 7168  # kda_in_proj@tp16
    pick = skinny_gemm.choose_tiling(n, k, 1, SMS)
    other = next(t for t in sweep.cta_shapes(n, k, 1, SMS) if t.chunk_atoms == 16 and t != pick)
    ptx = skinny_gemm.compile_skinny_gemm(n, k, 1, torch.bfloat16, other, "sm_90a",
                                          ptx_dir=str(tmp_path)).artifacts.PTX
    assert "mma.sync.aligned.m16n8k16" in ptx


def _fake_bench(broken: skinny_gemm.Tiling | None):
    """A stand-in for bench_case: time falls with splits and wider chunks; one tiling is wrong."""
    def bench_case(inp, m, copy_bw, tiling, baseline):
        assert baseline is False
        if isinstance(tiling, skinny_gemm.WgmmaTiling):
            t_us = 0.2 + 6.4 / tiling.block_w  # below every warp tiling, 128 rows fastest
        else:
            t_us = 20.0 / tiling.splits + 8.0 / tiling.chunk_atoms + tiling.row_tiles
        return {"time_us": t_us, "frac_of_copy_bw": 10.0 / t_us, "rel_err": 0.5 if tiling == broken else 1e-3,
                "status": "fail" if tiling == broken else "pass"}
    return bench_case


def test_the_sweep_finds_the_fastest_correct_tiling_and_reports_failures(monkeypatch):
    shape = GemmShape("kda_in_proj@tp16", 16, 3216, 7168)
    pick = skinny_gemm.choose_tiling(shape.n, shape.k, 1, SMS)
    stage_one = sweep.cta_shapes(shape.n, shape.k, 1, SMS)
    fake = _fake_bench(None)
    fastest = min(stage_one, key=lambda t: fake(None, 1, 0, t, False)["time_us"])
    monkeypatch.setattr(sweep, "bench_case", _fake_bench(fastest))
    r = sweep.sweep_case(SimpleNamespace(shape=shape), 1, 4.2, "sm_90a", SMS, time.monotonic() + 60)
    assert r["pick"]["tiling"] == sweep.describe(pick) and r["pick"]["ok"]
    assert [f["tiling"] for f in r["failed"]] == [sweep.describe(fastest)]
    timed = [c for c in r["candidates"] if c.get("ok")]
    assert r["best"]["time_us"] == min(c["time_us"] for c in timed)
    assert r["best"]["tiling"] != sweep.describe(fastest)
    # stage two varied the split count of the finalists: some candidate is not a stage-one shape
    tilings = [{k: v for k, v in c["tiling"].items() if k != "kernel"} for c in r["candidates"]]
    assert any(skinny_gemm.Tiling(**t) not in stage_one + [pick] for t in tilings)
    assert all(c["tiling"]["kernel"] == "warp" for c in r["candidates"])  # one row: no wgmma candidates
    # the pick's L2 requests before the PDL wait are timed against the same pick without them
    assert pick.prefetch_rounds > 0
    assert sweep.describe(replace(pick, prefetch_rounds=0)) in [c["tiling"] for c in r["candidates"]]


def test_beyond_16_rows_on_hopper_the_sweep_times_the_wgmma_kernel_too(monkeypatch):
    shape = GemmShape("lm_head@tp16", 16, 10240, 7168)
    monkeypatch.setattr(sweep, "bench_case", _fake_bench(None))
    r = sweep.sweep_case(SimpleNamespace(shape=shape), 33, 4.2, "sm_90a", SMS, time.monotonic() + 60)
    assert r["pick"]["tiling"]["kernel"] == "wgmma"
    wgmma = [c["tiling"] for c in r["candidates"] if c["tiling"]["kernel"] == "wgmma"]
    assert {t["block_w"] for t in wgmma} == {64, 128} and len({t["splits"] for t in wgmma}) > 1
    assert any(c["tiling"]["kernel"] == "warp" for c in r["candidates"])
    assert sweep.label(r["best"]["tiling"]).startswith("wgmma W128")  # the stand-in times 128 rows fastest
    r = sweep.sweep_case(SimpleNamespace(shape=shape), 33, 4.2, "sm_100a", SMS, time.monotonic() + 60)
    assert all(c["tiling"]["kernel"] == "warp" for c in r["candidates"])


def test_the_sweep_stops_at_its_budget(monkeypatch):
    shape = GemmShape("kda_in_proj@tp16", 16, 3216, 7168)
    monkeypatch.setattr(sweep, "bench_case", _fake_bench(None))
    r = sweep.sweep_case(SimpleNamespace(shape=shape), 1, 4.2, "sm_90a", SMS, time.monotonic() - 1)
    assert r["best"] is None and all(c.get("skipped") == "budget" for c in r["candidates"])


def test_replay_reads_the_current_picks_time_among_the_timed_candidates(capsys):
    """`--replay`: this tree's pick is looked up among a sweep's timed candidates (a stage count
    apart still matches, marked), a pick the sweep never timed is reported as such, and failed
    or skipped candidates never count as the fastest."""
    n, k = 20480, 7168
    pick = skinny_gemm.pick_tiling("sm_90a", n, k, 4, SMS)
    as_timed = sweep.describe(pick)
    other = sweep.describe(skinny_gemm.WgmmaTiling(64 if pick.block_w == 128 else 128, 2, 1))
    restaged = {**as_timed, "stages": as_timed["stages"] + 1}

    def case(m, candidates):
        return {"shape": "lm_head@tp8", "n": n, "k": k, "m": m, "pick": {"time_us": 99.0}, "candidates": candidates}

    result = {"results": [
        case(32, [{"tiling": as_timed, "time_us": 80.0, "ok": True}, {"tiling": other, "time_us": 64.0, "ok": True},
                  {"tiling": other, "time_us": 1.0, "ok": False}, {"tiling": other, "skipped": "budget"}]),
        case(24, [{"tiling": restaged, "time_us": 70.0, "ok": True}]),
        case(17, [{"tiling": other, "time_us": 50.0, "ok": True}]),
    ]}
    rows = sweep.replay_picks(result, "sm_90a", SMS)
    assert [(r["time_us"], r["best_us"], r["stand_in"]) for r in rows] == \
        [(80.0, 64.0, False), (70.0, 70.0, True), (None, 50.0, False)]
    sweep.print_replay(rows, lambda r: f"{r['shape']} M={r['m']}", sweep.label)
    assert "2 of 3 picks timed" in capsys.readouterr().out
