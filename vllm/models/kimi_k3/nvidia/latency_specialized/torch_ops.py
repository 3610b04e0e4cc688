"""`TorchOps`: the op table in plain PyTorch that a CUDA graph can capture (the benchmark's baseline).

The decode benchmark (benchmarks/decode_latency.py, "standard graphed") times the
specialized path (`KernelOps`, CuTe DSL kernels) against the standard path with its launch
overhead taken away. That baseline must be the best a plain PyTorch step can do, so it runs
the same `SpecializedDecode` executor (same buckets, same static `StepMeta` buffers, one
CUDA graph per bucket) with this table: stock cuBLAS GEMMs and batched torch ops, no
hand-written kernel and no per-request Python loop. What is left between the two is then
the kernels' fusion and scheduling, not graph replay or batching.

Capturability is the one rule every op here keeps: no host synchronisation (`.tolist()`,
`.item()`, `int(tensor)`, `torch.unique`, `nonzero`, boolean-mask indexing, shapes that
depend on data). Every slot, length and block index is read on the device from the
`StepMeta` tensors, and every shape is fixed by the bucket (rows, q) and the state pools.
In particular no op calls `StepMeta.kda_segments()`, which builds host `Segment`s.

| op | implementation |
| --- | --- |
| `linear` | `F.linear` in bf16 (cuBLAS); fp32 out from fp32-upcast operands (the router); the addend and the scale after the bf16 product, as `DecodeOps.linear_epilogue` |
| `kda_core` | batched over requests: device-indexed conv window, gated delta rule unrolled over the q tokens, `index_copy_` writes |
| `mla_attend` | the whole block table of each request gathered, masked and attended with two batched GEMMs |
| `routed_experts` | per bucket the form moving fewer bytes: selected experts gathered (`w13[ids]`, `w2[ids]`) into batched GEMVs, or all experts on all rows |
| inherited from `ReferenceOps` | `rms_norm`, `embed`, `attn_res` (already capturable), `route` (stable sorts, int32 ids) |
| inherited from `DecodeOps` | `mla_absorb`, `mla_unabsorb` (batched `bmm`s, the gate after them), the glue of `decode_ops.GLUE` |

Rounding points follow the reference (reference/ops.py and K3_MATH.md §8): bf16 GEMM
outputs, fp32 pointwise math and accumulation. The pointwise math of the ops written here
is fp32 on every device, i.e. what the reference computes on CUDA; on CPU the reference
uses fp64 instead, so CPU results agree with it to bf16 tolerance rather than bit for bit
(the inherited ops keep the reference's per-device choice).

Padding requests of a bucket (slots 0, block table of zeros) run through the same batched
math as real ones: they read and write only the null slot / block (collisions among them
there are harmless) and their KDA output rows are forced to zero with `masked_fill`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..reference.dense_mlp import activation_clips
from ..reference.kda import CONV_WIDTH, L2_NORM_EPS, O_NORM_EPS, SOFTPLUS_THRESHOLD
from ..reference.ops import BF16, F32, situ_and_mul
from .decode_ops import ReferenceOps

if TYPE_CHECKING:
    from ..reference.params import KDAWeights, MoEWeights
    from ..reference.state import KDALayerState
    from .config import K3TextConfig, ShardShapes
    from .executor import StepMeta


def _l2_normalize(y: torch.Tensor) -> torch.Tensor:
    """y/sqrt(Σy² + 1e-6) over the last dim (reference.kda._l2_normalize, fp32 on every device)."""
    return y / torch.sqrt((y * y).sum(-1, keepdim=True) + L2_NORM_EPS)


def _decay_log_alpha(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     lower_bound: float | None) -> torch.Tensor:
    """reference.kda.decay_log_alpha in fp32 on every device; g_raw [..., h, d]."""
    h, d = g_raw.shape[-2:]
    zg = g_raw.to(F32) + dt_bias.to(F32).view(h, d)
    a = torch.exp(A_log.to(F32)).view(h, 1)
    if lower_bound is None:
        return -a * F.softplus(zg, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    return lower_bound * torch.sigmoid(a * zg)


class TorchOps(ReferenceOps):
    """Plain-PyTorch, CUDA-graph-capturable ops on the executor's contract (module docstring)."""

    impl = "torch"

    def linear(self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = BF16, *,
               addend: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        self._rec("linear")
        if addend is not None or scale is not None:
            return self.linear_epilogue(F.linear(x.to(BF16), w.to(BF16)), out_dtype, addend, scale)
        if out_dtype == BF16:
            return F.linear(x.to(BF16), w.to(BF16))
        # bf16 operands are exact in fp32, so this is the bf16 GEMM with an fp32 result
        # (only the router asks for it; its logits feed the selection keys unrounded)
        return (x.to(F32) @ w.to(F32).t()).to(out_dtype)

    def kda_core(self, z: torch.Tensor, g_raw: torch.Tensor, w: KDAWeights, st: KDALayerState,
                 meta: StepMeta, cfg: K3TextConfig, shard: ShardShapes) -> torch.Tensor:
        self._rec("kda_core")
        h, d, p = shard.kda_heads, cfg.kda_head_dim, shard.kda_proj
        q, n_req = meta.q, meta.requests
        rows, c = z.shape[0], 3 * p
        window_len = st.conv.shape[1]  # 2 + max_q rows per conv slot
        dev = z.device

        conv_slot = meta.conv_slot.long()
        # accepted is 1..max_q for real requests and 1 for padding; the clamp keeps a bad value
        # inside its own slot's rows instead of reading (or, below, writing) a neighbour slot
        accepted = meta.accepted.long().clamp(1, window_len - 2)
        padding = (meta.conv_slot <= 0) | (meta.rec_read_slot <= 0) | (meta.rec_slots[:, 0] <= 0)

        # the conv pool flattened to rows: slot s, time j is row s·(2 + max_q) + j, so both the
        # window gather and the rewrite are single index ops on device indices
        conv_rows = st.conv.view(-1, c)
        taps = torch.arange(CONV_WIDTH - 1, device=dev)
        window_idx = (conv_slot * window_len + accepted - 1).unsqueeze(1) + taps  # [R, 3]: C[a-1 : a+2]
        window = conv_rows.index_select(0, window_idx.reshape(-1)).view(n_req, CONV_WIDTH - 1, c)

        x = z[:, :c].reshape(n_req, q, c)
        g_out = z[:, c:c + p].reshape(rows, h, d)
        beta = torch.sigmoid(z[:, 4 * p + d:4 * p + d + h].to(F32)).view(n_req, q, h)
        alpha = torch.exp(_decay_log_alpha(g_raw.reshape(n_req, q, h, d), w.A_log, w.dt_bias, cfg.gate_lower_bound))

        # short conv + SiLU: taps summed in order 0..3 in fp32 (as reference short_conv), y rounded to bf16
        seq = torch.cat([window, x], dim=1).to(F32)  # [R, 3 + q, C]
        acc = w.conv[:, 0] * seq[:, 0:q]
        for j in range(1, CONV_WIDTH):
            acc = acc + w.conv[:, j] * seq[:, j:j + q]
        y = F.silu(acc).to(BF16).to(F32).view(n_req, q, 3, h, d)
        qh = _l2_normalize(y[:, :, 0]) * d ** -0.5
        kh = _l2_normalize(y[:, :, 1])
        v = y[:, :, 2]

        # index_select copies, so the writes below cannot disturb the start state even when the
        # read slot is one of the write slots (a verify step after a partial accept)
        s = st.rec.index_select(0, meta.rec_read_slot.long())  # [R, h, d_v, d_k]
        rec_slots = meta.rec_slots.long()
        o = torch.empty(n_req, q, h, d, dtype=F32, device=dev)
        for t in range(q):  # q is static per bucket: the loop unrolls into the graph
            k_t = kh[:, t]
            s = s * alpha[:, t].unsqueeze(2)
            recalled = torch.matmul(s, k_t.unsqueeze(-1)).squeeze(-1)
            delta = beta[:, t].unsqueeze(-1) * (v[:, t] - recalled)
            # S + δ·k̂ᵀ in one pass over the state, without an outer-product temporary
            s = torch.addcmul(s, delta.unsqueeze(-1), k_t.unsqueeze(2))
            o[:, t] = torch.matmul(s, qh[:, t].unsqueeze(-1)).squeeze(-1)
            st.rec.index_copy_(0, rec_slots[:, t], s)

        # conv[slot, 0 : 2+q] ← [C[a], C[a+1], x_0 … x_{q-1}]; padding requests rewrite slot 0
        new_idx = (conv_slot * window_len).unsqueeze(1) + torch.arange(2 + q, device=dev)
        conv_rows.index_copy_(0, new_idx.reshape(-1), torch.cat([window[:, 1:], x], dim=1).reshape(-1, c))

        # padding rows read the null slot, which may hold anything (even NaN): overwrite, don't multiply
        core = o.to(BF16).masked_fill(padding.view(n_req, 1, 1, 1), 0)
        of = core.view(rows, h, d).to(F32)
        rrms = torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + O_NORM_EPS)
        return (of * rrms * w.o_norm.to(F32) * torch.sigmoid(g_out.to(F32))).to(BF16).reshape(rows, p)

    def mla_attend(self, q_lat: torch.Tensor, cache: torch.Tensor, meta: StepMeta, r_kv: int,
                   tau: float) -> torch.Tensor:
        self._rec("mla_attend")
        q, n_req = meta.q, meta.requests
        heads, width = q_lat.shape[1], q_lat.shape[2]
        n_blocks, bs = meta.block_table.shape[1], cache.shape[1]
        length = n_blocks * bs
        dev = q_lat.device

        # every position of every table entry: the shape depends only on the bucket, and
        # positions past a request's length are masked below
        kv = cache.index_select(0, meta.block_table.long().reshape(-1)).view(n_req, length, width)
        pos = torch.arange(length, device=dev)
        seq_lens = meta.seq_lens.long()
        # masked positions get probability 0, but 0·NaN is NaN: table entries past the length
        # may point at the null block, which padding rows write with anything
        kv = kv.masked_fill((pos >= seq_lens.unsqueeze(1)).unsqueeze(-1), 0).to(F32)

        # row j of request r sits at position seq_lens[r] − q + j and sees positions up to it
        limit = seq_lens.unsqueeze(1) - q + 1 + torch.arange(q, device=dev)  # [R, q]
        hidden = pos.view(1, 1, 1, length) >= limit.view(n_req, q, 1, 1)

        ql = q_lat.reshape(n_req, q * heads, width).to(F32)
        scores = (tau * torch.bmm(ql, kv.transpose(1, 2))).view(n_req, q, heads, length)
        p = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        ol = torch.bmm(p.view(n_req, q * heads, length), kv[:, :, :r_kv])
        return ol.to(BF16).view(n_req * q, heads, r_kv)

    def routed_experts(self, x_lat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: MoEWeights,
                       cfg: K3TextConfig, shard: ShardShapes) -> torch.Tensor:
        self._rec("moe_experts")
        n_rows, k = ids.shape
        n_exp, inter, lat = w.w13.shape[0], shard.moe_inter, x_lat.shape[1]
        clips = activation_clips(cfg)
        x_lat = x_lat.to(BF16)
        ids = ids.long()
        # The reference groups rows by expert (torch.unique, nonzero: host syncs). Two fixed-shape
        # forms instead, chosen per bucket from the weight bytes each moves (S = one expert):
        #  - gather: copy each (row, pick)'s expert and run batched GEMVs, ~3·N·k·S (read, write
        #    and re-read the copies), the cheap form for few rows;
        #  - dense: every expert on every row with one GEMM per projection, ~E·S plus [N, E, ·]
        #    activations, cheaper once N·k picks touch a large part of the E experts.
        # Both round at the reference's points (bf16 GEMM outputs, bf16 SiTU).
        if 3 * n_rows * k <= n_exp:
            flat = ids.reshape(-1)
            w13 = w.w13.index_select(0, flat)  # [N·k, 2I, H_lat]
            w2 = w.w2.index_select(0, flat)  # [N·k, H_lat, I]
            xs = x_lat.unsqueeze(1).expand(n_rows, k, lat).reshape(n_rows * k, lat, 1)
            gate_up = torch.bmm(w13, xs).view(n_rows * k, 2 * inter)
            act = situ_and_mul(gate_up[:, :inter], gate_up[:, inter:], *clips)
            y = torch.bmm(w2, act.unsqueeze(-1)).view(n_rows, k, lat)
        else:
            gate_up = F.linear(x_lat, w.w13.reshape(n_exp * 2 * inter, lat)).view(n_rows, n_exp, 2 * inter)
            act = situ_and_mul(gate_up[..., :inter], gate_up[..., inter:], *clips)  # [N, E, I]
            y_all = torch.bmm(act.transpose(0, 1), w.w2.transpose(1, 2))  # [E, N, H_lat]
            y = y_all[ids, torch.arange(n_rows, device=ids.device).unsqueeze(1)]  # [N, k, H_lat]
        acc = torch.zeros(n_rows, lat, dtype=F32, device=x_lat.device)
        for j in range(k):  # selection order fixes the fp32 summation order, as in the reference
            acc = acc + weights[:, j:j + 1] * y[:, j].to(F32)
        return acc.to(BF16)


class RoundingNoiseOps(TorchOps):
    """The torch table with each bf16 GEMM output off by up to one rounding: the fp32 result is
    scaled by (1 + u·2^-8), u ~ U(-1, 1), before its round to bf16 (unit roundoff 2^-8). Its
    distance from the eager reference is the spread any correct bf16 implementation may show,
    the yardstick of decode_latency's parity rule (random-weight K3 blocks amplify it)."""

    def linear(self, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = BF16, *,
               addend: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
        epilogue = addend is not None or scale is not None
        if out_dtype != BF16 and not epilogue:  # the router's fp32 logits: no bf16 rounding to perturb
            return super().linear(x, w, out_dtype)
        self._rec("linear")
        y = x.to(F32) @ w.to(F32).t()
        y = (y * (1 + (2 * torch.rand_like(y) - 1) * 2.0**-8)).to(BF16)
        return self.linear_epilogue(y, out_dtype, addend, scale) if epilogue else y
