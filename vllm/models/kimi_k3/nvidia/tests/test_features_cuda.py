"""SCOPE.yaml's preserved features on the kernels: the shipped tiny model (inside every kernel's
envelope) served on this GPU (SCOPE.yaml's H200 or H100 envelope) by the specialized executor's
CUDA graphs, against the standard path on the same weights. The CPU tests of the same features (test_engine.py,
test_model_reference.py) prove the harness and the fallback; these prove the kernels keep them.

- temperature / top-k / top-p sampling with seeds: the standard path against itself is exact
  (the control); specialized against standard picks the same tokens in most sequences. A
  kernel's bf16 rounding moves a probability by ~1e-3, which changes a sampled token only when
  the draw lands that close to a boundary, and every later token of that sequence may follow;
  the bound (12 of 16 sequences of 24 tokens identical) leaves room for that, not for a bug.
- structured output (xgrammar JSON schema and regex): valid on the specialized path, and the
  same tokens as the standard path under greedy decoding.
- full context: at the end of a 4096-token context every kernel matches its reference op on
  identical inputs (PARITY_OP_REL), and 16 decode steps on the kernels stay as close to the
  standard decode as the standard path with one bf16 rounding of noise per GEMM output does
  (decode_latency's parity rule); a step past the executor's max_len is not planned. The ids
  fed are the standard path's greedy tokens: an earlier form fed random bytes and saw single
  steps up to 0.24 from the standard decode, which the reference ops in the same executor
  (0.21) and the yardstick (0.15) show too on those inputs (H200; docs/fast_track/REVIEW.md,
  "The tiny model inside the kernels' envelope").
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (PARITY_OP_REL, copy_state, parity_lockstep,
                                                                  parity_status)
from vllm.models.kimi_k3.nvidia.evals.tiny import config_named, shipped_weights
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import KernelOps, ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment, StepFacts
from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import Dispatcher
from vllm.models.kimi_k3.nvidia.latency_specialized.engine import Engine, Request, build_specialized
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.op_parity import ComparedOps
from vllm.models.kimi_k3.nvidia.latency_specialized.options import BackendOptions
from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import SamplingParams
from vllm.models.kimi_k3.nvidia.latency_specialized.tokenizer import ByteTokenizer
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import RoundingNoiseOps
from vllm.models.kimi_k3.nvidia.latency_specialized.weights import SafetensorsSource, load_rank
from vllm.models.kimi_k3.nvidia.reference.model import ReferenceModel

TOK = ByteTokenizer()
MAX_LEN = 512
CONTEXT = 4096
STEPS = 16  # decode steps at the end of the context


@pytest.fixture(scope="module")
def tiny():
    cfg = config_named("tiny")
    return ReferenceModel(cfg, load_rank(SafetensorsSource(shipped_weights("tiny")), cfg, device="cuda"))


def _run(model, backend: str, requests: list[Request]):
    """The CLI's flow: dispatcher, executor when admitted, engine on the executor's state."""
    extra = {"decode_backend": backend, **({"allow_unvalidated": True} if backend != "auto" else {})}
    d = Dispatcher(BackendOptions.parse(extra), Deployment.detect(tp=1, max_model_len=MAX_LEN, expert_dtype="bfloat16"))
    ex = build_specialized(model, d, len(requests), MAX_LEN)
    if backend != "auto":
        assert ex is not None, "the specialized executor was not built for the tiny model"
    eng = Engine(model, dispatcher=d, specialized=ex, max_requests=len(requests), max_len=MAX_LEN,
                 state=None if ex is None else ex.state)
    return eng.generate(requests), d.counters.as_dict(), eng


def _served_by_kernels(counters: dict, eng: Engine) -> None:
    assert counters["steps"].get("specialized", 0) == eng.stats.decode_steps > 0, counters
    assert not counters["fallbacks"], counters


@pytest.mark.gpu
def test_sampling_on_the_kernels_matches_the_standard_path(tiny):
    reqs = [Request(TOK.encode(f"key {i}: value {7 * i} ;"),
                    SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=100 + i, max_tokens=24))
            for i in range(16)]
    std, _, _ = _run(tiny, "auto", reqs)
    again, _, _ = _run(tiny, "auto", reqs)
    spec, counters, eng = _run(tiny, "latency_specialized", reqs)
    _served_by_kernels(counters, eng)
    assert [c.output_ids for c in again] == [c.output_ids for c in std]  # the control: seeds are exact
    same = sum(a.output_ids == b.output_ids for a, b in zip(std, spec))
    assert len({tuple(c.output_ids) for c in std}) > 8  # the seeds matter
    assert same >= 12, f"{same} of 16 sampled sequences identical"


@pytest.mark.gpu
def test_the_generate_command_serves_decode_from_the_kernels(capsys):
    """Issue 8's command end to end: `k3-decode generate --device cuda --decode-backend
    latency_specialized` serves every decode step from the executor's graphs, per its own summary
    line, and prints the greedy text `--decode-backend auto` prints."""
    from vllm.models.kimi_k3.nvidia.latency_specialized.cli import main

    argv = ["generate", "--device", "cuda", "--max-tokens", "24",
            "--prompt", "r93tz7=47751\nlfi7ig=13198\nvjmsh9=55309\n.......\nget lfi7ig vjmsh9:"]
    outs = {}
    for backend in ("auto", "latency_specialized"):
        assert main([*argv, "--decode-backend", backend, "--additional-config", '{"allow_unvalidated": true}'
                     if backend != "auto" else "{}"]) == 0
        outs[backend] = capsys.readouterr().out.splitlines()
    std, spec = outs["auto"], outs["latency_specialized"]
    assert spec[0] == std[0], (std[0], spec[0])
    summary = next(line for line in spec if line.startswith("[k3-decode]"))
    decode = int(re.search(r"steps: 1 prefill \+ (\d+) decode;", summary).group(1))
    assert decode > 0 and f"served by: specialized {decode}, standard 1;" in summary, summary
    assert f"steps {decode}: specialized {decode}, standard 0" in summary and "; kernels: " in summary, summary


@pytest.mark.gpu
def test_structured_output_on_the_kernels(tiny):
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar ([test] extra)")
    from vllm.models.kimi_k3.nvidia.latency_specialized.structured import GrammarConstraint

    vocab = tiny.cfg.vocab_size
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                         "required": ["id", "ok"], "additionalProperties": False})
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    for kind, make in (("json", lambda: GrammarConstraint.json_schema(schema, vocab, any_whitespace=False)),
                       ("regex", lambda: GrammarConstraint.regex(pattern, vocab))):
        outs = {}
        for backend in ("auto", "latency_specialized"):
            p = SamplingParams(max_tokens=60, stop_token_ids=(TOK.EOS,), token_mask=make())
            (c,), counters, eng = _run(tiny, backend, [Request(TOK.encode("out:"), p)])
            if backend != "auto":
                _served_by_kernels(counters, eng)
            text = TOK.decode(c.output_ids)
            assert c.finish_reason == "stop", (kind, backend, text)
            if kind == "json":
                obj = json.loads(text)
                assert set(obj) == {"id", "ok"} and isinstance(obj["ok"], bool), text
            else:
                assert re.fullmatch(pattern, text), text
            outs[backend] = c.output_ids
        assert outs["auto"] == outs["latency_specialized"], kind


@pytest.mark.gpu
def test_full_context_decode_on_the_kernels_matches_the_standard_path(tiny):
    gen = torch.Generator().manual_seed(4)
    seq = torch.randint(0, 256, (CONTEXT,), generator=gen).cuda()
    prefix = CONTEXT - STEPS
    kw = {"max_requests": 1, "max_len": CONTEXT, "buckets": [(1, 1)]}
    spec = SpecializedDecode(tiny, **kw)
    r = spec.state.allocate()
    tiny.forward(seq[:prefix], [spec.state.segment(r, 0, prefix, prefill=True)], spec.state)
    # per op: each kernel against its reference op on identical inputs, at the end of the context
    compared = ComparedOps(KernelOps(), ReferenceOps())
    per_op = SpecializedDecode(tiny, **kw, ops=compared, graphs=False)
    copy_state(per_op.state, spec.state)
    per_op(seq[prefix:prefix + 1], [per_op.state.segment(r, 0, 1, prefill=False)], per_op.state)
    bad = [(op, i, err) for op, i, err in compared.report
           if (err < 0.99 if op == "route.ids_equal" else not err <= PARITY_OP_REL)]
    assert not bad, f"ops off their reference at position {prefix}: {bad}"
    # whole steps: the kernels' logits against the standard decode's, judged by decode_latency's
    # rule (no further than the standard path with bf16 rounding noise is)
    noise = SpecializedDecode(tiny, **kw, ops=RoundingNoiseOps(), graphs=False)
    std = tiny.new_state(max_requests=1, max_len=CONTEXT)
    par, _ = parity_lockstep(tiny, {"specialized": spec, "standard_rounding_noise": noise}, std, [r], 1, STEPS,
                             torch.Generator(device="cuda").manual_seed(5), required="specialized")
    assert spec.state.seq_lens[r] == CONTEXT, f"{spec.state.seq_lens[r]} positions cached, not {CONTEXT}"
    assert parity_status(par) == "pass", par
    assert spec.plan(StepFacts(rows=1, tokens_per_request=1, max_context=CONTEXT + 1, pure_decode=True)) is None
