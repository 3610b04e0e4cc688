"""`TorchDistributed` across real processes: gloo on CPU here and in CI, NCCL on GPUs (`gpu`).

What is checked, each against an independent computation:
- the collectives equal `ThreadGroup`'s bit for bit (the in-process oracle of every TP test)
  on heavy-tailed bf16 partials where the order of the fp32 sum shows, on the world group
  (TP4) and on two TP2 subgroups of it;
- the mini model at TP2 and TP4: dense-MLP variant bit-identical to the ThreadGroup run and
  within bf16 bounds of TP1 over prefill and decode; the MoE mini identical on every rank
  with the first prompt row tracking TP1 (routing flips later rows, test_model_reference);
- the specialized executor (ReferenceOps, no graphs) at TP2 and TP4: each step equal to the
  same rank's reference and to the ThreadGroup run, bit for bit;
- the rank-agreement check catches a rank that took another path or sampled another token;
- the torchrun command line end to end, against the in-process TP2 engine.

One spawn of four gloo processes serves the CPU checks (module fixture): torch start-up
is the cost, not the mini model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset
from vllm.models.kimi_k3.nvidia.latency_specialized.distributed import (
    MULTICAST_OFF, LaunchError, TorchDistributed, check_ranks_agree, disable_nvlink_multicast, init_from_env)
from vllm.models.kimi_k3.nvidia.latency_specialized.engine import Engine, Request
from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import SamplingParams
from vllm.models.kimi_k3.nvidia.latency_specialized.tokenizer import ByteTokenizer
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import RandomSource, load_rank
from vllm.models.kimi_k3.nvidia.reference.collective import ThreadGroup
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel

from ._util import executor_rank_steps, mini_model, rel_err, run_steps

ROOT = Path(__file__).resolve().parents[5]
WORLD = 4
DENSE = {"first_k_dense_replace": 6}
SPAWN_TIMEOUT_S = 150


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 260, (n,), generator=g).tolist()


PROMPT = _tokens(12, seed=12)
STEPS = [[_tokens(1, seed=50 + s)] for s in range(5)]
MOE_PROMPT = _tokens(8, seed=13)


# ---------------------------------------------------------------- work done on every rank

def _partials(rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's partial sums: normal values scaled by 2^±24; with more than two ranks, on a
    quarter of the elements (the same on every rank) rank 0 holds +2^40 and rank 2 −2^40, so
    the fp32 sum depends on the order: rank 1's term is absorbed by 2^40 before the two
    cancel, rank 3's is added after."""
    g = torch.Generator().manual_seed(1000 * tp + rank)
    same_everywhere = torch.Generator().manual_seed(tp)

    def heavy(*shape):
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-24, 25, shape, generator=g).float())
        cancel = torch.rand(shape, generator=same_everywhere) < 0.25
        if tp > 2 and rank in (0, 2):
            x = torch.where(cancel, torch.full_like(x, 2.0**40 if rank == 0 else -2.0**40), x)
        return x

    return {"rows": heavy(5, 384).bfloat16(), "cube": heavy(2, 3, 64).bfloat16(), "fp32": heavy(4, 96)}


def _collectives(coll, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    p = {k: v.to(device) for k, v in _partials(coll.rank, coll.tp).items()}
    out = {f"sum_{k}": coll.all_reduce(v) for k, v in p.items()}
    for d in (0, 1, -1):
        out[f"cat_cube_{d}"] = coll.all_gather(p["cube"], dim=d)
    out["cat_rows"] = coll.all_gather(p["rows"], dim=-1)
    return {k: v.cpu() for k, v in out.items()}


def _dense_logits(coll) -> list[torch.Tensor]:
    m = mini_model(seed=0, tp=coll.tp, rank=coll.rank, coll=coll, **DENSE)
    return run_steps(m, [PROMPT], STEPS)[0]


def _moe_prefill(coll) -> torch.Tensor:
    m = mini_model(seed=0, tp=coll.tp, rank=coll.rank, coll=coll)
    return run_steps(m, [MOE_PROMPT], [])[0][0]


def _divergence_messages(coll) -> list[str]:
    facts = (1, 1, 13, True)
    agreed = check_ranks_agree(coll, [(facts, "standard", "decode_backend=auto")], [[7, 8]])
    caught = [agreed]
    path = "specialized" if coll.rank == 2 else "standard"
    token = 9 if coll.rank == 3 else 8
    for steps, outs in (([(facts, "standard", "x"), (facts, path, "x")], [[7, 8]]),
                        ([(facts, "standard", "x")], [[7, token]])):
        try:
            check_ranks_agree(coll, steps, outs)
            caught.append("not caught")
        except RuntimeError as e:
            caught.append(str(e))
    return caught


def _join(rank: int, world: int, port: int, backend: str) -> TorchDistributed:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # four ranks share two cores
    return init_from_env(backend)


def _cpu_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    coll4 = _join(rank, world, port, "gloo")
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    coll2 = TorchDistributed(pairs[rank // 2])
    res = {"rank_in": {4: coll4.rank, 2: coll2.rank}, "backend": coll4.backend,
           "collectives": {4: _collectives(coll4), 2: _collectives(coll2)},
           "dense": {4: _dense_logits(coll4), 2: _dense_logits(coll2)},
           "moe": {4: _moe_prefill(coll4), 2: _moe_prefill(coll2)},
           "divergence": _divergence_messages(coll4),
           "executor": {4: executor_rank_steps(coll4, 4), 2: executor_rank_steps(coll2, 2)}}
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


# ---------------------------------------------------------------- launching

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(worker, nprocs: int, out_dir: Path, *extra) -> list[dict]:
    ctx = mp.start_processes(worker, args=(nprocs, _free_port(), str(out_dir), *extra), nprocs=nprocs,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=1):  # raises with the worker's traceback if one fails
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{nprocs} ranks did not finish within {SPAWN_TIMEOUT_S} s (a collective hangs?)")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(nprocs)]


@pytest.fixture
def one_thread():
    """ThreadGroup runs with one intra-op thread, as every worker process has. The CPU oracle
    is not invariant to that count (a fp32 dot product in attn_res_mix rounds differently
    with 2 threads and 4 rank threads), which is not what these tests are about."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(_cpu_worker, WORLD, tmp_path_factory.mktemp("gloo"))


def _groups(tp):
    """Rank lists of the TP groups the workers formed: the world, or two pairs."""
    return [list(range(WORLD))] if tp == WORLD else [[0, 1], [2, 3]]


# ---------------------------------------------------------------- collectives

def test_processes_form_the_groups_they_were_given(ranks):
    assert [r["rank_in"] for r in ranks] == [{4: 0, 2: 0}, {4: 1, 2: 1}, {4: 2, 2: 0}, {4: 3, 2: 1}]
    assert all(r["backend"] == "gloo" for r in ranks)


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_are_bit_identical_to_thread_group(ranks, one_thread, tp):
    want = ThreadGroup.run(tp, _collectives)
    for group in _groups(tp):
        for gr, r in enumerate(group):
            got = ranks[r]["collectives"][tp]
            assert got.keys() == want[gr].keys()
            for k in got:
                assert got[k].dtype == want[gr][k].dtype and torch.equal(got[k], want[gr][k]), (tp, r, k)


@pytest.mark.parametrize("tp", [2, 4])
def test_all_reduce_sums_in_rank_order_in_fp32(ranks, tp):
    parts = [_partials(r, tp) for r in range(tp)]
    got = ranks[0]["collectives"][tp]
    for k in ("rows", "cube", "fp32"):
        acc = torch.zeros_like(parts[0][k], dtype=torch.float32)
        for p in parts:
            acc += p[k].float()
        assert torch.equal(got[f"sum_{k}"], acc.to(parts[0][k].dtype)), k
        if tp > 2:  # the inputs are built so that a sum in another order would be caught
            backwards = torch.zeros_like(acc)
            for p in reversed(parts):
                backwards += p[k].float()
            assert not torch.equal(got[f"sum_{k}"], backwards.to(parts[0][k].dtype)), k
    cube = [p["cube"] for p in parts]
    for d in (0, 1, -1):
        assert torch.equal(got[f"cat_cube_{d}"], torch.cat(cube, dim=d))


# ---------------------------------------------------------------- the model at TP2 / TP4

@pytest.fixture(scope="module")
def tp1_dense():
    return run_steps(mini_model(seed=0, **DENSE), [PROMPT], STEPS)[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_dense_mini_equals_thread_group_and_tracks_tp1(ranks, tp1_dense, one_thread, tp):
    first = ranks[0]["dense"][tp]
    for group in _groups(tp):
        for r in group:
            assert all(torch.equal(a, b) for a, b in zip(first, ranks[r]["dense"][tp])), (tp, r)
    threads = ThreadGroup.run(tp, _dense_logits)[0]
    assert all(torch.equal(a, b) for a, b in zip(first, threads))
    rows = [(a[i], b[i]) for a, b in zip(first, tp1_dense) for i in range(a.shape[0])]
    assert len(rows) == len(PROMPT) + len(STEPS) and first[0].shape[-1] == preset("mini").vocab_size
    errs = sorted(rel_err(a, b) for a, b in rows)
    assert errs[len(errs) // 2] < 3e-2 and errs[-1] < 8e-2, errs
    assert sum(int(a.argmax() == b.argmax()) for a, b in rows) >= len(rows) - 1


@pytest.mark.parametrize("tp", [2, 4])
def test_moe_mini_identical_on_every_rank_and_first_row_tracks_tp1(ranks, one_thread, tp):
    (tp1,), _ = run_steps(mini_model(seed=0), [MOE_PROMPT], [])
    got = [r["moe"][tp] for r in ranks]
    assert all(torch.equal(got[0], g) for g in got[1:])
    assert torch.equal(got[0], ThreadGroup.run(tp, _moe_prefill)[0])
    assert rel_err(got[0][0], tp1[0]) < 2e-2


# ---------------------------------------------------------------- rank agreement, launch errors

@pytest.mark.parametrize("tp", [2, 4])
def test_executor_over_processes_equals_the_reference_and_thread_group(ranks, one_thread, tp):
    """The specialized executor's plumbing (ReferenceOps) with its collectives over gloo processes:
    every step equals the same rank's reference bit for bit, and the logits equal the in-process
    ThreadGroup run's on every rank."""
    got = [ranks[r]["executor"][tp] for group in _groups(tp) for r in group]
    assert all(all(same) for same, _ in got), [same for same, _ in got]
    threads = ThreadGroup.run(tp, lambda coll: executor_rank_steps(coll, tp))
    assert all(torch.equal(logits, threads[0][1]) for _, logits in got)


def test_rank_agreement_check_names_the_diverging_rank(ranks):
    for r in ranks:
        agreed, path, token = r["divergence"]
        assert agreed.startswith("tp 4 over gloo: all 4 ranks took the same path on every step "
                                 "(decode steps: 1)")
        assert path.startswith("TP ranks diverged at decode step 1: rank 2 took") and "'specialized'" in path
        assert token.startswith("TP ranks diverged: rank 3 sampled [[7, 9]]")


def test_launch_errors_are_clear(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(LaunchError, match="not started by torchrun: WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                                          "MASTER_PORT unset.*torchrun --nproc-per-node"):
        init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "two")
    for k, v in (("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(k, v)
    with pytest.raises(LaunchError, match="must be integers"):
        init_from_env()
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="backend 'mpi' is not supported"):
        init_from_env("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(LaunchError, match="nccl needs CUDA"):
            init_from_env("nccl")
    with pytest.raises(RuntimeError, match="not initialized"):
        TorchDistributed()


def test_the_launch_hint_names_a_config_that_runs_at_its_tp():
    """The hint's command once used the default tiny config, whose one head does not split over 4 ranks."""
    import shlex

    from vllm.models.kimi_k3.nvidia.latency_specialized import cli, distributed

    command = distributed.LAUNCH_HINT.split("`")[1]
    words = shlex.split(command)
    nproc = int(words[words.index("--nproc-per-node") + 1])
    args = words[words.index("vllm.models.kimi_k3.nvidia.latency_specialized") + 1:]
    assert args[:1] == ["generate"] and "--config" in args, command
    tp, config = int(args[args.index("--tp") + 1]), args[args.index("--config") + 1]
    assert tp == nproc > 1
    for rank in range(tp):
        preset(config).shard(tp, rank)  # raises ConfigError for a config that does not split
    assert "--config mini" in cli.__doc__ and "tiny runs at TP 1 only" in cli.__doc__


def test_disable_nvlink_multicast_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    disable_nvlink_multicast()
    assert {k: os.environ[k] for k in MULTICAST_OFF} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ---------------------------------------------------------------- the command line

def _torchrun(nprocs: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "vllm.models.kimi_k3.nvidia.latency_specialized", "generate", "--tp", str(nprocs), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=SPAWN_TIMEOUT_S)


def _engine_texts(tp: int, prompts: list[str], max_tokens: int) -> list[str]:
    """What the CLI should print: the same engine and sampling, ranks as ThreadGroup threads."""
    cfg, tok = preset("mini"), ByteTokenizer()
    params = SamplingParams(seed=0, max_tokens=max_tokens, stop_token_ids=(tok.EOS,))
    reqs = [Request(tok.encode(p), params) for p in prompts]

    def rank(coll):
        w = load_rank(RandomSource(cfg, seed=0), cfg, tp, coll.rank)
        eng = Engine(ReferenceModel(cfg, w, coll=coll), max_requests=len(reqs), max_len=64)
        return [f"{p!r} -> {tok.decode(c.output_ids)!r}" for p, c in zip(prompts, eng.generate(reqs))]

    return ThreadGroup.run(tp, rank)[0]


@pytest.mark.slow
def test_torchrun_generate_at_tp2_prints_once_and_matches_the_in_process_run(one_thread):
    prompts = ["hi", "K3 at TP2"]
    r = _torchrun(2, "--config", "mini", "--prompt", prompts[0], "--prompt", prompts[1], "--max-tokens", "5")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert [x for x in lines if " -> " in x] == _engine_texts(2, prompts, 5)  # rank 0 alone prints
    summary = [x for x in lines if x.startswith("[k3-decode]")]
    assert len(summary) == 1, r.stdout
    assert "tp 2 over gloo: all 2 ranks took the same path on every step (decode steps: 4)" in summary[0]
    assert "served by: standard 5" in summary[0]


def test_tp_above_one_without_torchrun_is_a_clear_error(monkeypatch, capsys):
    from vllm.models.kimi_k3.nvidia.latency_specialized.cli import main

    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert main(["generate", "--tp", "2", "--prompt", "x"]) == 2
    assert "not started by torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--tp", "0", "--prompt", "x"])
    assert "--tp must be >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------- GPUs (NCCL), one process per GPU

MINI8 = {"num_attention_heads": 8, "kda_num_heads": 8, "kda_head_dim": 16, **DENSE}  # shards up to TP8


def _gpu_tps() -> list[int]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [tp for tp in (2, 4, 8) if tp <= n] or [2]


def _gpu_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    coll = _join(rank, world, port, "nccl")
    device = torch.device("cuda", rank)
    res = {"env": {k: os.environ.get(k) for k in MULTICAST_OFF}, "collectives": _collectives(coll, device)}
    cfg = preset("mini").replace(**MINI8)
    w = load_rank(RandomSource(cfg, seed=0), cfg, world, rank, device=device)
    logits = run_steps(ReferenceModel(cfg, w, coll=coll), [PROMPT], STEPS)[0]
    res["dense"] = [x.cpu() for x in logits]
    if rank == 0:  # TP1 on the same kind of GPU, same kernels
        w1 = load_rank(RandomSource(cfg, seed=0), cfg, device=device)
        res["tp1"] = [x.cpu() for x in run_steps(ReferenceModel(cfg, w1), [PROMPT], STEPS)[0]]
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("tp", _gpu_tps())
def test_nccl_collectives_and_model_at_tp(tmp_path, tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP{tp} over NCCL needs {tp} GPUs, this machine has {torch.cuda.device_count()}")
    got = _spawn(_gpu_worker, tp, tmp_path)
    want = ThreadGroup.run(tp, _collectives)  # on CPU: fp32 adds round the same on both
    for r in range(tp):
        assert got[r]["env"] == MULTICAST_OFF
        for k, v in got[r]["collectives"].items():
            assert torch.equal(v, want[r][k]), (r, k)
        assert all(torch.equal(a, b) for a, b in zip(got[0]["dense"], got[r]["dense"])), r
    rows = [(a[i], b[i]) for a, b in zip(got[0]["dense"], got[0]["tp1"]) for i in range(a.shape[0])]
    errs = sorted(rel_err(a, b) for a, b in rows)
    assert errs[len(errs) // 2] < 3e-2 and errs[-1] < 8e-2, errs


@pytest.mark.gpu
@pytest.mark.slow
def test_torchrun_generate_on_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"TP2 over NCCL needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    r = _torchrun(2, "--config", "mini", "--prompt", "hi", "--max-tokens", "5", "--device", "cuda")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tp 2 over nccl: all 2 ranks took the same path on every step (decode steps: 4)" in r.stdout
