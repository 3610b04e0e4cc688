"""The long-context evals: task generators, scores, the harness on both paths, the training
model against the reference, training steps, the checkpoint round trip, and the lm-eval
adapter (skipped without lm-eval)."""

import argparse
import io
import json
import math
import re
from pathlib import Path

import pytest
import torch

from vllm.models.kimi_k3.nvidia.evals import harness, tasks, train_tiny
from vllm.models.kimi_k3.nvidia.evals.tiny import TINY, TINY_DIR, config_named, has_checkpoint
from vllm.models.kimi_k3.nvidia.evals.train_model import TrainModel, chunked_delta_rule
from vllm.models.kimi_k3.nvidia.evals.train_tiny import (Batches, DictSource, GraphedStep, TrainConfig, batch,
                                                          optimizer, save, sequence, set_lr, train_step,
                                                         weighted_loss)
from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment
from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import NOT_BUILT_REASON
from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import SamplingParams
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import (RandomSource, SafetensorsSource,
                                                                     expected_shapes, load_rank)
from vllm.models.kimi_k3.nvidia.reference.collective import SingleRank
from vllm.models.kimi_k3.nvidia.reference.kda import gated_delta_rule_recurrent, kda_attention
from vllm.models.kimi_k3.nvidia.reference.mla import mla_attention
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel
from vllm.models.kimi_k3.nvidia.reference.moe import moe

from ._util import mini_model, rel_err

H200 = Deployment.describe(gpu="H200", tp=1, max_model_len=4096, expert_dtype="bfloat16")
MAX_CHECKPOINT_BYTES = 4_000_000


# ---------------------------------------------------------------------- the tiny config


def test_tiny_config_keeps_k3_geometry_and_fits_4mb():
    c = TINY
    assert (c.kda_head_dim, c.short_conv_kernel_size, c.gate_lower_bound) == (128, 4, -5.0)
    assert (c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (512, 128, 64, 128)
    assert c.mla_use_nope and c.mla_use_output_gate and c.latent_moe_use_norm
    assert (c.hidden_act, c.activation_situ_beta, c.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    assert c.moe_router_activation_func == "sigmoid" and c.num_experts > c.num_experts_per_token > 1
    assert c.vocab_size % 64 == 0 and c.vocab_size >= 260
    # the block-write layers are KDA and the MLA layers recur every 4th layer, as in K3
    assert all(c.layer_kind(i) == "kda" for i in range(0, c.num_hidden_layers, c.attn_res_block_size))
    assert c.mla_layers == [3, 7] and c.num_attn_res_blocks == 2
    stored = sum(math.prod(shape) * (2 if dt == torch.bfloat16 else 4) for shape, dt in expected_shapes(c).values())
    assert stored <= MAX_CHECKPOINT_BYTES - 100_000  # room for the safetensors header


# ---------------------------------------------------------------------- task generators


@pytest.mark.parametrize("task", list(tasks.TASKS))
@pytest.mark.parametrize("length", [300, 1024, 4096])
def test_generators_are_deterministic_and_exactly_the_requested_length(task, length):
    a, b = tasks.make(task, length, 7), tasks.make(task, length, 7)
    assert a == b and a.prompt_ids == b.prompt_ids
    assert len(a.prompt_ids) == length and a.prompt_ids[0] == tasks.TOK.BOS
    assert a.answer_ids == list(a.answer.encode()) + [tasks.TOK.EOS] and "\n" not in a.answer
    assert tasks.make(task, length, 8).prompt != a.prompt


def test_mrcr_answer_is_the_nth_earlier_answer_to_that_ask():
    for seed in range(5):
        s = tasks.make("mrcr", 4096, seed)
        kind, nth, topic = re.search(r"User: repeat (\w+) (\d+)\w\w about (\w+)\nBot: $", s.prompt).groups()
        earlier = re.findall(rf"User: write a {kind} about {topic}\nBot: ([^\n]*)\n", s.prompt)
        assert len(earlier) >= int(nth) and s.answer == earlier[int(nth) - 1]


def test_kv_needles_sit_at_the_requested_depths_and_answer_from_context():
    s = tasks.kv(4096, 3, needles=3, depths=(0.0, 0.5, 1.0))
    keys = re.search(r"get ([a-z0-9 ]+):$", s.prompt).group(1).split()
    facts = re.findall(r"^([a-z0-9]{6})=(\d{5})$", s.prompt, flags=re.M)
    table = dict(facts)
    order = [k for k, _ in facts]
    assert s.answer.split() == [table[k] for k in keys]
    for k, want in zip(keys, (0.0, 0.5, 1.0)):
        assert abs(order.index(k) / (len(order) - 1) - want) < 0.02


def test_arith_answer_is_the_sum_written_lsd_first_with_a_carry():
    for seed in range(5):
        s = tasks.make("arith", 1024, seed, digits=6)
        a, b = re.search(r"\n(\d+)\+(\d+)=$", s.prompt).groups()
        x, y = int(a[::-1]), int(b[::-1])
        assert s.answer == f"{x + y:07d}"[::-1]
        assert any(int(p) + int(q) >= 10 for p, q in zip(a, b))  # a carry happens
    # one-digit pairs carry about half the time, so here the rule, not luck, puts a carry in each
    for seed in range(40):
        a, b = re.search(r"\n(\d+)\+(\d+)=$", tasks.make("arith", 1024, seed, digits=1).prompt).groups()
        assert int(a) + int(b) >= 10, (seed, a, b)
    assert tasks._has_carry(15, 5) and tasks._has_carry(91, 10) and not tasks._has_carry(12, 34)


def test_practice_spans_mark_answers_found_in_the_context():
    s = tasks.kv(2048, 1, practice=0.3)  # two needles: practice asks two keys, as the final query does
    table = dict(re.findall(r"^([a-z0-9]{6})=(\d{5})$", s.prompt, flags=re.M))
    asked = re.findall(r"^get ([a-z0-9]{6}) ([a-z0-9]{6}):(\d{5}) (\d{5})$", s.prompt, flags=re.M)
    spans = [bytes(s.prompt_ids[a:b]).decode() for a, b in s.supervised]
    assert asked and len(spans) == len(asked)
    assert all(table[k1] == v1 and table[k2] == v2 and k1 != k2 and span == f"{v1} {v2}\n"
               for (k1, k2, v1, v2), span in zip(asked, spans))
    assert tasks.kv(2048, 1).prompt.count("get ") == 1  # evals: the final query alone
    m = tasks.mrcr(2048, 1, practice=0.3)
    assert m.supervised and all(m.prompt_ids[b - 1] == ord("\n") for _, b in m.supervised)


def test_bad_requests_name_the_problem():
    with pytest.raises(ValueError, match="too short"):
        tasks.make("kv", 10, 0)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.make("sudoku", 1024, 0)
    with pytest.raises(ValueError, match="depths"):
        tasks.kv(1024, 0, needles=2, depths=(0.5,))


def test_scores_on_planted_answers():
    s = tasks.make("mrcr", 1024, 2)
    assert tasks.score(s, s.answer) == tasks.Score(True, 1.0)
    assert tasks.score(s, s.answer + "\nUser: more") == tasks.Score(True, 1.0)
    assert tasks.similarity("abcd", "abxd") == pytest.approx(0.75)  # 2·3 matches / 8 characters
    assert tasks.similarity("", "abc") == 0.0
    half = s.answer[: len(s.answer) // 2]
    got = tasks.score(s, half)
    assert not got.exact and got.similarity == pytest.approx(2 * len(half) / (len(half) + len(s.answer)))
    assert tasks.primary_value(s, got) == got.similarity
    k = tasks.make("kv", 1024, 2)
    assert tasks.primary_value(k, tasks.score(k, k.answer[:-1])) == 0.0
    # exact means the whole first line: the answer inside a longer line is wrong
    assert not tasks.score(k, k.answer + " 00000").exact and not tasks.score(k, "1" + k.answer).exact
    assert tasks.score(k, k.answer + "\nget more").exact


# ---------------------------------------------------------------------- the harness


@pytest.fixture(scope="module")
def model():
    return mini_model(seed=0)


def _spec(**kw):
    base = dict(tasks=("mrcr", "kv", "arith"), lengths=(160,), samples=2, batch=2, logit_samples=1, slack=1)
    base.update(kw)
    return harness.EvalSpec(**base)


def test_harness_runs_both_paths_and_writes_a_wellformed_record(model, tmp_path):
    paths = harness.Paths(model, H200)
    out = tmp_path / "eval.json"
    rec = harness.evaluate(paths, _spec(), out=out, command="pytest", weights="random seed 0",
                           parity_runs=2, progress=False)
    disk = json.loads(out.read_text())
    assert disk["kind"] == "eval" and disk["family"] == "evals" and disk["source_hash"] == rec["source_hash"]
    assert any(s.endswith("evals/harness.py") for s in disk["sources"])
    names = {r["name"] for r in disk["results"]}
    for t in ("mrcr", "kv", "arith"):
        assert {f"{t}@160/standard", f"{t}@160/specialized", f"{t}@160/parity"} <= names
    assert all(r["status"] in ("pass", "fail") for r in disk["results"])
    # both paths ran the reference (no executor): identical outputs, so every comparison holds,
    # and the gate that the specialized path served its steps fails: nothing was compared
    served = [t for t in disk["targets"] if "served by the specialized path" in t["name"]]
    assert len(served) == 3 and not any(t["met"] for t in served) and len(disk["targets"]) == 3 * 4 + 2
    assert all(t["met"] for t in disk["targets"] if t not in served)
    par = [r for r in disk["results"] if r["name"].endswith("/parity")]
    assert all(r["greedy_agreement"] == 1.0 and r["logit_max_abs"] == 0.0 and r["forced_steps"] > 0
               and r["specialized_steps"] == 0 and r["status"] == "fail" for r in par)
    # the record says honestly what served the specialized side
    assert disk["paths_served"]["specialized"].get("specialized", 0) == 0
    spec_counts = disk["dispatch"]["specialized"]
    assert spec_counts["fallbacks"] == {NOT_BUILT_REASON: spec_counts["admitted_on_standard"]} and "note" in disk
    assert "| mrcr | 160 |" in harness.table(disk)


class _Admit:
    """An executor stub that admits every step, so the specialized decode function serves it."""

    def plan(self, step):
        return step


def _skewed(model, scale):
    """A 'specialized' path whose logits differ from the standard ones by a fixed skew."""
    skew = torch.linspace(0, scale, model.cfg.vocab_size)

    def decode(ids, segs, state):
        return model.logits(model.forward(ids, segs, state)) + skew

    return decode


def test_harness_gates_catch_a_diverging_specialized_path(model):
    paths = harness.Paths(model, H200, specialized=_skewed(model, 40.0), executor=_Admit())
    results, targets = harness.run_tasks(paths, _spec(tasks=("kv",)))
    par = next(r for r in results if r["name"] == "kv@160/parity")
    assert par["greedy_agreement"] < 0.99 and par["status"] == "fail" and par["specialized_steps"] > 0
    assert par["logit_max_abs"] == pytest.approx(40.0, rel=1e-3) and par["kl_max"] > 0.1
    assert not next(t for t in targets if "greedy" in t["name"])["met"]


def test_the_kl_gate_catches_a_skew_that_keeps_every_argmax(model):
    """Logits times 3 pick the same greedy tokens (agreement 1.0, accuracy equal) but sharpen every
    distribution: only the KL gate fails it."""
    def sharpened(ids, segs, state):
        return model.logits(model.forward(ids, segs, state)) * 3.0

    paths = harness.Paths(model, H200, specialized=sharpened, executor=_Admit())
    results, targets = harness.run_tasks(paths, _spec(tasks=("kv",)))
    par = next(r for r in results if r["name"] == "kv@160/parity")
    assert par["greedy_agreement"] == 1.0 and par["kl_max"] > harness.KL_BOUND and par["status"] == "fail"
    assert [t["met"] for t in targets] == [True, True, True, False]  # served, accuracy, greedy, KL
    assert paths.served["specialized"]["specialized"] > 0


class _AdmittingDecode(_Admit):
    """A yardstick stand-in: admits every step and decodes with `decode`."""

    def __init__(self, decode):
        self.decode = decode

    def __call__(self, ids, segs, state):
        return self.decode(ids, segs, state)


def test_agreement_floor_by_hand():
    # the yardstick's rates (1, 0, 1, 0): sample variance 1/3, SE of their mean sqrt(1/3 / 4)
    assert harness.agreement_floor(0.5, [1.0, 0.0, 1.0, 0.0]) == pytest.approx(0.5 - 2 * math.sqrt(1 / 3) / 2)
    assert harness.agreement_floor(1.0, [1.0] * 4) == 1.0
    # too few yardstick samples to say how far it scatters: the plain bar
    assert harness.agreement_floor(0.5, [1.0, 0.0]) == harness.GREEDY_AGREEMENT
    rate, rates, total = harness.agreement([[1, 2, 3], [4]], [[1, 2, 0], [4, 5]])
    assert (rate, rates, total) == (pytest.approx(3 / 5), [pytest.approx(2 / 3), 0.5], 5)


def test_greedy_agreement_is_judged_against_the_yardstick(model):
    """A path that forks as often as the yardstick passes although its agreement is below 0.99;
    a diverging one still fails next to an exact yardstick."""
    skew = _skewed(model, 40.0)
    paths = harness.Paths(model, H200, specialized=skew, executor=_Admit())
    paths.use_yardstick(_AdmittingDecode(skew))
    results, targets = harness.run_tasks(paths, _spec(tasks=("kv",), samples=harness.MIN_YARDSTICK_SAMPLES))
    par = next(r for r in results if r["name"] == "kv@160/parity")
    assert par["greedy_agreement"] < 0.99 and par["yardstick_agreement"] == par["greedy_agreement"]
    # the agreement gate passes next to the yardstick (the skew's KL fails its own gate)
    assert par["agreement_floor"] <= par["greedy_agreement"] and par["agreement_floor"] < 0.99
    assert next(t for t in targets if "greedy" in t["name"])["met"]
    assert paths.served[harness.YARDSTICK]["specialized"] > 0

    exact = _AdmittingDecode(lambda ids, segs, state: model.logits(model.forward(ids, segs, state)))
    paths = harness.Paths(model, H200, specialized=skew, executor=_Admit())
    paths.use_yardstick(exact)
    results, targets = harness.run_tasks(paths, _spec(tasks=("kv",)))
    par = next(r for r in results if r["name"] == "kv@160/parity")
    assert par["yardstick_agreement"] == 1.0 and par["agreement_floor"] == 0.99 and par["status"] == "fail"
    assert not next(t for t in targets if "greedy" in t["name"])["met"]
    assert "yardstick's" in harness.table({"results": results})


def test_total_variation_by_hand():
    p = SamplingParams(temperature=1.0)
    a = torch.tensor([[0.0, 0.0]])
    b = torch.tensor([[math.log(3.0), 0.0]])  # softmax (3/4, 1/4) against (1/2, 1/2)
    assert float(harness.total_variation(a, b, p)[0]) == pytest.approx(0.25)
    top1 = SamplingParams(temperature=1.0, top_k=1)
    assert float(harness.total_variation(a + torch.tensor([[1.0, 0.0]]), b[:, [1, 0]] + 5, top1)[0]) == 1.0


def test_sampling_parity_measures_total_variation(model):
    prompts = [tasks.make("kv", 100, s).prompt_ids for s in range(2)]
    params = harness.default_sampling_params(2, max_tokens=4)
    same, same_t = harness.sampling_parity(harness.Paths(model, H200), prompts, params)
    assert same["tv_max"] == 0.0 and same["identical_runs"] == 1.0 and all(t["met"] for t in same_t)
    skewed = harness.Paths(model, H200, specialized=_skewed(model, 3.0), executor=_Admit())
    diff, diff_t = harness.sampling_parity(skewed, prompts, params)
    assert diff["tv_max"] > harness.TV_BOUND and not diff_t[0]["met"] and diff["status"] == "fail"


def test_progress_bar_writes_to_its_stream():
    buf = io.StringIO()
    bar = harness.Progress(4, "kv 1024", stream=buf, enabled=True, width=8)
    bar.advance(2)
    bar.close()
    assert "kv 1024 [####....] 2/4" in buf.getvalue() and buf.getvalue().endswith("\n")
    quiet = io.StringIO()
    harness.Progress(4, stream=quiet).advance(1)  # not a terminal: silent by default
    assert quiet.getvalue() == ""


def test_eval_cli_runs_and_explains_a_missing_checkpoint(tmp_path, capsys):
    from vllm.models.kimi_k3.nvidia.evals import cli

    out = tmp_path / "e.json"
    code = cli.main(["eval", "--config", "mini", "--random-weights", "0", "--tasks", "arith", "--lengths", "100",
                     "--samples", "1", "--logit-samples", "1", "--parity-runs", "0", "--out", str(out)])
    assert code == 0 and json.loads(out.read_text())["kind"] == "eval"
    assert "| arith | 100 |" in capsys.readouterr().out
    # on a CPU the specialized side runs the reference ops: no yardstick unless asked for
    assert not json.loads(out.read_text())["yardstick"]
    code = cli.main(["eval", "--config", "mini", "--random-weights", "0", "--tasks", "arith", "--lengths", "100",
                     "--samples", "1", "--logit-samples", "1", "--parity-runs", "0", "--yardstick", "--out", str(out)])
    rec = json.loads(out.read_text())
    assert code in (0, 1) and rec["yardstick"] and rec["paths_served"]["yardstick"]["specialized"] > 0
    assert "yardstick_agreement" in next(r for r in rec["results"] if r["name"] == "arith@100/parity")
    capsys.readouterr()
    assert cli.main(["eval", "--config", "mini"]) == 2
    assert "--random-weights" in capsys.readouterr().err
    assert cli.main(["eval", "--config", "mini", "--random-weights", "0", "--lengths", "5"]) == 2
    assert "too short" in capsys.readouterr().err


_WIRING = ["eval", "--config", "mini", "--random-weights", "0", "--tasks", "arith", "--lengths", "100",
           "--samples", "1", "--parity-runs", "0"]


def _both_entry_points():
    """`python -m vllm.models.kimi_k3.nvidia.evals.cli` and `k3-decode`, as their `main`s."""
    from vllm.models.kimi_k3.nvidia.evals import cli
    from vllm.models.kimi_k3.nvidia.latency_specialized import cli as k3_decode

    return cli.main, k3_decode.main


def _nothing_loads(monkeypatch):
    """Refusals come at argument time: building a prompt or loading weights fails the test."""
    from vllm.models.kimi_k3.nvidia.latency_specialized import weights

    def loaded(*a, **k):
        raise AssertionError("the eval went on to build prompts or load weights")

    monkeypatch.setattr(tasks, "make", loaded)
    monkeypatch.setattr(weights, "load_rank", loaded)


@pytest.mark.parametrize("flag, value, words", [
    ("--logit-samples", "0", "compares no step"),  # 0 would report an unmeasured KL of 0 as met
    ("--logit-samples", "-1", "compares no step"),
    ("--parity-runs", "-1", "0 skips"),
    ("--samples", "0", "at least 1"),
    ("--batch", "0", "at least 1"),
    ("--lengths", "0", "at least 1"),
])
def test_eval_cli_refuses_counts_it_cannot_run_naming_the_flag(flag, value, words, monkeypatch, capsys):
    _nothing_loads(monkeypatch)
    for main in _both_entry_points():
        with pytest.raises(SystemExit) as e:
            main(_WIRING + [flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"argument {flag}: " in err and words in err, err
        assert f"found {value}" in err or f"found '{value}'" in err, err


def test_eval_cli_refuses_weights_beside_random_weights(monkeypatch, capsys):
    _nothing_loads(monkeypatch)
    for main in _both_entry_points():
        assert main(_WIRING + ["--weights", str(TINY_DIR)]) == 2
        err = capsys.readouterr().err
        assert "--weights" in err and "--random-weights" in err and "would ignore the checkpoint" in err, err


def test_eval_cli_reports_a_mismatched_checkpoint_without_a_traceback(capsys):
    """The tiny checkpoint under the mini config: one error line and exit 2 from both entry points."""
    for main in _both_entry_points():
        assert main(["eval", "--config", "mini", "--weights", str(TINY_DIR), "--tasks", "arith",
                     "--lengths", "100"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: tensor ") and "embed_tokens" in err and "Traceback" not in err, err


def test_eval_cli_refuses_a_length_that_cannot_fit_before_building_prompts(monkeypatch, capsys):
    from vllm.models.kimi_k3.nvidia.evals import cli

    _nothing_loads(monkeypatch)
    for main in _both_entry_points():  # the reviewer's command: 32 GB for one MLA layer's cache alone
        assert main(["eval", "--config", "mini", "--random-weights", "0", "--tasks", "kv",
                     "--lengths", "99999999", "--samples", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --lengths 99999999 with --batch 4 needs at least ") and "Pass shorter" in err
        assert "2 states of 4 requests x 100000255 tokens" in err, err
    # the bound is this machine's memory: a length whose footprint it holds passes the check
    monkeypatch.setattr(cli, "usable_memory", lambda device: (1 << 30, "a 1 GiB stand-in"))
    need = cli.footprint(config_named("mini"), 2000, 2256, 4, 2)["total"]
    assert need < 1 << 30 and cli.footprint(config_named("mini"), 8000, 8256, 4, 2)["total"] > 1 << 30
    args = cli.add_parser(argparse.ArgumentParser().add_subparsers()).parse_args(
        ["--config", "mini", "--random-weights", "0", "--lengths", "2000"])
    assert cli._memory_refusal(args, config_named("mini")) is None
    args.lengths = (8000,)
    assert "a 1 GiB stand-in (1 GiB)" in cli._memory_refusal(args, config_named("mini"))


@pytest.mark.parametrize("name", ["mini", "tiny"])
def test_the_eval_footprint_counts_the_decode_states_bytes(name):
    """`state_bytes` against a DecodeState of the same shape built on the meta device (no memory)."""
    from vllm.models.kimi_k3.nvidia.evals import cli
    from vllm.models.kimi_k3.nvidia.reference.state import DecodeState

    cfg = config_named(name)
    for requests, max_len in ((1, 100), (4, 1280), (3, 4097)):
        st = DecodeState(cfg, cfg.shard(1, 0), max_requests=requests, max_len=max_len, device="meta")
        pools = [t for layer in st.kda.values() for t in (layer.rec, layer.conv)]
        pools += [layer.cache for layer in st.mla.values()]
        assert cli.state_bytes(cfg, requests, max_len) == sum(t.numel() * t.element_size() for t in pools)
    # the naive prefill's scores: three fp64 copies on a CPU (fp32 on CUDA) and a bool mask
    heads = cfg.shard(1, 0).mla_heads
    assert cli.footprint(cfg, 1000, 1256, 4, 3)["scores"] == heads * 1000 * 1000 * (3 * 8 + 1)
    assert cli.footprint(cfg, 1000, 1256, 4, 3, "cuda")["scores"] == heads * 1000 * 1000 * (3 * 4 + 1)


def test_eval_cli_warns_when_no_logit_step_was_forced(monkeypatch, capsys):
    """A sample whose standard output is one token forces no decode step; its KL of 0 measured
    nothing, and the run says so."""
    from vllm.models.kimi_k3.nvidia.evals import cli

    real = harness.evaluate

    def one_token_outputs(*a, **k):
        record = real(*a, **k)
        for r in record["results"]:
            if r["name"].endswith("/parity"):
                r["forced_steps"] = 0
        return record

    monkeypatch.setattr(harness, "evaluate", one_token_outputs)
    assert cli.main(_WIRING) in (0, 1)
    assert "warning: arith@100: no decode step was teacher-forced" in capsys.readouterr().err


def test_the_shipped_tiny_checkpoint_retrieves_keys_from_a_long_context(tmp_path):
    """The committed checkpoint, loaded like the real one, on both paths at 1K (CPU): the kv task
    (two values asked by key from ~170 key=value lines) well above chance (0: five random digits
    each), the specialized side served by the executor; every task's 1K and 4K figures are in
    evidence/cpu/eval_tiny.json."""
    from vllm.models.kimi_k3.nvidia.evals import cli

    assert has_checkpoint(), f"the tiny checkpoint is missing from {TINY_DIR}"
    out = tmp_path / "e.json"
    assert cli.main(["eval", "--tasks", "kv", "--lengths", "1024", "--samples", "4", "--logit-samples", "1",
                     "--parity-runs", "0", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    accuracy = {r["path"]: r["accuracy"] for r in record["results"] if "accuracy" in r}
    assert accuracy["standard"] >= 0.75 and accuracy["specialized"] == accuracy["standard"], accuracy
    assert all(t["met"] for t in record["targets"]), record["targets"]
    # on a CPU the executor serves the specialized side's decode steps with the reference ops
    assert record["specialized_built"] and record["paths_served"]["specialized"].get("specialized", 0) > 0
    assert "reference ops" in record["note"]


# ---------------------------------------------------------------------- the training model


def _delta_rule_case(seed: int, b: int, h: int, t: int, d: int, log_alpha: torch.Tensor | None, chunk: int):
    """chunked_delta_rule on random unit-norm q, k (q scaled d^-1/2), random v and β, and the
    token-by-token recurrence on the same inputs: (got, want), each [b, h, t, d]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, h, t, d, generator=g), dim=-1) * d ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, h, t, d, generator=g), dim=-1)
    v = torch.randn(b, h, t, d, generator=g)
    if log_alpha is None:
        log_alpha = -5.0 * torch.rand(b, h, t, d, generator=g)
    beta = torch.rand(b, h, t, generator=g)
    got = chunked_delta_rule(q, k, v, log_alpha, beta, chunk=chunk)
    want = torch.stack([gated_delta_rule_recurrent(*(x[i].transpose(0, 1).contiguous() for x in (q, k, v, log_alpha)),
                                                   beta[i].transpose(0, 1).contiguous(), torch.zeros(h, d, d))[0]
                        .transpose(0, 1) for i in range(b)])
    return got, want


def test_chunked_delta_rule_matches_the_token_recurrence():
    got, want = _delta_rule_case(3, 2, 2, 23, 16, None, chunk=5)  # uneven last chunk
    assert all(rel_err(a, w) < 1e-5 for a, w in zip(got, want))


def test_chunked_delta_rule_is_finite_at_the_strongest_decay_k3_allows():
    # every gate at K3's bound (log α = −5) over 32-token chunks: e^{±80} factors, masked overflow
    log_alpha = torch.full((1, 2, 70, 16), -5.0)
    log_alpha[..., ::7, :] = -1e-3  # and some slow channels, so the state keeps history
    got, want = _delta_rule_case(4, 1, 2, 70, 16, log_alpha, chunk=32)
    assert torch.isfinite(got).all()
    assert rel_err(got[0], want[0]) < 1e-5


def test_training_model_refuses_chunks_its_gate_bound_cannot_keep_finite():
    with pytest.raises(ValueError, match="kda_chunk 64 with gate_lower_bound -5.0"):
        TrainModel.from_source(TINY, RandomSource(TINY, seed=0), kda_chunk=64)
    with pytest.raises(ValueError, match="bounded gate"):
        TrainModel.from_source(TINY.replace(gate_lower_bound=None), RandomSource(TINY, seed=0))


@pytest.fixture(scope="module")
def tiny_pair():
    src = RandomSource(TINY, seed=5)
    ref = ReferenceModel(TINY, load_rank(src, TINY))
    return ref, TrainModel.from_source(TINY, src, kda_chunk=16).double()


def test_training_layers_equal_the_reference_layers(tiny_pair):
    """Each sub-layer on the same bf16 input: the same roundings, fp64 vs fp64 accumulation (KDA's
    recurrence fp32 in both), so the outputs agree to a few bf16 ulps on a handful of elements."""
    ref, tm = tiny_pair
    t = 40
    u = torch.randn(1, t, TINY.hidden_size, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    st = ref.new_state(max_requests=1, max_len=t)
    seg = [st.segment(st.allocate(), 0, t, True)]
    p = "language_model.model.layers."
    with torch.no_grad():
        pairs = [(tm._kda(p + "0.self_attn.", u.double()),
                  kda_attention(ref.w.layers[0].attn, TINY, ref.shard, u[0], seg, st.kda[0], SingleRank())),
                 (tm._mla(p + "3.self_attn.", u.double()),
                  mla_attention(ref.w.layers[3].attn, TINY, ref.shard, u[0], seg, st.mla[3], SingleRank())),
                 (tm._moe(p + "1.block_sparse_moe.", u.double()),
                  moe(ref.w.layers[1].mlp, TINY, ref.shard, u[0], SingleRank()))]
    for got, want in pairs:
        assert rel_err(got[0], want) < 1e-4


def test_training_logits_equal_reference_prefill_logits(tiny_pair):
    """Whole model, two 40-token prefills. Both compute the same roundings, but one bf16 rounding
    that lands on the other side (fp64 sums in a different order, the chunked KDA's fp32
    arithmetic) is amplified by the random weights, and may flip a near-tied top-2 route,
    moving the rows after it by up to O(1) (seen: 0.16 with dense MLPs only, 0.9 with MoE).
    So the whole-model check is statistical, as the reference's own stock-form checks are:
    the median row within 5e-3 (typically 0: bit-equal) and the argmax on >= 95 % of rows.
    The per-layer test above holds every sub-layer to 1e-4."""
    ref, tm = tiny_pair
    t = 40
    ids = torch.randint(0, 260, (2, t), generator=torch.Generator().manual_seed(1))
    st = ref.new_state(max_requests=2, max_len=t)
    segs = [st.segment(st.allocate(), 0, t, True), st.segment(st.allocate(), t, t, True)]
    want = ref.logits(ref.forward(ids.reshape(-1), segs, st)).view(2, t, -1)
    with torch.no_grad():
        got = tm(ids)
    rows = sorted(rel_err(a, b) for a, b in zip(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])))
    assert rows[len(rows) // 2] <= 5e-3, rows
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.95


def test_three_steps_reduce_the_loss_and_gradients_reach_the_chosen_experts():
    torch.manual_seed(0)
    model = TrainModel.from_source(TINY, RandomSource(TINY, seed=1), kda_chunk=16)
    seqs = [sequence(tasks.make(t, 96, 0), 0.1) for t in ("kv", "arith")]
    ids = torch.tensor([s[0][:96] for s in seqs])
    targets = torch.cat([ids[:, 1:], ids[:, :1]], 1)
    weights = torch.tensor([s[1][:96] for s in seqs])
    opt = optimizer(model, TrainConfig(lr=3e-3))
    losses = []
    for step in range(3):
        loss = weighted_loss(model(ids), targets, weights)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            b = "language_model.model.layers.1.block_sparse_moe."
            router_grad = model.get_parameter(b + "gate.weight").grad
            assert router_grad is not None and router_grad.abs().sum() > 0  # through the routing weights
            grads = [model.get_parameter(f"{b}experts.{e}.w1.weight").grad for e in range(TINY.num_experts)]
            assert any(g is not None and g.abs().sum() > 0 for g in grads)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0], losses


def test_batches_from_worker_processes_equal_the_inline_batches():
    tc = TrainConfig(steps=5, workers=2, tokens_per_step=2048, max_length=1024)
    ahead = Batches(tc, "cpu")
    try:
        got = list(ahead)
    finally:
        ahead.close()
    assert [g[3] for g in got] == [512, 512, 512, 1024, 1024]  # the stage shares: 0.35 / 0.3 of 5 steps
    for step, g in enumerate(got):
        want = batch(step, tc, "cpu")
        assert all(torch.equal(a, b) for a, b in zip(g[:3], want[:3])), step


@pytest.mark.gpu
def test_graphed_training_steps_equal_eager_steps():
    # three steps across a shape change (a second capture): same losses and weights as eager
    tc = TrainConfig(steps=3, tokens_per_step=1024, max_length=1024)
    data = [batch(s, tc, "cuda") for s in (0, 0, 2)]
    runs = []
    for graphed in (False, True):
        torch.manual_seed(0)
        model = TrainModel.from_source(TINY, RandomSource(TINY, seed=1)).cuda()
        opt = optimizer(model, tc, capturable=graphed)
        step = GraphedStep(model, opt, tc.clip) if graphed else (
            lambda i, t, w: train_step(model, opt, i, t, w, tc.clip))
        losses = []
        for k, (ids, targets, weights, _) in enumerate(data):
            set_lr(opt, 1e-3 * (k + 1))
            losses.append(float(step(ids, targets, weights)[0]))
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l_eager, p_eager), (l_graph, p_graph) = runs
    assert data[0][0].shape != data[2][0].shape
    assert l_graph == pytest.approx(l_eager, rel=1e-4), (l_graph, l_eager)
    assert max(rel_err(a, b) for a, b in zip(p_graph, p_eager)) < 1e-3


def test_saved_checkpoint_loads_with_load_rank_and_round_trips(tmp_path):
    model = TrainModel.from_source(TINY, RandomSource(TINY, seed=2))
    with torch.no_grad():  # trained-looking weights: not what RandomSource(seed=2) would give
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    folder = save(model, tmp_path / "tiny")
    assert (folder / "model.safetensors").stat().st_size <= MAX_CHECKPOINT_BYTES
    disk = SafetensorsSource(folder)
    saved = model.checkpoint_tensors()
    for name, (shape, dtype) in expected_shapes(TINY).items():
        t = disk.get(name)
        assert t.dtype == dtype and tuple(t.shape) == shape and torch.equal(t, saved[name]), name
    loaded, direct = load_rank(disk, TINY), load_rank(DictSource(saved), TINY)
    assert torch.equal(loaded.embed, direct.embed)
    for a, b in zip(loaded.layers, direct.layers):
        for part in ("attn", "mlp", "attn_res"):
            x, y = getattr(a, part).tensors(), getattr(b, part).tensors()
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    from vllm.models.kimi_k3.nvidia.latency_specialized.config import K3TextConfig

    assert K3TextConfig.from_json(folder) == TINY


# ---------------------------------------------------------------------- lm-eval


def test_lm_eval_adapter_runs_the_synthetic_task(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval", reason="the lm-eval adapter needs lm-eval (the [eval] extra)")
    import lm_eval
    from lm_eval.tasks import TaskManager
    import importlib.util

    import yaml

    from vllm.models.kimi_k3.nvidia.evals import lm_eval_adapter, lm_eval_data

    task_dir = Path(lm_eval_data.__file__).parent / "lm_eval_tasks"
    lm_eval_data.write(tmp_path, tasks=("kv",), lengths=(120,), samples=2)
    monkeypatch.setenv("K3_EVAL_DATA", str(tmp_path))
    tm = TaskManager(include_path=str(task_dir))
    assert {"k3_mrcr_synthetic", "k3_kv_synthetic", "k3_arith_synthetic", "k3_mrcr", "k3_aime25"} <= set(tm.all_tasks)
    # every config is indexed from its file, and each `!function utils.X` it names exists
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda ld, node: ld.construct_scalar(node))
    spec = importlib.util.spec_from_file_location("k3_task_utils", task_dir / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    for name in ("k3_mrcr_synthetic", "k3_kv_synthetic", "k3_arith_synthetic", "k3_mrcr", "k3_aime25"):
        path = tm.task_index[name].yaml_path
        assert path.parent == task_dir
        conf = yaml.load(path.read_text(), Loader=loader)
        hooks = [v for v in conf.values() if isinstance(v, str) and v.startswith("utils.")]
        assert hooks and all(callable(getattr(utils, h.removeprefix("utils."))) for h in hooks), name
    assert utils.aime_process_results({"answer": "204"}, ["so it is \\boxed{204}."]) == {"exact_match": 1.0}
    doc = {"random_string_to_prepend": "xY1", "answer": "xY1a poem"}
    assert utils.mrcr_process_results(doc, ["xY1a poem"])["mrcr_score"] == 1.0
    assert utils.mrcr_process_results(doc, ["a poem"])["mrcr_score"] == 0.0
    # device in model_args and lm-eval's own device (its CLI default is cuda): model_args win
    res = lm_eval.simple_evaluate(model="k3-decode",
                                  model_args="config=mini,random_weights=0,backend=specialized,device=cpu",
                                  device="cuda:0", tasks=["k3_kv_synthetic"], task_manager=tm, limit=2,
                                  log_samples=False)
    got = res["results"]["k3_kv_synthetic"]
    assert 0.0 <= got["exact_match,none"] <= 1.0 and 0.0 <= got["similarity,none"] <= 1.0
    # the scorer lm-eval reports: exact on the first line only, similarity as tasks.similarity
    assert utils.process_synthetic({"answer": "12 34"}, ["12 34\nx"]) == {"exact_match": 1.0, "similarity": 1.0}
    assert utils.process_synthetic({"answer": "12 34"}, ["12 345"])["exact_match"] == 0.0
    assert utils.process_synthetic({"answer": "abcd"}, ["abxd"])["similarity"] == pytest.approx(0.75)
    # loglikelihood through the decode path equals the full-sequence log-probabilities
    lm = lm_eval_adapter.K3DecodeLM(config="mini", random_weights=0, backend="specialized")

    class Req:
        args = ("get abc:", "12")

    (ll, greedy), = lm.loglikelihood([Req()])
    ids = lm_eval_adapter.TOK.encode("get abc:12")
    ref = mini_model(seed=0, decode_forms_in_prefill=True)
    st = ref.new_state(max_requests=1, max_len=len(ids))
    logp = torch.log_softmax(ref.logits(ref.forward(torch.tensor(ids), [st.segment(st.allocate(), 0, len(ids), True)],
                                                      st)).double(), -1)
    want = float(logp[-3, ord("1")] + logp[-2, ord("2")])
    assert ll == pytest.approx(want, rel=1e-2)
    assert greedy == bool(logp[-3].argmax() == ord("1") and logp[-2].argmax() == ord("2"))


def test_lm_eval_data_writes_where_the_task_configs_read(tmp_path, monkeypatch):
    from vllm.models.kimi_k3.nvidia.evals import lm_eval_data

    monkeypatch.setenv("K3_EVAL_DATA", str(tmp_path))
    assert lm_eval_data.main(["--tasks", "kv", "--lengths", "120", "--samples", "1"]) == 0
    line = json.loads((tmp_path / "k3_kv_synthetic.jsonl").read_text().splitlines()[0])
    assert line["task"] == "kv" and line["length"] == 120


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is visible")
def test_train_tiny_on_cuda_without_a_gpu_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_tiny.main(["--device", "cuda", "--out", str(tmp_path / "ckpt"), "--curve", str(tmp_path / "c.json")])
    assert e.value.code == 2 and "no CUDA GPU is visible" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()
