#!/usr/bin/env bash
# GPU-runner job: serve the real Kimi K3 through vLLM 0.33.0 with this backend on, send a
# few requests on loopback, and check what the operator would check: the start-up verdict
# line, a greedy and a grammar-constrained completion, and the path counters in the log.
#   usage: .ci/vllm_gpu_serve.sh MODEL_DIR TP [on|off] [VLLM_SERVE_FLAG...]
# 'on' (the default) requires the backend to turn on and build its executor; 'off' requires it
# to turn itself off with a reason while the standard path still serves both completions (the
# fall-back, as on GB300 today, whose checkpoint's MXFP4 experts the weight binding refuses).
# Needs a runner with the checkpoint on local disk and TP GPUs in one node (multi-node TP16
# needs vLLM's multi-node launch, see docs/fast_track/OPERATOR.md); never run on CPU CI.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR="${1:?model directory}"
TP="${2:?tensor-parallel size}"
EXPECT="${3:-on}"
shift $(($# < 3 ? $# : 3))  # what is left: vllm serve flags (--max-model-len, --moe-backend)
case "$EXPECT" in on|off) ;; *) echo "third argument: 'on' or 'off', not '$EXPECT'"; exit 2;; esac
PORT="${K3_SERVE_PORT:-8765}"
VENV="${RUNNER_TEMP:-/tmp}/k3-vllm-serve-venv"
LOG="${RUNNER_TEMP:-/tmp}/k3-vllm-serve.log"

# NVLink multicast off, as on every shared H200 host (distributed.py's MULTICAST_OFF): vLLM's
# own NCCL and symmetric-memory collectives would otherwise use it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q vllm==0.33.0
"$VENV/bin/pip" install -q --no-deps .

"$VENV/bin/vllm" serve "$MODEL_DIR" --host 127.0.0.1 --port "$PORT" --tensor-parallel-size "$TP" \
  --additional-config '{"decode_backend": "latency_specialized", "allow_unvalidated": true}' "$@" \
  > "$LOG" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT

for _ in $(seq 1 240); do  # up to 40 minutes for weights and graph capture
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then echo "vllm serve exited early:"; tail -50 "$LOG"; exit 1; fi
  sleep 10
done
curl -sf "http://127.0.0.1:$PORT/health" > /dev/null || { echo "server not healthy in time"; tail -50 "$LOG"; exit 1; }

complete() {
  curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d "$1"
}
complete '{"model": "'"$MODEL_DIR"'", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}' \
  | python3 -c 'import json,sys; t=json.load(sys.stdin)["choices"][0]["text"]; print("greedy:", repr(t)); assert t.strip()'
complete '{"model": "'"$MODEL_DIR"'", "prompt": "Answer in JSON:", "max_tokens": 64, "temperature": 0.7, "seed": 1,
           "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema":
             {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}}' \
  | python3 -c 'import json,sys; t=json.load(sys.stdin)["choices"][0]["text"]; print("json:", t); assert "ok" in json.loads(t)'

grep -m1 "Kimi K3 latency_specialized decode O[NF]" "$LOG" || echo "no verdict line in $LOG"
if [ "$EXPECT" = off ]; then
  # the verdict may come at start-up (scope) or at the first forward (weight binding)
  grep -m1 "Kimi K3 latency_specialized decode OFF:" "$LOG" || { echo "the backend did not say it is off"; exit 1; }
  if grep -q "the specialized executor runs admitted steps" "$LOG"; then echo "the executor was built"; exit 1; fi
  exit 0
fi
grep -q "Kimi K3 latency_specialized decode ON" "$LOG" || { echo "the backend did not turn on"; exit 1; }
# built over vLLM's caches at the first warm-up forward, and never turned off afterwards
grep -q "the specialized executor runs admitted steps" "$LOG" || { echo "the executor was not built"; exit 1; }
if grep -m1 "Kimi K3 latency_specialized decode OFF:" "$LOG"; then echo "the backend turned itself off"; exit 1; fi
grep -m3 "Kimi K3 latency_specialized" "$LOG"
