"""`_util.long_run_vs_graphed`, the verdict of the GPU long-run tests, on the CPU (mini config):
it passes a correct op table and fails one whose KDA states are scaled by 1.03 after every step.
KDA's decay gates bound that planted error, so it biases every step about equally (median error
~0.5 against the yardstick's ~0.15-0.2 on seeds 1-4) and the first-to-last-quarter growth ratio
(all that judged the long runs of `executor_depth_parity.json` of 2026-12-03) stays near 1 and
lets it through. A factor of 1.01 hides in the
mini model's chaos (rounding noise alone moves its logits by ~0.15 within 128 steps)."""

import torch

from vllm.models.kimi_k3.nvidia.benchmarks.decode_latency import fill_state
from vllm.models.kimi_k3.nvidia.latency_specialized.decode_ops import ReferenceOps
from vllm.models.kimi_k3.nvidia.latency_specialized.executor import SpecializedDecode
from vllm.models.kimi_k3.nvidia.latency_specialized.torch_ops import RoundingNoiseOps, TorchOps
from vllm.models.kimi_k3.nvidia.tests._util import long_run_vs_graphed, mini_model

STEPS = 128


class DriftingStateOps(TorchOps):
    """The standard ops with one planted bug: every KDA step leaves its recurrent state scaled."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def kda_core(self, z, g_raw, w, st, meta, cfg, shard):
        out = super().kda_core(z, g_raw, w, st, meta, cfg, shard)
        st.rec.mul_(self.factor)
        return out


def _verdict(ops) -> tuple[dict, list[str]]:
    model = mini_model()
    kw = dict(max_requests=2, max_len=200, buckets=[(2, 1)], graphs=False)
    spec, noisy, graphed = (SpecializedDecode(model, ops=o, **kw) for o in (ops, RoundingNoiseOps(), TorchOps()))
    slots = fill_state(spec.state, 2, 20, torch.Generator().manual_seed(1))  # copied to the others by the run
    return long_run_vs_graphed(spec, noisy, graphed, slots, 1, STEPS, torch.Generator().manual_seed(7))


def test_a_correct_op_table_passes():
    runs, failed = _verdict(ReferenceOps())
    assert not failed, (failed, runs)
    assert runs["specialized"]["steps"] == STEPS and "standard_rounding_noise" in runs


def test_a_drifting_state_fails_where_the_growth_ratio_alone_passes_it():
    runs, failed = _verdict(DriftingStateOps(1.03))
    assert any("yardstick" in f for f in failed), (failed, runs)
    assert not any("grew" in f for f in failed), "the growth ratio alone now catches it: the docstring is stale"
