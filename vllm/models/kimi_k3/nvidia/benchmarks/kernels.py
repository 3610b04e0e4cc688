"""One call on the GPU: every kernel family's GPU tests (kernel-test evidence) and benchmark
(kernel-bench evidence), then a short table.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.kernels --out DIR [--only gemm norms kda mla moe]
                                                           [--tests-only]

Each family runs in its own process (a failing or hanging family does not take the others
with it), writing its JSON records into DIR. Pass the git commit as K3_COMMIT on the device
copy (its .git, if any, may name an older commit): the records carry it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from .bench_skinny_gemm import require_cuda

TESTS = "vllm/models/kimi_k3/nvidia/tests"
BENCH = "vllm.models.kimi_k3.nvidia.benchmarks"

# family -> (GPU test files, its benchmarks: (module, arguments given the output dir) each)
FAMILIES = {
    "gemm": (("test_skinny_gemm.py",), (("bench_skinny_gemm", lambda d: ["--out", str(d / "skinny_gemm_bench.json")]),)),
    "norms": (("test_norm_kernels.py", "test_situ_mul_kernel.py"), (("bench_norms", lambda d: ["--out-dir", str(d)]),)),
    "kda": (("test_kda_decode_kernel.py",),
            (("bench_kda_decode", lambda d: ["--out", str(d / "kda_decode_bench.json")]),)),
    "mla": (("test_mla_decode_kernel.py", "test_mla_cache_write.py"),
            (("bench_mla_decode", lambda d: ["--out", str(d / "mla_decode_bench.json")]),)),
    # the routed experts alone, then the whole layer as the step runs it (issue 5's two targets)
    "moe": (("test_moe_kernels.py",), (("bench_moe", lambda d: ["--out", str(d / "moe_bench.json")]),
                                       ("bench_moe_layer", lambda d: ["--out", str(d / "moe_layer_bench.json")]))),
}


def _run(cmd: list[str], env: dict[str, str], timeout: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    print("$", " ".join(cmd), flush=True)
    try:
        rc = subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    return rc, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory for the evidence JSON records")
    ap.add_argument("--only", nargs="*", choices=sorted(FAMILIES), default=None)
    ap.add_argument("--tests-only", action="store_true", help="skip the benchmarks")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per test run or benchmark")
    args = ap.parse_args(argv)
    require_cuda(ap)  # on a CPU host every GPU test would skip, and the table would call that ok
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, K3_EVIDENCE_DIR=str(out), PYTHONUNBUFFERED="1")
    rows = []
    for fam in args.only or FAMILIES:
        tests, benches = FAMILIES[fam]
        t_rc, t_s = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                          *(f"{TESTS}/{t}" for t in tests)], env, args.timeout)
        b_rc, b_s = None, 0.0
        for bench, bench_args in () if args.tests_only else benches:
            rc, took = _run([sys.executable, "-m", f"{BENCH}.{bench}", *bench_args(out)], env, args.timeout)
            b_rc, b_s = (rc if b_rc in (None, 0) else b_rc), b_s + took
        rows.append((fam, t_rc, t_s, b_rc, b_s))
    print(f"\n{'family':8} {'tests':>8} {'s':>6} {'bench':>8} {'s':>6}")
    for fam, t_rc, t_s, b_rc, b_s in rows:
        bench = "skipped" if b_rc is None else ("ok" if b_rc == 0 else f"rc {b_rc}")
        print(f"{fam:8} {'ok' if t_rc == 0 else f'rc {t_rc}':>8} {t_s:6.0f} {bench:>8} {b_s:6.0f}")
    print("records:", ", ".join(sorted(p.name for p in out.glob("*.json"))) or "none")
    return 0 if all(t == 0 and b in (None, 0) for _, t, _, b, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
