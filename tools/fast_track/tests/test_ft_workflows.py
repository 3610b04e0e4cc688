"""The CI workflows: actionlint-clean, install as the README does, call only commands that exist."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ..cli import _parser

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
        assert (ROOT / "vllm/models/kimi_k3/nvidia" / source).is_file(), source
    tests = "\n".join(p.read_text() for p in (ROOT / "vllm/models/kimi_k3/nvidia/tests").glob("test_*.py"))
    for selected in re.findall(r"pytest -q -k (\w+)", scripts):
        assert re.search(rf"def test_\w*{selected}", tests), f"-k {selected} selects no test"
