"""SCOPE.yaml: schema and fact errors (file, key path, expected, found), and admission on both sides of every boundary."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path

import pytest
import yaml

from vllm.models.kimi_k3.nvidia.latency_specialized import scope as scope_mod
from vllm.models.kimi_k3.nvidia.latency_specialized.deployment import DTYPES, NO_CUDA, Deployment, StepFacts
from vllm.models.kimi_k3.nvidia.latency_specialized.scope import DEFAULT_SCOPE_PATH, Scope, ScopeError, format_ints

REPO = Path(__file__).resolve().parents[5]


def shipped() -> dict:
    return yaml.safe_load(DEFAULT_SCOPE_PATH.read_text())


def write(tmp_path: Path, data: dict | str, name: str = "SCOPE.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def env(data: dict, i: int) -> dict:
    return data["envelopes"][i]


# ------------------------------------------------------------------ the shipped file


def test_shipped_scope_loads_with_the_declared_envelopes():
    s = Scope.load()
    assert s.path == DEFAULT_SCOPE_PATH
    assert (s.model, s.backend, s.schema_version) == ("kimi_k3", "latency_specialized", 1)
    gb, h = s.envelope("gb300-tp8-tp16"), s.envelope("h200-validation")
    assert (gb.gpu_name, gb.compute_capability, gb.tensor_parallel) == ("GB300", "10.3", (8, 16))
    assert (h.gpu_name, h.compute_capability, h.tensor_parallel) == ("H200", "9.0", (1, 8, 16))
    for e in (gb, h):
        assert e.rows_per_step == (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)
        assert e.tokens_per_request == tuple(range(1, 9))
        assert e.status == "declared" and e.evidence == ()
    assert (gb.max_context, h.max_context) == (1048576, 131072)
    assert dict(gb.dtypes) == {"weights": "bfloat16", "experts": "mxfp4",
                               "mla_latent_cache": "bfloat16", "kda_recurrent_state": "float32",
                               "kda_conv_state": "bfloat16"}
    assert dict(h.dtypes)["experts"] == "bfloat16"
    tests = {f.name: f.test for f in s.preserved_features}
    assert tests["structured_output"].endswith("test_features_cuda.py::test_structured_output_on_the_kernels")
    assert set(tests) == {"full_context", "temperature_sampling", "structured_output"}


def test_docs_schema_is_an_identical_copy_of_the_packaged_one():
    packaged = scope_mod.SCHEMA_PATH.read_bytes()
    assert (REPO / "docs/fast_track/scope.schema.json").read_bytes() == packaged
    schema = json.loads(packaged)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_schema_dtype_enum_matches_the_deployment_vocabulary():
    assert tuple(scope_mod.load_schema()["$defs"]["dtype"]["enum"]) == DTYPES


def test_docs_describe_every_schema_key():
    doc = (REPO / "docs/fast_track/SCOPE.md").read_text()
    schema = scope_mod.load_schema()
    keys = set(schema["properties"])
    for name in ("envelope", "preserved_feature"):
        keys |= set(schema["$defs"][name]["properties"])
    env_props = schema["$defs"]["envelope"]["properties"]
    keys |= {f"{parent}.{k}" for parent in ("gpu", "dtypes") for k in env_props[parent]["properties"]}
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"SCOPE.md does not describe {missing}"


def test_a_schema_keyword_the_walker_does_not_implement_is_refused(tmp_path, monkeypatch):
    schema = json.loads(scope_mod.SCHEMA_PATH.read_text())
    schema["$defs"]["envelope"]["properties"]["max_context"]["exclusiveMaximum"] = 10
    bad = tmp_path / "scope.schema.json"
    bad.write_text(json.dumps(schema))
    monkeypatch.setattr(scope_mod, "SCHEMA_PATH", bad)
    scope_mod.load_schema.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="exclusiveMaximum"):
            Scope.load()
    finally:
        monkeypatch.undo()
        scope_mod.load_schema.cache_clear()


# ------------------------------------------------------------------ malformed files


def _set(path: list, value):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return mutate


def _delete(path: list):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        del node[path[-1]]
    return mutate


def _rename(path: list, new: str):
    def mutate(d):
        node = d
        for k in path[:-1]:
            node = node[k]
        node[new] = node.pop(path[-1])
    return mutate


def _add_overlapping(d):
    twin = copy.deepcopy(env(d, 0))
    twin.update(name="gb300-small", tensor_parallel=[16], rows_per_step=[1, 2])
    d["envelopes"].append(twin)


MALFORMED = [
    # (id, mutation, key path, expected fragment, found fragment)
    ("top-level typo", _rename(["envelopes"], "envelope"), "envelope",
     "one of the keys schema_version, model, backend, preserved_features, envelopes",
     "unknown key 'envelope' (did you mean 'envelopes'?)"),
    ("envelope typo", _rename(["envelopes", 0, "rows_per_step"], "rows"), "envelopes[0].rows",
     "one of the keys name, description, gpu", "unknown key 'rows'"),
    ("missing key", _delete(["envelopes", 1, "max_context"]), "envelopes[1].max_context",
     "the required key 'max_context'", "no such key"),
    ("unquoted capability", _set(["envelopes", 0, "gpu", "compute_capability"], 10.3),
     "envelopes[0].gpu.compute_capability", 'a string such as "10.3"', "float 10.3"),
    ("capability form", _set(["envelopes", 1, "gpu", "compute_capability"], "sm_90"),
     "envelopes[1].gpu.compute_capability", "a string matching", "string 'sm_90'"),
    ("rows unsorted", _set(["envelopes", 1, "rows_per_step"], [1, 3, 2]),
     "envelopes[1].rows_per_step", "integers in ascending order", "list [1, 3, 2]"),
    ("rows zero", _set(["envelopes", 0, "rows_per_step"], [0, 1, 2]),
     "envelopes[0].rows_per_step[0]", "a number >= 1", "integer 0"),
    ("rows repeated", _set(["envelopes", 0, "rows_per_step"], [1, 8, 8]),
     "envelopes[0].rows_per_step", "a list without repeated items (8 repeats)", "list [1, 8, 8]"),
    ("empty tp list", _set(["envelopes", 0, "tensor_parallel"], []),
     "envelopes[0].tensor_parallel", "a list of at least 1 item", "an empty list"),
    ("tp not an int", _set(["envelopes", 0, "tensor_parallel"], [8, "16"]),
     "envelopes[0].tensor_parallel[1]", "an integer", "string '16'"),
    ("tp a bool", _set(["envelopes", 0, "tensor_parallel"], [True]),
     "envelopes[0].tensor_parallel[0]", "an integer", "boolean true"),
    ("no envelopes", _set(["envelopes"], []), "envelopes", "a list of at least 1 item",
     "an empty list"),
    ("bad status", _set(["envelopes", 0, "status"], "tested"), "envelopes[0].status",
     'one of "validated", "declared"', "string 'tested'"),
    ("dtype alias", _set(["envelopes", 1, "dtypes", "weights"], "bf16"),
     "envelopes[1].dtypes.weights", 'one of "float32", "bfloat16"', "string 'bf16'"),
    ("graphs as string", _set(["envelopes", 0, "cuda_graphs"], "on"), "envelopes[0].cuda_graphs",
     "true or false", "string 'on'"),
    ("feature test form", _set(["preserved_features", "full_context", "test"], "tests/test_x.py"),
     "preserved_features.full_context.test", "a string matching", "string 'tests/test_x.py'"),
    ("feature missing", _delete(["preserved_features", "structured_output"]),
     "preserved_features.structured_output", "the required key 'structured_output'", "no such key"),
    ("schema version", _set(["schema_version"], 2), "schema_version", "1", "integer 2"),
    ("wrong model", _set(["model"], "deepseek_v41"), "model", '"kimi_k3"', "string 'deepseek_v41'"),
    ("duplicate name", _set(["envelopes", 1, "name"], "gb300-tp8-tp16"), "envelopes[1].name",
     "a name no other envelope uses", "already the name of envelopes[0]"),
    ("overlap", _add_overlapping, "envelopes[3]", "no deployment step can match twice",
     "'gb300-small' overlaps envelopes[0] 'gb300-tp8-tp16' on GPU GB300 sm_103, speculative "
     "[dspark, none], tensor_parallel [16], rows [1, 2], tokens_per_request [1..8]"),
    ("validated without evidence", _set(["envelopes", 0, "status"], "validated"),
     "envelopes[0].evidence", "at least one evidence file for a validated envelope",
     "an empty list"),
    ("evidence form", _set(["envelopes", 0, "evidence"], ["../secret.json"]),
     "envelopes[0].evidence[0]", "a string matching", "string '../secret.json'"),
]


@pytest.mark.parametrize("mutate,key_path,expected,found", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_scope_is_refused_precisely(tmp_path, mutate, key_path, expected, found):
    data = shipped()
    mutate(data)
    path = write(tmp_path, data)
    with pytest.raises(ScopeError) as info:
        Scope.load(path)
    e = info.value
    assert (e.file, e.key_path) == (str(path), key_path)
    assert expected in e.expected, e.expected
    assert found in e.found, e.found
    msg = str(e)
    assert msg.startswith(f"{path}: {key_path}: expected ") and expected in msg and found in msg


def test_validated_envelope_needs_its_evidence_files_to_exist(tmp_path):
    data = shipped()
    env(data, 1).update(status="validated", evidence=["evidence/h200-parity.json"])
    path = write(tmp_path, data)
    with pytest.raises(ScopeError) as info:
        Scope.load(path)
    assert info.value.key_path == "envelopes[1].evidence[0]"
    assert "'evidence/h200-parity.json', which does not exist" in info.value.found
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence/h200-parity.json").write_text("{}")
    assert Scope.load(path).envelope("h200-validation").status == "validated"


def test_envelopes_that_differ_in_a_dtype_or_in_rows_do_not_overlap(tmp_path):
    data = shipped()
    bf16 = copy.deepcopy(env(data, 0))
    bf16.update(name="gb300-bf16-experts")
    bf16["dtypes"]["experts"] = "bfloat16"
    large = copy.deepcopy(env(data, 0))
    large.update(name="gb300-large", rows_per_step=[128, 256])
    data["envelopes"] += [bf16, large]
    assert len(Scope.load(write(tmp_path, data)).envelopes) == len(shipped()["envelopes"]) + 2


def test_yaml_level_errors_name_the_file_and_line(tmp_path):
    text = DEFAULT_SCOPE_PATH.read_text()
    dup = text.replace("    max_context: 131072\n",
                       "    max_context: 131072\n    max_context: 262144\n")
    path = write(tmp_path, dup, "dup.yaml")
    with pytest.raises(ScopeError) as info:
        Scope.load(path)
    line = dup.splitlines().index("    max_context: 262144") + 1
    assert info.value.key_path == f"line {line}"
    assert info.value.found == "key 'max_context' repeated"
    broken = write(tmp_path, text.replace("tensor_parallel: [8, 16]", "tensor_parallel: [8, 16"),
                   "broken.yaml")
    with pytest.raises(ScopeError, match=r"broken\.yaml: line \d+: expected valid YAML"):
        Scope.load(broken)
    with pytest.raises(ScopeError, match="expected a mapping; found list"):
        Scope.load(write(tmp_path, "- 1\n- 2\n", "list.yaml"))
    with pytest.raises(ScopeError, match="no such scope file"):
        Scope.load(tmp_path / "absent.yaml")


def test_a_directory_or_a_file_that_is_not_utf8_is_a_scope_error_naming_it(tmp_path, capsys):
    """Not IsADirectoryError's traceback, nor a UnicodeDecodeError that names no file."""
    with pytest.raises(ScopeError) as info:
        Scope.load(tmp_path)
    assert str(info.value).startswith(f"{tmp_path}: a directory, not a scope file")
    assert info.value.file == str(tmp_path) and "SCOPE.yaml" in str(info.value)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("model: K3 \u2014 caf\u00e9\n".encode("latin-1", errors="replace"))
    with pytest.raises(ScopeError) as info:
        Scope.load(latin1)
    assert str(info.value).startswith(f"{latin1}: byte ") and "expected UTF-8 text" in str(info.value)
    from vllm.models.kimi_k3.nvidia.latency_specialized.cli import main
    for path in (tmp_path, latin1):
        assert main(["scope", "--scope", str(path)]) == 2
        assert f"k3-decode scope: {path}: " in capsys.readouterr().err


# ------------------------------------------------------------------ deployment admission


@pytest.fixture(scope="module")
def scope() -> Scope:
    return Scope.load()


def gb300(**kw) -> Deployment:
    args = dict(gpu="GB300", tp=16, max_model_len=262144, spec="dspark:7")
    args.update(kw)
    return Deployment.describe(**args)


def h200(**kw) -> Deployment:
    args = dict(gpu="H200", tp=8, max_model_len=131072, expert_dtype="bfloat16")
    args.update(kw)
    return Deployment.describe(**args)


def test_declared_envelope_needs_allow_unvalidated(scope):
    refused = scope.admits(gb300())
    assert not refused
    assert refused.reasons[0].startswith("gb300-tp8-tp16: status declared")
    admitted = scope.admits(gb300(), allow_unvalidated=True)
    assert admitted and admitted.envelope.name == "gb300-tp8-tp16"
    assert any("declared, not validated" in w for w in admitted.warnings)


def test_validated_envelope_admits_without_allow_unvalidated(tmp_path):
    data = shipped()
    env(data, 1).update(status="validated", evidence=["evidence/parity.json"])
    (tmp_path / "evidence").mkdir()
    (tmp_path / "evidence/parity.json").write_text("{}")
    v = Scope.load(write(tmp_path, data)).admits(h200())
    assert v and v.envelope.name == "h200-validation" and v.warnings == ()


@pytest.mark.parametrize("inside,outside,reason", [
    (dict(gpu="GB300"), dict(gpu="B300"), "GPU NVIDIA B300 (sm_103) not in scope [GB300 sm_103, H200 sm_90, H100 sm_90]"),
    (dict(gpu="GB300"), dict(gpu="GB300", compute_capability="10.0"), "not in scope"),
    (dict(tp=16), dict(tp=4), "tensor_parallel 4 not in [8, 16]"),
    (dict(tp=8), dict(tp=32), "tensor_parallel 32 not in [8, 16]"),
    (dict(spec="dspark:7"), dict(spec="dspark:8"),
     "speculative dspark:8 needs 9 tokens per request, not in [1..8]"),
    (dict(spec=None), dict(spec="eagle:3"), "speculative method eagle not in [none, dspark]"),
    (dict(cuda_graphs=True), dict(cuda_graphs=False), "CUDA graphs off (the envelope needs them on)"),
    (dict(weight_dtype="bf16"), dict(weight_dtype="fp16"), "weight dtype float16 is not bfloat16"),
    (dict(expert_dtype="mxfp4"), dict(expert_dtype="nvfp4"), "expert dtype nvfp4 is not mxfp4"),
    (dict(mla_cache_dtype="bfloat16"), dict(mla_cache_dtype="fp8"),
     "MLA latent cache dtype fp8_e4m3 is not bfloat16"),
    (dict(kda_recurrent_dtype="fp32"), dict(kda_recurrent_dtype="bf16"),
     "KDA recurrent state dtype bfloat16 is not float32"),
    (dict(conv_dtype="bfloat16"), dict(conv_dtype="float32"),
     "KDA conv state dtype float32 is not bfloat16"),
])
def test_gb300_boundaries(scope, inside, outside, reason):
    assert scope.admits(gb300(**inside), allow_unvalidated=True)
    v = scope.admits(gb300(**outside), allow_unvalidated=True)
    assert not v and v.envelopes == ()
    assert any(reason in r for r in v.reasons), v.reasons


@pytest.mark.parametrize("inside,outside,reason", [
    (dict(gpu="H200"), dict(gpu="A100"), "GPU NVIDIA A100 (sm_80) not in scope"),
    (dict(tp=1), dict(tp=2), "tensor_parallel 2 not in [1, 8, 16]"),
    (dict(expert_dtype="bfloat16"), dict(expert_dtype="mxfp4"), "expert dtype mxfp4 is not bfloat16"),
])
def test_h200_boundaries(scope, inside, outside, reason):
    assert scope.admits(h200(**inside), allow_unvalidated=True).envelope.name == "h200-validation"
    v = scope.admits(h200(**outside), allow_unvalidated=True)
    assert not v and any(reason in r for r in v.reasons), v.reasons


def test_an_h100_is_admitted_by_its_own_envelope(scope):
    """The H100 has its own envelope (and evidence folder), not the H200's."""
    v = scope.admits(h200(gpu="H100"), allow_unvalidated=True)
    assert v and v.envelope.name == "h100-validation"


def test_context_beyond_the_envelope_is_a_per_step_caveat_not_a_refusal(scope):
    at_limit = scope.admits(h200(max_model_len=131072), allow_unvalidated=True)
    assert not any("context" in w for w in at_limit.warnings)
    beyond = scope.admits(h200(max_model_len=131073), allow_unvalidated=True)
    (caveat,) = [w for w in beyond.warnings if "context" in w]
    assert beyond and caveat.startswith("steps with context over 131072 run the standard path (max_model_len 131073)")
    assert "under vLLM that is every step" in caveat and "--max-model-len 131072 or less" in caveat


def test_context_beyond_the_envelope_is_a_refusal_when_every_step_runs_at_max_model_len(scope):
    """vLLM routes every step at max_model_len: a longer one admits no step, so the verdict is OFF."""
    def under_vllm(max_model_len):
        return dataclasses.replace(h200(max_model_len=max_model_len), steps_at_max_model_len=True)

    assert scope.admits(under_vllm(131072), allow_unvalidated=True)
    beyond = scope.admits(under_vllm(131073), allow_unvalidated=True)
    assert not beyond
    assert any("max_model_len 131073 over context 131072" in r for r in beyond.reasons), beyond.reasons


def test_every_unmet_requirement_of_every_envelope_is_reported(scope):
    v = scope.admits(Deployment.describe(gpu="A100", tp=4))
    assert v.reasons == (
        "GPU NVIDIA A100 (sm_80) not in scope [GB300 sm_103, H200 sm_90, H100 sm_90]",
        "gb300-tp8-tp16: tensor_parallel 4 not in [8, 16], status declared (not validated; "
        "set allow_unvalidated to admit it)",
        "h200-validation: tensor_parallel 4 not in [1, 8, 16], expert dtype mxfp4 is not "
        "bfloat16, status declared (not validated; set allow_unvalidated to admit it)",
        "h100-validation: tensor_parallel 4 not in [1, 8, 16], expert dtype mxfp4 is not "
        "bfloat16, status declared (not validated; set allow_unvalidated to admit it)",
    )
    # a GPU in scope: the other GPU's envelope names the mismatch itself
    v = scope.admits(h200(tp=4), allow_unvalidated=True)
    assert v.reasons == (
        "gb300-tp8-tp16: GPU NVIDIA H200 (sm_90) is not GB300 sm_103, tensor_parallel 4 not in "
        "[8, 16], expert dtype bfloat16 is not mxfp4",
        "h200-validation: tensor_parallel 4 not in [1, 8, 16]",
        "h100-validation: GPU NVIDIA H200 (sm_90) is not H100 sm_90, tensor_parallel 4 not in [1, 8, 16]",
    )


def test_no_cuda_device_is_reported_first(scope):
    d = Deployment(tensor_parallel=8, max_model_len=4096, cuda_present=False)
    v = scope.admits(d, allow_unvalidated=True)
    assert not v and v.reasons[0] == NO_CUDA


# ------------------------------------------------------------------ step admission


@pytest.mark.parametrize("inside,outside,reason", [
    (dict(rows=8), dict(rows=9), "rows 9 not in [1..8, 16, 32, 64]"),
    (dict(rows=16), dict(rows=15), "rows 15 not in"),
    (dict(rows=64), dict(rows=65), "rows 65 not in"),
    (dict(rows=64, tokens_per_request=8), dict(rows=63, tokens_per_request=9),
     "tokens_per_request 9 not in [1..8]"),
    (dict(rows=8, tokens_per_request=2), dict(rows=7, tokens_per_request=2),
     "rows 7 not a multiple of tokens_per_request 2"),
    (dict(max_context=131072), dict(max_context=131073), "context over 131072"),
    (dict(pure_decode=True), dict(pure_decode=False), "step has prefill rows"),
    (dict(tokens_per_request=1), dict(tokens_per_request=None), "requests carry different token counts"),
])
def test_step_boundaries(scope, inside, outside, reason):
    e = scope.envelope("h200-validation")
    base = dict(rows=4, tokens_per_request=1, max_context=1000, pure_decode=True)
    ok = e.admits(StepFacts(**{**base, **inside}))
    assert ok and ok.envelope is e
    no = e.admits(StepFacts(**{**base, **outside}))
    assert not no and any(reason in r for r in no.reasons), no.reasons


def test_random_steps_follow_the_envelope_rule(scope):
    # an independent statement of the rule, checked on seeded random steps
    rng = random.Random(1234)
    e = scope.envelope("gb300-tp8-tp16")
    served_rows = set(range(1, 9)) | {16, 32, 64}
    admitted = 0
    for _ in range(2000):
        q = rng.choice([None, 1, 1, 1, 2, 3, 4, 7, 8, 9, 10])
        rows = rng.choice([*range(1, 18), 24, 31, 32, 33, 63, 64, 65, 80])
        step = StepFacts(rows=rows, tokens_per_request=q,
                         max_context=rng.choice([1, 4096, 1048576, 1048577, 2000000]),
                         pure_decode=rng.random() < 0.8)
        expect = (step.pure_decode and q is not None and 1 <= q <= 8 and step.rows % q == 0
                  and step.rows in served_rows and step.max_context <= 1048576)
        v = e.admits(step)
        assert bool(v) == expect, step
        assert bool(v.reasons) != expect
        admitted += expect
    assert 100 < admitted < 1900  # both sides of the rule are exercised


def test_format_ints_collapses_runs():
    assert format_ints([1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]) == "[1..8, 16, 32, 64]"
    assert format_ints([1, 8, 16]) == "[1, 8, 16]"
    assert format_ints([4, 5, 9]) == "[4, 5, 9]"


def test_a_gpu_is_matched_by_its_whole_name_not_a_substring(scope):
    """An NVIDIA GH200 at sm_90 contains "H200" but is not the H200 the envelope validated:
    it is out of scope, while the H200 under its full device name is admitted."""
    v = scope.admits(h200(gpu="NVIDIA GH200 480GB", compute_capability="9.0"), allow_unvalidated=True)
    assert not v and v.envelopes == ()
    assert v.reasons[0] == "GPU NVIDIA GH200 480GB (sm_90) not in scope [GB300 sm_103, H200 sm_90, H100 sm_90]"
    assert scope.admits(h200(gpu="NVIDIA H200"), allow_unvalidated=True).envelope.name == "h200-validation"
