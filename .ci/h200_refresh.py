"""The stale evidence records' refresh commands as `step` lines of .ci/h200_call.sh, for the lent
H200 or H100 (`--card`, which refresh_stale passes: that card's stale records and those it lacks).

    source .ci/h200_call.sh; refresh_stale
    python3 .ci/h200_refresh.py --evidence "$EVIDENCE" --commands   # a CI runner (gpu-run.yml)

With `--commands` the same rewritten commands come as plain bash lines, for a GPU runner of CI:
after the workflow's own steps, what is still stale in its evidence folder is run again as its
record says it was made, so the workflow and the committed records cannot drift apart.

A record's command is written as it was run (`python`, `pytest`, `k3-decode`, `--out` to the
device's evidence folder of that day, `K3_EVIDENCE_DIR=<dir>`), so this rewrites each into what
the lent machine runs now: `python3 -m`, records into $K3_EVIDENCE_DIR, GPU tests with
`-m gpu`, coverage through `record_coverage`, sanitizer and `record-tests` records through
`fast-track record-sanitizer` / `record-tests` with the record's own sources; a GPU test whose
record was never committed runs too (`unrecorded_steps`). Each command appears once
(bench_norms writes three records), in the order of KIND_ORDER (kernel tests first, sanitizer
runs last; the longest first within a kind; with `--card`, what no card holds fresh before what
another card does, `fresh_elsewhere`), with a time limit from its kind and, where the
record says how long it ran (`wall_s`), the time it is expected to take, so `step` skips what
cannot finish in the call and a later call picks it up: copy the records of one call into the
card's folder, evidence/h200/ or evidence/h100/ (uncommitted is enough, the working tree
travels) before the next. Records whose command it cannot rewrite are echoed as skipped, never
run half-right. Records made on a CPU (no `gpu`) are left to the CPU. On a host of several GPUs
(`--gpus N`, which refresh_stale passes) the steps run as N queues side by side, one per GPU
(`on_gpus`); with `--lanes L` the checks (every kind but the timed ones) share each GPU in L
lanes, and the timed records run after them, alone on their GPU (on an 80 GB card, `--card h100`,
the kernel tests and the depth tests take turns with the 12-layer blocks in the first lane). On 2026-12-04 three lanes ran five checks whose last runs took 801 s in one
580 s call (the depth test 334 -> 472 s, an eval 187 -> 310 s: the lanes share the host's cores
and the GPU), so a record's `wall_s` from a lane overstates what it takes alone.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.fast_track.evidence import EvidenceSet, Record  # noqa: E402
from tools.fast_track.model import ModelError, discover  # noqa: E402
from tools.fast_track.stale import stale_records  # noqa: E402

# seconds; measured on the H200 (2026-12-03) and given headroom: eval 188-205 s, decode records
# 30-155 s, the rest under 90 s; the depth test took 177 s before its yardstick ran in lockstep and
# 355 s after (2026-12-04); the 12-layer long runs took 203-217 s at rows 1, 8 and q 8 and
# 256 s at rows 64 (2026-12-04); pinned-routing parity took 80 s at TP16 alone; rows 2, 4 and 16 of
# the block with rows 32 still running outlasted 450 s (2026-12-04), so rows 16 and 32 are a file:
# rows 2 and 4 took 173 s, rows 16 and 32 353 s, TP8 rows 1, 8 and q 8 220 s (2026-12-04)
LIMIT_BY_KIND = {"eval": 330, "decode-bench": 170, "sanitizer": 300}
LIMIT_BY_FILE = {"executor_depth_parity.json": 450, "executor_long_runs.json": 400,
                 "executor_long_runs_rows64.json": 450, "executor_long_runs_mid.json": 400,
                 "executor_long_runs_rows16_32.json": 560, "executor_long_runs_tp8.json": 450,
                 "executor_long_runs_tp8_rows64.json": 520, "executor_long_runs_tp8_mid.json": 400,
                 "executor_long_runs_tp8_rows16_32.json": 580, "executor_depth_parity_tp8.json": 560,
                 "pinned_routing_parity.json": 300}
DEFAULT_LIMIT = 150
# what a record never run yet is expected to take, from its siblings' runs (2026-12-04: TP8's long
# runs took about what TP16's did; TP16 rows 2/4 173 s, rows 16/32 353 s, rows 64 307 s; the TP16
# depth test 355 s alone; TP8's depth test, estimated at 450 s, took 462 s on an H100 on 2026-12-06), so
# `step` can pack it; without one a step is expected to take its limit
FIRST_RUN_EXPECT = {"executor_long_runs_tp8_mid.json": 200, "executor_long_runs_tp8_rows16_32.json": 420,
                    "executor_long_runs_tp8_rows64.json": 380}
# the order a refresh runs in, when one call cannot hold every stale record: the kernels' own
# tests first (every other record stands on them), then the executor's parity, the evals, the
# decode benchmarks, the kernel benchmarks and the sanitizer runs; the longest first within a kind,
# so that `step`, which skips what does not fit and goes on, fills a call's budget with what is left
KIND_ORDER = ("kernel-test", "parity", "eval", "decode-bench", "kernel-bench", "sanitizer")
# a record that says how long its run took (`wall_s`) is expected to take this much again, so a
# call fits as many as its budget holds; the limit stays, raised to twice that where it is lower.
# On 2026-12-04 nine records re-ran at 0.65-1.11x their previous wall_s, and each step took its
# new wall_s plus 1-4 s (startup): 1.15x + 10 s covers both, where 1.3x + 15 s left ~100 s unused
# in a call holding the depth test (334 s)
EXPECT_FACTOR, EXPECT_EXTRA_S = 1.15, 10
# the kinds whose figures are times: with lanes they run after the checks, alone on their GPU
TIMED_KINDS = ("decode-bench", "kernel-bench")
# the checks that hold a 12-layer K3 block with all 896 experts: two at once could exhaust an
# H200's 141 GB, so with lanes they take turns in a GPU's first lane, the other checks beside
# them. Measured on 2026-12-04 (nvidia-smi every 5 s): a TP16 long run with the sanitizer runs
# beside it peaked at 63 GB; the depth test with two evals at 54 GB; the parity rule's power (a
# TP16 then a TP8 block) beside those two at 115 GB. So a TP8 block beside two other checks
# nears the card's memory: LANES=2 (a block and one check) is the safe setting when one is queued.
# On 2026-12-06 (two lanes) a TP16 block beside the TP16 depth test peaked at 116.6 GB, and TP8's
# block beside TP8's depth test at 138.2 GB, next to the H200's 139 GiB: no third lane there
HOLDS_A_BLOCK = frozenset({"executor_long_runs.json", "executor_long_runs_rows64.json", "executor_long_runs_mid.json",
                           "executor_long_runs_rows16_32.json", "executor_long_runs_tp8.json",
                           "executor_long_runs_tp8_rows64.json", "executor_long_runs_tp8_mid.json",
                           "executor_long_runs_tp8_rows16_32.json",
                           "pinned_routing_parity.json", "parity_rule_power.json"})
# on an 80 GB card (evidence/h100/) a block leaves about 20 GB: on 2026-12-06 the skinny-GEMM and MoE
# kernel tests ran out of memory there beside the rows-16/32 long runs (59.2 GB), and the depth tests
# (93 layers) need more than that too. So on such a card these take turns with the blocks in the
# first lane, and the other lanes get only the light checks (evals, features, binding, sanitizers)
HEAVY_ON_80GB = frozenset({"executor_depth_parity.json", "executor_depth_parity_tp8.json"})
HEAVY_KINDS_ON_80GB = ("kernel-test",)
CARDS_OF_80GB = ("h100",)
EV = "$K3_EVIDENCE_DIR"
# a folder the records were written to on the device, in any session: /root/out/ev, /root/out/w/ev
_DEVICE_EV = re.compile(r"^/root/out(/w)?/ev(/|$)")
# a record file the device wrote elsewhere under its $OUT (2026-12-06: a judging sweep, written
# beside ev/ and committed as evidence/h100/mla_decode_sweep.json): its refresh goes into ev/ too
_DEVICE_OUT_JSON = re.compile(r"^/root/out/.*\.json$")
# an eval's table is named for the card it ran on (eval_tiny_h200.md); a refresh on another card
# names it for that one (h200_call.sh's K3_GPU_FOLDER), not for the card of the last run
_CARD_TABLE = re.compile(r"_(h200|h100)\.md$")


def _retarget(arg: str) -> str:
    """A path into a device evidence folder, or a repository path of a record, into $K3_EVIDENCE_DIR."""
    if _DEVICE_EV.match(arg):
        arg = _DEVICE_EV.sub(EV + r"\2", arg)
    elif "/evidence/" in arg or arg.startswith("docs/") or _DEVICE_OUT_JSON.match(arg):
        arg = f"{EV}/{Path(arg).name}"
    else:
        return arg
    return _CARD_TABLE.sub("_$K3_GPU_FOLDER.md", arg)


def _gpu_pytest(args: list[str]) -> list[str] | None:
    """The pytest run of `args`' test files or node ids (`file.py::test[param]`) and its -k selection,
    as a step runs it; None where `args` name no test file, which would run every GPU test instead."""
    targets = [a for a in args if a.endswith(".py") or ".py::" in a]
    if not targets:
        return None
    keep = []
    for i, a in enumerate(args):  # a -k selection travels; -q, -m gpu and the targets are re-added
        if a == "-k" and i + 1 < len(args):
            keep += ["-k", args[i + 1]]
    return ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *keep, *targets]


def _recorder(record: Record, tool: str, also: tuple[str, ...] = ()) -> list[str]:
    """`fast-track TOOL` writing `record` again, with those of its sources the tree still has (a
    file deleted since, say a kernel folded into another, would make the tool refuse the run):
    the sources as the record was given them where it says (`source_args`: a folder stays a
    folder, so a file added to it since is measured too), else the files it lists; then `also`."""
    given = record.data.get("source_args") or record.sources
    given = list(dict.fromkeys([*given, *also]))
    sources = [a for s in given if (REPO / s).exists() for a in ("--source", s)]
    return ["python3", "-m", "tools.fast_track.cli", tool, "--out", f"{EV}/{Path(record.rel).name}", *sources]


def _namesake_sources(record: Record) -> tuple[str, ...]:
    """The sources that the same sanitizer record lists on the other cards' folders. The same
    command checks the same kernels on every card, so a refresh on one card covers what any card's
    run covered (2026-12-07: the H200's KDA record, older than rows.py, would have left that
    file's cluster barrier unchecked, where the H100's covered it). Sanitizer records only: a
    record-tests record's sources follow its own `source_args`."""
    path = Path(record.rel)
    found = []
    for other in sorted((REPO / path.parent.parent).glob(f"*/{path.name}")):
        if other.parent.name == path.parent.name:
            continue
        try:
            data = json.loads(other.read_text())
        except (OSError, ValueError):
            continue  # an unreadable namesake is main()'s to report
        if isinstance(data, dict) and (namesake := Record(str(other), data)).kind == "sanitizer":
            found += namesake.source_args or namesake.sources
    return tuple(found)


def narrower_than_namesake(record: Record) -> bool:
    """A sanitizer record that checked fewer of the tree's files than its namesake on another card
    (2026-12-07: the H200's KDA record, fresh, lists no rows.py; the H100's does). A refresh here
    would check them too, so the card makes it again although nothing it lists has changed."""
    if record.kind != "sanitizer":
        return False
    own = set(record.source_args or record.sources)
    return any(s not in own and (REPO / s).exists() for s in _namesake_sources(record))


def device_command(record: Record) -> list[str] | None:
    """The command that refreshes `record` on the lent H200, or None when its form is unknown."""
    words = shlex.split(record.command.replace("<dir>", "DIR"))
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # env prefixes: $K3_EVIDENCE_DIR is set
        words = words[1:]
    if not words:
        return None
    head = words[0]
    if head == "compute-sanitizer":
        inner = words[words.index("python3"):] if "python3" in words else None
        if not inner or "pytest" not in inner or not record.sources:
            return None
        run = _gpu_pytest(inner[inner.index("pytest") + 1:])
        return None if run is None else [*_recorder(record, "record-sanitizer", _namesake_sources(record)),
                                         "--", *run]
    if "exit_code" in record.data and "pytest" in words[:3]:  # made by `fast-track record-tests`
        if not record.sources:
            return None
        run = _gpu_pytest(words[words.index("pytest") + 1:])
        return None if run is None else [*_recorder(record, "record-tests"), "--kind", record.kind, "--family",
                                         str(record.data.get("family", "")), "--", *run]
    if head == "coverage":
        return ["record_coverage", *[a for a in words if a.endswith(".py")]]
    if head == "pytest" or words[:3] in (["python", "-m", "pytest"], ["python3", "-m", "pytest"]):
        return _gpu_pytest(words[1:])
    if head == "k3-decode":
        return ["python3", "-m", "vllm.models.kimi_k3.nvidia.latency_specialized", *map(_retarget, words[1:])]
    if head in ("python", "python3") and len(words) > 2 and words[1] == "-m":
        return ["python3", *map(_retarget, words[1:])]
    return None


def _last_wall_s(record: Record) -> float | None:
    """How long the record's last run took, where it says."""
    wall = record.data.get("wall_s")
    return float(wall) if isinstance(wall, (int, float)) and wall > 0 else None


def by_priority(records: list[Record]) -> list[Record]:
    """The records in KIND_ORDER (kinds not named last), the longest last run first within a kind."""
    def key(record: Record) -> tuple[int, float]:
        rank = KIND_ORDER.index(record.kind) if record.kind in KIND_ORDER else len(KIND_ORDER)
        return rank, -(_last_wall_s(record) or 0.0)
    return sorted(records, key=key)


def _commands(records: list[Record], seen: set[str] | None = None) -> list[tuple[Record, str | None]]:
    """Each record with its refresh command as bash text ($K3_EVIDENCE_DIR left for bash to expand),
    None where its form is unknown; a command shared by several records (or already in `seen`,
    which grows) only with the first."""
    out, seen = [], set() if seen is None else seen
    for record in records:
        cmd = device_command(record)
        text = None if cmd is None else re.sub(r"'(\$K3_EVIDENCE_DIR[^']*)'", r'"\1"', shlex.join(cmd))
        if text is None or text not in seen:
            out.append((record, text))
            seen.add(text)
    return out


def _skipped(record: Record, why: str) -> str:
    return f"echo {shlex.quote(f'=== {Path(record.rel).stem}: skipped, {why}')}"


def command_lines(records: list[Record]) -> list[str]:
    """The refresh as plain bash lines, one per distinct command, for a CI runner (gpu-run.yml):
    no `step`, budget or lanes, the runner's job limit governs. GPU coverage, which the device
    records through h200_call.sh's `record_coverage`, is the workflow's own step there."""
    lines = []
    for record, text in _commands(records):
        if text is None:
            lines.append(_skipped(record, f"no rewrite for: {record.command}"))
        elif text.startswith("record_coverage "):
            lines.append(_skipped(record, "GPU coverage is recorded by the workflow's coverage step"))
        else:
            lines.append(text)
    return lines


def step_lines(records: list[Record], seen: set[str] | None = None) -> list[str]:
    """One `[EXPECT=S] step NAME LIMIT CMD` line per distinct command not in `seen` (which grows),
    $K3_EVIDENCE_DIR left for bash to expand."""
    lines = []
    for record, text in _commands(records, seen):
        name = Path(record.rel).stem
        if text is None:
            lines.append(_skipped(record, f"no rewrite for: {record.command}"))
            continue
        limit = LIMIT_BY_FILE.get(Path(record.rel).name, LIMIT_BY_KIND.get(record.kind, DEFAULT_LIMIT))
        wall = _last_wall_s(record)
        if wall is not None:  # its last run's time, with headroom
            expect = math.ceil(EXPECT_FACTOR * wall) + EXPECT_EXTRA_S
            lines.append(f"EXPECT={expect} step {name} {max(limit, 2 * expect)} {text}")
        else:
            lines.append(f"step {name} {limit} {text}")
    return lines


# tests/_evidence.py's recorders, and the kind of record each writes
RECORDERS = {"record_parity": "parity", "parity_record": "parity", "record_kernel_test": "kernel-test"}
TEST_MAKERS = ("long_run_tests", "depth_tests")  # make GPU tests that write the parity record they are given


def _records_written(source: str) -> dict[str, str]:
    """The record files a GPU test module writes, with their kinds: the `.json` names its calls of RECORDERS or
    TEST_MAKERS pass (parsed, so a call quoted inside a string is not one). A module with neither a
    `pytest.mark.gpu` nor a TEST_MAKERS call has no GPU test, so its RECORDERS calls (a CPU test of
    the recorder itself) write no record a GPU run would make."""
    tree = ast.parse(source)
    calls = [(getattr(n.func, "id", getattr(n.func, "attr", None)), n)
             for n in ast.walk(tree) if isinstance(n, ast.Call)]
    has_gpu_tests = any(name in TEST_MAKERS for name, _ in calls) or any(
        isinstance(n, ast.Attribute) and n.attr == "gpu" and getattr(n.value, "attr", None) == "mark"
        for n in ast.walk(tree))
    written = {}
    for name, call in calls:
        if has_gpu_tests and (name in RECORDERS or name in TEST_MAKERS):
            for a in call.args:
                if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.endswith(".json"):
                    written.setdefault(a.value, RECORDERS.get(name, "parity"))
    return written


def unrecorded_steps(model_dir: Path, repo: Path, card: str = "h200",
                     covered: frozenset[str] = frozenset(), kinds: frozenset[str] | None = None) -> list[str]:
    """A step for each record a GPU test file writes that is not in evidence/CARD/ yet (nor
    `covered`, the record names a step already makes), of `kinds` (default: all): a test written
    and never run has no record to go stale, so it would not be refreshed otherwise."""
    lines = []
    for test in sorted((model_dir / "tests").glob("test_*.py")):
        for name, kind in _records_written(test.read_text()).items():
            if kinds is not None and kind not in kinds:
                continue
            if not (model_dir / "evidence" / card / name).exists() and name not in covered:
                cmd = shlex.join(_gpu_pytest([test.relative_to(repo).as_posix()]))
                expect = f"EXPECT={FIRST_RUN_EXPECT[name]} " if name in FIRST_RUN_EXPECT else ""
                lines.append(f"{expect}step {Path(name).stem} {LIMIT_BY_FILE.get(name, DEFAULT_LIMIT)} {cmd}")
    return lines


# a step line: `[EXPECT=S] step NAME LIMIT CMD...`
_STEP_LINE = re.compile(r"(?:EXPECT=(\d+) )?step (\S+) (\d+) ")


def _expected_s(line: str) -> int:
    """The seconds a step line is expected to take: its EXPECT, else its limit."""
    m = _STEP_LINE.match(line)
    return int(m.group(1) or m.group(3))


def _name(line: str) -> str:
    return _STEP_LINE.match(line).group(2)


def _queue(lines: list[str], slots: int, only: dict[str, list[int]]) -> list[list[str]]:
    """The step lines dealt to `slots` queues: each step, in the order given (the refresh's
    priority), to the queue with the least expected time so far among those it may take (`only`:
    step name -> its queues; all by default)."""
    queues: list[list[str]] = [[] for _ in range(slots)]
    load = [0] * slots
    for line in lines:
        slot = min(only.get(_name(line), range(slots)), key=lambda i: load[i])
        queues[slot].append(line)
        load[slot] += _expected_s(line)
    return queues


def _side_by_side(queues: dict[str, tuple[int, list[str]]]) -> list[str]:
    """Each queue (its transcript's name -> (GPU, steps)) in a subshell pinned to its GPU, all run
    side by side until every one is done."""
    out = []
    for label, (gpu, queue) in queues.items():
        if queue:
            out += [f"( export CUDA_VISIBLE_DEVICES={gpu}", *queue, f') > "$W/{label}.out" 2>&1 &', "queued+=($!)"]
    # only these, and none when none ran: a bare `wait` would also wait for whatever else the call
    # left in the background (a memory log)
    return ["queued=()", *out, 'wait "${queued[@]}"'] if out else []


def on_gpus(lines: list[str], gpus: int, lanes: int = 1, timed: frozenset[str] = frozenset(),
            holds_a_block: frozenset[str] = frozenset()) -> list[str]:
    """The lines as they run on `gpus` GPUs of one host: one queue per GPU, each step, in the
    order given, put on the queue with the least expected time so far; the queues run side by
    side (CUDA_VISIBLE_DEVICES pins each), their transcripts printed once all are done. A GPU
    runs one step at a time, so a benchmark still times a GPU no other step uses. With `lanes`
    above 1, the steps not named in `timed` run first in `lanes` queues per GPU (those named in
    `holds_a_block` one at a time, in each GPU's first lane, which the others leave to them),
    then the timed ones, one queue per GPU as before. With one GPU and one lane, the lines as they are."""
    if gpus <= 1 and lanes <= 1:
        return lines
    said = [line for line in lines if line.startswith("echo ")]
    steps = [line for line in lines if not line.startswith("echo ")]
    if lanes <= 1:
        phases = [("gpu{gpu}", steps, 1, {})]
    else:
        first_lanes = [gpu * lanes for gpu in range(gpus)]
        other_lanes = [i for i in range(gpus * lanes) if i % lanes]
        checks = [line for line in steps if _name(line) not in timed]
        lanes_of = {}
        if any(_name(line) in holds_a_block for line in checks):
            # while blocks are queued the first lanes are theirs, so a long check cannot hold one up
            lanes_of = {_name(line): first_lanes if _name(line) in holds_a_block else other_lanes for line in checks}
        phases = [("gpu{gpu}.lane{lane}", checks, lanes, lanes_of),
                  ("gpu{gpu}.timed", [line for line in steps if _name(line) in timed], 1, {})]
    out = list(said)
    for label, phase, per_gpu, pinned in phases:
        queues = _queue(phase, gpus * per_gpu, pinned)
        out += _side_by_side({label.format(gpu=i // per_gpu, lane=i % per_gpu): (i // per_gpu, q)
                              for i, q in enumerate(queues)})
    return [*out, 'for f in "$W"/gpu*.out; do echo "--- ${f##*/}"; cat "$f"; done']


def only_steps(lines: list[str], names: list[str], recorded: frozenset[str] = frozenset()) -> list[str]:
    """The step lines of `names`, in the refresh's own order. A name that is no step here but names
    a record (`recorded`: fresh on this card) is said on stderr and left out, so one call line serves
    either card (2026-12-07: an H200 call that came up on an H100, where two of its benches were
    fresh, ran none of its refresh); any other name is refused with the names there are, so a typo
    cannot make a call that runs nothing."""
    steps = [line for line in lines if _STEP_LINE.match(line)]
    known = {_name(line) for line in steps}
    unknown = [n for n in names if n not in known and n not in recorded]
    if unknown:
        sys.exit(f"h200_refresh: --only {' '.join(unknown)}: no such step in this refresh; "
                 f"it has: {' '.join(sorted(known)) or 'none'}")
    fresh = [n for n in names if n not in known]
    if fresh:
        print(f"h200_refresh: --only {' '.join(fresh)}: fresh for this card, not run", file=sys.stderr)
    return [line for line in steps if _name(line) in names]


def _made_on_gpu(record: Record) -> bool:
    return record.data.get("gpu") not in (None, "", "none")


def gpu_records(stale: list[tuple[Record, str]]) -> list[Record]:
    """The stale records made on a GPU; those made on a CPU (evals on the reference ops) are refreshed there."""
    return [r for r, _ in stale if _made_on_gpu(r)]


def card_records(evidence: EvidenceSet, card: str) -> list[Record]:
    """What a refresh on one card (its evidence/CARD/ folder: h200, h100) makes: the card's own
    stale records and its sanitizer records narrower than another card's (`narrower_than_namesake`),
    and each GPU record that only other cards have, made again by its command (the H100 envelope
    began on 2026-12-05 with none of the H200's long runs)."""
    gpu_made = [r for r in evidence.records if _made_on_gpu(r)]
    own = {Path(r.rel).name for r in gpu_made if Path(r.rel).parent.name == card}
    wanted, borrowed = [], set()
    for record in gpu_made:
        name = Path(record.rel).name
        if Path(record.rel).parent.name == card:
            if not evidence.freshness(record).fresh or narrower_than_namesake(record):
                wanted.append(record)
        elif name not in own and (name, record.position) not in borrowed:
            wanted.append(record)
            borrowed.add((name, record.position))
    return wanted


def fresh_elsewhere(evidence: EvidenceSet, card: str) -> frozenset[str]:
    """The record files that a folder other than evidence/CARD/ holds fresh, with as many results as
    CARD's own record of it (the H100's pinned-routing record has TP16's 4, its TP8 half skipping
    there; the H200's has 8): a refresh on CARD makes them after what no card has for the current
    code (on 2026-12-06 an H200, lent rarely, would have spent its first call on records the H100
    had just made, before TP8's, which only it can make)."""
    gpu_made = [r for r in evidence.records if _made_on_gpu(r)]
    own = {Path(r.rel).name: len(r.results) for r in gpu_made if Path(r.rel).parent.name == card}
    return frozenset(Path(r.rel).name for r in gpu_made
                     if Path(r.rel).parent.name != card and evidence.freshness(r).fresh
                     and len(r.results) >= own.get(Path(r.rel).name, 0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="the model folder (default: the only one discovered)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs of the lent host to spread the steps over (default 1)")
    ap.add_argument("--lanes", type=int, default=1,
                    help="checks run side by side on each GPU, the timed records after them alone (default 1)")
    ap.add_argument("--evidence", default=None,
                    help="only the records in this folder (a CI runner's evidence/<kind>/; default: all)")
    ap.add_argument("--card", default=None,
                    help="the lent card's evidence folder (h200, h100): its stale records and those it lacks "
                         "(default: every stale GPU record, and GPU tests unrecorded in evidence/h200)")
    ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                    help="only these steps, named as their records (moe_test, executor_long_runs): a call "
                         "that serves one issue when the card's whole refresh outlasts the session")
    ap.add_argument("--commands", action="store_true",
                    help="plain bash lines, one per command, for a CI runner (gpu-run.yml): no step, budget or lanes")
    args = ap.parse_args(argv)
    if args.gpus < 1:
        sys.exit(f"h200_refresh: --gpus must be at least 1, got {args.gpus}")
    if args.lanes < 1:
        sys.exit(f"h200_refresh: --lanes must be at least 1, got {args.lanes}")
    if args.only is not None and args.commands:
        sys.exit("h200_refresh: --only picks a call's steps, and --commands lists every stale command for a CI "
                 "runner: pass one of them")
    try:
        models = discover(Path.cwd(), args.model)
    except ModelError as e:
        sys.exit(f"h200_refresh: {e}")
    if len(models) != 1:
        sys.exit(f"h200_refresh: {len(models)} model folders here; pass --model DIR")
    (model,) = models
    stale, unreadable = stale_records(model)
    if unreadable:  # no command can be read from such a file, so no step would ever make it again
        sys.exit("h200_refresh: evidence files that hold no readable record; fix or remove them first:\n"
                 + "\n".join(f"  {p.path}: {p.message}" for p in unreadable))
    # one load for both uses on a card: its freshness hashes every record's sources (about 1.4 s)
    evidence = None if args.card is None else EvidenceSet.load(model)
    records = by_priority(gpu_records(stale) if evidence is None else card_records(evidence, args.card))
    if args.evidence is not None:
        folder = (Path.cwd() / args.evidence).resolve()
        if not folder.is_dir():
            sys.exit(f"h200_refresh: --evidence {args.evidence}: no such folder; pass the runner kind's "
                     "evidence folder, e.g. vllm/models/kimi_k3/nvidia/evidence/h200")
        records = [r for r in records if (model.root / r.rel).resolve().parent == folder]
    if args.commands:  # a CI runner's GPU-test step has run every GPU test, recorded or not
        print("\n".join(command_lines(records)))
        return 0
    covered = frozenset(Path(r.rel).name for r in records)
    unrecorded = functools.partial(unrecorded_steps, model.path, model.root, args.card or "h200", covered)
    # on one card, what another card holds fresh comes last: what no card has comes first
    elsewhere = frozenset() if evidence is None else fresh_elsewhere(evidence, args.card)
    seen: set[str] = set()
    # a kernel test never run is quick, and what every later record stands on: it goes first
    lines = (unrecorded(kinds=frozenset({"kernel-test"}))
             + step_lines([r for r in records if Path(r.rel).name not in elsewhere], seen)
             + unrecorded(kinds=frozenset({"parity"}))
             + step_lines([r for r in records if Path(r.rel).name in elsewhere], seen))
    if args.only is not None:
        recorded = frozenset(p.stem for p in (model.path / "evidence").glob("*/*.json"))
        lines = only_steps(lines, args.only, recorded)
    timed = frozenset(Path(r.rel).stem for r in records if r.kind in TIMED_KINDS)
    first_lane = {Path(n).stem for n in HOLDS_A_BLOCK}
    if args.card in CARDS_OF_80GB:
        first_lane |= {Path(n).stem for n in HEAVY_ON_80GB}
        first_lane |= {Path(r.rel).stem for r in records if r.kind in HEAVY_KINDS_ON_80GB}
        first_lane |= {_name(line) for line in unrecorded(kinds=frozenset(HEAVY_KINDS_ON_80GB))
                       if _STEP_LINE.match(line)}
    print("\n".join(on_gpus(lines, args.gpus, args.lanes, timed, frozenset(first_lane))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
