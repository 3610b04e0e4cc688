"""`fast-track record-sanitizer`: run a command under compute-sanitizer, once per tool, and record it.

    fast-track record-sanitizer --out FILE --source K [--source K ...] [--tool racecheck ...]
                                [--kernel-name SUBSTRING] -- CMD...

Each tool (default: racecheck and synccheck, the two that see cross-thread ordering
bugs) runs `compute-sanitizer --tool T --error-exitcode 1 CMD...`; its result passes
when the command exits 0 and the sanitizer reports 0 errors. The record (kind
`sanitizer`) lists the kernel files given as `--source`, so item `sanitizer` can match
it to the synchronising kernels and judge its freshness. CMD should drive those kernels
hard: the GPU tests of the kernel and its stress test.

`--kernel-name` checks only the kernels whose name contains SUBSTRING (compute-sanitizer's
`--kernel-name kns=`): a test's reference side runs library kernels too, and racecheck
reports hazards inside cuBLAS's own GEMMs that are not the change's. The record says which
kernels were checked. Prefer a command with no library kernel in it: on the H200
(compute-sanitizer 2025.3.1, 2026-12-03) racecheck with any kernel filter stopped at the
first CuTe DSL kernel with "Internal Sanitizer Error: failed to handle a hardware exception",
while the same run unfiltered checked it cleanly.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from .records import record_head, write_json

DEFAULT_TOOLS = ("racecheck", "synccheck")
# memcheck/synccheck end with "ERROR SUMMARY: N errors"; racecheck with
# "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)"
_SITE = re.compile(r"access at (\S+?)\+0x")
_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+error"
                      r"|RACECHECK SUMMARY:\s*\d+\s+hazards? displayed\s*\((\d+)\s+error")


def _filter(kernel_name: str | None) -> list[str]:
    return ["--kernel-name", f"kns={kernel_name}"] if kernel_name else []


def run_tool(tool: str, command: list[str], timeout_s: int, kernel_name: str | None = None) -> dict[str, Any]:
    out = subprocess.run(["compute-sanitizer", *_filter(kernel_name), "--tool", tool, "--error-exitcode", "1",
                          *command], capture_output=True, text=True, timeout=timeout_s)
    text = out.stdout + out.stderr
    counts = [int(a or b) for a, b in _SUMMARY.findall(text)]
    errors = sum(counts) if counts else None
    status = "pass" if out.returncode == 0 and errors == 0 else "fail"
    # which kernels the reports are in ("... access at <kernel>+0x...": the tail alone may not say)
    sites = sorted(set(_SITE.findall(text)))
    return {"name": tool, "status": status, "errors": errors, "exit_code": out.returncode,
            "reported_in": sites, "tail": text.strip().splitlines()[-5:]}


def record_sanitizer(root: Path, out: Path, sources: list[str], tools: list[str], command: list[str],
                     timeout_s: int = 3600, kernel_name: str | None = None) -> dict[str, Any]:
    if not command:
        raise ValueError("no command to run under compute-sanitizer: put it after `--`")
    if shutil.which("compute-sanitizer") is None:
        raise ValueError("compute-sanitizer is not on PATH: it ships with the CUDA toolkit "
                         "(e.g. /usr/local/cuda/bin); add that folder to PATH")
    shown = shlex.join(["compute-sanitizer", *_filter(kernel_name)]) + " --tool {" + ",".join(tools) + "} " \
        + shlex.join(command)
    record = record_head(root, "sanitizer", "sanitizer", shown, sources)
    record["kernels_checked"] = f"names containing {kernel_name!r}" if kernel_name else "all"
    start = time.monotonic()
    record["results"] = [run_tool(t, command, timeout_s, kernel_name) for t in tools]
    record["wall_s"] = round(time.monotonic() - start, 1)  # what a refresh of this record plans for
    record["targets"] = []
    write_json(out, record)
    return record
