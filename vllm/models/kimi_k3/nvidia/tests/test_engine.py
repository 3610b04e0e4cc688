"""The generation harness: stop rules, batching, and the features SCOPE.yaml promises to
preserve — temperature sampling and structured output behave the same whichever path the
dispatcher picks."""

import json
import re

import pytest

from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import Deployment
from vllm.models.kimi_k3.nvidia.latency_specialized.dispatch import NOT_BUILT_REASON, Dispatcher
from vllm.models.kimi_k3.nvidia.latency_specialized.engine import Engine, Request, build_specialized
from vllm.models.kimi_k3.nvidia.latency_specialized.options import BackendOptions
from vllm.models.kimi_k3.nvidia.latency_specialized.sampler import SamplingParams
from vllm.models.kimi_k3.nvidia.latency_specialized.tokenizer import ByteTokenizer

from ._util import mini_model

TOK = ByteTokenizer()
H200 = Deployment.describe(gpu="H200", tp=1, max_model_len=4096, expert_dtype="bfloat16")


@pytest.fixture(scope="module")
def model():
    return mini_model(seed=0)


def _dispatcher(backend: str) -> Dispatcher:
    extra = {"decode_backend": backend}
    if backend != "auto":
        extra["allow_unvalidated"] = True
    return Dispatcher(BackendOptions.parse(extra), H200)


def _run(model, backend, requests, build=True):
    """Generate on `backend`; for latency_specialized the executor is built (reference ops on the
    CPU: its step plumbing, with the features' sampler and masks) unless `build` is False."""
    d = _dispatcher(backend)
    ex = build_specialized(model, d, len(requests), 256, reference_on_cpu=True) if build else None
    eng = Engine(model, dispatcher=d, specialized=ex, state=None if ex is None else ex.state,
                 max_requests=len(requests), max_len=256)
    out = eng.generate(requests)
    if ex is not None:  # every decode step was the executor's, so "identical across paths" compares two
        assert eng.stats.paths["specialized"] == eng.stats.decode_steps > 0, eng.stats.paths
    return out, d, eng


def test_greedy_stop_and_length(model):
    prompt = TOK.encode("abc")
    (c,), _, _ = _run(model, "auto", [Request(prompt, SamplingParams(max_tokens=6))])
    assert len(c.output_ids) == 6 and c.finish_reason == "length"
    stop = c.output_ids[2]
    (s,), _, _ = _run(model, "auto", [Request(prompt, SamplingParams(max_tokens=6, stop_token_ids=(stop,)))])
    first = c.output_ids.index(stop)
    assert s.output_ids == c.output_ids[:first + 1] and s.finish_reason == "stop"


def test_batched_requests_match_single_requests(model):
    reqs = [Request(TOK.encode("first prompt"), SamplingParams(max_tokens=5)),
            Request(TOK.encode("a much longer second prompt"), SamplingParams(max_tokens=9))]
    batch, _, eng = _run(model, "auto", reqs)
    assert eng.stats.decode_steps == 8 and [len(c.output_ids) for c in batch] == [5, 9]
    for r, c in zip(reqs, batch):
        (alone,), _, _ = _run(model, "auto", [r])
        assert alone.output_ids == c.output_ids


def test_sampling_identical_across_paths(model):
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=s, max_tokens=12) for s in (1, 2, 3)]
    reqs = [Request(TOK.encode(f"prompt {i}"), p) for i, p in enumerate(params)]
    std, d_auto, _ = _run(model, "auto", reqs)
    spec, d_spec, eng = _run(model, "latency_specialized", reqs)
    assert [c.output_ids for c in std] == [c.output_ids for c in spec]
    assert len({tuple(c.output_ids) for c in std}) == 3  # the seeds matter
    # the counters say honestly which path served the admitted steps
    a, s = d_auto.counters.as_dict(), d_spec.counters.as_dict()
    assert a["steps"]["specialized"] == 0 and a["fallbacks"] == {"decode_backend=auto": eng.stats.decode_steps}
    assert s["steps"]["specialized"] == eng.stats.decode_steps == 11 and not s["fallbacks"]
    # with no executor built, admitted steps run the standard path, counted under their reason
    unbuilt, d_unbuilt, eng = _run(model, "latency_specialized", reqs, build=False)
    assert [c.output_ids for c in unbuilt] == [c.output_ids for c in std]
    u = d_unbuilt.counters.as_dict()
    assert u["admitted_on_standard"] == eng.stats.decode_steps == 11 and u["fallbacks"] == {NOT_BUILT_REASON: 11}


def test_structured_output_identical_across_paths(model):
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar ([test] extra)")
    from vllm.models.kimi_k3.nvidia.latency_specialized.structured import GrammarConstraint

    V = model.cfg.vocab_size
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
                         "required": ["id", "ok"], "additionalProperties": False})
    cases = [("regex", r"[0-9]{3}-[a-z]{2,5}", lambda: GrammarConstraint.regex(r"[0-9]{3}-[a-z]{2,5}", V)),
             ("json", schema, lambda: GrammarConstraint.json_schema(schema, V))]
    for kind, spec, make in cases:
        outs = {}
        for backend in ("auto", "latency_specialized"):
            for temp, seed in ((0.0, None), (1.0, 7)):
                p = SamplingParams(temperature=temp, seed=seed, max_tokens=60, stop_token_ids=(TOK.EOS,),
                                   token_mask=make())
                (c,), _, _ = _run(model, backend, [Request(TOK.encode("out:"), p)])
                text = TOK.decode(c.output_ids)
                assert c.finish_reason == "stop", (kind, text)
                if kind == "json":
                    obj = json.loads(text)
                    assert set(obj) == {"id", "ok"} and isinstance(obj["ok"], bool)
                else:
                    import re
                    assert re.fullmatch(spec, text), text
                outs[(backend, temp)] = c.output_ids
        assert outs[("auto", 0.0)] == outs[("latency_specialized", 0.0)]
        assert outs[("auto", 1.0)] == outs[("latency_specialized", 1.0)]


def test_request_validation(model):
    eng = Engine(model, max_requests=1, max_len=16)
    with pytest.raises(ValueError, match="exceed max_requests=1"):
        eng.generate([Request([1]), Request([2])])
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        eng.generate([Request([1] * 10, SamplingParams(max_tokens=10))])
    with pytest.raises(ValueError, match="at least one prompt token"):
        eng.generate([Request([])])


def test_auto_is_identical_to_no_backend(model):
    """decode_backend=auto (or unset) must leave the harness exactly as without the backend."""
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=8)
    reqs = [Request(TOK.encode("same"), p)]
    bare = Engine(model, max_requests=1, max_len=64)
    got = bare.generate(reqs)
    auto, d, _ = _run(model, "auto", reqs)
    assert got[0].output_ids == auto[0].output_ids
    assert not d.enabled and d.counters.as_dict()["steps"]["specialized"] == 0
    assert bare.stats.paths == {"standard": 8}


def test_compact_json_refuses_the_whitespace_the_default_allows():
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar ([test] extra)")
    from vllm.models.kimi_k3.nvidia.latency_specialized.structured import GrammarConstraint

    schema = json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})
    loose, compact = (GrammarConstraint.json_schema(schema, 320, any_whitespace=w) for w in (True, False))
    after_brace, space, quote = [ord("{")], ord(" "), ord('"')  # byte tokens
    assert loose(after_brace)[space] and not compact(after_brace)[space]
    assert compact(after_brace)[quote]


def test_special_tokens_are_never_grammar_text():
    """The byte tokenizer's specials decode to nothing, so a grammar must never take them for the
    text of their names: a regex that spells `<pad>` and a JSON string allow none of them."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar ([test] extra)")
    from vllm.models.kimi_k3.nvidia.latency_specialized.structured import GrammarConstraint

    specials = sorted(TOK.SPECIALS.values())
    spelled = GrammarConstraint.regex(r"<[a-z]+>x", 320)
    assert not spelled([])[specials].any() and spelled([])[ord("<")]
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    inside = GrammarConstraint.json_schema(schema, 320)
    assert not inside(list(b'{"s": "'))[specials].any()
    done = GrammarConstraint.regex(r"ab", 320)
    assert done(list(b"ab"))[TOK.EOS] and done.stop_token_ids == (TOK.EOS,)  # EOS still ends it


def test_one_grammar_object_serves_a_retry_and_two_requests(model):
    """A `GrammarConstraint` reused for a second run of its request, or shared by two requests of
    one batch, masks each output by that output (it starts over where the output is not the one
    it last saw), so every completion matches the grammar."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar ([test] extra)")
    import re

    from vllm.models.kimi_k3.nvidia.latency_specialized.structured import GrammarConstraint

    grammar = GrammarConstraint.regex(r"(abc|xyz)[0-9]", model.cfg.vocab_size)
    p = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, stop_token_ids=(TOK.EOS,), token_mask=grammar)
         for s in (1, 2, 3)]
    first = Engine(model, max_requests=1, max_len=64).generate([Request(TOK.encode("q:"), p[0])])
    again = Engine(model, max_requests=1, max_len=64).generate([Request(TOK.encode("q:"), p[0])])
    both = Engine(model, max_requests=2, max_len=64).generate([Request(TOK.encode("q:"), p[1]),
                                                               Request(TOK.encode("r:"), p[2])])
    for c in (*first, *again, *both):
        assert c.finish_reason == "stop" and re.fullmatch(r"(abc|xyz)[0-9]", TOK.decode(c.output_ids)), c
    assert first[0].output_ids == again[0].output_ids


def test_a_grammar_ends_its_request_without_eos_among_the_stop_tokens(model):
    """A grammar that has matched allows only its stop token (EOS): sampling it ends the request
    even when the caller left EOS out of stop_token_ids, where the next step would have asked a
    terminated matcher for a mask."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar ([test] extra)")
    from vllm.models.kimi_k3.nvidia.latency_specialized.structured import GrammarConstraint

    p = SamplingParams(max_tokens=20, token_mask=GrammarConstraint.regex(r"ab[0-9]", model.cfg.vocab_size))
    (c,) = Engine(model, max_requests=1, max_len=64).generate([Request(TOK.encode("q:"), p)])
    assert c.finish_reason == "stop" and c.output_ids[-1] == TOK.EOS and len(c.output_ids) == 4
    assert re.fullmatch(r"ab[0-9]", TOK.decode(c.output_ids))


def test_a_sampled_token_the_grammar_rejects_is_an_error():
    """Output the grammar cannot continue (a token sampled without its mask) raises at once,
    rather than the matcher silently skipping it and masking later tokens for the wrong text."""
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar ([test] extra)")
    from vllm.models.kimi_k3.nvidia.latency_specialized.structured import GrammarConstraint

    grammar = GrammarConstraint.regex(r"ab", 320)
    assert grammar([ord("a")])[ord("b")]
    with pytest.raises(RuntimeError, match=f"token {ord('c')} was sampled but the grammar rejects it"):
        grammar([ord("a"), ord("c")])
    with pytest.raises(RuntimeError, match="grammar rejects"):
        GrammarConstraint.regex(r"ab", 320)([ord("x")])
