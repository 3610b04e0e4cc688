"""The SM-activity benchmark reads ncu's CSV as ncu writes it, picks the split kernel out of a
launch, judges issue 7's 1M target on the right cases, and says clearly what is wrong when ncu
is missing or reports something else (CPU)."""

import argparse
import time

import pytest

from vllm.models.kimi_k3.nvidia.benchmarks import mla_sm_activity as sa

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def csv_text(kernels: list[tuple[str, dict[str, tuple[str, str]]]]) -> str:
    """ncu's details CSV for `kernels` [(name, {metric: (unit, value)})], its own log lines first."""
    lines = ["==PROF== Connected to process 4242 (/usr/bin/python3.12)",
             '==PROF== Profiling "kernel" - 0: 0%....50%....100% - 1 pass', HEADER]
    for kid, (name, metrics) in enumerate(kernels):
        for metric, (unit, value) in metrics.items():
            lines.append(f'"{kid}","4242","python3.12","127.0.0.1","{name}","1","7","(256, 1, 1)","(132, 1, 1)",'
                         f'"0","9.0","Command line profiler metrics","{metric}","{unit}","{value}"')
    lines.append("==PROF== Disconnected from process 4242")
    return "\n".join(lines) + "\n"


SPLIT = {"sm__cycles_active.avg": ("cycle", "34,928"), "sm__cycles_active.min": ("cycle", "30,000"),
         "gpc__cycles_elapsed.max": ("cycle", "46,387"),
         "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", "48.12"),
         "gpu__time_duration.sum": ("usecond", "24.9"), "launch__grid_size": ("", "132")}
COMBINE = {"gpu__time_duration.sum": ("nsecond", "5,312"), "launch__grid_size": ("", "132")}


def test_parse_reads_every_kernel_in_order_with_units_and_separators():
    kernels = sa.parse_ncu_csv(csv_text([("kernel_cutlass__mla_decode_kernel_0", SPLIT),
                                         ("kernel_cutlass__mla_combine_kernel_1", COMBINE)]))
    assert [k["kernel"] for k in kernels] == ["kernel_cutlass__mla_decode_kernel_0", "kernel_cutlass__mla_combine_kernel_1"]
    assert kernels[0]["sm__cycles_active.avg"] == 34928.0
    assert kernels[0]["gpu__time_duration.sum"] == pytest.approx(24900.0)  # µs read as ns
    assert kernels[1]["gpu__time_duration.sum"] == 5312.0


def test_summary_is_the_split_kernels_share_of_its_cycles():
    s = sa.summarize(sa.parse_ncu_csv(csv_text([("mla_decode_kernel", SPLIT), ("mla_combine_kernel", COMBINE)])))
    assert s["sm_active_mean"] == pytest.approx(34928 / 46387)
    assert s["sm_active_min"] == pytest.approx(30000 / 46387)
    assert s["split_us"] == pytest.approx(24.9) and s["combine_us"] == pytest.approx(5.312)
    assert s["dram_pct"] == pytest.approx(48.12) and s["grid"] == 132
    alone = sa.summarize(sa.parse_ncu_csv(csv_text([("mla_decode_kernel", SPLIT)])))  # no combine row: none reported
    assert "combine_us" not in alone and alone["sm_active_mean"] == s["sm_active_mean"]


@pytest.mark.parametrize("kernels, says", [
    ([("mla_decode_kernel", SPLIT), ("elementwise_kernel", SPLIT)], "expected the split kernel"),
    ([("mla_combine_kernel", COMBINE)], "expected the split kernel"),
    ([("mla_decode_kernel", dict(SPLIT, **{"sm__cycles_active.min": ("cycle", "n/a")}))], "sm__cycles_active.min"),
])
def test_summary_refuses_what_is_not_one_launch_of_the_kernel(kernels, says):
    with pytest.raises(sa.NcuError, match=says):
        sa.summarize(sa.parse_ncu_csv(csv_text(kernels)))


def test_parse_says_when_ncu_wrote_no_table_or_another_page():
    with pytest.raises(sa.NcuError, match="no CSV table"):
        sa.parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission\n")
    with pytest.raises(sa.NcuError, match="Metric Name"):
        sa.parse_ncu_csv('"ID","Kernel Name","sm__cycles_active.avg"\n"","","cycle"\n"0","k","1"\n')


def test_target_counts_only_one_request_at_1m():
    def res(requests, context, busy, status="pass"):
        return {"name": f"r{requests} c{context}", "status": status, "sm_active_mean": busy,
                "shape": {"requests": requests, "context": context}}
    results = [res(1, 1 << 20, 0.95), res(1, 1 << 20, 0.92), res(1, 32768, 0.5), res(64, 32768, 0.3),
               res(1, 1 << 20, 0.1, status="fail")]
    (t,) = sa.targets_of(results)
    assert t["value"] == pytest.approx(0.92) and t["met"] and t["cases"] == 2 and t["worst_case"] == "r1 c1048576"
    (t,) = sa.targets_of([res(1, 1 << 20, 0.85)])
    assert not t["met"]
    assert sa.targets_of([res(1, 32768, 0.99)]) == []


@pytest.mark.parametrize("text, says", [("6,1,1", "four integers"), ("6,9,1,64", "q <= 8"),
                                        ("6,8,16,64", "requests · q <= 64"), ("0,1,1,64", ">= 1")])
def test_a_bad_case_names_the_form(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        sa.parse_case(text)
    assert sa.parse_case("12,8,1,1048576") == (12, 8, 1, 1 << 20)


def test_missing_ncu_names_where_it_looked(monkeypatch):
    monkeypatch.setattr(sa.shutil, "which", lambda _: None)
    monkeypatch.setattr(sa.glob, "glob", lambda _: [])
    with pytest.raises(sa.NcuError, match="neither on PATH nor in /usr/local/cuda"):
        sa.find_ncu()
    monkeypatch.setattr(sa.glob, "glob", lambda pat: ["/usr/local/cuda-13.0/bin/ncu"] if "cuda" in pat else [])
    assert sa.find_ncu() == "/usr/local/cuda-13.0/bin/ncu"


def fake_ncu(tmp_path, body: str) -> str:
    """An executable standing in for ncu: `log` is the path given after --log-file."""
    path = tmp_path / "ncu"
    path.write_text("#!/usr/bin/env python3\nimport os, subprocess, sys, time\n"
                    "log = sys.argv[sys.argv.index('--log-file') + 1]\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_case_is_read_from_the_log_ncu_wrote(tmp_path):
    table = csv_text([("mla_decode_kernel", SPLIT), ("mla_combine_kernel", COMBINE)])
    ncu = fake_ncu(tmp_path, f"open(log, 'w').write({table!r})\n")
    res = sa.profile_case(ncu, (6, 1, 1, 1024), timeout_s=60)
    assert res["status"] == "pass", res
    assert res["sm_active_mean"] == pytest.approx(34928 / 46387) and res["shape"]["context"] == 1024


def test_ncus_own_error_lines_reach_the_result(tmp_path):
    ncu = fake_ncu(tmp_path, "open(log, 'w').write('==ERROR== ERR_NVGPUCTRPERM - no permission\\n')\n"
                             "sys.stderr.write('a warning from the child\\n'); sys.exit(1)\n")
    res = sa.profile_case(ncu, (6, 1, 1, 1024), timeout_s=60)
    assert res["status"] == "fail" and "ERR_NVGPUCTRPERM" in res["error"] and "exited 1" in res["error"]
    ncu = fake_ncu(tmp_path, "open(log, 'w').write('==ERROR== ERR_NVGPUCTRPERM - no permission\\n')\n")
    res = sa.profile_case(ncu, (6, 1, 1, 1024), timeout_s=60)  # exit 0, no table
    assert res["status"] == "fail" and "no CSV table" in res["error"] and "ERR_NVGPUCTRPERM" in res["error"]


def test_a_run_past_its_time_is_killed_with_its_child(tmp_path):
    pid_file = tmp_path / "child.pid"
    ncu = fake_ncu(tmp_path, "child = subprocess.Popen(['sleep', '60'])\n"
                             f"open({str(pid_file)!r}, 'w').write(str(child.pid))\ntime.sleep(60)\n")
    t0 = time.monotonic()
    res = sa.profile_case(ncu, (6, 1, 1, 1024), timeout_s=2)
    # killing ncu alone would leave the child holding the output pipes until it ended (60 s)
    assert time.monotonic() - t0 < 30
    assert res["status"] == "fail" and "ran past 2 s" in res["error"]
    child = int(pid_file.read_text())
    for _ in range(50):
        if not alive(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the profiled child {child} outlived the timeout")


def alive(pid: int) -> bool:
    """Running, not gone and not a zombie (a killed orphan stays one where nothing reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
