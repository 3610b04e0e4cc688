"""The executor's lanes never run two skinny GEMMs that share a split-K scratch at once (CPU).

`SpecializedDecode._moe` runs a MoE layer's latent down-projection on lane 0 and its shared
experts on lane 1 while the router runs on the step's stream. The skinny GEMM keeps one split-K
workspace and one set of arrival counters per (output width, tiling, heads)
(`skinny_gemm._split_scratch`), so two GEMMs of one key that both split K, running at once,
would mix their partial sums and counts: a silent wrong result, no error. The widths follow the
config, so this checks every TP size of K3, the shipped tiny checkpoint's config and the mini
test config at every row count of the envelope.
"""

import itertools

import pytest

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.evals.tiny import config_named  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels import skinny_gemm  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.shapes import k3_gemm_shapes  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.config import PRESETS  # noqa: E402

# what runs at once in a MoE layer: the step's stream, lane 0 and lane 1 (in order within each)
SIDE_BY_SIDE = (("moe_router",), ("moe_latent_down",), ("shared_gate_up", "shared_down"))
# (arch, SMs): the H200, whose 17-64 rows run the wgmma kernel, and a B200/GB300-class part
DEVICES = (("sm_90a", 132), ("sm_100a", 148))


@pytest.mark.parametrize("cfg, tps", [(PRESETS["k3"], (1, 8, 16)), (config_named("tiny"), (1,)),
                                      (PRESETS["mini"], (1, 2))], ids=["k3", "tiny", "mini"])
def test_gemms_on_different_lanes_never_share_a_split_k_scratch(cfg, tps):
    for tp in tps:
        shapes = {s.name.split("@")[0]: s for s in k3_gemm_shapes((tp,), cfg)}
        for m, (arch, sm_count) in itertools.product(range(1, skinny_gemm.MAX_ROWS + 1), DEVICES):
            keys = []  # per lane, the scratch keys of its GEMMs that split K
            for lane in SIDE_BY_SIDE:
                found = set()
                for name in lane:
                    s = shapes[name]
                    tiling = skinny_gemm.pick_tiling(arch, s.n, s.k, -(-m // 8), sm_count)  # as `launch`
                    if tiling.splits > 1:
                        found.add((s.n, tiling))
                keys.append(found)
            for a, b in itertools.combinations(keys, 2):
                assert not a & b, (tp, m, arch, a & b)
