"""The CI workflows: actionlint-clean, install as the README does, call only commands that exist."""

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ..cli import _parser
from ..records import expand_sources

ROOT = Path(__file__).resolve().parents[3]
WORKFLOWS = ROOT / ".github" / "workflows"
LINT_CONFIG = ROOT / "tools" / "fast_track" / "actionlint.yaml"
GITHUB_LABELS = {"self-hosted", "linux", "x64", "arm64", "ubuntu-latest"}


def _workflow(name):
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _run_scripts(name):
    return [step["run"] for job in _workflow(name)["jobs"].values()
            for step in job.get("steps", []) if "run" in step]


@pytest.mark.skipif(shutil.which("actionlint") is None,
                    reason="actionlint is not installed (the [test] extra brings it)")
def test_workflows_pass_actionlint():
    files = sorted(str(p.relative_to(ROOT)) for p in WORKFLOWS.glob("*.yml"))
    out = subprocess.run(["actionlint", "-config-file", str(LINT_CONFIG), *files], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (the [test] extra brings it)")
def test_the_cpu_workflows_ruff_commands_pass():
    """Every ruff command of cpu.yml, run as the workflow runs it: CI on a clean checkout fails
    where the workflow's lint step would (it once let 16 over-long lines of tools/fast_track by)."""
    commands = [line.strip() for script in _run_scripts("cpu.yml") for line in script.splitlines()
                if line.strip().startswith("ruff check")]
    assert len(commands) == 2, commands
    for command in commands:
        out = subprocess.run(command.split(), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{command}:\n{out.stdout}{out.stderr}"


def test_cpu_workflow_installs_as_the_readme_does_and_runs_every_check():
    readme = (ROOT / "README.md").read_text()
    install = re.search(r"^pip install .*$", readme, re.MULTILINE).group(0)
    scripts = "\n".join(_run_scripts("cpu.yml"))
    assert install in scripts.splitlines()
    assert "python -m pytest -q vllm/models/kimi_k3/nvidia/tests tools/fast_track/tests" in scripts
    assert 'fast-track check --base "$base" --report "$GITHUB_STEP_SUMMARY"' in scripts
    assert "actionlint -config-file tools/fast_track/actionlint.yaml" in scripts
    assert "ruff check --config tools/fast_track/ruff.toml ." in scripts


def test_gpu_workflow_has_a_job_per_runner_kind_with_known_labels():
    jobs = _workflow("gpu.yml")["jobs"]
    labels = {name: json.loads(job["with"]["runs-on"]) for name, job in jobs.items()}
    assert {"h200"} <= set(labels["h200"])
    assert {"gb300", "tp8"} <= set(labels["gb300-tp8"])
    assert {"gb300", "tp16"} <= set(labels["gb300-tp16"])
    custom = set(yaml.safe_load(LINT_CONFIG.read_text())["self-hosted-runner"]["labels"])
    used = set().union(*labels.values())
    assert used - GITHUB_LABELS == custom
    assert all(job["uses"] == "./.github/workflows/gpu-run.yml" for job in jobs.values())


def test_gpu_steps_call_only_modules_and_subcommands_that_exist():
    scripts = "\n".join(_run_scripts("gpu-run.yml") + _run_scripts("cpu.yml"))
    modules = set(re.findall(r"python -m (vllm\.[\w.]+)", scripts))
    assert modules, "the GPU workflow runs no module of the model"
    for module in modules:
        path = ROOT / (module.replace(".", "/") + ".py")
        assert path.is_file(), f"{module} is called by a workflow but {path} does not exist"
    subcommands = set(re.findall(r"fast-track ([a-z][a-z-]+)", scripts))
    known = set(_parser()._subparsers._group_actions[0].choices)
    assert subcommands and subcommands <= known, subcommands - known
    for source in re.findall(r'--source "\$MODEL/([\w/.]+)"', scripts):
        assert (ROOT / "vllm/models/kimi_k3/nvidia" / source).exists(), source
    tests = "\n".join(p.read_text() for p in (ROOT / "vllm/models/kimi_k3/nvidia/tests").glob("test_*.py"))
    selections = [w for c in _commands("gpu-run.yml") for i, a in enumerate(c) if a == "-k"
                  for w in c[i + 1].split()]
    assert selections, "the GPU workflow selects no test with -k"
    for selected in set(selections) - {"and", "or", "not"}:
        assert re.search(rf"def test_\w*{selected}", tests), f"-k {selected} selects no test"


MODEL = "vllm/models/kimi_k3/nvidia"
# the runner kinds' record folders: the H200's, and the H100's that holds the same envelope
GPU_FOLDERS = [ROOT / MODEL / "evidence" / kind for kind in ("h200", "h100")]
OUT_FLAGS = ("--out", "--table", "--out-dir")


def _commands(name):
    """Each command of the workflow's run scripts as its words, continuation lines joined and
    $MODEL set; comments dropped."""
    out = []
    for script in _run_scripts(name):
        for line in script.replace("\\\n", " ").splitlines():
            words = shlex.split(line.replace("$MODEL", MODEL), comments=True)
            if words:
                out.append(words)
    return out


def _record_written(words):
    """The committed GPU record a workflow command writes (its file name), or None."""
    for i, a in enumerate(words[:-1]):
        if a == "--out" and words[i + 1].startswith("$EVIDENCE"):
            name = words[i + 1].removeprefix("$EVIDENCE").strip("/")
            if not name and "--name" in words:  # decode_latency: a folder and the record's name
                name = words[words.index("--name") + 1] + ".json"
            return name if name.endswith(".json") else None  # a plot is no record
    return None


def _as_run(words):
    """A command's words with where it writes left out and `python3` read as `python`; the runner
    kind's TP sizes (`--tps $TP`) are the benchmark's default on the H200 (gpu.yml)."""
    out, skip = [], False
    for i, a in enumerate(words):
        if skip:
            skip = False
        elif a in OUT_FLAGS or (a == "--tps" and words[i + 1] == "$TP"):
            skip = True
        else:
            out.append("python" if a == "python3" else a)
    return out


def test_the_gpu_workflow_writes_the_committed_records_as_they_were_made():
    """A record the GPU workflow writes keeps its committed name, command and sources: a workflow
    that drifted from the records (a sanitizer record without gemm_store.py, the split-K counters'
    file, which item 9 then found unchecked; features over 5 files where the record hashes 58;
    kernels-coverage.json beside kernels_coverage.json) refreshes nothing, and the gate fails."""
    assert _workflow("gpu.yml")["jobs"]["h200"]["with"]["tp"].split() == ["1", "8", "16"]
    written = [(w, _record_written(w)) for w in _commands("gpu-run.yml")]
    written = [(w, name) for w, name in written if name]
    for words, name in written:
        path = next((folder / name for folder in GPU_FOLDERS if (folder / name).is_file()), None)
        assert path is not None, f"{name}: the workflow writes a record not committed ({' '.join(words)})"
        record = json.loads(path.read_text())
        command = shlex.split(record["command"])
        if words[:2] in (["fast-track", "record-sanitizer"], ["fast-track", "record-tests"]):
            sources = [words[i + 1] for i, a in enumerate(words) if a == "--source"]
            kept = [s for s in record["sources"] if (ROOT / s).exists()]
            assert set(expand_sources(ROOT, sources)) >= set(kept), f"{name}: the workflow hashes less"
            inner = command[command.index("python3"):] if words[1] == "record-sanitizer" else command
            assert _as_run(words[words.index("--") + 1:]) == _as_run(inner), name
        elif words[:2] == ["fast-track", "record-coverage"]:
            assert words[words.index("--command") + 1] == record["command"], name
        else:
            assert _as_run(words) == _as_run(command), name
    assert len(written) >= 8, written  # coverage, features, three sanitizer runs, decode, eval, skinny bench


def test_each_serving_job_expects_the_verdict_its_envelope_and_binding_allow():
    """A serving job expects ON only where the backend can turn on: the card's envelope holds BF16
    experts (the weight binding refuses quantized ones), vLLM's MoE backend keeps the checkpoint's
    layout, and max_model_len is the envelope's context. Elsewhere it must check the fall-back."""
    scope = yaml.safe_load((ROOT / "vllm/models/kimi_k3/nvidia/SCOPE.yaml").read_text())
    inputs = _workflow("gpu-run.yml")[True]["workflow_call"]["inputs"]  # yaml reads `on:` as True
    serving = {name: job["with"] for name, job in _workflow("gpu.yml")["jobs"].items()
               if job["with"].get("serve-tp")}
    assert serving, "no GPU job serves the model through vLLM"
    for name, args in serving.items():
        labels = set(json.loads(args["runs-on"]))
        envelope = next(e for e in scope["envelopes"] if e["gpu"]["name"].lower() in labels)
        assert int(args["serve-tp"]) in envelope["tensor_parallel"], name
        expect = args.get("serve-expect", inputs["serve-expect"]["default"])
        flags = shlex.split(args.get("serve-flags", ""))
        can_turn_on = envelope["dtypes"]["experts"] == "bfloat16"
        assert expect == ("on" if can_turn_on else "off"), (name, envelope["name"])
        if expect == "on":
            assert flags[flags.index("--moe-backend") + 1] == "triton", name
            assert int(flags[flags.index("--max-model-len") + 1]) == envelope["max_context"], name


def test_the_serving_script_refuses_an_unknown_expectation_before_installing_anything():
    out = subprocess.run(["bash", ".ci/vllm_gpu_serve.sh", "/nonexistent", "8", "maybe"], cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "'on' or 'off', not 'maybe'" in out.stdout, out.stdout + out.stderr
