"""SiTU-and-mul of a merged gate/up output (kernels/situ_mul.py) against
`reference/ops.py::situ_and_mul`.

CPU: envelope errors (raised before any CUDA use, each naming the problem); compile checks for
sm_90a, sm_100a and sm_103a whose PTX must show the design (two 16-byte loads and one 16-byte
store per thread, no local memory). GPU (marker `gpu`): K3's per-rank widths (shared experts and
the dense MLP at TP1 / TP8 / TP16), M from 1 to 64, K3's clips (β 4, λ 25), SiLU (no clips) and a
gate clip alone, four input distributions plus saturating inputs (|x| up to 3e4), a strided
gate_up (a column slice), NaN-poisoned outputs; ‖out − ref‖/‖ref‖ per row under REL_ERR_BOUND.
With K3_EVIDENCE_DIR set the GPU results are written there as a "kernel-test" record.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed (pip install nvidia-cutlass-dsl==4.8.1)")

from vllm.models.kimi_k3.nvidia.kernels import situ_mul  # noqa: E402
from vllm.models.kimi_k3.nvidia.kernels.rows import NormEnvelopeError  # noqa: E402
from vllm.models.kimi_k3.nvidia.latency_specialized.config import preset  # noqa: E402
from vllm.models.kimi_k3.nvidia.reference.ops import situ_and_mul  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._pdl import check_pdl_order  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._evidence import record_kernel_test  # noqa: E402
from vllm.models.kimi_k3.nvidia.tests._util import DISTRIBUTIONS, draw, rel_err  # noqa: E402

BF16 = torch.bfloat16
K3 = preset("k3")
WIDTHS = sorted({w for tp in (1, 8, 16) for w in (K3.shared_intermediate // tp, K3.intermediate_size // tp)})
ROWS = (1, 2, 7, 16, 64)
CLIPS = {"k3": (K3.activation_situ_beta, K3.activation_situ_linear_beta), "silu": (None, None), "gate only": (4.0, None)}
# both sides compute in fp32 and round once to bf16; exp / tanh differ from torch's by a few fp32
# ulps, so an element may land one bf16 ulp (2^-8 relative) away where its value straddles a
# rounding boundary
REL_ERR_BOUND = 1e-2
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
TEST_FILE = "vllm/models/kimi_k3/nvidia/tests/test_situ_mul_kernel.py"
SOURCES = ("vllm/models/kimi_k3/nvidia/kernels/situ_mul.py", "vllm/models/kimi_k3/nvidia/kernels/moe_experts.py",
           "vllm/models/kimi_k3/nvidia/kernels/rows.py", TEST_FILE)


# ---------------------------------------------------------------- envelope (CPU)


@pytest.mark.parametrize("make, match", [
    (lambda: torch.randn(4, 768), "gate_up must be bfloat16, got torch.float32"),
    (lambda: torch.randn(4, 24).to(BF16), "gate_up has 24 columns; it must be [g | u] with I = columns / 2 a multiple of 8"),
    (lambda: torch.randn(65, 768).to(BF16), "M=65 rows is outside 1..64"),
    (lambda: torch.randn(4, 780).to(BF16)[:, :768], "gate_up rows must be contiguous, 16-byte aligned"),
    (lambda: torch.randn(768).to(BF16), "gate_up must be a 2-D [M, 2I] tensor"),
    (lambda: torch.randn(4, 768).to(BF16), "gate_up must be a CUDA tensor"),
])
def test_envelope_errors(make, match):
    with pytest.raises(NormEnvelopeError, match=re.escape(match)):
        situ_mul.launch(make(), 4.0, 25.0)


def test_out_shape_is_checked():
    with pytest.raises(NormEnvelopeError, match=re.escape("out must be [4, 384], got (4, 768)")):
        situ_mul.launch(torch.randn(4, 768).to(BF16), 4.0, 25.0, out=torch.empty(4, 768, dtype=BF16))


# ---------------------------------------------------------------- compile checks (CPU)


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_for_arch(arch, tmp_path):
    plan = situ_mul.SituPlan(384, 768, 384, K3.activation_situ_beta, K3.activation_situ_linear_beta)
    ptx = situ_mul.compile_situ_mul(plan, arch, str(tmp_path)).artifacts.PTX
    assert f".target {arch}" in ptx
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == 2  # g and u, one vector each
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 1
    assert not re.search(r"(ld|st)\.global\.(b|u|s)(16|8)\b", ptx), "narrow accesses"
    assert not re.search(r"\b(ld|st)\.local", ptx), "registers spilled to local memory"
    check_pdl_order(ptx, 0)  # it has no weights


# ---------------------------------------------------------------- GPU checks


@pytest.fixture(scope="module")
def evidence():
    results: list[dict] = []
    yield results
    record_kernel_test("situ_mul_test.json", "dense", TEST_FILE, SOURCES, results,
                       "every row within the bound, every output written", extra={"rel_err_bound": REL_ERR_BOUND})


def _check(gate_up: torch.Tensor, clips: tuple, name: str, evidence: list[dict]) -> None:
    width = gate_up.shape[1] // 2
    out = torch.full((gate_up.shape[0], width), float("nan"), dtype=BF16, device="cuda")
    situ_mul.launch(gate_up, *clips, out=out)
    torch.cuda.synchronize()
    want = situ_and_mul(gate_up[:, :width], gate_up[:, width:], *clips)
    errs = [rel_err(o, w) for o, w in zip(out.float(), want.float())]
    written = not torch.isnan(out).any().item()
    status = "pass" if written and max(errs) <= REL_ERR_BOUND else "fail"
    evidence.append({"name": name, "shape": {"m": gate_up.shape[0], "width": width}, "status": status,
                     "rel_err_max_row": max(errs), "all_written": written})
    assert status == "pass", (name, max(errs), written)


@pytest.mark.gpu
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("clip", list(CLIPS))
def test_matches_reference(width, clip, evidence):
    gen = torch.Generator(device="cuda").manual_seed(width)
    for m in ROWS:
        for dist in DISTRIBUTIONS:
            x = draw(dist, (m, 2 * width), gen, "cuda")
            _check(x, CLIPS[clip], f"I={width} {clip} M={m} {dist}", evidence)


@pytest.mark.gpu
def test_saturating_inputs_and_a_strided_slice(evidence):
    gen = torch.Generator(device="cuda").manual_seed(1)
    width = K3.shared_intermediate // 16
    x = (3e4 * torch.randn(8, 2 * width, generator=gen, device="cuda")).to(BF16)  # tanh and σ saturate
    _check(x, CLIPS["k3"], f"I={width} saturating", evidence)
    wide = torch.randn(8, 2 * width + 64, generator=gen, device="cuda").to(BF16)
    _check(wide[:, :2 * width], CLIPS["k3"], f"I={width} column slice of a wider row", evidence)
