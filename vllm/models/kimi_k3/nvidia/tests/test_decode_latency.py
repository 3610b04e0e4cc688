"""The block-parity verdict of the decode records (benchmarks/block_parity.py): the rounding-noise yardstick, with top-1 agreement judged
as a rate over the tokens it was counted on, each point's parity run over at least
PARITY_MIN_TOKENS tokens."""

from __future__ import annotations

import pytest
import torch

from vllm.models.kimi_k3.nvidia.benchmarks import decode_latency
from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (PARITY_MIN_TOKENS, copy_state, fill_state,
                                                                parity_lockstep, parity_status, parity_steps_at)
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import RoundingNoiseOps
from vllm.models.kimi_k3.nvidia.tests._util import mini_model


def _par(spec_err, spec_top1, base_err, base_top1, tokens):
    return {"specialized": {"steps": 8, "tokens": tokens, "rel_err_median": spec_err, "top1_agreement": spec_top1},
            "standard_rounding_noise": {"steps": 8, "tokens": tokens, "rel_err_median": base_err,
                                        "top1_agreement": base_top1}}


@pytest.mark.parametrize("par, verdict", [
    # H200 records of 2026-12-03 at one row (8 tokens): 0/8 and 1/8 against the yardstick's 2/8
    (_par(0.66, 0.0, 0.82, 0.25, 8), "pass"),
    (_par(0.74, 0.125, 0.73, 0.25, 8), "pass"),
    # the same rates over 512 tokens are a real difference
    (_par(0.66, 0.0, 0.82, 0.25, 512), "fail"),
    (_par(0.70, 0.10, 0.75, 0.30, 512), "fail"),
    (_par(0.70, 0.20, 0.75, 0.30, 512), "pass"),  # within 1/1.5 of the yardstick's rate
    # the logit error is judged as before, whatever the token count
    (_par(1.40, 0.30, 0.75, 0.30, 8), "fail"),
    (_par(1.10, 0.30, 0.75, 0.30, 512), "pass"),  # 1.10 <= 1.5 · 0.75 + 0.02
])
def test_the_verdict_weighs_top1_by_the_tokens_counted(par, verdict):
    assert parity_status(par) == verdict


def test_without_a_yardstick_the_absolute_bounds_apply():
    assert parity_status({"specialized": {"steps": 8, "rel_err_median": 1e-3, "top1_agreement": 1.0}}) == "pass"
    assert parity_status({"specialized": {"steps": 8, "rel_err_median": 5e-2, "top1_agreement": 1.0}}) == "fail"


def test_lockstep_parity_serves_every_path_from_one_standard_run():
    """Every executor starts from the first one's state and gets the standard path's tokens; one
    that raises is dropped and named, the required one's error propagates."""
    class Failing(ReferenceOps):
        armed = False

        def rms_norm(self, x, w, eps):
            if self.armed:
                raise RuntimeError("broken on purpose")
            return super().rms_norm(x, w, eps)

    model = mini_model(seed=2)

    def executor(ops):
        return SpecializedDecode(model, max_requests=2, max_len=64, buckets=[(2, 1)], ops=ops, graphs=False,
                                 log=lambda _: None)
    exact, noisy, failing = executor(ReferenceOps()), executor(RoundingNoiseOps()), executor(Failing())
    slots = fill_state(exact.state, 2, 40, torch.Generator().manual_seed(0))
    for ex in (noisy, failing):
        for _ in slots:
            ex.state.allocate()
    failing.ops.armed = True
    std = model.new_state(max_requests=2, max_len=64)
    eager_ms = []
    par, dropped = parity_lockstep(model, {"exact": exact, "noisy": noisy, "failing": failing}, std, slots, 1, 6,
                                   torch.Generator().manual_seed(1), required="exact", eager_ms=eager_ms)
    assert len(eager_ms) == 6 and min(eager_ms) > 0  # each standard step's own time
    assert set(par) == {"exact", "noisy"} and "broken on purpose" in dropped["failing"]
    assert par["exact"]["rel_err_max"] == 0 and par["exact"]["top1_agreement"] == 1.0
    assert par["exact"]["tokens"] == par["noisy"]["tokens"] == 12
    assert par["noisy"]["rel_err_median"] > 0
    with pytest.raises(RuntimeError, match="broken on purpose"):
        parity_lockstep(model, {"failing": failing}, std, slots, 1, 2, torch.Generator().manual_seed(1),
                        required="failing")


class _Stop(Exception):
    pass


@pytest.mark.parametrize("rows, q, steps", [(1, 1, 64), (2, 1, 32), (3, 1, 22), (8, 8, 8), (8, 1, 8), (4, 2, 16)])
def test_a_point_runs_parity_over_at_least_the_minimum_tokens(monkeypatch, rows, q, steps):
    """run_point hands parity_lockstep --parity-steps (8 here), raised where a step has fewer than
    PARITY_MIN_TOKENS / 8 tokens: one row's 8 steps judged the yardstick on 8 tokens."""
    seen = {}

    def capture(model, executors, std_state, slots, q_, n, gen, *, required, eager_ms=None):
        seen.update(steps=n, q=q_, requests=len(slots))
        raise _Stop

    monkeypatch.setattr(decode_latency, "parity_lockstep", capture)
    model = mini_model(seed=2)
    requests = rows // q
    ex = SpecializedDecode(model, max_requests=requests, max_len=128, buckets=[(rows, q)], ops=ReferenceOps(),
                           graphs=False, log=lambda _: None)
    with pytest.raises(_Stop):
        decode_latency.run_point(model, {"specialized": ex}, model.new_state(max_requests=requests, max_len=128),
                                 16, rows, q, 40, reps=1, parity_steps=8, copy_bw=4.0, gen=torch.Generator())
    assert seen == {"steps": steps, "q": q, "requests": requests}
    assert steps * rows >= PARITY_MIN_TOKENS
    assert parity_steps_at(64, 8) == 8 and parity_steps_at(1, 100) == 100


def test_the_eager_step_is_timed_on_the_parity_steps_when_there_are_enough():
    def again():
        raise AssertionError("timed again")
    # the first step, a warm-up, is left out of the median
    assert decode_latency.eager_step_ms([900.0, 5.0, 7.0, 6.0, 5.5, 6.5, 6.0], again) == 6.0
    assert decode_latency.eager_step_ms([900.0, 5.0, 7.0], lambda: 42.0) == 42.0  # too few: timed apart


def test_speed_targets_are_judged_against_the_fastest_standard_step_timed():
    """With --compile the compiled standard step may beat the graphed one: the targets take, per
    point, whichever was faster (`run_point`'s `speedup_vs_standard`) and say which it was."""
    def point(rows, graphed, compiled):
        fastest = min((("standard_graphed", graphed), ("standard_compiled", compiled)), key=lambda kv: kv[1])
        return {"tp": 16, "q": 1, "context": 4096, "rows": rows, "time_us": 100.0, "x_floor": 1.4,
                "standard_baseline": fastest[0], "speedup_vs_standard": fastest[1] / 100.0}
    targets = decode_latency.targets_of([point(1, 900.0, 250.0), point(2, 900.0, 190.0)])
    (vs,) = [t for t in targets if "fastest standard step" in t["name"]]
    assert vs["value"] == 1.9 and not vs["met"] and "(standard_compiled)" in vs["name"]


def test_the_cache_budget_is_a_share_of_the_free_memory_and_skips_what_does_not_fit():
    """2026-12-05: beside the TP16 block the H100 had about 28e9 bytes free and ran out at 128K with
    8 requests (14.5e9 of caches in 4 states); the H200, about 92e9 free, ran every point."""
    h100, h200 = decode_latency.cache_budget(28e9), decode_latency.cache_budget(92e9)
    assert h200 == decode_latency.CACHE_BUDGET  # the cap every recorded H200 point ran under
    fits, skipped = decode_latency.points_that_fit([1, 8, 3], [1, 8], 131072, 4, 3, h100)
    assert fits == [(1, 1), (3, 1), (8, 8)] and skipped == [(8, 1)]  # no (3, 8): 8 does not divide 3
    assert decode_latency.points_that_fit([1, 8], [1, 8], 131072, 4, 3, h200) == ([(1, 1), (8, 1), (8, 8)], [])


def test_a_point_after_the_yardstick_was_dropped_is_unjudged_not_passed(monkeypatch):
    """The yardstick ran out of memory at one point (the H100, 2026-12-05): that point and every
    later one of the context have no rule to be judged by, so none may pass, and the table says
    why instead of a plain `fail`; a run that never had a yardstick keeps the absolute bounds."""
    Y = decode_latency.YARDSTICK

    def lockstep(model, executors, std_state, slots, q_, n, gen, *, required, eager_ms=None):
        for st in (std_state, *(e.state for e in executors.values())):  # as the real one starts
            copy_state(st, executors[required].state)
        eager_ms += [5.0] * 8
        close = {"steps": n, "tokens": n * len(slots) * q_, "rel_err_median": 1e-3, "top1_agreement": 1.0}
        return ({name: dict(close) for name in executors if name != Y},
                {Y: "OutOfMemoryError: CUDA out of memory"} if Y in executors else {})

    monkeypatch.setattr(decode_latency, "parity_lockstep", lockstep)
    monkeypatch.setattr(decode_latency, "median_ms", lambda fn, reps, warmup=3: 1.0)
    model = mini_model(seed=2)
    def executor(ops):
        return SpecializedDecode(model, max_requests=1, max_len=128, buckets=[(1, 1)], ops=ops, graphs=False,
                                 log=lambda _: None)
    ex = executor(ReferenceOps())

    def point(untimed, lost):
        (res,) = decode_latency.run_point(model, {"specialized": ex}, model.new_state(max_requests=1, max_len=128),
                                          16, 1, 1, 40, reps=1, parity_steps=8, copy_bw=4.0,
                                          gen=torch.Generator().manual_seed(0), untimed=untimed, lost=lost)
        return res

    untimed, lost = {Y: executor(RoundingNoiseOps())}, {}  # never stepped: the lockstep drops it
    first = point(untimed, lost)
    assert first["status"] == "fail" and "OutOfMemoryError" in first["unjudged"]
    assert "dropped at rows 1 q 1 ctx 40" in first["unjudged"] and not untimed and set(lost) == {Y}
    later = point(untimed, lost)
    assert later["status"] == "fail" and later["unjudged"] == first["unjudged"]
    never = point(None, None)
    assert never["status"] == "pass" and "unjudged" not in never
    table = decode_latency.markdown([first, never], [], 4.0, "test GPU")
    assert table.count("unjudged (no yardstick)") == 1 and table.rstrip().count("| pass |") == 1


def test_a_block_that_cannot_fit_is_refused_before_loading_with_its_sizes():
    """TP8's 12-layer block: on the H100 (85.0e9 bytes, about 84.5e9 free on a clean card) it ran
    out of memory deep in the weight loader (2026-12-05); now it is refused first, by name. The
    sizes come from the shapes `load_rank` builds (on the meta device), not from a formula."""
    from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import (LOAD_MARGIN, BlockDoesNotFit, check_fits,
                                                                    rank_bytes)
    from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset

    k3 = preset("k3")
    block = k3.replace(num_hidden_layers=12, name="k3-12L", kda_layers=tuple(i for i in k3.kda_layers if i <= 12),
                       full_attn_layers=tuple(i for i in k3.full_attn_layers if i <= 12))
    tp8, tp16 = rank_bytes(block, 8), rank_bytes(block, 16)
    # one MoE layer's experts: 896 x (gate and up, 2 x 384 rows; down, 384 columns) x 3584 x 2 bytes
    assert tp8[1] == 896 * 3 * 384 * 3584 * 2 and tp16[1] == 896 * 3 * 256 * 3584 * 2  # TP16: 192 padded to 256
    assert 11 * tp8[1] < tp8[0] < 11 * tp8[1] + 5e9  # eleven MoE layers and the rest
    clean_h100 = 84.5e9
    check_fits(block, 16, clean_h100, "NVIDIA H100 80GB HBM3")
    assert tp16[0] + tp16[1] + LOAD_MARGIN < clean_h100 < tp8[0] + tp8[1] + LOAD_MARGIN
    with pytest.raises(BlockDoesNotFit, match=r"k3-12L at TP8: loading its 8\d\.\d GB of weights needs 9\d\.\d GB "
                                              r"and this GPU \(NVIDIA H100 80GB HBM3\) has 84\.5 GB free"):
        check_fits(block, 8, clean_h100, "NVIDIA H100 80GB HBM3")


def test_a_test_whose_block_cannot_fit_is_skipped_with_the_reason(tmp_path):
    """The hooks of _block_fit.py, in a conftest of their own: a block refused in a fixture or in a
    test's body is a skip that says why; any other error still fails."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "conftest.py").write_text(
        "from vllm.models.kimi_k3.nvidia.tests._block_fit import pytest_runtest_call, pytest_runtest_setup\n")
    (tmp_path / "test_fit.py").write_text(
        "import pytest\n"
        "from vllm.models.kimi_k3.nvidia.benchmarks.block_parity import BlockDoesNotFit\n"
        "@pytest.fixture(scope='module')\n"
        "def block():\n"
        "    raise BlockDoesNotFit('k3-12L at TP8: too big')\n"
        "def test_in_fixture(block):\n"
        "    pass\n"
        "def test_in_body():\n"
        "    raise BlockDoesNotFit('k3-12L at TP8: too big')\n"
        "def test_other_error():\n"
        "    raise MemoryError('not a block')\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[5])})
    assert "1 failed, 2 skipped" in run.stdout, run.stdout
    assert "SKIPPED [2]" in run.stdout and "this GPU cannot hold the block: k3-12L at TP8: too big" in run.stdout
