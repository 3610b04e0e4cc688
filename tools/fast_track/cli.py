"""`fast-track`: the console script.

    fast-track check [--base REF] [--model DIR] [--report FILE]
    fast-track render-evidence [--model DIR] --out FILE
    fast-track record-coverage --coverage FILE --out FILE --command CMD [--model DIR]
    fast-track record-sanitizer --out FILE --source PATH [--source ...] [--tool T ...] [--kernel-name S]
                                -- CMD...
    fast-track record-tests --out FILE --kind KIND --family F --source PATH [--source ...] -- PYTEST CMD...
    fast-track stale [--model DIR]
    fast-track compare BEFORE AFTER [--control REGEX] [--field time_us]

`check` prints the markdown review and writes it to --report too (e.g.
$GITHUB_STEP_SUMMARY); exit 0 only when every automatic item holds, 1 when one does not,
2 when the inputs are wrong (not a git checkout, a base that does not resolve, no model
folder). Run from anywhere inside the checkout under review.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .compare import compare, load, render as render_comparison
from .coverage_record import write_coverage_record
from .evidence import EvidenceSet
from .evidence_report import render
from .gitrepo import GitError, repo_root
from .model import ModelError, discover
from .report import render_report
from .review import run_review
from .sanitizer_record import DEFAULT_TOOLS, record_sanitizer
from .stale import render as render_stale, stale_records, text_only_records
from .tests_record import KINDS, record_tests


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fast-track", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser("check", help="review the change against docs/fast_track/CHECKLIST.md")
    check.add_argument("--base", help="what the change is compared with (branch, tag, sha; the "
                                      "merge-base with HEAD is used); default: git's empty tree, "
                                      "i.e. the whole repository is the change")
    check.add_argument("--model", help="the model folder (default: every vllm/models/*/*/SCOPE.yaml)")
    check.add_argument("--report", type=Path, help="also write the markdown report to this file")
    render_cmd = commands.add_parser("render-evidence", help="render evidence JSON as markdown tables")
    render_cmd.add_argument("--model", help="the model folder (default: the only one discovered)")
    render_cmd.add_argument("--out", type=Path, required=True, help="markdown file to write")
    record = commands.add_parser("record-coverage",
                                 help="turn a `coverage json` report of a GPU run into an evidence record")
    record.add_argument("--model", help="the model folder (default: the only one discovered)")
    record.add_argument("--coverage", type=Path, required=True, help="output of `coverage json`")
    record.add_argument("--out", type=Path, required=True, help="evidence JSON file to write")
    record.add_argument("--command", required=True, help="the command that produced the coverage")
    sanitize = commands.add_parser("record-sanitizer",
                                   help="run a command under compute-sanitizer and record the outcome")
    sanitize.add_argument("--out", type=Path, required=True, help="evidence JSON file to write")
    sanitize.add_argument("--source", action="append", required=True, dest="sources",
                          help="repository-relative kernel file the command exercises (repeat)")
    sanitize.add_argument("--tool", action="append", dest="tools",
                          help=f"compute-sanitizer tool (repeat; default: {', '.join(DEFAULT_TOOLS)})")
    sanitize.add_argument("--kernel-name", default=None, metavar="SUBSTRING",
                          help="check only kernels whose name contains SUBSTRING (default: every kernel)")
    sanitize.add_argument("run", nargs=argparse.REMAINDER, help="-- then the command to run")
    tests = commands.add_parser("record-tests", help="run pytest and record each test's outcome")
    tests.add_argument("--out", type=Path, required=True, help="evidence JSON file to write")
    tests.add_argument("--kind", choices=KINDS, default="parity", help="record kind (default: parity)")
    tests.add_argument("--family", required=True, help="record family, e.g. features")
    tests.add_argument("--source", action="append", required=True, dest="sources",
                       help="repository-relative file whose behaviour the tests prove (repeat)")
    tests.add_argument("run", nargs=argparse.REMAINDER, help="-- then the pytest command")
    stale = commands.add_parser("stale",
                                help="list the stale evidence records and the commands that refresh them")
    stale.add_argument("--model", help="the model folder (default: the only one discovered)")
    cmp = commands.add_parser("compare", help="two benchmark records of one family, case by case")
    cmp.add_argument("before", help="record file, or REF:PATH for the record as committed at a git ref")
    cmp.add_argument("after", help="record file, or REF:PATH")
    cmp.add_argument("--control", type=_regex, metavar="REGEX",
                     help="cases the change cannot touch (regular expression on the case name): "
                          "their median ratio is the run-to-run drift")
    cmp.add_argument("--field", default="time_us", help="the result field compared (default: time_us)")
    return parser


def _regex(text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None


def _after_dashes(run: list[str]) -> list[str]:
    """The command given after `--` (argparse keeps the separator in a REMAINDER)."""
    return run[1:] if run[:1] == ["--"] else run


def _one_model(root: Path, model: str | None):
    models = discover(root, model)
    if len(models) > 1:
        raise ModelError(f"several model folders ({', '.join(m.rel for m in models)}); pass --model")
    return models[0]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        root = repo_root(Path.cwd())
        if args.command == "check":
            review = run_review(root, args.base, args.model)
            text = render_report(review)
            sys.stdout.write(text)
            if args.report is not None:
                args.report.parent.mkdir(parents=True, exist_ok=True)
                args.report.write_text(text)
            return 0 if review.passed else 1
        if args.command == "record-sanitizer":
            command = _after_dashes(args.run)
            tools = args.tools or list(DEFAULT_TOOLS)
            record = record_sanitizer(root, args.out.resolve(), args.sources, tools, command,
                                      kernel_name=args.kernel_name)
            verdicts = ", ".join(f"{r['name']} {r['status']}" for r in record["results"])
            print(f"wrote {args.out}: {verdicts}")
            return 0 if all(r["status"] == "pass" for r in record["results"]) else 1
        if args.command == "record-tests":
            command = _after_dashes(args.run)
            record = record_tests(root, args.out.resolve(), args.kind, args.family, args.sources, command)
            counts = {s: sum(r["status"] == s for r in record["results"]) for s in ("pass", "fail", "skip")}
            print(f"wrote {args.out}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
            for r in record["results"]:
                if r["status"] != "pass":
                    print(f"  {r['status']} {r['name']}: {r.get('reason', '')}")
            return 0 if counts["pass"] == len(record["results"]) else 1
        if args.command == "compare":
            found = compare(load(root, args.before), load(root, args.after), args.field, args.control)
            sys.stdout.write(render_comparison(found, args.field))
            return 0
        model = _one_model(root, args.model)
        if args.command == "stale":
            evidence = EvidenceSet.load(model)
            found, unreadable = stale_records(model, evidence)
            sys.stdout.write(render_stale(found, unreadable, text_only_records(evidence)))
            return 1 if found or unreadable else 0
        out = args.out.resolve()
        if args.command == "render-evidence":
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(render(model, out))
            print(f"wrote {out}")
            return 0
        record = write_coverage_record(model, args.coverage, out, args.command)
        ran = sum(r["status"] == "pass" for r in record["results"])
        print(f"wrote {out}: {ran} of {len(record['results'])} kernel file(s) executed")
        return 0
    except (GitError, ModelError, ValueError) as e:
        print(f"fast-track: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
