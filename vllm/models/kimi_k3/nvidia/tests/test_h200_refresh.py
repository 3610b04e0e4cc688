"""`.ci/h200_refresh.py`: each stale record's command rewritten into a `step` the H200 can run.

The lines are sourced by bash there, so these tests source them here too, with a `step` that
prints its arguments: what matters is how bash splits and expands them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tools.fast_track.evidence import Record

ROOT = Path(__file__).resolve().parents[5]
EVIDENCE = ROOT / "vllm/models/kimi_k3/nvidia/evidence/h200"
_spec = importlib.util.spec_from_file_location("h200_refresh", ROOT / ".ci/h200_refresh.py")
refresh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh)


def _record(command: str, name: str = "x.json", kind: str = "kernel-test", **data) -> Record:
    return Record(f"vllm/models/kimi_k3/nvidia/evidence/h200/{name}",
                  {"kind": kind, "command": command, "gpu": "NVIDIA H200", **data})


def _run_steps(lines: list[str]) -> list[list[str]]:
    """Source the lines under bash; each `step` call comes back as its argument list."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = ("K3_EVIDENCE_DIR=/ev K3_GPU_FOLDER=h100\nstep() { printf '%s\\0' \"$@\"; printf '\\n'; }\n"
              "record_coverage() { :; }\n" + "\n".join(lines) + "\n")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    return [line.rstrip("\0").split("\0") for line in out.splitlines() if line]


def _expects(lines: list[str]) -> list[str]:
    """The EXPECT each `step` call saw ("-" for none)."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = "step() { echo \"${EXPECT:--}\"; }\nrecord_coverage() { :; }\n" + "\n".join(lines) + "\n"
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()


def test_every_committed_gpu_record_has_a_device_command():
    records = [Record(p.relative_to(ROOT).as_posix(), json.loads(p.read_text())) for p in sorted(EVIDENCE.glob("*.json"))]
    assert records
    missing = [r.rel for r in refresh.gpu_records([(r, "") for r in records]) if refresh.device_command(r) is None]
    assert not missing, f"records whose command h200_refresh cannot rewrite: {missing}"


def test_commands_are_rewritten_for_the_device_and_split_as_one_argument_each():
    records = [
        _record("K3_EVIDENCE_DIR=<dir> python -m pytest -q -m gpu vllm/models/kimi_k3/nvidia/tests/test_moe_kernels.py",
                "moe_test.json"),
        _record("k3-decode eval --device cuda --tasks kv --out vllm/models/kimi_k3/nvidia/evidence/h200/eval_tiny.json "
                "--table docs/fast_track/eval_tiny_h200.md", "eval_tiny.json", kind="eval"),
        _record("python -m vllm.models.kimi_k3.nvidia.benchmarks.decode_latency --out /root/out/ev --quick --name d",
                "d.json", kind="decode-bench"),
        _record("coverage run --source=vllm/models/kimi_k3/nvidia/kernels -m pytest -q -m gpu "
                "vllm/models/kimi_k3/nvidia/tests/test_specialized_steps_cuda.py", "kernels_coverage.json"),
        _record("compute-sanitizer --tool {racecheck,synccheck} python3 -m pytest -q -p no:cacheprovider -m gpu "
                "vllm/models/kimi_k3/nvidia/tests/test_kda_decode_kernel.py -k 'all_padding or cuda_graph_capture'",
                "kda_decode_sanitizer.json", kind="sanitizer",
                sources=["vllm/models/kimi_k3/nvidia/kernels/kda_decode.py"]),
    ]
    steps = _run_steps(refresh.step_lines(records))
    assert [s[:2] for s in steps] == [["moe_test", "150"], ["eval_tiny", "330"], ["d", "170"],
                                     ["kernels_coverage", "150"], ["kda_decode_sanitizer", "300"]]
    test, evals, bench, cov, sanitizer = (s[2:] for s in steps)
    assert test == ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                    "vllm/models/kimi_k3/nvidia/tests/test_moe_kernels.py"]
    assert evals[:4] == ["python3", "-m", "vllm.models.kimi_k3.nvidia.latency_specialized", "eval"]
    assert evals[evals.index("--out") + 1] == "/ev/eval_tiny.json"
    assert evals[evals.index("--table") + 1] == "/ev/eval_tiny_h100.md"  # named for the card it runs on
    assert bench[bench.index("--out") + 1] == "/ev" and bench[0] == "python3"
    assert cov == ["record_coverage", "vllm/models/kimi_k3/nvidia/tests/test_specialized_steps_cuda.py"]
    assert sanitizer[sanitizer.index("--out") + 1] == "/ev/kda_decode_sanitizer.json"
    assert sanitizer[sanitizer.index("--source") + 1] == "vllm/models/kimi_k3/nvidia/kernels/kda_decode.py"
    assert sanitizer[sanitizer.index("-k") + 1] == "all_padding or cuda_graph_capture"
    assert sanitizer[sanitizer.index("--") + 1:][:3] == ["python3", "-m", "pytest"]


def test_a_record_written_beside_the_device_evidence_folder_is_refreshed_into_it():
    """A judging run's `--out /root/out/w/<name>.json`, committed as a record, is made again in
    $K3_EVIDENCE_DIR, where the call's results are collected; a device folder keeps its form."""
    sweep = _record("python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_mla_decode --long 0 --sweep "
                    "--out /root/out/w/mla_decode_sweep.json", "mla_decode_sweep.json", kind="kernel-bench")
    (step,) = _run_steps(refresh.step_lines([sweep]))
    assert step[2:][step[2:].index("--out") + 1] == "/ev/mla_decode_sweep.json"
    assert refresh._retarget("/root/out/w/before") == "/root/out/w/before"


def test_a_record_of_fast_track_record_tests_is_made_by_it_again():
    features = _record("python3 -m pytest -q -p no:cacheprovider -m gpu vllm/models/kimi_k3/nvidia/tests/test_features_cuda.py",
                       "features_parity.json", kind="parity", family="features", exit_code=0,
                       sources=["vllm/models/kimi_k3/nvidia/latency_specialized/engine.py"])
    (step,) = _run_steps(refresh.step_lines([features]))
    args = step[2:]
    assert args[:5] == ["python3", "-m", "tools.fast_track.cli", "record-tests", "--out"]
    assert args[5] == "/ev/features_parity.json"
    assert args[args.index("--kind") + 1] == "parity" and args[args.index("--family") + 1] == "features"
    assert args[args.index("--source") + 1] == "vllm/models/kimi_k3/nvidia/latency_specialized/engine.py"
    assert args[args.index("--") + 1:][-1] == "vllm/models/kimi_k3/nvidia/tests/test_features_cuda.py"


def test_node_ids_travel_and_a_command_naming_no_test_file_is_not_rewritten():
    """A record of one test (`file.py::test[param]`) is made by that test again, not by every GPU
    test; a pytest command that names no test file gets no step (it would run them all)."""
    node = "vllm/models/kimi_k3/nvidia/tests/test_features_cuda.py::test_structured_output_on_the_kernels[1]"
    features = _record(f"python3 -m pytest -q -p no:cacheprovider -m gpu {node}", "features_parity.json",
                       kind="parity", family="features", exit_code=0,
                       sources=["vllm/models/kimi_k3/nvidia/latency_specialized/engine.py"])
    (step,) = _run_steps(refresh.step_lines([features]))
    assert step[2:][-1] == node
    bare = _record("python -m pytest -q -m gpu", "bare.json")
    assert refresh.device_command(bare) is None
    assert "skipped" in refresh.step_lines([bare])[0]


def test_a_source_deleted_since_the_record_is_left_out_of_its_refresh():
    features = _record("python3 -m pytest -q -p no:cacheprovider -m gpu vllm/models/kimi_k3/nvidia/tests/test_features_cuda.py",
                       "features_parity.json", kind="parity", family="features", exit_code=0,
                       sources=["vllm/models/kimi_k3/nvidia/latency_specialized/engine.py",
                                "vllm/models/kimi_k3/nvidia/kernels/folded_into_another.py"])
    (step,) = _run_steps(refresh.step_lines([features]))
    args = step[2:]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--source"] == [
        "vllm/models/kimi_k3/nvidia/latency_specialized/engine.py"]


def test_a_record_made_from_folders_is_made_from_them_again():
    """`source_args` (what record-tests was given) wins over the expanded file list, so a kernel
    file added since the run is hashed by the refreshed record; a folder since removed is left out."""
    features = _record("python3 -m pytest -q -p no:cacheprovider -m gpu vllm/models/kimi_k3/nvidia/tests/test_features_cuda.py",
                       "features_parity.json", kind="parity", family="features", exit_code=0,
                       sources=["vllm/models/kimi_k3/nvidia/kernels/attn_res.py"],
                       source_args=["vllm/models/kimi_k3/nvidia/kernels", "vllm/models/kimi_k3/nvidia/gone"])
    (step,) = _run_steps(refresh.step_lines([features]))
    args = step[2:]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--source"] == ["vllm/models/kimi_k3/nvidia/kernels"]


def test_a_shared_command_runs_once_and_an_unknown_one_is_said_not_run():
    norms = "python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_norms --out-dir /root/out/w/ev"
    lines = refresh.step_lines([_record(norms, "norm_bench.json"), _record(norms, "attn_res_bench.json"),
                                _record("make bench", "odd.json")])
    assert sum(line.startswith("step ") for line in lines) == 1
    assert lines[-1].startswith("echo ") and "odd" in lines[-1] and "make bench" in lines[-1]


def test_for_a_ci_runner_the_commands_come_as_plain_lines_without_step_or_coverage(tmp_path):
    """`--commands` (gpu-run.yml): each distinct command once, as bash runs it, coverage and unknown
    forms said and not run; `--evidence` keeps one runner kind's folder and refuses a missing one."""
    norms = "python -m vllm.models.kimi_k3.nvidia.benchmarks.bench_norms --out-dir /root/out/w/ev"
    lines = refresh.command_lines([
        _record(norms, "norm_bench.json", "kernel-bench"), _record(norms, "attn_res_bench.json", "kernel-bench"),
        _record("coverage run --source=vllm/models/kimi_k3/nvidia/kernels -m pytest -q -m gpu "
                "vllm/models/kimi_k3/nvidia/tests/test_specialized_steps_cuda.py", "kernels_coverage.json"),
        _record("make bench", "odd.json")])
    assert len(lines) == 3 and lines[1].startswith("echo ") and lines[2].startswith("echo ")
    assert "kernels_coverage" in lines[1] and "make bench" in lines[2]
    script = tmp_path / "refresh.sh"
    script.write_text("K3_EVIDENCE_DIR=/ev\npython3() { printf '%s\\0' \"$@\"; printf '\\n'; }\n" + "\n".join(lines))
    out = subprocess.run(["bash", "-e", str(script)], capture_output=True, text=True, check=True).stdout
    (bench, *said) = out.splitlines()
    assert bench.rstrip("\0").split("\0") == ["-m", "vllm.models.kimi_k3.nvidia.benchmarks.bench_norms",
                                                "--out-dir", "/ev"]
    assert len(said) == 2 and all(line.startswith("=== ") for line in said)
    cpu = subprocess.run([sys.executable, ".ci/h200_refresh.py", "--evidence", "vllm/models/kimi_k3/nvidia/evidence/cpu",
                          "--commands"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert cpu.stdout.strip() == ""  # records made on a CPU are never the runner's
    missing = subprocess.run([sys.executable, ".ci/h200_refresh.py", "--evidence", "vllm/models/kimi_k3/nvidia/evidence/none",
                              "--commands"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode != 0 and "--evidence vllm/models/kimi_k3/nvidia/evidence/none: no such folder" in missing.stderr


def test_records_made_on_a_cpu_are_left_to_the_cpu():
    cpu = Record("vllm/models/kimi_k3/nvidia/evidence/cpu/eval_tiny.json", {"kind": "eval", "command": "k3-decode eval"})
    gpu = _record("pytest -m gpu vllm/models/kimi_k3/nvidia/tests/test_executor_cuda.py")
    assert refresh.gpu_records([(cpu, "stale"), (gpu, "stale")]) == [gpu]


def test_a_record_that_says_how_long_it_ran_is_expected_to_take_that_again():
    timed = _record("pytest -m gpu vllm/models/kimi_k3/nvidia/tests/test_executor_cuda.py", "a.json", wall_s=40.0)
    slow = _record("pytest -m gpu vllm/models/kimi_k3/nvidia/tests/test_moe_kernels.py", "b.json", wall_s=200.0)
    untimed = _record("pytest -m gpu vllm/models/kimi_k3/nvidia/tests/test_situ_mul_kernel.py", "c.json")
    lines = refresh.step_lines([timed, slow, untimed])
    assert _expects(lines) == ["56", "240", "-"]  # 1.15 x wall_s + 10 s; none without wall_s
    assert [s[:2] for s in _run_steps(lines)] == [["a", "150"], ["b", "480"], ["c", "150"]]  # limit >= 2 x expected


def test_stale_records_run_kernel_tests_first_and_the_longest_first_within_a_kind():
    records = [_record("a", "bench.json", "kernel-bench", wall_s=40), _record("b", "san.json", "sanitizer"),
               _record("c", "long.json", "parity", wall_s=300), _record("d", "t.json", "kernel-test"),
               _record("e", "short.json", "parity", wall_s=60), _record("f", "odd.json", "other"),
               _record("g", "ev.json", "eval", wall_s=100), _record("h", "db.json", "decode-bench", wall_s=90)]
    assert [r.rel.rsplit("/", 1)[1] for r in refresh.by_priority(records)] == \
        ["t.json", "long.json", "short.json", "ev.json", "db.json", "bench.json", "san.json", "odd.json"]


def test_step_skips_by_what_a_step_is_expected_to_take_and_cuts_its_limit_to_the_budget(tmp_path):
    """The `step` of .ci/h200_call.sh itself: EXPECT decides the skip for its own call only, and
    a limit beyond what is left of BUDGET is cut to it."""
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("no bash or timeout")
    step_fn = re.search(r"^step\(\) \{.*?^\}", (ROOT / ".ci/h200_call.sh").read_text(), re.S | re.M).group(0)
    script = (f"W={tmp_path}\nBUDGET=100\n{step_fn}\n"
              "EXPECT=50 step fits 170 bash -c 'echo ran'; echo \"rc $?\"\n"
              "EXPECT=150 step over 170 bash -c 'echo ran'; echo \"rc $?\"\n"
              "step plain 170 bash -c 'echo ran'; echo \"rc $?\"\n"
              "SECONDS=98; EXPECT=1 step cut 10 sleep 5; echo \"rc $?\"\n")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert "fits: exit 0" in out and "over: skipped" in out and "plain: skipped" in out
    assert out.count("rc 125") == 2 and "rc 0" in out
    assert "cut: exit 124" in out  # its 10 s limit cut to the 2 s left, so 5 s of sleep overrun it


def test_a_gpu_test_whose_record_was_never_committed_gets_a_step(tmp_path):
    model = tmp_path / "m"
    (model / "tests").mkdir(parents=True)
    (model / "evidence" / "h200").mkdir(parents=True)
    (model / "tests" / "test_new.py").write_text('parity_record("new_parity.json", "executor", "f", [], R)\n'
                                                 'long_run_tests(RUNS, "long.json", "f")\n'
                                                 'depth_tests(8, "deep.json", "f")\n')
    (model / "tests" / "test_kernel.py").write_text('record_kernel_test("kernel_test.json", "gemm", "f", S, R, "t")\n'
                                                    '@pytest.mark.gpu\ndef test_it(): pass\n')
    # a CPU test of the recorder (no GPU test in its module) writes no record a GPU run makes
    (model / "tests" / "test_recorder.py").write_text('record_kernel_test("x.json", "demo", "f", S, R, "t")\n')
    (model / "tests" / "test_old.py").write_text('record_parity(\n    "old.json", "executor", "f", [], R)\n')
    (model / "evidence" / "h200" / "old.json").write_text("{}")
    # a test that only quotes such a call (as this file does) writes no record
    (model / "tests" / "test_quotes.py").write_text("""SRC = 'record_parity("quoted.json", "executor")'\n""")
    lines = refresh.unrecorded_steps(model, tmp_path)
    assert [line.split()[:2] for line in lines] == [["step", "kernel_test"], ["step", "new_parity"], ["step", "long"],
                                                    ["step", "deep"]]
    assert all(line.endswith("-m gpu m/tests/test_new.py") for line in lines[1:])
    here = refresh.unrecorded_steps(ROOT / "vllm/models/kimi_k3/nvidia", ROOT)
    assert not [line for line in here if "test_h200_refresh.py" in line]
    # a record never run but estimated from its siblings is packed by that estimate
    (model / "tests" / "test_tp8.py").write_text('long_run_tests(RUNS, "executor_long_runs_tp8_mid.json", "f")\n')
    tp8 = [line for line in refresh.unrecorded_steps(model, tmp_path) if "test_tp8.py" in line]
    assert tp8 == [f"EXPECT={refresh.FIRST_RUN_EXPECT['executor_long_runs_tp8_mid.json']} step "
                   f"executor_long_runs_tp8_mid {refresh.LIMIT_BY_FILE['executor_long_runs_tp8_mid.json']} "
                   "python3 -m pytest -q -p no:cacheprovider -m gpu m/tests/test_tp8.py"]


def _cards_model(root: Path) -> tuple[str, Callable[..., None]]:
    """A model folder `m` with one source, m/k.py: its fresh hash, and `put(card, name, digest,
    **fields)`, which writes m/evidence/CARD/NAME.json, a kernel-test record of that source made on
    CARD (a field given replaces the default: kind, command, gpu)."""
    from tools.fast_track.evidence import source_hash

    (root / "m").mkdir()
    (root / "m" / "k.py").write_text("x = 1\n")

    def put(card: str, name: str, digest: str, **fields) -> None:
        folder = root / "m" / "evidence" / card
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps({
            "kind": "kernel-test", "command": f"pytest -m gpu m/tests/test_{name}.py",
            "gpu": f"NVIDIA {card.upper()}", "sources": ["m/k.py"], "source_hash": digest,
            "source_hashes": {}, **fields}))

    return source_hash(root, ["m/k.py"]), put


def test_on_one_card_its_stale_records_and_those_only_other_cards_have_are_made(tmp_path):
    """`--card h100`: the H100's stale records, and the H200's records the H100 has none of (made
    by their commands); its fresh ones, and what the H200 alone has stale, are not its business."""
    from tools.fast_track.evidence import EvidenceSet
    from tools.fast_track.model import ModelFolder

    fresh, put = _cards_model(tmp_path)
    put("h200", "a", fresh)
    put("h200", "b", "0" * 64)  # stale, and the H100 has no b
    put("h200", "c", fresh)
    put("h100", "a", "0" * 64)  # stale on the H100
    put("h100", "c", fresh)
    put("cpu", "d", "0" * 64, gpu="none")  # a CPU's record is the CPU's
    model = EvidenceSet.load(ModelFolder(tmp_path, "m"))
    assert sorted(r.rel for r in refresh.card_records(model, "h100")) == ["m/evidence/h100/a.json", "m/evidence/h200/b.json"]
    assert [r.rel for r in refresh.card_records(model, "h200")] == ["m/evidence/h200/b.json"]
    assert sorted(r.rel for r in refresh.card_records(model, "b200")) == [  # a new card: all it lacks
        "m/evidence/h100/a.json", "m/evidence/h100/c.json", "m/evidence/h200/b.json"]


def test_on_one_card_what_no_card_holds_fresh_runs_before_what_another_card_holds(tmp_path, monkeypatch, capsys):
    """`--card h200`: its stale records that no other card holds fresh come first, then what the
    H100 holds fresh; a fresh H100 record with fewer results than the H200's (a TP8 half that
    skipped there) does not count as held, and a command shared across the groups runs once."""
    fresh, put_record = _cards_model(tmp_path)
    (tmp_path / "m" / "SCOPE.yaml").write_text("model: m\n")

    def put(card: str, name: str, digest: str, results: int, command: str | None = None) -> None:
        put_record(card, name, digest, kind="parity", results=[{"status": "pass"}] * results, wall_s=50.0,
                   **({"command": command} if command else {}))

    shared = "pytest -m gpu m/tests/test_shared.py"
    for name in ("held", "half", "alone", "s1", "s2"):
        put("h200", name, "0" * 64, 8, shared if name.startswith("s") else None)
    put("h100", "held", fresh, 8)
    put("h100", "half", fresh, 4)
    put("h100", "s2", fresh, 8, shared)
    monkeypatch.chdir(tmp_path)
    assert refresh.main(["--model", "m", "--card", "h200"]) == 0
    names = [line.split()[2] for line in capsys.readouterr().out.splitlines() if " step " in f" {line}"]
    assert names == ["alone", "half", "s1", "held"], names


def test_main_lists_every_stale_record_and_refuses_an_unreadable_one(tmp_path, monkeypatch, capsys):
    """With no --card, every stale GPU record gets a step; an evidence file that holds no record
    stops the refresh by name, since no step could ever make it again."""
    (tmp_path / "m" / "evidence" / "h200").mkdir(parents=True)
    (tmp_path / "m" / "SCOPE.yaml").write_text("model: m\n")
    (tmp_path / "m" / "k.py").write_text("x = 1\n")
    (tmp_path / "m" / "evidence" / "h200" / "a.json").write_text(json.dumps({
        "kind": "kernel-test", "command": "pytest -m gpu m/tests/test_a.py", "gpu": "NVIDIA H200",
        "sources": ["m/k.py"], "source_hash": "0" * 64}))
    monkeypatch.chdir(tmp_path)
    assert refresh.main(["--model", "m"]) == 0
    assert "step a " in capsys.readouterr().out
    (tmp_path / "m" / "evidence" / "h200" / "broken.json").write_text("{")
    with pytest.raises(SystemExit, match="broken.json"):
        refresh.main(["--model", "m"])


def _run_script(script: list[str], tmp_path, timeout: float | None = None) -> str:
    """The script with a `step` that only says where it ran."""
    return subprocess.run(
        ["bash", "-c", f'W={tmp_path}\nstep() {{ echo "ran $1 on GPU $CUDA_VISIBLE_DEVICES"; }}\n' + "\n".join(script)],
        capture_output=True, text=True, check=True, timeout=timeout).stdout


def test_on_several_gpus_each_step_runs_once_on_the_least_loaded_queue_in_priority_order(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    lines = ["EXPECT=300 step a 600 true", "step c 150 true", "EXPECT=200 step b 400 true",
             "echo '=== x: skipped, no rewrite for: y'", "EXPECT=100 step d 200 true"]
    script = refresh.on_gpus(lines, 2)
    assert refresh.on_gpus(lines, 1) == lines
    ran = _run_script(script, tmp_path)
    # a (300) and c (150) open the queues, b (200) joins c's, d (100) a's (300 against 350)
    for name, gpu in {"a": 0, "c": 1, "b": 1, "d": 0}.items():
        assert ran.count(f"ran {name} on GPU") == 1 and f"ran {name} on GPU {gpu}" in ran
    assert "=== x: skipped" in ran
    assert ran.index("ran a") < ran.index("ran d") and ran.index("ran c") < ran.index("ran b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu0.out", "gpu1.out"]


def _steps_of(script: list[str], label: str) -> list[str]:
    """The step names of the queue whose transcript is `label`, in order."""
    end = script.index(f') > "$W/{label}.out" 2>&1 &')
    start = max(i for i in range(end) if script[i].startswith("( export CUDA_VISIBLE_DEVICES="))
    return [refresh._name(line) for line in script[start + 1:end]]


def test_in_lanes_the_checks_share_a_gpu_the_blocks_take_turns_and_the_timed_run_alone(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    lines = ["EXPECT=900 step check0 1000 true", "EXPECT=300 step block_a 600 true", "EXPECT=50 step check 100 true",
             "EXPECT=100 step block_b 200 true",
             "EXPECT=80 step bench 200 true", "EXPECT=20 step check2 100 true"]
    script = refresh.on_gpus(lines, 1, 2, timed=frozenset({"bench"}), holds_a_block=frozenset({"block_a", "block_b"}))
    # the two blocks in the first lane, though the second is emptier; the checks beside them, the
    # first of them (the longest) not in the blocks' lane though it came first
    assert _steps_of(script, "gpu0.lane0") == ["block_a", "block_b"]
    assert _steps_of(script, "gpu0.lane1") == ["check0", "check", "check2"]
    # the bench only after every check is done, alone
    first_wait = script.index('wait "${queued[@]}"')
    assert any("step bench" in line for line in script[first_wait:]) and \
        not any("step bench" in line for line in script[:first_wait])
    # a job the call left in the background (a memory log) does not hold the lanes' waits up
    ran = _run_script(["sleep 60 > /dev/null 2>&1 &", *script], tmp_path, timeout=30)
    assert all(ran.count(f"ran {n} on GPU 0") == 1 for n in ("block_a", "block_b", "check0", "check", "check2", "bench"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu0.lane0.out", "gpu0.lane1.out", "gpu0.timed.out"]
    # with nothing timed queued, no phase of its own (whose wait, on no job, would wait for all)
    checks_only = refresh.on_gpus(lines[:2], 1, 2, holds_a_block=frozenset({"block_a"}))
    assert sum(line.startswith("wait") for line in checks_only) == 1
    _run_script(["sleep 60 > /dev/null 2>&1 &", *checks_only], tmp_path, timeout=30)


def test_on_an_80gb_card_kernel_and_depth_tests_take_turns_with_the_blocks(tmp_path, monkeypatch, capsys):
    """A 12-layer block leaves about 20 GB of an H100: kernel tests ran out of memory beside one on
    2026-12-06. So with `--card h100` the kernel tests and the depth tests share the blocks' lane
    and only light checks (an eval) run beside them; on the H200 they run beside the blocks."""
    _, put = _cards_model(tmp_path)
    (tmp_path / "m" / "SCOPE.yaml").write_text("model: m\n")
    for card in ("h100", "h200"):
        put(card, "executor_long_runs", "0" * 64, kind="parity", wall_s=300.0)
        put(card, "executor_depth_parity", "0" * 64, kind="parity", wall_s=400.0)
        put(card, "moe_test", "0" * 64, wall_s=90.0)
        put(card, "eval_tiny", "0" * 64, kind="eval", wall_s=200.0)
    monkeypatch.chdir(tmp_path)
    lanes = {}
    for card in ("h100", "h200"):
        assert refresh.main(["--model", "m", "--card", card, "--lanes", "2"]) == 0
        script = capsys.readouterr().out.splitlines()
        lanes[card] = sorted(_steps_of(script, "gpu0.lane0")), sorted(_steps_of(script, "gpu0.lane1"))
    assert lanes["h100"] == (["executor_depth_parity", "executor_long_runs", "moe_test"], ["eval_tiny"])
    assert lanes["h200"] == (["executor_long_runs"], ["eval_tiny", "executor_depth_parity", "moe_test"])


def test_only_keeps_the_named_steps_in_the_refresh_order_and_refuses_an_unknown_name(tmp_path, monkeypatch, capsys):
    """`--only`: a call that serves one issue runs just its records, in the priority order (the
    kernel test before the parity run, whatever order they are named in); a misspelt name stops
    the call with the names there are, rather than making a call that runs nothing; a record fresh
    on this card is said and left out."""
    fresh, put = _cards_model(tmp_path)
    (tmp_path / "m" / "SCOPE.yaml").write_text("model: m\n")
    put("h200", "executor_long_runs", "0" * 64, kind="parity", wall_s=300.0)
    put("h200", "moe_test", "0" * 64, wall_s=90.0)
    put("h200", "eval_tiny", "0" * 64, kind="eval", wall_s=200.0)
    monkeypatch.chdir(tmp_path)
    assert refresh.main(["--model", "m", "--card", "h200", "--only", "executor_long_runs", "moe_test"]) == 0
    names = [line.split()[2] for line in capsys.readouterr().out.splitlines() if " step " in f" {line}"]
    assert names == ["moe_test", "executor_long_runs"], names
    with pytest.raises(SystemExit, match=r"--only moe_tst: no such step.*it has: eval_tiny executor_long_runs moe_test"):
        refresh.main(["--model", "m", "--card", "h200", "--only", "moe_tst"])
    # a record fresh on this card is said and skipped, and the rest still run
    put("h200", "moe_bench", fresh, kind="kernel-bench", wall_s=40.0)
    capsys.readouterr()
    assert refresh.main(["--model", "m", "--card", "h200", "--only", "moe_bench", "moe_test"]) == 0
    out, err = capsys.readouterr()
    assert [line.split()[2] for line in out.splitlines() if " step " in f" {line}"] == ["moe_test"], out
    assert "--only moe_bench: fresh for this card, not run" in err, err
    with pytest.raises(SystemExit, match="--only picks a call's steps.*pass one of them"):
        refresh.main(["--model", "m", "--card", "h200", "--only", "moe_test", "--commands"])


def test_more_gpus_than_steps_leaves_the_rest_idle_and_no_gpus_is_refused(capsys):
    script = refresh.on_gpus(["step a 10 true"], 4)
    assert sum(line.startswith("( export CUDA_VISIBLE_DEVICES=") for line in script) == 1
    with pytest.raises(SystemExit, match="--gpus must be at least 1"):
        refresh.main(["--gpus", "0"])
    with pytest.raises(SystemExit, match="--lanes must be at least 1"):
        refresh.main(["--lanes", "0"])


def test_the_memory_log_samples_until_stopped_and_reports_the_peak(tmp_path):
    """gpu_memory_log and gpu_memory_peak of .ci/h200_call.sh, on an nvidia-smi stand-in that
    prints two GPUs' samples in its -l loop."""
    if shutil.which("bash") is None or shutil.which("awk") is None:
        pytest.skip("no bash or awk")
    text = (ROOT / ".ci/h200_call.sh").read_text()
    fns = [re.search(rf"^{f}\(\) \{{.*?^\}}", text, re.S | re.M).group(0) for f in ("gpu_memory_log", "gpu_memory_peak")]
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\nwhile true; do echo "0, 61715"; echo "1, 114966"; sleep 0.05; done\n')
    fake.chmod(0o755)
    # a bare `wait` (a call's lanes) returns while the log still samples
    script = "\n".join([f"W={tmp_path}", f"PATH={fake.parent}:$PATH", *fns,
                        "gpu_memory_log", "sleep 0.3 & wait; echo waited", "gpu_memory_peak", "gpu_memory_peak"])
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, timeout=20).stdout
    assert out.split("\n")[:2] == ["waited", "peak GPU memory: 114966 MiB"]  # the second call: nothing to stop
    assert "0, 61715" in (tmp_path / "gpu_mem.log").read_text()


def test_the_call_refuses_a_commit_taken_from_an_older_git_in_the_device_copy(tmp_path):
    if shutil.which("bash") is None or shutil.which("git") is None:
        pytest.skip("no bash or git")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(tmp_path)}
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "kernel.py").write_text("old\n")
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "older"]):
        subprocess.run(["git", *args], cwd=copy, env=env, check=True)

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\necho "NVIDIA H200"\n')
    fake.chmod(0o755)
    env["PATH"] = f"{fake.parent}:{env['PATH']}"

    def call() -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f'export OUT={tmp_path}; K3_COMMIT=$(git rev-parse HEAD) '
                               f'source {ROOT}/.ci/h200_call.sh'], cwd=copy, env=env, capture_output=True, text=True)

    (copy / "kernel.py").write_text("what travelled\n")  # the tree is newer than the copy's .git
    refused = call()
    assert refused.returncode == 2 and "older than its tree" in refused.stdout
    subprocess.run(["git", "checkout", "-q", "kernel.py"], cwd=copy, env=env, check=True)
    passed = call()  # a tree that is its commit gets past the check (and stops at the missing wheels)
    assert "older than its tree" not in passed.stdout and "no .devwheels" in passed.stdout


@pytest.mark.parametrize("commit", ["", "none", "HEAD", "ac87a23", "0" * 39 + "g"])
def test_the_call_refuses_a_commit_that_is_not_a_full_sha(tmp_path, commit):
    """Every record of the call carries K3_COMMIT: on 2026-12-05 a script that read it from a missing
    file set "none", which the call took and three records carried."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    ran = subprocess.run(["bash", "-c", f"source {ROOT}/.ci/h200_call.sh"], cwd=tmp_path,
                         env={**os.environ, "K3_COMMIT": commit, "OUT": str(tmp_path)}, capture_output=True, text=True)
    assert ran.returncode == 2 and "K3_COMMIT" in ran.stdout, ran.stdout
    assert "records belong" not in ran.stdout  # stopped before anything else


def test_the_call_names_the_records_folder_of_its_card_and_stops_on_another(tmp_path):
    """Records go to the folder of the card that ran them: an H200 to evidence/h200/, an H100
    (SCOPE.yaml's h100-validation, lent since 2026-12-05) to evidence/h100/; a card with no
    envelope stops the call before any step, unless K3_ANY_GPU says the figures are wanted anyway."""
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "K3_COMMIT": "0" * 40, "OUT": str(tmp_path)}

    def call(card: str, extra: dict) -> subprocess.CompletedProcess:
        fake.write_text(f'#!/bin/bash\necho "{card}"\n')
        fake.chmod(0o755)
        return subprocess.run(["bash", "-c", f"source {ROOT}/.ci/h200_call.sh"], cwd=tmp_path, env={**env, **extra},
                              capture_output=True, text=True)

    for card, folder in (("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100")):
        ran = call(card, {})  # past the check, to the missing wheels
        assert f"records belong in evidence/{folder}/" in ran.stdout and "no .devwheels" in ran.stdout, ran.stdout
    for extra in ({}, {"K3_ANY_GPU": "0"}):
        stopped = call("NVIDIA A100-SXM4-80GB", extra)
        assert stopped.returncode == 3 and "'NVIDIA A100-SXM4-80GB', not an H200 or H100" in stopped.stdout
    forced = call("NVIDIA A100-SXM4-80GB", {"K3_ANY_GPU": "1"})
    assert "records belong in evidence/none/" in forced.stdout and "no .devwheels" in forced.stdout


def test_a_sanitizer_refresh_also_checks_what_its_namesake_on_another_card_covered(tmp_path, monkeypatch):
    """The H200's KDA sanitizer record predates rows.py, the H100's lists it: an H200 refresh must
    check rows.py's barrier too. A record-tests record keeps its own sources, whatever the other
    card's says."""
    for rel in ("m/k.py", "m/rows.py", "m/old.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    for card, sources in (("h100", ["m/k.py", "m/rows.py", "m/old.py"]), ("h200", ["m/k.py"])):
        folder = tmp_path / "m" / "evidence" / card
        folder.mkdir(parents=True)
        (folder / "san.json").write_text(json.dumps({"kind": "sanitizer", "sources": sources}))
        (folder / "feat.json").write_text(json.dumps({"kind": "parity", "sources": sources}))
    (tmp_path / "m" / "old.py").unlink()  # deleted since the H100 run: left out, as for the own sources
    monkeypatch.setattr(refresh, "REPO", tmp_path)
    sanitizer = Record("m/evidence/h200/san.json", {
        "kind": "sanitizer", "gpu": "NVIDIA H200", "sources": ["m/k.py"],
        "command": "compute-sanitizer --tool racecheck python3 -m pytest -q -m gpu m/tests/test_k.py"})
    features = Record("m/evidence/h200/feat.json", {
        "kind": "parity", "family": "features", "exit_code": 0, "gpu": "NVIDIA H200", "sources": ["m/k.py"],
        "command": "python3 -m pytest -q -m gpu m/tests/test_feat.py"})
    san_args, feat_args = (refresh.device_command(r) for r in (sanitizer, features))
    assert [san_args[i + 1] for i, a in enumerate(san_args) if a == "--source"] == ["m/k.py", "m/rows.py"]
    assert [feat_args[i + 1] for i, a in enumerate(feat_args) if a == "--source"] == ["m/k.py"]


def test_a_fresh_sanitizer_record_narrower_than_its_namesake_is_made_again_on_its_card(tmp_path, monkeypatch):
    """The H200's KDA sanitizer record is fresh but lists no rows.py, which the H100's covers: a
    refresh on the H200 makes it again (with rows.py, the test above); on the H100, whose record
    is the wider one, nothing is made, and a fresh record of another kind is never made again."""
    from tools.fast_track.evidence import EvidenceSet, source_hash
    from tools.fast_track.model import ModelFolder

    fresh, put = _cards_model(tmp_path)
    (tmp_path / "m" / "rows.py").write_text("y = 2\n")
    wide = {"sources": ["m/k.py", "m/rows.py"], "source_hash": source_hash(tmp_path, ["m/k.py", "m/rows.py"])}
    monkeypatch.setattr(refresh, "REPO", tmp_path)
    command = "compute-sanitizer --tool racecheck python3 -m pytest -q -m gpu m/tests/test_k.py"
    put("h200", "san", fresh, kind="sanitizer", command=command)
    put("h100", "san", "", kind="sanitizer", command=command, **wide)
    put("h200", "test", fresh)
    put("h100", "test", "", **wide)
    model = EvidenceSet.load(ModelFolder(tmp_path, "m"))
    assert all(model.freshness(r).fresh for r in model.records)
    assert [r.rel for r in refresh.card_records(model, "h200")] == ["m/evidence/h200/san.json"]
    assert refresh.card_records(model, "h100") == []

