"""How busy MLA decode's split kernel keeps the SMs, read from Nsight Compute's counters: issue 7's
"one request at 1M keeps every SM busy", measured instead of inferred from the work-unit count.

Per case (heads, q, requests, context) this process runs itself once under `ncu` (the child runs
the case's launches once to compile and warm up, then one launch inside the NVTX range
`mla_step`), and ncu reads, for each kernel of that range (the split kernel and the combine, which
`mla_decode.launch` always runs: it exits at once where a request did not split):

    sm_active_mean = sm__cycles_active.avg / gpc__cycles_elapsed.max   (the mean SM's share of the
                     kernel's cycles with a CTA resident: SM utilisation)
    sm_active_min  = sm__cycles_active.min / gpc__cycles_elapsed.max   (the least busy SM's share)
    dram_pct       = dram__throughput.avg.pct_of_peak_sustained_elapsed
    duration_us    = gpu__time_duration.sum

ncu runs each kernel alone (no PDL overlap with its neighbours) and with `--clock-control none`,
so the card's clocks stay as they are; its durations are not `bench_mla_decode`'s graphed times,
and the counters need the driver's permission to profile (an error says so). Default cases: one
request at 1M and at 32K for TP16's decode (h 6, q 1) and TP8's verify (h 12, q 8), and 64
requests at 32K, where the kernel streams at ~90% of the copy bandwidth, as the saturated
reference.

    python -m vllm.models.kimi_k3.nvidia.benchmarks.mla_sm_activity --out $OUT/mla_sm_activity.json

writes an evidence record (kind "kernel-bench", family "mla") and prints a table last.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..latency_specialized.evidence import write_record
from . import bench_mla_decode
from .bench_skinny_gemm import require_cuda
from .targets import worst

SOURCES = bench_mla_decode.SOURCES + ("vllm/models/kimi_k3/nvidia/benchmarks/mla_sm_activity.py",)
MODULE = "vllm.models.kimi_k3.nvidia.benchmarks.mla_sm_activity"
RANGE = "mla_step"
METRICS = ("sm__cycles_active.avg", "sm__cycles_active.min", "gpc__cycles_elapsed.max",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed", "gpu__time_duration.sum", "launch__grid_size")
DEFAULT_CASES = ("6,1,1,1048576", "12,8,1,1048576", "6,1,1,32768", "12,8,1,32768", "6,1,64,32768")
BUSY_TARGET = 0.9  # issue 7: "the split keeps every SM busy", as the mean SM's share of the kernel
TIME_UNITS_NS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9, "ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
NCU_PLACES = ("/usr/local/cuda/bin/ncu", "/usr/local/cuda-*/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu",
              "/usr/local/NVIDIA-Nsight-Compute*/ncu")


class NcuError(RuntimeError):
    """ncu is missing, failed, or reported something other than the kernels a launch runs."""


def find_ncu() -> str:
    """ncu on PATH, else in the usual CUDA / Nsight Compute install folders (the default CUDA's
    first, then the newest version of each pattern: an old ncu may lack an option used here)."""
    found = shutil.which("ncu") or next((sorted(glob.glob(pat))[-1] for pat in NCU_PLACES if glob.glob(pat)), None)
    if found is None:
        raise NcuError("ncu (Nsight Compute) is neither on PATH nor in " + ", ".join(NCU_PLACES)
                       + ": install Nsight Compute or put its ncu on PATH")
    return found


def parse_case(text: str) -> tuple[int, int, int, int]:
    """'heads,q,requests,context' as four positive integers, with rows = requests · q <= 64."""
    try:
        h, q, r, n = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"case {text!r}: expected heads,q,requests,context (four integers, "
                                         "e.g. 6,1,1,1048576)") from None
    if min(h, q, r, n) < 1 or r * q > 64 or q > 8:
        raise argparse.ArgumentTypeError(f"case {text!r}: heads, q, requests and context must be >= 1, "
                                         "q <= 8 and requests · q <= 64 (the kernel's envelope)")
    return h, q, r, n


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))  # ncu may print thousands separators
    except ValueError:
        return None  # "n/a" and the like: the metric counts as not reported


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu's `--csv` details output (one row per kernel and metric: "ID", "Kernel Name",
    "Metric Name", "Metric Unit", "Metric Value", among other columns; lines before the header are
    ncu's own) as one dict per profiled kernel, in launch order: {"kernel": name, metric: value},
    durations in ns whatever unit ncu chose."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise NcuError("ncu wrote no CSV table (no header line starting with \"ID\")")
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(lines[start:]):
        try:
            kid, name, metric, unit, value = (row["ID"], row["Kernel Name"], row["Metric Name"],
                                              row["Metric Unit"], row["Metric Value"])
        except KeyError as e:
            raise NcuError(f"ncu's CSV has no column {e}: expected the details page (not --page raw)") from None
        if kid is None or not kid.strip().isdigit():
            continue
        k = kernels.setdefault(kid, {"kernel": name})
        v = _number(value)
        if v is None:
            continue
        k[metric] = v * TIME_UNITS_NS[unit] if metric == "gpu__time_duration.sum" and unit in TIME_UNITS_NS else v
    return [kernels[k] for k in sorted(kernels, key=int)]


def summarize(kernels: list[dict]) -> dict:
    """The split kernel's figures (and the combine's duration, when there is one) from the kernels
    of one launch: exactly one kernel whose name does not say "combine"."""
    split = [k for k in kernels if "combine" not in k["kernel"]]
    combine = [k for k in kernels if "combine" in k["kernel"]]
    if len(split) != 1 or len(combine) > 1:
        raise NcuError(f"expected the split kernel and at most one combine in the range, got {[k['kernel'] for k in kernels]}")
    s = split[0]
    missing = [m for m in METRICS if m not in s]
    if missing:
        raise NcuError(f"ncu reported no {missing} for {s['kernel']}")
    elapsed = s["gpc__cycles_elapsed.max"]
    out = {"sm_active_mean": s["sm__cycles_active.avg"] / elapsed, "sm_active_min": s["sm__cycles_active.min"] / elapsed,
           "dram_pct": s["dram__throughput.avg.pct_of_peak_sustained_elapsed"],
           "split_us": s["gpu__time_duration.sum"] / 1e3, "grid": int(s["launch__grid_size"]), "split_kernel": s["kernel"]}
    if combine:
        if "gpu__time_duration.sum" not in combine[0]:
            raise NcuError(f"ncu reported no gpu__time_duration.sum for {combine[0]['kernel']}")
        out["combine_us"] = combine[0]["gpu__time_duration.sum"] / 1e3
    return out


def targets_of(results: list[dict]) -> list[dict]:
    long_one = [r for r in results if r["status"] == "pass" and r["shape"]["requests"] == 1
                and r["shape"]["context"] >= 1 << 20]
    t = worst("one request at 1M: the split kernel's SMs busy (mean share of its cycles with a CTA, ncu)",
              f">= {BUSY_TARGET}", long_one, "sm_active_mean", BUSY_TARGET)
    return [t] if t else []


def run_child(h: int, q: int, r: int, n: int) -> None:
    """The profiled process: the case compiled and warmed up, then one launch inside the NVTX range."""
    case = bench_mla_decode.Case(h, q, r, n, torch.Generator(device="cuda").manual_seed(0))
    out = torch.empty((r * q, h, bench_mla_decode.LATENT), device="cuda", dtype=torch.bfloat16)
    for f in case.launches(out):
        f()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push(RANGE)
    case.kernel(out, 0)()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()


def profile_case(ncu: str, shape: tuple[int, int, int, int], timeout_s: float) -> dict:
    h, q, r, n = shape
    res: dict = {"name": f"h={h} q={q} requests={r} context={n}",
                 "shape": {"heads": h, "q": q, "requests": r, "rows": r * q, "context": n}}
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ncu.csv"
        # raw metric names on every row: a metric that a default section also shows would otherwise
        # come under its label ("Duration") there
        cmd = [ncu, "--csv", "--log-file", str(log), "--print-units", "base", "--print-metric-name", "name",
               "--clock-control", "none",
               "--nvtx", "--nvtx-include", f"{RANGE}/", "--metrics", ",".join(METRICS),
               sys.executable, "-m", MODULE, "--child", f"{h},{q},{r},{n}"]
        # its own session, so that a timeout kills the profiled child too (it would hold GPU memory
        # and ncu's profiling lock through the cases after it); C locale: decimal points, not commas
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=dict(os.environ, LC_ALL="C"))
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            out, err = "", f"ran past {timeout_s:.0f} s"
        text = log.read_text() if log.is_file() else ""
    # ncu's own lines (==ERROR==, ==WARNING==) say why, e.g. ERR_NVGPUCTRPERM: no permission to read
    # the counters; they go to the log file, not to stderr
    said = [line for line in text.splitlines() if line.startswith("==")][-3:]
    if proc.returncode != 0:
        tail = (err or out).strip().splitlines()[-3:]
        return dict(res, status="fail", error=f"ncu exited {proc.returncode}: " + " | ".join(said + tail))
    try:
        res.update(summarize(parse_ncu_csv(text)))
    except NcuError as e:
        return dict(res, status="fail", error=" | ".join([str(e)] + said))
    return dict(res, status="pass")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=parse_case, nargs="+", default=[parse_case(c) for c in DEFAULT_CASES],
                   metavar="H,Q,R,CTX", help="heads,q,requests,context per case")
    p.add_argument("--timeout-s", type=float, default=300.0, help="the most one case's ncu run may take")
    p.add_argument("--child", type=parse_case, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="evidence JSON path")
    args = p.parse_args(argv)
    require_cuda(p)
    if args.child:
        run_child(*args.child)
        return 0
    try:
        ncu = find_ncu()
    except NcuError as e:
        p.error(str(e))
    t0 = time.time()
    results = []
    for shape in args.cases:
        results.append(profile_case(ncu, shape, args.timeout_s))
        print(f"  {results[-1]['name']}: {results[-1]['status']} ({time.time() - t0:.0f} s)", flush=True)
    targets = targets_of(results)
    if args.out:
        write_record(args.out, "kernel-bench", "mla", f"python -m {MODULE} " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:]),
                     SOURCES, results, targets,
                     extra={"timing": "Nsight Compute counters of one launch, each kernel run alone, clocks as found",
                            "ncu": ncu, "wall_s": time.time() - t0})
    print(f"{'case':38s} {'grid':>5s} {'split us':>9s} {'combine':>8s} {'SMs busy':>8s} {'least':>6s} {'DRAM %':>6s}")
    for r in results:
        if r["status"] != "pass":
            print(f"{r['name']:38s} FAIL: {r['error']}")
            continue
        print(f"{r['name']:38s} {r['grid']:5d} {r['split_us']:9.1f} {r.get('combine_us', float('nan')):8.1f} "
              f"{r['sm_active_mean']:8.2f} {r['sm_active_min']:6.2f} {r['dram_pct']:6.1f}")
    for t in targets:
        print(f"target {t['name']} {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'MISSED'}; worst {t['worst_case']})")
    return 0 if all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
