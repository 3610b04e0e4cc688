"""The decode benchmark's plot: a PNG from decode-bench records, a clear error without timings."""

import pytest

from vllm.models.kimi_k3.nvidia.benchmarks.plot_decode import main, plot, points

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the [plot] or [test] extra)")


def _result(tp, rows, q, t, graphed=None):
    return {"name": f"tp{tp} rows{rows}", "status": "pass", "tp": tp, "rows": rows, "q": q, "context": 4096,
            "time_us": t, "floor_us": t / 3, "baseline_us": {"standard_eager": 30 * t,
                                                             **({"standard_graphed": graphed} if graphed else {})}}


def test_plot_writes_a_png_of_every_timed_result(tmp_path):
    records = [{"results": [_result(16, 1, 1, 2700.0, 9300.0), _result(16, 8, 1, 5000.0), _result(16, 8, 8, 5100.0),
                            {"name": "tp16 build", "status": "pass"}]},
               {"results": [_result(8, 64, 1, 32000.0, 44000.0)]}]
    assert len(points(records)) == 4
    out = plot(records, tmp_path / "decode.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_records_without_timings_are_refused(tmp_path, capsys):
    rec = tmp_path / "r.json"
    rec.write_text('{"results": [{"name": "build", "status": "pass"}]}')
    assert main([str(rec), "--out", str(tmp_path / "x.png")]) == 2
    assert "no timed results" in capsys.readouterr().err


def test_bench_plot_draws_every_record_in_the_out_folder(tmp_path, monkeypatch):
    """`k3-decode bench --plot`: the benchmark (stubbed: this machine has no GPU) writes its record,
    then one PNG is drawn from it and the other decode-bench records beside it."""
    import json

    import torch

    from vllm.models.kimi_k3.nvidia.benchmarks import decode_latency
    from vllm.models.kimi_k3.nvidia.latency_specialized import cli

    (tmp_path / "decode_bench_tp8.json").write_text(json.dumps({"results": [_result(8, 64, 1, 32000.0)]}))
    seen = []

    def bench(argv):
        seen.append(argv)
        (tmp_path / "mine.json").write_text(json.dumps({"results": [_result(16, 1, 1, 2700.0, 9300.0)]}))
        return 1  # a missed target: the plot is still drawn, the exit status kept

    from vllm.models.kimi_k3.nvidia.benchmarks import plot_decode

    drawn = []
    monkeypatch.setattr(plot_decode, "plot", lambda records, out: drawn.append(len(records)) or plot(records, out))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode_latency, "main", bench)
    assert cli.main(["bench", "--out", str(tmp_path), "--name", "mine", "--quick", "--plot"]) == 1
    assert seen == [["--out", str(tmp_path), "--name", "mine", "--quick"]]
    assert (tmp_path / "mine.png").read_bytes()[:4] == b"\x89PNG" and drawn == [2]
