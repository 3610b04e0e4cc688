"""additional_config parsing, the dispatcher (start-up verdict, per-step route), PathCounters, and `k3-decode scope`."""

from __future__ import annotations

import argparse
import copy
import logging
import random
from collections import Counter

import pytest
import torch
import yaml

from vllm.models.kimi_k3.nvidia.latency_specialized import scope_cli
from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment, StepFacts
from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import (
    AUTO_REASON, DECLINED_REASON, LOGGER_NAME, NOT_BUILT_REASON, OUT_OF_SCOPE_REASON, Dispatcher,
    PathCounters, Route)
from vllm.models.kimi_k3.nvidia.latency_specialized.engine import Engine, Request
from vllm.models.kimi_k3.nvidia.latency_specialized.options import BackendOptions
from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import SamplingParams
from vllm.models.kimi_k3.nvidia.latency_specialized.scope import DEFAULT_SCOPE_PATH, Scope, ScopeError

from ._util import mini_model

ON = BackendOptions(decode_backend="latency_specialized", allow_unvalidated=True)
H200_ROWS = set(range(1, 9)) | {16, 32, 64}


def h200(**kw) -> Deployment:
    args = dict(gpu="H200", tp=8, max_model_len=131072, expert_dtype="bfloat16")
    args.update(kw)
    return Deployment.describe(**args)


def a100_tp4() -> Deployment:
    return Deployment.describe(gpu="A100", tp=4)


def random_steps(seed: int, n: int) -> list[StepFacts]:
    rng = random.Random(seed)
    return [StepFacts(rows=rng.choice([1, 2, 3, 4, 8, 9, 12, 16, 17, 32, 64, 65]),
                      tokens_per_request=rng.choice([1, 1, 2, 4, 9]),
                      max_context=rng.choice([17, 5000, 131072, 131073]),
                      pure_decode=rng.random() < 0.85) for _ in range(n)]


def in_h200_envelope(s: StepFacts) -> bool:
    # stated independently of scope.py
    q = s.tokens_per_request
    return (s.pure_decode and q is not None and q <= 8 and s.rows % q == 0
            and s.rows in H200_ROWS and s.max_context <= 131072)


class PlanSpy:
    """An executor that declines 3-row steps and counts its calls."""

    def __init__(self):
        self.calls = 0

    def plan(self, step):
        self.calls += 1
        return None if step.rows == 3 else ("plan", step.rows)


# ------------------------------------------------------------------ options


def test_options_defaults_and_accepted_values():
    assert BackendOptions.parse(None) == BackendOptions("auto", False, False)
    assert BackendOptions.parse({}) == BackendOptions()
    o = BackendOptions.parse({"decode_backend": "latency_specialized", "strict_scope": True})
    assert (o.decode_backend, o.strict_scope, o.allow_unvalidated, o.requested) == (
        "latency_specialized", True, False, True)
    assert not BackendOptions.parse({"decode_backend": "auto"}).requested


@pytest.mark.parametrize("config,fragments", [
    ({"decode-backend": "auto"}, ["unknown key 'decode-backend'", "did you mean 'decode_backend'?",
                                  "the Kimi K3 latency_specialized decode backend accepts only the keys "
                                  "decode_backend, strict_scope, allow_unvalidated"]),
    ({"mla_core": "auto"}, ["unknown key 'mla_core'", "accepts only the keys"]),
    ({"decode_backend": "fast"}, ["'fast' is not a value", "'auto'", "'latency_specialized'"]),
    ({"decode_backend": "latency_specialized", "strict_scope": "yes"},
     ["additional_config['strict_scope'] must be true or false", "found str 'yes'"]),
    ({"decode_backend": "latency_specialized", "allow_unvalidated": 1},
     ["additional_config['allow_unvalidated'] must be true or false", "found int 1"]),
    ({"strict_scope": True}, ["no effect with decode_backend 'auto'"]),
    ('{"decode_backend": "auto"}', ["must be a mapping (a JSON object)", "found str"]),
])
def test_options_errors_list_what_is_accepted(config, fragments):
    with pytest.raises(ValueError) as info:
        BackendOptions.parse(config)
    for f in fragments:
        assert f in str(info.value), str(info.value)


def test_a_key_of_vllms_own_is_refused_outside_vllm_as_vllms_not_as_a_typo():
    """k3-decode runs no vLLM: `kda_decode_backend` is refused, named as vLLM's key that nothing
    here reads, not as a misspelling of `decode_backend`."""
    with pytest.raises(ValueError) as info:
        BackendOptions.parse({"kda_decode_backend": "triton"})
    msg = str(info.value)
    assert "unknown key 'kda_decode_backend'" in msg and "did you mean" not in msg, msg
    assert "vLLM's own" in msg and "outside vLLM (k3-decode, its evals) nothing reads them" in msg, msg


# ------------------------------------------------------------------ auto is inert


def test_auto_is_inert(monkeypatch, caplog):
    def no_scope(*a, **k):
        raise AssertionError("decode_backend=auto must not read SCOPE.yaml")

    monkeypatch.setattr(Scope, "load", no_scope)
    spy = PlanSpy()
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        d = Dispatcher(BackendOptions(), h200(), executor=spy)
        routes = {d.route(s) for s in random_steps(0, 200)}
    assert routes == {Route("standard", AUTO_REASON)}
    assert (d.scope, d.verdict, d.enabled, spy.calls) == (None, None, False, 0)
    assert all(r.levelno == logging.DEBUG for r in caplog.records)


def test_auto_generates_bit_identical_tokens_to_no_backend():
    model = mini_model(seed=3)
    gen = torch.Generator().manual_seed(11)

    def wrong_specialized(ids, segs, state):
        return torch.randn(ids.numel(), model.cfg.vocab_size, generator=gen)

    params = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=6)
    prompts = [[5, 9, 2, 7], [3, 1, 4]]

    def run(dispatcher):
        engine = Engine(model, dispatcher=dispatcher, specialized=wrong_specialized, max_len=64)
        return [c.output_ids for c in engine.generate([Request(p, params) for p in prompts])]

    auto = Dispatcher(BackendOptions.parse({"decode_backend": "auto"}), h200())
    assert run(auto) == run(None)
    assert auto.counters.as_dict()["steps"] == {"specialized": 0, "standard": 5}


# ------------------------------------------------------------------ start-up verdict


def test_strict_scope_raises_with_every_reason():
    strict = BackendOptions(decode_backend="latency_specialized", strict_scope=True)
    with pytest.raises(ScopeError) as info:
        Dispatcher(strict, a100_tp4())
    msg = str(info.value)
    for reason in ("GPU NVIDIA A100 (sm_80) not in scope [GB300 sm_103, H200 sm_90, H100 sm_90]",
                   "gb300-tp8-tp16: tensor_parallel 4 not in [8, 16]",
                   "h200-validation: tensor_parallel 4 not in [1, 8, 16], expert dtype mxfp4 is not bfloat16",
                   "h100-validation: tensor_parallel 4 not in [1, 8, 16], expert dtype mxfp4 is not bfloat16",
                   "strict_scope is set"):
        assert reason in msg, msg
    # an in-scope GPU but a declared envelope: strict refuses it without allow_unvalidated
    with pytest.raises(ScopeError, match="status declared"):
        Dispatcher(strict, h200())


def one_record(caplog) -> logging.LogRecord:
    records = [r for r in caplog.records if r.name == LOGGER_NAME]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "\n" not in records[0].getMessage()
    return records[0]


def test_startup_verdict_off_is_one_line_with_every_reason(caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        d = Dispatcher(BackendOptions(decode_backend="latency_specialized"), a100_tp4())
        for s in random_steps(1, 50):
            assert d.route(s) == Route("standard", OUT_OF_SCOPE_REASON)
    rec = one_record(caplog)
    assert rec.levelno == logging.WARNING and not d.enabled
    assert rec.getMessage().startswith(
        "Kimi K3 latency_specialized decode OFF, the standard path serves every step: "
        "GPU NVIDIA A100 (sm_80) not in scope [GB300 sm_103, H200 sm_90, H100 sm_90]; gb300-tp8-tp16: "
        "tensor_parallel 4 not in [8, 16]")
    assert len(d.verdict.reasons) > 2 and all(r in rec.getMessage() for r in d.verdict.reasons)


def test_startup_verdict_on_names_the_envelope_and_its_limits(caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        d = Dispatcher(ON, h200(max_model_len=262144))
        for s in random_steps(2, 50):
            d.route(s)
    rec = one_record(caplog)
    msg = rec.getMessage()
    assert rec.levelno == logging.WARNING  # declared, admitted through allow_unvalidated
    assert msg.startswith("Kimi K3 latency_specialized decode ON for NVIDIA H200 (sm_90) tensor_parallel 8: "
                          "envelope h200-validation (H200 sm_90, tensor_parallel [1, 8, 16], rows "
                          "[1..8, 16, 32, 64], tokens/request [1..8], context <= 131072")
    assert "declared, not validated; admitted because allow_unvalidated is set" in msg
    assert "steps with context over 131072 run the standard path (max_model_len 262144)" in msg
    assert d.enabled and d.startup_line == msg


def validated_scope(tmp_path) -> Scope:
    data = yaml.safe_load(DEFAULT_SCOPE_PATH.read_text())
    data["envelopes"][1].update(status="validated", evidence=["evidence/parity.json"])
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence/parity.json").write_text("{}")
    path = tmp_path / "SCOPE.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return Scope.load(path)


def test_startup_verdict_on_a_validated_envelope_is_info(tmp_path, caplog):
    scope = validated_scope(tmp_path)
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        Dispatcher(BackendOptions(decode_backend="latency_specialized"), h200(), scope=scope)
    rec = one_record(caplog)
    assert rec.levelno == logging.INFO and "status validated" in rec.getMessage()


# ------------------------------------------------------------------ routing and counters


def test_counters_add_up_over_routed_steps():
    spy = PlanSpy()
    d = Dispatcher(ON, h200(), executor=spy, log=logging.getLogger("test.quiet"))
    steps = random_steps(7, 600)
    expect_paths, expect_reasons, admitted_standard = Counter(), Counter(), 0
    for s in steps:
        r = d.route(s)
        inside = in_h200_envelope(s)
        assert r.admitted == inside
        if inside and s.rows != 3:
            assert (r.path, r.plan, r.envelope) == ("specialized", ("plan", s.rows), "h200-validation")
            d.counters.record_kernels(["rms_norm", "skinny_gemm", "skinny_gemm"])
        else:
            assert r.path == "standard" and r.plan is None
            expect_reasons[r.reason] += 1
            admitted_standard += inside
        expect_paths[r.path] += 1
    c = d.counters.as_dict()
    assert c["steps"] == {"specialized": expect_paths["specialized"], "standard": expect_paths["standard"]}
    assert sum(c["steps"].values()) == len(steps) == d.counters.total_steps
    assert sum(c["fallbacks"].values()) == c["steps"]["standard"]
    assert c["fallbacks"] == dict(expect_reasons)
    assert c["admitted_on_standard"] == admitted_standard == c["fallbacks"][DECLINED_REASON]
    n = c["steps"]["specialized"]
    assert c["kernels"] == {"skinny_gemm": 2 * n, "rms_norm": n}
    assert spy.calls == n + admitted_standard
    # out-of-envelope reasons name the limit, never the raw context (counters stay few)
    assert "context over 131072" in c["fallbacks"]
    assert not any("131073" in reason for reason in c["fallbacks"])
    assert any(reason.startswith("rows 9 not in [1..8, 16, 32, 64]") for reason in c["fallbacks"])


def test_admitted_steps_without_an_executor_are_counted_apart():
    model = mini_model(seed=1)
    d = Dispatcher(ON, h200(), log=logging.getLogger("test.quiet"))
    engine = Engine(model, dispatcher=d, max_len=64)
    engine.generate([Request([2, 4, 6], SamplingParams(max_tokens=5))])
    c = d.counters.as_dict()
    assert c["steps"] == {"specialized": 0, "standard": 4}
    assert c["admitted_on_standard"] == 4 and c["fallbacks"] == {NOT_BUILT_REASON: 4}
    outside = d.route(StepFacts(rows=9, tokens_per_request=1, max_context=10, pure_decode=True))
    assert not outside.admitted
    c = d.counters.as_dict()
    assert c["fallbacks"] == {NOT_BUILT_REASON: 4, "rows 9 not in [1..8, 16, 32, 64]": 1}
    assert c["admitted_on_standard"] == 4
    assert "admitted but standard 4" in d.counters.summary()


def test_steps_pick_the_envelope_that_admits_them(tmp_path):
    data = yaml.safe_load(DEFAULT_SCOPE_PATH.read_text())
    large = copy.deepcopy(data["envelopes"][1])
    data["envelopes"][1]["rows_per_step"] = [1, 2, 4, 8]
    large.update(name="h200-large", rows_per_step=[16, 32, 64])
    data["envelopes"].append(large)
    path = tmp_path / "SCOPE.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    d = Dispatcher(ON, h200(), scope=path, executor=PlanSpy(), log=logging.getLogger("test.quiet"))
    assert [e.name for e in d.envelopes] == ["h200-validation", "h200-large"]
    route = d.route(StepFacts(rows=32, tokens_per_request=4, max_context=99, pure_decode=True))
    assert (route.path, route.envelope) == ("specialized", "h200-large")
    route = d.route(StepFacts(rows=12, tokens_per_request=4, max_context=99, pure_decode=True))
    assert route.reason == ("h200-validation: rows 12 not in [1, 2, 4, 8]; "
                            "h200-large: rows 12 not in [16, 32, 64]")


def test_disabled_counters_record_nothing():
    def never_iterated():
        raise AssertionError("disabled counters must not touch the kernel names")
        yield

    counters = PathCounters(enabled=False)
    d = Dispatcher(ON, h200(), executor=PlanSpy(), counters=counters, log=logging.getLogger("test.quiet"))
    routes = [d.route(s) for s in random_steps(3, 100)]
    assert {r.path for r in routes} == {"specialized", "standard"}
    counters.record_kernels(never_iterated())
    assert counters.as_dict() == {"enabled": False, "steps": {"specialized": 0, "standard": 0},
                                  "admitted_on_standard": 0, "fallbacks": {}, "kernels": {}}
    assert counters.summary() == "path counters off" == counters.table()


def test_summary_is_one_line_and_table_lists_every_count():
    c = PathCounters()
    for _ in range(3):
        c.record_route(Route("specialized", "in envelope e", "e"))
    c.record_route(Route("standard", NOT_BUILT_REASON, "e"))
    c.record_route(Route("standard", "rows 9 not in [1..8]"))
    c.record_route(Route("standard", "rows 9 not in [1..8]"))
    c.record_kernels("skinny_gemm")
    c.record_kernels(["skinny_gemm", "rms_norm"])
    line = c.summary()
    assert "\n" not in line
    assert line == ("steps 6: specialized 3, standard 3 (admitted but standard 1); standard because: "
                    "rows 9 not in [1..8] x2, admitted; specialized executor not built x1; "
                    "kernels: 3 launches of 2 kernels")
    table = c.table().splitlines()
    assert table[0] == "path counters (6 steps)"
    cells = {(name.strip(), n) for name, n in (line.rsplit(None, 1) for line in table[1:] if line.strip())}
    for row in (("specialized", "3"), ("standard", "3"), ("of which admitted but standard", "1"),
                ("rows 9 not in [1..8]", "2"), (NOT_BUILT_REASON, "1"), ("skinny_gemm", "2"),
                ("rms_norm", "1")):
        assert row in cells, row
    c.reset()
    assert c.total_steps == 0 and c.as_dict()["kernels"] == {}


# ------------------------------------------------------------------ k3-decode scope


def scope_cmd(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="k3-decode")
    scope_cli.add_parser(parser.add_subparsers(dest="cmd"))
    rc = scope_cli.run(parser.parse_args(["scope", *argv]))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_scope_cli_admits_gb300_tp16_with_allow_unvalidated(capsys):
    rc, out, _ = scope_cmd(["--gpu", "GB300", "--tp", "16", "--max-model-len", "262144",
                            "--spec", "dspark:7", "--allow-unvalidated"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[1] == ("deployment (described): NVIDIA GB300 (sm_103, 160 SMs), tensor_parallel 16, "
                        "max_model_len 262144, speculative dspark:7 (8 tokens per request), CUDA graphs "
                        "on, dtypes: weights bfloat16, experts mxfp4, MLA cache bfloat16, KDA recurrent "
                        "float32, conv bfloat16")
    assert lines[2].startswith("verdict: IN SCOPE")
    assert lines[3].startswith("  envelope gb300-tp8-tp16: GB300 sm_103, tensor_parallel [8, 16], rows "
                               "[1..8, 16, 32, 64], tokens/request [1..8], context <= 1048576")
    assert "  warning: envelope gb300-tp8-tp16 is declared, not validated" in out
    table = [line for line in lines if line.startswith(("gb300-tp8-tp16 ", "h200-validation "))]
    assert len(table) == 2 and "declared" in table[0] and "131072" in table[1]


def test_scope_cli_refuses_a100_tp4_with_every_reason(capsys):
    rc, out, _ = scope_cmd(["--gpu", "A100", "--tp", "4"], capsys)
    assert rc == 0
    assert "verdict: OUT OF SCOPE: the standard path serves every step, because" in out
    assert "  - GPU NVIDIA A100 (sm_80) not in scope [GB300 sm_103, H200 sm_90, H100 sm_90]\n" in out
    assert "  - gb300-tp8-tp16: tensor_parallel 4 not in [8, 16], status declared" in out
    assert "  - h200-validation: tensor_parallel 4 not in [1, 8, 16], expert dtype mxfp4 is not bfloat16" in out


def test_scope_cli_on_a_machine_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, out, _ = scope_cmd([], capsys)
    assert rc == 0
    assert "deployment (this machine): no CUDA device present (torch.cuda.is_available() is False)" in out
    assert "the standard path serves every step" in out
    assert "  - no CUDA device present" in out


def test_scope_cli_bad_input_exits_2(capsys, tmp_path):
    rc, out, err = scope_cmd(["--gpu", "GB300", "--spec", "dspark"], capsys)
    assert rc == 2 and out == "" and "write METHOD:N" in err
    rc, _, err = scope_cmd(["--gpu", "MI300"], capsys)
    assert rc == 2 and "unknown GPU 'MI300'" in err
    bad = tmp_path / "SCOPE.yaml"
    bad.write_text("schema_version: 1\n")
    rc, _, err = scope_cmd(["--scope", str(bad)], capsys)
    assert rc == 2 and f"{bad}: model: expected the required key 'model'" in err


def test_reset_returns_the_counters_to_a_fresh_state():
    """After reset every count is zero, "admitted but served standard" included, so a second
    measurement never carries the first one's steps."""
    c = PathCounters()
    c.record_route(Route("specialized", "in envelope e", "e"))
    c.record_route(Route("standard", NOT_BUILT_REASON, "e"))
    c.record_route(Route("standard", "rows 9 not in [1..8]"))
    c.record_kernels(["skinny_gemm", "rms_norm"])
    assert c.as_dict()["admitted_on_standard"] == 1
    c.reset()
    assert c.as_dict() == PathCounters().as_dict()
    assert c.summary() == PathCounters().summary()
