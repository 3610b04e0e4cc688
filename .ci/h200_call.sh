# Sourced first by a command on the lent H200 (the `run` tool), so that each call builds,
# checks and times several things, within its limit, and everything it wrote comes back:
#
#   source .ci/h200_call.sh
#   step moe_test 120 python3 -m pytest -q -p no:cacheprovider -m gpu vllm/models/kimi_k3/nvidia/tests/test_moe_kernels.py
#   step cov 120 record_coverage vllm/models/kimi_k3/nvidia/tests/test_specialized_steps_cuda.py
#   refresh_stale        # every stale GPU record's command, as steps (.ci/h200_refresh.py)
#   overlay_step judge 200 python3 -m ...   # a branch's code (.ci/carry_overlay.sh), beside HEAD's records
#   gpu_memory_log       # first, to learn the peak memory of what ran (printed at exit)
#
# Needs, from the CPU side: `.devwheels/` carried (`bash ../shared/device/cutedsl_wheels.sh`,
# plus a cp312 coverage wheel dropped there for record_coverage, and `bash .ci/carry_xgrammar.sh`
# for the structured-output test), and K3_COMMIT set to the checked-out commit (a `.git` in the
# device copy may name another). GPU tests write their
# records into $W/ev (K3_EVIDENCE_DIR), except the preserved-feature tests (test_features_cuda.py),
# which write none: run those through `python3 -m tools.fast_track.cli record-tests`, as
# refresh_stale does (2026-12-06: a plain pytest step passed and left no record); benchmarks
# take `--out $W/ev`. On exit $W is packed into
# $OUT/results.tgz: the tool returns only a few files, so one archive holds every record and log.
# A step that could overrun BUDGET seconds (default 570) since the start is skipped, and says so.

# every record carries it as its `commit`: unset, or a value that is no sha (2026-12-05: "none",
# from a file a call script meant to read it from), would tie them to no commit
[[ "${K3_COMMIT:-}" =~ ^[0-9a-f]{40}$ ]] || { echo "h200_call: set K3_COMMIT to the full 40-hex sha of the checked-out commit, \$(git rev-parse HEAD) on the CPU side (got '${K3_COMMIT:-}')"; exit 2; }
# the device copy's .git can be older than the tree that travels (2026-12-03, 2026-12-04), so a sha
# taken from it there names a commit that is not what runs
# (markdown files, the source of no record, may be held back from a call when the tree, CuTe DSL and
# xgrammar together pass the 64 MiB carry limit, as on 2026-12-05 and 2026-12-07: .ci/carry_size.py names them)
if [ "$K3_COMMIT" = "$(git rev-parse HEAD 2>/dev/null)" ] &&
   [ -n "$(git status --porcelain --untracked-files=no -- . ':(exclude,glob)**/*.md' 2>/dev/null)" ]; then
  echo "h200_call: K3_COMMIT is this copy's .git HEAD, but the tracked files differ from that commit (the copy's .git is older than its tree): set K3_COMMIT to \$(git rev-parse HEAD) computed on the CPU side, where the tree was committed"
  exit 2
fi
# the records go to the folder of the card they ran on, evidence/h200/ or evidence/h100/ (SCOPE.yaml
# validates the same envelope on both; the pool lends H100s when no H200 comes, as on 2026-12-05):
# another card stops the call before it spends device time; K3_ANY_GPU=1 lets a judging call run
# anyway (its relative timings hold on the card it ran on, and its records are no one's evidence)
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU_NAME" in
  *H200*) K3_GPU_FOLDER=h200 ;;
  *H100*) K3_GPU_FOLDER=h100 ;;
  *) if [[ "${K3_ANY_GPU:-0}" != 1 ]]; then
       echo "h200_call: this card is '${GPU_NAME:-none}', not an H200 or H100: nothing run (K3_ANY_GPU=1 runs anyway, for figures that are not records)"
       exit 3
     fi
     K3_GPU_FOLDER=none ;;
esac
export K3_GPU_FOLDER
echo "h200_call: ${GPU_NAME:-no GPU}: its records belong in evidence/$K3_GPU_FOLDER/"
export FAST_TRACK_COMMIT=${FAST_TRACK_COMMIT:-$K3_COMMIT}
python3 -c "import tarfile, glob; tarfile.open(glob.glob('.devwheels/cutedsl-*.tar.xz')[0]).extractall('/tmp/site', filter='tar')" ||
  { echo "h200_call: no .devwheels/cutedsl-*.tar.xz: carry .devwheels (../shared/device/cutedsl_wheels.sh)"; exit 2; }
# the rest of what is carried: a coverage wheel (record_coverage) and xgrammar (.ci/carry_xgrammar.sh)
python3 -c "import zipfile, tarfile, glob; [zipfile.ZipFile(w).extractall('/tmp/site') for w in glob.glob('.devwheels/coverage-*.whl')]; [tarfile.open(t).extractall('/tmp/site', filter='tar') for t in glob.glob('.devwheels/xgrammar-*.tar.xz')]"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site:$PWD PYTHONUNBUFFERED=1
W=$OUT/w
export W K3_EVIDENCE_DIR=$W/ev
mkdir -p "$K3_EVIDENCE_DIR"
trap 'gpu_memory_peak; tar czf "$OUT/results.tgz" -C "$OUT" w && rm -rf "$W"' EXIT
BUDGET=${BUDGET:-570}

# [EXPECT=S] step NAME SECONDS CMD...: CMD under a time limit (cut to what is left of BUDGET), its
# output in $W/NAME.log, the log's tail printed; skipped when the S seconds it is expected to take
# (default: its limit) would overrun BUDGET; returns CMD's exit status (125 when skipped), so
# `step a ... && step b ...` gates b on a
step() {
  local name=$1 limit=$2 t=$SECONDS rc
  shift 2
  if (( SECONDS + ${EXPECT:-$limit} > BUDGET )); then echo "=== [${SECONDS}s] $name: skipped (it could overrun BUDGET=$BUDGET s)"; return 125; fi
  if (( limit > BUDGET - SECONDS )); then limit=$((BUDGET - SECONDS)); fi
  echo "=== [${SECONDS}s] $name: $*"
  # a function of this file (record_coverage) runs in a child bash, which timeout can start
  if declare -F "$1" > /dev/null; then set -- bash -c '"$@"' _ "$@"; fi
  timeout "$limit" "$@" > "$W/$name.log" 2>&1
  rc=$?
  echo "    $name: exit $rc after $((SECONDS - t)) s"
  tail -"${TAILN:-8}" "$W/$name.log"
  return $rc
}

# gpu_memory_log: every GPU's used memory (nvidia-smi, every 5 s) into $W/gpu_mem.log while the
# call runs; gpu_memory_peak (also at exit) stops it and prints the peak, which says how many
# checks can share a GPU (LANES; .ci/h200_refresh.py has what was measured)
gpu_memory_log() {
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 5 > "$W/gpu_mem.log" 2>&1 &
  GPU_MEMORY_LOG=$!
  # out of the job table, so that a bare `wait` for a call's lanes does not wait on this endless
  # loop too (2026-12-05: it held a judging call until its 600 s limit)
  disown "$GPU_MEMORY_LOG"
}
gpu_memory_peak() {
  [ -n "${GPU_MEMORY_LOG:-}" ] || return 0
  kill "$GPU_MEMORY_LOG" 2>/dev/null
  GPU_MEMORY_LOG=
  echo "peak GPU memory: $(awk -F', *' '$2 > m {m = $2} END {print m + 0}' "$W/gpu_mem.log") MiB"
}

# record_coverage PYTEST_ARGS...: the GPU tests under coverage of kernels/, recorded here, where
# `fast-track record-coverage` can read the GPU and the report's paths are this tree's
record_coverage() {
  local model=vllm/models/kimi_k3/nvidia
  python3 -m coverage run --source="$model/kernels" -m pytest -q -p no:cacheprovider -m gpu "$@" &&
    python3 -m coverage json -o "$W/coverage.json" &&
    python3 -m tools.fast_track.cli record-coverage --model "$model" --coverage "$W/coverage.json" \
      --out "$K3_EVIDENCE_DIR/kernels_coverage.json" --command "coverage run --source=$model/kernels -m pytest -q -m gpu $*"
}
export -f record_coverage

# overlay_step NAME SECONDS CMD...: `step`, run over a copy of this tree with .nb9/overlay's files
# laid on top (.ci/carry_overlay.sh REV on the CPU side): REV's code judged in the call that makes
# HEAD's records. What it writes belongs in $W/judge, never in $K3_EVIDENCE_DIR: no record may
# name HEAD's commit for REV's code
overlay_step() {
  [ -f .nb9/overlay/REV ] || { echo "overlay_step: no .nb9/overlay (run .ci/carry_overlay.sh REV and carry .nb9)"; return 2; }
  rm -rf /tmp/overlay && mkdir -p /tmp/overlay "$W/judge" && cp -r vllm tools /tmp/overlay/ &&
    cp -r .nb9/overlay/. /tmp/overlay/
  echo "overlay_step: $(cat .nb9/overlay/REV) over this tree in /tmp/overlay"
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" bash -c 'cd /tmp/overlay && K3_EVIDENCE_DIR="$W/judge" PYTHONPATH="/tmp/overlay:$PYTHONPATH" "$@"' _ "$@"
}

# refresh_stale: a step for each stale record of this card's folder (K3_GPU_FOLDER) and each GPU
# record only another card has, its command rewritten for this machine by .ci/h200_refresh.py;
# what does not fit in BUDGET is skipped and said; on a host of several GPUs (GPUS, default:
# nvidia-smi's count) one queue of steps per GPU, side by side; LANES=L (default 1) runs the
# checks in L queues per GPU, then the timed records alone
refresh_stale() {
  local gpus
  gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  (( gpus >= 1 )) || gpus=1
  local card=()
  [[ "$K3_GPU_FOLDER" == none ]] || card=(--card "$K3_GPU_FOLDER")
  python3 .ci/h200_refresh.py --gpus "$gpus" --lanes "${LANES:-1}" "${card[@]}" "$@" > "$W/refresh.sh" || return
  echo "=== [${SECONDS}s] refresh_stale: $(grep -cE '^(EXPECT=[0-9]+ )?step ' "$W/refresh.sh") step(s)"
  # shellcheck disable=SC1091
  source "$W/refresh.sh"
}
