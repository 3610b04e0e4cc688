"""Items `scope-valid` and `default-unchanged`, and the schema validator behind the first."""

import json
from pathlib import Path

import pytest
import yaml

from ..items import FAIL, NEEDS_HUMAN, PASS
from ..schema import SchemaUnsupported, Validator
from .conftest import MODEL, SCOPE, review_items

ROOT = Path(__file__).resolve().parents[3]


def _rewrite_scope(repo, old, new):
    path = repo.root / MODEL / "SCOPE.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_a_schema_error_names_the_key_path_and_line(repo):
    _rewrite_scope(repo, "rows: [1, 2, 4]", "rows: [1, 0, 4]")
    item = review_items(repo.root)["scope-valid"]
    assert item.status == FAIL
    (finding,) = item.findings
    assert finding.message.startswith("envelopes[0].rows[1]: expected at least 1")
    assert (finding.path, finding.line) == (f"{MODEL}/SCOPE.yaml", 9)


def test_unknown_and_missing_keys_are_both_reported(repo):
    _rewrite_scope(repo, "    status: validated\n", "    stauts: validated\n")
    messages = [f.message for f in review_items(repo.root)["scope-valid"].findings]
    assert any("missing required key 'status'" in m for m in messages)
    assert any("envelopes[0].stauts: unknown key 'stauts'" in m for m in messages)


def test_a_repeated_key_and_a_yaml_syntax_error_fail(repo):
    _rewrite_scope(repo, "backend: fast_path\n", "backend: fast_path\nbackend: other\n")
    item = review_items(repo.root)["scope-valid"]
    assert item.status == FAIL and "'backend' repeated" in item.findings[0].message
    assert item.findings[0].line == 3
    _rewrite_scope(repo, "rows: [1, 2, 4]", "rows: [1, 2, 4")
    item = review_items(repo.root)["scope-valid"]
    assert item.status == FAIL and item.summary == "SCOPE.yaml is not valid YAML"


def test_a_model_copy_of_the_schema_must_match_the_shared_one(repo):
    shared = (repo.root / "docs/fast_track/scope.schema.json").read_text()
    repo.write(f"{MODEL}/scope.schema.json", shared)
    assert review_items(repo.root)["scope-valid"].status == PASS
    repo.write(f"{MODEL}/scope.schema.json", shared.replace('"minimum": 1', '"minimum": 0'))
    item = review_items(repo.root)["scope-valid"]
    assert item.status == FAIL
    assert item.findings[0].path == f"{MODEL}/scope.schema.json"


def test_repeated_envelope_names_fail(repo):
    second = SCOPE.split("envelopes:\n")[1].replace("validated", "declared")
    path = repo.root / MODEL / "SCOPE.yaml"
    path.write_text(path.read_text() + second)
    item = review_items(repo.root)["scope-valid"]
    assert [f.message for f in item.findings] == ["envelope name 'h200' used twice"]


def test_a_non_auto_default_fails_at_its_line(repo):
    path = repo.root / MODEL / "options.py"
    path.write_text(path.read_text().replace('= "auto"', '= "fast_path"'))
    item = review_items(repo.root)["default-unchanged"]
    assert item.status == FAIL
    assert (item.findings[0].path, item.findings[0].line) == (f"{MODEL}/options.py", 7)


def test_defaults_in_parameters_and_get_calls_are_found(repo):
    repo.write(f"{MODEL}/hook.py", "def configure(cfg, decode_backend=None):\n"
                                   "    return cfg.get('decode_backend', 'fast_path')\n")
    item = review_items(repo.root)["default-unchanged"]
    assert item.status == FAIL
    bad = [f for f in item.findings if "'fast_path'" in f.message]
    assert [(f.path, f.line) for f in bad] == [(f"{MODEL}/hook.py", 2)]
    assert any(f.line == 1 and "None" in f.message for f in item.findings)


def test_backend_auto_or_no_default_or_an_expression(repo):
    _rewrite_scope(repo, "backend: fast_path", "backend: auto")
    item = review_items(repo.root)["default-unchanged"]
    assert item.status == FAIL and "never 'auto'" in item.findings[0].message
    _rewrite_scope(repo, "backend: auto", "backend: fast_path")
    path = repo.root / MODEL / "options.py"
    path.write_text(path.read_text().replace('= "auto"', "= DEFAULT"))
    assert review_items(repo.root)["default-unchanged"].status == NEEDS_HUMAN
    path.unlink()
    item = review_items(repo.root)["default-unchanged"]
    assert item.status == FAIL and "no default for decode_backend found" in item.findings[0].message


# ---------------------------------------------------------------- the validator itself


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer"}, 3, True),  # a YAML boolean is not an integer
    ({"const": 1}, 1, True),
    ({"enum": ["a", "b"]}, "b", "c"),
    ({"type": "string", "pattern": "^x+$"}, "xx", "xy"),
    ({"type": "string", "minLength": 2}, "ab", "a"),
    ({"type": "array", "minItems": 1, "uniqueItems": True}, [1, 2], [1, 1]),
    ({"type": "object", "required": ["a"]}, {"a": 1}, {"b": 1}),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"a": 1}, {"a": "x"}),
    ({"$defs": {"n": {"minimum": 2}}, "items": {"$ref": "#/$defs/n"}}, [2, 3], [2, 1]),
])
def test_each_keyword_accepts_and_refuses(schema, good, bad):
    validator = Validator(schema)
    assert validator.errors(good) == []
    assert len(validator.errors(bad)) == 1


def test_a_keyword_the_validator_does_not_know_is_refused():
    with pytest.raises(SchemaUnsupported, match="oneOf"):
        Validator({"properties": {"a": {"oneOf": [{"type": "string"}]}}})


def test_the_real_scope_validates_and_a_broken_copy_does_not():
    schema_path = ROOT / "docs/fast_track/scope.schema.json"
    scope_path = ROOT / "vllm/models/kimi_k3/nvidia/SCOPE.yaml"
    if not schema_path.is_file() or not scope_path.is_file():
        pytest.skip("this checkout has no Kimi K3 SCOPE.yaml or shared schema")
    validator = Validator(json.loads(schema_path.read_text()))
    scope = yaml.safe_load(scope_path.read_text())
    assert validator.errors(scope) == []
    scope["envelopes"][0]["gpu"]["compute_capability"] = 10.3  # unquoted in YAML: a float
    (error,) = validator.errors(scope)
    assert error.path == "envelopes[0].gpu.compute_capability"
