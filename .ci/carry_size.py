"""What a device call will carry, against the `run` tool's limit (64 MiB): the tracked files and the
untracked ones git does not ignore (both travel with every call), and the ignored paths named in
`carry`. Run it before a call, with the same paths:

    python3 .ci/carry_size.py .devwheels .nb9

It prints each part and the total, and exits 1 over the limit, with what can be held back and
what needs it: the rendered evidence report (h200_call.sh runs without it), the xgrammar archive
(the structured-output test), the coverage wheel (`record_coverage`). On 2026-12-06 the tree, CuTe
DSL and xgrammar came to within a few hundred KB of the limit, which hand sums kept missing.
Each file counts as the 4 KiB blocks it takes on disk, not its bytes: on 2026-12-07 the tool refused
a call of 63.90 MiB in bytes, which is 64.54 MiB in blocks (the tree's ~330 small files round up by
0.6 MiB); the tool's own rule is not documented, and the block count is the one that explains it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LIMIT_MIB = 64
BLOCK = 4096
# (glob, who needs it): held back in this order until the call fits
# (markdown is the source of no record, and h200_call.sh allows its absence)
HOLD_BACK = (("docs/fast_track/*_evidence.md", "nothing on the device (a rendered report)"),
             ("vllm/models/*/nvidia/kernels/MEASURED.md", "nothing on the device (the measurement log)"),
             ("docs/fast_track/REVIEW.md", "nothing on the device (the worked review)"),
             (".devwheels/coverage-*.whl", "record_coverage (kernels_coverage.json)"),
             (".devwheels/xgrammar-*.tar.xz", "the structured-output test (features_parity.json)"))


def _git_files(root: Path, *args: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", *args], cwd=root, capture_output=True, check=True).stdout
    return [root / name for name in out.decode().split("\0") if name and (root / name).is_file()]


def _files_under(root: Path, rel: str) -> list[Path]:
    path = root / rel
    if path.is_file():
        return [path]
    if not path.is_dir():
        sys.exit(f"carry_size: {rel}: no such file or folder here; name the paths the call carries")
    return [p for p in path.rglob("*") if p.is_file()]


def footprint(p: Path) -> int:
    """The bytes a file counts for against the limit: its size rounded up to whole blocks."""
    return -(-p.stat().st_size // BLOCK) * BLOCK


def parts(root: Path, carried: list[str]) -> dict[str, list[Path]]:
    return {"tracked": _git_files(root), "untracked, not ignored": _git_files(root, "--others", "--exclude-standard"),
            **{f"carried {rel}": _files_under(root, rel) for rel in carried}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("carry", nargs="*", help="the ignored paths the call names in `carry`")
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    args = ap.parse_args(argv)
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    found = parts(root, args.carry)
    every = {p for files in found.values() for p in files}
    total = sum(footprint(p) for p in every)
    limit = int(args.limit_mib * 2**20)
    for name, files in found.items():
        print(f"{name:40s} {sum(footprint(p) for p in files) / 2**20:8.2f} MiB")
    print(f"{'total':40s} {total / 2**20:8.2f} MiB of {args.limit_mib:g} ({(limit - total) / 2**20:+.2f} to spare)")
    if total <= limit:
        return 0
    over = total - limit
    print(f"over by {over / 2**20:.2f} MiB; what can be held back (moved out of the tree for the call):")
    for pattern, needed_by in HOLD_BACK:
        for p in sorted(root.glob(pattern)):
            if p in every:
                size = footprint(p)
                print(f"  {p.relative_to(root)} ({size / 2**20:.2f} MiB), needed by {needed_by}")
                over -= size
        if over <= 0:
            break
    if over > 0:
        print(f"  and {over / 2**20:.2f} MiB more: nothing above is enough")
    return 1


if __name__ == "__main__":
    sys.exit(main())
