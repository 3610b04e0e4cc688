"""The wheel is an overlay: it adds our subpackages and never an upstream vLLM file."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]
NAMESPACE_DIRS = ["vllm", "vllm/models", "vllm/models/kimi_k3", "vllm/models/kimi_k3/nvidia"]
# modules vLLM 0.33.0 already ships in vllm/models/kimi_k3/nvidia/ (ARCHITECTURE.md §2)
UPSTREAM = {"model.py", "mla.py", "kda.py", "mtp.py", "model_state.py", "dspark_mla.py",
            "kda_metadata.py", "latent_moe_runner.py", "low_latency_gemm.py",
            "ops", "recoverssm", "specialized_decode"}


def test_source_tree_has_no_namespace_init():
    for d in NAMESPACE_DIRS:
        assert not (ROOT / d / "__init__.py").exists(), f"{d}/__init__.py would overwrite vLLM's"


@pytest.mark.slow
def test_wheel_is_a_pure_overlay(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for d in NAMESPACE_DIRS:
        assert f"{d}/__init__.py" not in names
    prefix = "vllm/models/kimi_k3/nvidia/"
    top = {n[len(prefix):].split("/")[0] for n in names if n.startswith(prefix)}
    clash = top & UPSTREAM
    assert not clash, f"wheel would overwrite upstream vLLM modules: {sorted(clash)}"
    for needed in ("SCOPE.yaml", "latency_specialized", "reference", "kernels", "tests"):
        assert needed in top, f"{needed} missing from the wheel"
    assert f"{prefix}latency_specialized/cli.py" in names
    shipped = {n for n in names if n.startswith(f"{prefix}evidence/")}
    committed = {p.relative_to(ROOT).as_posix() for p in (ROOT / prefix / "evidence").glob("*/*.json")}
    assert committed and shipped == committed, "the wheel ships the evidence records as committed"
    assert all(n.startswith(("vllm/models/kimi_k3/nvidia/", "tools/fast_track/", "kimi_k3_latency_specialized-"))
               for n in names), \
        [n for n in names if not n.startswith(prefix)][:5]
