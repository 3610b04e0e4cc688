"""benchmarks/decode_tp.py: on the CPU, the exchange count it divides by, its summary's arithmetic
and its usage errors; on a host of several GPUs, a short run of it end to end under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks import decode_tp
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.reference.collective import SingleRank
from vllm.models.kimi_k3.nvidia.reference.params import DenseMLPWeights, MoEWeights

from ._util import mini_model, prefill

ROOT = Path(__file__).resolve().parents[5]


class CountingRank(SingleRank):
    """Identity exchanges, counted."""

    def __init__(self, tp: int, rank: int = 0):
        super().__init__(tp, rank)
        self.calls = 0

    def all_reduce(self, x):
        self.calls += 1
        return x

    def all_gather(self, x, dim=-1):
        self.calls += 1
        return x


@pytest.mark.parametrize("q", [1, 4])
def test_exchanges_per_step_is_what_one_executor_step_makes(q):
    """The count the benchmark divides the exchanges' cost by, against the collectives one step of
    the executor really calls, on a model with dense and MoE layers."""
    coll = CountingRank(tp=2)
    model = mini_model(seed=0, tp=2, coll=coll)
    kinds = {type(lw.mlp) for lw in model.w.layers}
    assert kinds == {DenseMLPWeights, MoEWeights}, kinds
    ex = SpecializedDecode(model, max_requests=2, max_len=64, buckets=[(2 * q, q)], ops=ReferenceOps(),
                           graphs=False, log=lambda _: None)
    slots = prefill(model, ex.state, [[5, 6, 7], [8, 9]])
    ids = torch.tensor([11, 12] * q)
    coll.calls = 0
    ex(ids, [ex.state.segment(r, j * q, q, prefill=False) for j, r in enumerate(slots)], ex.state)
    assert coll.calls == decode_tp.exchanges_per_step(model) == 2 + sum(
        3 if isinstance(lw.mlp, MoEWeights) else 2 for lw in model.w.layers)


def test_summary_takes_the_slowest_rank_and_prices_one_exchange():
    per_rank = [{"alone": [100.0, 102.0], "group": [150.0, 152.0]},
                {"alone": [104.0, 106.0], "group": [160.0, 158.0]}]
    r = decode_tp.summarize(per_rank, rows=2, exchanges=37, exchange_us=[9.0, 11.5], ranks_agree=True)
    assert r["name"] == "tp2 rows2 q1 ctx4096" and r["status"] == "pass"
    assert r["per_rank_us"] == {"alone": [101.0, 105.0], "group": [151.0, 159.0]}
    assert (r["alone_us"], r["time_us"]) == (105.0, 159.0)
    assert r["exchanges_us"] == pytest.approx(54.0) and r["per_exchange_us"] == pytest.approx(54.0 / 37)
    assert r["one_all_reduce_us"] == 11.5
    assert decode_tp.summarize(per_rank, 2, 37, [9.0, 11.5], ranks_agree=False)["status"] == "fail"


def test_without_torchrun_it_says_how_to_launch(monkeypatch, capsys):
    """(Without a GPU it stops first: test_benchmarks_need_a_gpu.py.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as e:
        decode_tp.main(["--rows", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "not started by torchrun" in err
    assert "torchrun --nproc-per-node N -m vllm.models.kimi_k3.nvidia.benchmarks.decode_tp" in err
    with pytest.raises(SystemExit) as e:
        decode_tp.main(["--rows", "0"])
    assert e.value.code == 2 and "--rows, --layers and --reps must be at least 1" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.slow
def test_a_short_run_on_every_gpu_of_the_host_times_both_forms_and_the_ranks_agree(tmp_path):
    """K3's first layers on the host's GPUs, 2, 4 or 8 of them: the record comes back with both forms
    timed on every rank and every rank's logits identical. Four layers (KDA, MLA, the dense MLP and
    MoE) from 4 GPUs; two (no MLA) on two, where a rank's three MoE layers (30 GB each) would not
    fit 80 GB."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    tp = max((t for t in (2, 4, 8) if t <= n), default=0)
    if not tp:
        pytest.skip(f"a TP group needs 2 or more GPUs, this machine has {n}")
    from .test_distributed import _free_port
    out = tmp_path / "decode_tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "-m", "vllm.models.kimi_k3.nvidia.benchmarks.decode_tp",
           "--layers", "4" if tp >= 4 else "2", "--rows", "1", "2", "--reps", "5", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [x["rows"] for x in record["results"]] == [1, 2]
    for x in record["results"]:
        assert x["status"] == "pass" and x["ranks_agree"] is True
        assert all(len(times) == tp and min(times) > 0 for times in x["per_rank_us"].values())
