"""`k3-decode`: the README's main-job command and the scope command, as an operator runs them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.models.kimi_k3.nvidia.latency_specialized.cli import main
from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset

ROOT = Path(__file__).resolve().parents[5]


def test_generate_prints_text_and_summary(capsys):
    assert main(["generate", "--config", "mini", "--prompt", "Hello, K3", "--max-tokens", "6", "--stats"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("'Hello, K3' -> ")
    summary = next(l for l in lines if l.startswith("[k3-decode]"))
    assert "6 tokens in" in summary and "tokens/s" in summary
    assert "1 prefill + 5 decode" in summary and "served by: standard 6" in summary
    assert "path counters (5 steps)" in out


def test_generate_with_backend_on_cpu_explains_fallback(capsys, caplog):
    rc = main(["generate", "--config", "mini", "--prompt", "x", "--max-tokens", "3",
               "--additional-config", '{"decode_backend": "latency_specialized"}'])
    assert rc == 0
    assert "standard because: deployment out of scope x2" in capsys.readouterr().out
    assert any("no CUDA device present" in r.getMessage() for r in caplog.records)


def test_decode_backend_flag_is_the_additional_config_key(capsys, caplog):
    """`k3-decode generate --decode-backend latency_specialized` (issue 8's command) selects the backend
    as the JSON key does; on a CPU it falls back and says why."""
    rc = main(["generate", "--config", "mini", "--prompt", "x", "--max-tokens", "3",
               "--decode-backend", "latency_specialized", "--additional-config", '{"allow_unvalidated": true}'])
    assert rc == 0
    out = capsys.readouterr().out
    assert "backend latency_specialized:" in out and "standard because: deployment out of scope x2" in out, out
    assert any("no CUDA device present" in r.getMessage() for r in caplog.records)
    # the same value twice is one choice; two different ones are refused, naming both
    assert main(["generate", "--config", "mini", "--prompt", "x", "--max-tokens", "1", "--decode-backend",
                 "auto", "--additional-config", '{"decode_backend": "auto"}']) == 0
    assert "backend auto:" in capsys.readouterr().out
    assert main(["generate", "--config", "mini", "--prompt", "x", "--decode-backend", "auto",
                 "--additional-config", '{"decode_backend": "latency_specialized"}']) == 2
    err = capsys.readouterr().err
    assert "--decode-backend auto and --additional-config's decode_backend 'latency_specialized' disagree" in err


def test_generate_defaults_to_the_tiny_checkpoint(capsys):
    from vllm.models.kimi_k3.nvidia.evals.tiny import has_checkpoint

    assert main(["generate", "--prompt", "get k1:", "--max-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert "config tiny" in out
    # the shipped weights when they exist, else random ones and a line saying so
    assert ("seeded random weights" in err) != has_checkpoint()


def test_bad_inputs_are_clear_errors(capsys):
    assert main(["generate", "--config", "nope", "--prompt", "x"]) == 2
    assert "unknown config 'nope'" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--additional-config", '{"decode_backend": "fast"}']) == 2
    assert "decode_backend" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--additional-config", "{oops"]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_a_key_given_twice_in_additional_config_is_refused_by_name(capsys):
    """json keeps the last value silently: "auto" then "latency_specialized" would turn it on."""
    rc = main(["generate", "--config", "mini", "--prompt", "x", "--max-tokens", "1", "--additional-config",
               '{"decode_backend": "auto", "decode_backend": "latency_specialized"}'])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--additional-config gives the key 'decode_backend' twice ('auto', then 'latency_specialized')" in err


def test_weights_that_are_not_safetensors_are_a_clear_error(capsys, tmp_path):
    bad = tmp_path / "w.safetensors"
    bad.write_text("hello\n")
    assert main(["generate", "--config", "mini", "--weights", str(bad), "--prompt", "x"]) == 2
    assert f"error: {bad}: not a readable safetensors file" in capsys.readouterr().err


def test_a_config_whose_weights_cannot_fit_is_refused_before_any_weight_is_drawn(capsys, monkeypatch):
    """`--config k3` on a CPU drew ~2.8T random parameters until the process ran out of memory."""
    from vllm.models.kimi_k3.nvidia.latency_specialized import cli, weights

    def never(*a, **k):
        raise AssertionError("weights drawn or loaded for a config that cannot fit")

    monkeypatch.setattr(weights, "RandomSource", never)
    monkeypatch.setattr(weights, "load_rank", never)
    monkeypatch.setattr(cli, "usable_memory", lambda device, index: (64 << 30, "this host's available memory"))
    assert main(["generate", "--config", "k3", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "error: config k3: its weights take about 5.06 TiB (2.78T parameters, loaded as bf16)" in err, err
    assert "more than this host's available memory (64 GiB)" in err and "--config tiny or --config mini" in err
    monkeypatch.setattr(cli, "usable_memory", lambda device, index: (80 << 30, "the memory of one NVIDIA H100"))
    # on GPUs each rank holds 1/tp of them
    assert "80.9 GiB on each of 64 GPUs, more than the memory of one NVIDIA H100 (80 GiB)" in \
        cli._weights_too_big(preset("k3"), "cuda", 64)
    assert cli._weights_too_big(preset("k3"), "cuda", 128) is None
    assert cli._weights_too_big(preset("mini"), "cpu", 1) is None


def test_the_memory_probe_reads_this_host():
    from vllm.models.kimi_k3.nvidia.latency_specialized.host_memory import size_words, usable_memory

    room, what = usable_memory("cpu")
    assert room > 10**8 and "host" in what
    assert [size_words(n) for n in (512, 3 << 20, 25_600 << 20, 5 << 40)] == ["512 bytes", "3 MiB", "25 GiB", "5 TiB"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bench_help_shows_the_flags_without_a_gpu(flag, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        main(["bench", flag])
    assert stop.value.code == 0
    out, err = capsys.readouterr()
    assert "--out" in out and "--quick" in out and "needs a CUDA" not in err


def test_scope_on_this_cpu_machine_says_standard_serves(capsys):
    assert main(["scope"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device present" in out and "standard path serves" in out


@pytest.mark.slow
def test_scope_into_a_closed_pipe_ends_quietly():
    """`k3-decode scope | head -3` ended in a BrokenPipeError traceback once head had its lines."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write meets a closed pipe
    try:
        r = subprocess.run([sys.executable, "-m", "vllm.models.kimi_k3.nvidia.latency_specialized", "scope"],
                           stdout=write, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, timeout=300)
    finally:
        os.close(write)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr


@pytest.mark.slow
def test_module_entry_point_runs_in_a_fresh_process():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "vllm.models.kimi_k3.nvidia.latency_specialized", "generate",
                        "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "[k3-decode]" in r.stdout


def test_scope_names_a_flag_that_exists_for_a_gpu_it_does_not_know(capsys):
    """The hint for an unknown --gpu named a compute_capability the scope command had no flag for."""
    assert main(["scope", "--gpu", "RTX4090"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU 'RTX4090'" in err and "--compute-capability 8.9" in err, err
    assert main(["scope", "--gpu", "RTX4090", "--compute-capability", "8.9"]) == 0
    out = capsys.readouterr().out
    assert "deployment (described): RTX4090 (sm_89)" in out and "OUT OF SCOPE" in out
    assert main(["scope", "--compute-capability", "9.0"]) == 2
    assert "--compute-capability describes the GPU named by --gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["scope", "--gpu", "RTX4090", "--compute-capability", "9"])
    assert "--compute-capability must look like 8.9 or 10.3, got '9'" in capsys.readouterr().err
