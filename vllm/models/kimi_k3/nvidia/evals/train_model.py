"""`TrainModel`: the K3 text decoder in differentiable, whole-sequence form, for training.

The same math as the reference prefill (reference/model.py with chunked KDA and naive
MLA), batched over [B, T] and written so autograd runs through it:

    x0 = E[ids];  per layer: u = AttnRes_pre → KDA | MLA → AttnRes_post → dense | latent MoE
    h  = AttnRes_final (bf16) → RMSNorm → LM head → fp32 logits [B, T, V]

- KDA: projections, the 4-tap causal conv with SiLU, L2-normalized q̂ (scaled d^-½) and k̂,
  β = σ(b), log α = lb·σ(e^{A_log}·(g_raw + dt_bias)), then the gated delta rule in the
  chunked UT-transform form (`chunked_delta_rule`: parallel inside a chunk, sequential
  across chunks, from a zero state), the gated RMSNorm (ε 1e-5) and o_proj.
- MLA: materialized keys [W_UK c ; k_pe] and values W_UV c (NoPE), causal softmax with
  τ = 1/sqrt(d_n + d_r), the sigmoid output gate and o_proj.
- MoE: fp32 router logits, sigmoid scores, selection by score + correction bias in
  descending order with ties to the lower expert index (the reference's stable sort),
  weights from the unbiased scores renormalized over the top k and scaled; each selected
  expert's SiTU MLP in the latent space, the weighted fp32 sum, the latent RMSNorm and
  up-projection, plus the shared experts. Gradients reach the chosen experts' weights and
  the router through the renormalized weights; the choice itself is discrete.
- AttnRes over the embedding, completed block sums and the running partial sum, each sum
  rounded to bf16 after every add, as in K3_MATH.md §3.2.

Rounding points are the reference's (K3_MATH.md §8): every GEMM output is bf16 (router
logits fp32), pointwise math is fp32 and rounded once where the reference rounds. That is
what bf16 autocast would do for the GEMMs, but pinned explicitly: autocast would also run
the AttnRes logits and the delta-rule matmuls in bf16, which the reference keeps in fp32.
Weights are fp32 masters rounded to their checkpoint dtype on use (straight-through), so
the saved bf16 checkpoint computes exactly what was trained; all the math runs in the
masters' dtype. On CUDA the GEMMs are bf16 tensor-core GEMMs. On CPU `model.double()`
gives the reference's CPU oracle precision (fp64 accumulation, the same bf16 roundings),
which is how the tests hold the two to a tight tolerance.

Parameters carry the real checkpoint names (`named_parameters()` yields
`language_model.model.layers.3.self_attn.kv_b_proj.weight`, ...), so saving is a rename-free
dump that `weights.load_rank` reads. Envelope: TP1, one expert group (grouped top-k with
several groups is refused), sequences of equal length (pad at the end: everything is causal).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..latency_specialized.config import K3TextConfig
from ..latency_specialized.weights import TensorSource, expected_shapes
from ..reference.kda import L2_NORM_EPS, O_NORM_EPS
from ..reference.moe import RENORM_EPS

BF16, F32 = torch.bfloat16, torch.float32
# the most a chunk's gates may decay in total (fp32 keeps e^{±80}: its largest finite is e^88.7)
MAX_CHUNK_DECAY = 160.0
MODEL = "language_model.model."


def _round(x: torch.Tensor, dtype: torch.dtype = BF16) -> torch.Tensor:
    """Round to `dtype` and come back to x's dtype; the gradient passes straight through."""
    return x.to(dtype).to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, out: torch.dtype = BF16) -> torch.Tensor:
    """x·wᵀ from bf16 operands, accumulated in w's (master) dtype or a bf16 tensor-core GEMM's
    fp32, rounded once to `out`; returned in w's dtype. A stack of weights w [E, M, K] gives
    every expert's product at once: [E, N, M] for x [N, K]."""
    xb, wt = x.to(BF16), w.to(BF16).transpose(-1, -2)
    if x.is_cuda and out == BF16:
        return torch.matmul(xb, wt).to(w.dtype)
    return (xb.to(w.dtype) @ wt.to(w.dtype)).to(out).to(w.dtype)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _round(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * _round(w))


def _situ(gate: torch.Tensor, up: torch.Tensor, beta: float | None, lam: float | None) -> torch.Tensor:
    gc = gate if beta is None else beta * torch.tanh(gate / beta)
    uc = up if lam is None else lam * torch.tanh(up / lam)
    return _round(gc * torch.sigmoid(gate) * uc)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_alpha: torch.Tensor,
                       beta: torch.Tensor, chunk: int) -> torch.Tensor:
    """Gated delta rule from a zero state, all fp32: q, k, log_alpha [B, h, T, d_k], v [B, h, T, d_v],
    beta [B, h, T] -> o [B, h, T, d_v]. Precondition: log α ≥ −MAX_CHUNK_DECAY / chunk (K3's
    bounded gate, lb = −5, allows chunks up to 32).

    Per token S_t = S_{t-1}·diag(α_t)·(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ and o_t = S_t q_t. Inside a
    chunk from state S₀, with G the within-chunk cumulative log decay, the chunk's corrections
    δ_t solve (I + diag(β)·A) Δ = diag(β)(V − (e^G ⊙ K) S₀ᵀ), A_ts = Σ_c k_t k_s e^{G_t − G_s}
    (s < t); then o = (e^G ⊙ Q) S₀ᵀ + B Δ with B_ts the same sum for q_t (s ≤ t).

    Three choices make it fast enough to train in minutes (the step is launch- and then
    bandwidth-bound at this size):
    - e^{G_t − G_s} = e^{G_t − R} · e^{R − G_s} with R the chunk's middle G, so A and B are plain
      matmuls; each factor stays within e^{±MAX_CHUNK_DECAY/2} (fp32-safe by the precondition)
      and the pairs s > t, whose product may overflow, are masked after the product.
    - Δ is linear in S₀: Δ = U − W S₀ᵀ with U = L⁻¹ diag(β) V and W = L⁻¹ diag(β)(e^G ⊙ K), and
      L⁻¹ = Σ_i (−N)^i for the nilpotent N = L − I is formed by log₂(chunk) squarings, so all of
      it runs for every chunk at once, in matmuls only (CUDA-graph capturable).
    - The sequential loop is the state hand-off alone: three small products per chunk.
    """
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    n = chunk
    pad = -t % n  # zero tokens at the end: β = 0 and k = 0 leave every earlier output unchanged
    if pad:
        q, k, v, log_alpha = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, log_alpha))
        beta = F.pad(beta, (0, pad))
    m = (t + pad) // n
    qc, kc, vc, gc = (x.reshape(b, h, m, n, -1) for x in (q, k, v, log_alpha))
    bc = beta.reshape(b, h, m, n, 1)
    g = gc.cumsum(3)  # [B, h, M, C, d_k]
    mid = g[..., n // 2:n // 2 + 1, :]
    k_in = kc * torch.exp(mid - g)  # the e^{R − G_s} factor of the source token s
    not_before = torch.ones(n, n, dtype=torch.bool, device=q.device).triu()  # pairs s >= t
    a = (kc * torch.exp(g - mid) @ k_in.transpose(-1, -2)).masked_fill(not_before, 0.0)
    bq = (qc * torch.exp(g - mid) @ k_in.transpose(-1, -2)).masked_fill(not_before.triu(1), 0.0)
    gamma = torch.exp(g)
    minus_n = -bc * a  # strictly lower: (I + N)^-1 = (I − N)(I + N²)(I + N⁴)...
    inverse = torch.eye(n, dtype=q.dtype, device=q.device) + minus_n
    power = minus_n
    for _ in range(max(0, (n - 1).bit_length() - 1)):
        power = power @ power
        inverse = inverse + inverse @ power
    u, w = (inverse @ (bc * torch.cat([vc, kc * gamma], -1))).split([dv, dk], -1)
    q_decayed = qc * gamma
    to_end = kc * torch.exp(g[..., -1:, :] - g)
    gamma_last = gamma[..., -1, :]  # [B, h, M, d_k]
    state = q.new_zeros(b, h, dv, dk)
    outs = []
    for c in range(m):
        delta = u[:, :, c] - w[:, :, c] @ state.transpose(-1, -2)
        outs.append(q_decayed[:, :, c] @ state.transpose(-1, -2) + bq[:, :, c] @ delta)
        state = state * gamma_last[:, :, c, None, :] + delta.transpose(-1, -2) @ to_end[:, :, c]
    return torch.cat(outs, dim=2)[:, :, :t]


class TrainModel(nn.Module):
    """One parameter per checkpoint tensor (fp32 master), named as in the checkpoint."""

    def __init__(self, cfg: K3TextConfig, tensors: dict[str, torch.Tensor], *, kda_chunk: int = 32):
        super().__init__()
        if cfg.use_grouped_topk and cfg.num_expert_group > 1:
            raise ValueError(f"TrainModel: config {cfg.name} uses grouped top-k over "
                             f"{cfg.num_expert_group} groups; training supports one group only")
        if kda_chunk < 1:
            raise ValueError(f"TrainModel: kda_chunk must be a positive token count, found {kda_chunk}")
        if any(cfg.layer_kind(i) == "kda" for i in range(cfg.num_hidden_layers)):
            lb = cfg.gate_lower_bound
            if lb is None or kda_chunk * abs(lb) > MAX_CHUNK_DECAY:
                raise ValueError(f"TrainModel: kda_chunk {kda_chunk} with gate_lower_bound {lb}: the chunked delta "
                                 f"rule needs a bounded gate with kda_chunk × |gate_lower_bound| <= "
                                 f"{MAX_CHUNK_DECAY:g} (K3's −5 allows chunks up to 32)")
        self.cfg, self.kda_chunk = cfg, kda_chunk
        self.dtypes: dict[str, torch.dtype] = {}
        want = expected_shapes(cfg)
        missing = sorted(set(want) - set(tensors))
        if missing:
            raise ValueError(f"TrainModel: {len(missing)} checkpoint tensors missing, e.g. {missing[:3]}")
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"TrainModel: {name} has shape {list(t.shape)}, expected {list(shape)}")
            self.dtypes[name] = dtype
            self._register(name, nn.Parameter(t.detach().to(F32).clone()))

    @classmethod
    def from_source(cls, cfg: K3TextConfig, source: TensorSource, **kw) -> "TrainModel":
        return cls(cfg, {n: source.get(n) for n in expected_shapes(cfg)}, **kw)

    def _register(self, name: str, p: nn.Parameter) -> None:
        node: nn.Module = self
        *path, leaf = name.split(".")
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = nn.Module()
                node.add_module(part, child)
            node = child
        node.register_parameter(leaf, p)

    def w(self, name: str) -> torch.Tensor:
        """The parameter as the checkpoint stores it (rounded to its dtype), in fp32."""
        return _round(self.get_parameter(name), self.dtypes[name])

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor in its checkpoint dtype, on the CPU, ready for safetensors."""
        return {n: p.detach().to(self.dtypes[n]).cpu().contiguous() for n, p in self.named_parameters()}

    # ------------------------------------------------------------------ forward

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] int64 -> logits [B, T, V] fp32."""
        cfg = self.cfg
        if ids.dim() != 2:
            raise ValueError(f"TrainModel: ids must be [batch, tokens], found shape {tuple(ids.shape)}")
        # (a graph capture cannot read the ids back; the captured step's ids were checked eagerly)
        capturing = ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
            raise ValueError(f"TrainModel: token ids must lie in [0, {cfg.vocab_size})")
        eps, size = cfg.rms_norm_eps, cfg.attn_res_block_size
        e = self.w(MODEL + "embed_tokens.weight")[ids]
        blocks, partial = [e], None
        for i in range(cfg.num_hidden_layers):
            p = f"{MODEL}layers.{i}."
            if i % size == 0 and i > 0:
                blocks, partial = blocks + [partial], None
            u = self._mix(blocks + ([partial] if partial is not None else []),
                          p + "self_attention_res", p + "input_layernorm.weight")
            a = self._kda(p + "self_attn.", u) if cfg.layer_kind(i) == "kda" else self._mla(p + "self_attn.", u)
            partial = a if partial is None else _round(partial + a)
            v = self._mix(blocks + [partial], p + "mlp_res", p + "post_attention_layernorm.weight")
            m = self._gated_mlp(p + "mlp.", v) if cfg.mlp_kind(i) == "dense" else self._moe(p + "block_sparse_moe.", v)
            partial = _round(partial + m)
        h = self._mix(blocks + [partial], MODEL + "output_attn_res", None)
        h_n = _rms_norm(h, self.w(MODEL + "norm.weight"), eps)
        head = MODEL + "embed_tokens.weight" if cfg.tie_word_embeddings else "language_model.lm_head.weight"
        return _linear(h_n, self.w(head)).to(F32) * cfg.logit_scale

    def _mix(self, sources: list[torch.Tensor], stem: str, out_norm: str | None) -> torch.Tensor:
        """AttnRes: softmax over sources of w·RMSNorm_γ(source), mixing the raw sources."""
        eps = self.cfg.rms_norm_eps
        if len(sources) == 1 and out_norm is None:
            return sources[0]
        vs = torch.stack(sources)  # [S, B, T, H]
        if len(sources) == 1:
            mix = vs[0]
        else:
            c = self.w(stem + "_norm.weight") * self.w(stem + "_proj.weight").reshape(-1)
            logits = (vs * c).sum(-1) / torch.sqrt(vs.pow(2).mean(-1) + eps)
            mix = (torch.softmax(logits, dim=0).unsqueeze(-1) * vs).sum(0)
        if out_norm is None:
            return _round(mix)
        return _rms_norm(mix, self.w(out_norm), eps)

    def _kda(self, a: str, u: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, t, _ = u.shape
        h, d = cfg.kda_num_heads, cfg.kda_head_dim
        x = torch.cat([_linear(u, self.w(a + n + ".weight")) for n in ("q_proj", "k_proj", "v_proj")], -1)
        conv = torch.cat([self.w(a + n + ".weight").reshape(h * d, -1)
                          for n in ("q_conv1d", "k_conv1d", "v_conv1d")])  # [3P, 4], tap 3 = current
        width = conv.shape[1]
        xp = F.pad(x, (0, 0, width - 1, 0))
        acc = conv[:, 0] * xp[:, 0:t]
        for j in range(1, width):
            acc = acc + conv[:, j] * xp[:, j:j + t]
        y = _round(F.silu(acc)).view(bsz, t, 3, h, d).permute(2, 0, 3, 1, 4)  # [3, B, h, T, d]
        qh = y[0] / torch.sqrt(y[0].pow(2).sum(-1, keepdim=True) + L2_NORM_EPS) * d ** -0.5
        kh = y[1] / torch.sqrt(y[1].pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)
        beta = torch.sigmoid(_linear(u, self.w(a + "b_proj.weight"))).transpose(1, 2)  # [B, h, T]
        g_raw = _linear(_linear(u, self.w(a + "f_a_proj.weight")), self.w(a + "f_b_proj.weight"))
        z = g_raw.view(bsz, t, h, d) + self.w(a + "dt_bias").view(h, d)
        a_coef = torch.exp(self.w(a + "A_log").reshape(-1)).view(h, 1)
        if cfg.gate_lower_bound is None:
            log_alpha = -a_coef * F.softplus(z, threshold=20.0)
        else:
            log_alpha = cfg.gate_lower_bound * torch.sigmoid(a_coef * z)
        # the recurrence is fp32 whatever the masters' dtype: the reference's state is fp32
        core = [x.to(F32) for x in (qh, kh, y[2], log_alpha.transpose(1, 2), beta)]
        o = chunked_delta_rule(*core, self.kda_chunk).to(BF16).to(u.dtype).transpose(1, 2)  # [B, T, h, d]
        g_out = _linear(u, self.w(a + "g_proj.weight")).view(bsz, t, h, d)
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + O_NORM_EPS) * self.w(a + "o_norm.weight")
        y_gated = _round(normed * torch.sigmoid(g_out)).reshape(bsz, t, h * d)
        return _linear(y_gated, self.w(a + "o_proj.weight"))

    def _mla(self, a: str, u: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        bsz, t, _ = u.shape
        nh, d_n, d_r, d_v, r_kv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                   cfg.v_head_dim, cfg.kv_lora_rank)
        eps = cfg.rms_norm_eps
        q_c = _rms_norm(_linear(u, self.w(a + "q_a_proj.weight")), self.w(a + "q_a_layernorm.weight"), eps)
        kv_c, k_pe = _linear(u, self.w(a + "kv_a_proj_with_mqa.weight")).split([r_kv, d_r], -1)
        latent = _rms_norm(kv_c, self.w(a + "kv_a_layernorm.weight"), eps)
        q = _linear(q_c, self.w(a + "q_b_proj.weight")).view(bsz, t, nh, d_n + d_r).transpose(1, 2)
        kv_b = self.w(a + "kv_b_proj.weight").view(nh, d_n + d_v, r_kv)
        k_nope = _round(torch.einsum("btr,hdr->bhtd", latent, kv_b[:, :d_n]))
        values = _round(torch.einsum("btr,hvr->bhtv", latent, kv_b[:, d_n:]))
        keys = torch.cat([k_nope, k_pe.unsqueeze(1).expand(bsz, nh, t, d_r)], -1)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(d_n + d_r)
        future = torch.ones(t, t, dtype=torch.bool, device=u.device).triu(1)
        o = _round(torch.softmax(scores.masked_fill(future, -math.inf), -1) @ values)  # [B, nh, T, d_v]
        gate = _linear(u, self.w(a + "g_proj.weight"))
        gated = _round(o.transpose(1, 2).reshape(bsz, t, nh * d_v) * torch.sigmoid(gate))
        return _linear(gated, self.w(a + "o_proj.weight"))

    def _clips(self) -> tuple[float | None, float | None]:
        if self.cfg.hidden_act == "silu":
            return None, None
        return self.cfg.activation_situ_beta, self.cfg.activation_situ_linear_beta

    def _gated_mlp(self, stem: str, v: torch.Tensor) -> torch.Tensor:
        hidden = _situ(_linear(v, self.w(stem + "gate_proj.weight")), _linear(v, self.w(stem + "up_proj.weight")),
                       *self._clips())
        return _linear(hidden, self.w(stem + "down_proj.weight"))

    def route(self, b: str, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights fp32 [N, k], expert ids [N, k]) for rows v [N, H], in selection order."""
        cfg = self.cfg
        logits = _linear(v, self.w(b + "gate.weight"), out=F32)
        scores = torch.softmax(logits, -1) if cfg.moe_router_activation_func == "softmax" else torch.sigmoid(logits)
        keys = (scores + self.w(b + "gate.e_score_correction_bias")).detach()
        keys = keys.masked_fill(torch.isnan(keys), -math.inf)
        ids = torch.sort(keys, dim=-1, descending=True, stable=True).indices[:, :cfg.num_experts_per_token]
        weights = scores.gather(1, ids)
        if cfg.moe_renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + RENORM_EPS)
        return weights * cfg.routed_scaling_factor, ids

    def _moe(self, b: str, v: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = v.shape
        rows = v.reshape(-1, shape[-1])
        weights, ids = self.route(b, rows)
        x_lat = _linear(rows, self.w(b + "routed_expert_down_proj.weight"))
        # Every expert runs on every row and the selected outputs are gathered in selection
        # order: at `tiny` size the extra FLOPs cost less than a launch per expert and a host
        # sync per nonzero(), and an unselected expert's output is multiplied by nothing, so
        # its gradient is exactly zero, as in the sparse form.
        stack = [torch.stack([self.w(f"{b}experts.{e}.{n}.weight") for e in range(cfg.num_experts)])
                 for n in ("w1", "w3", "w2")]  # [E, I, R], [E, I, R], [E, R, I]
        hidden = _situ(_linear(x_lat, stack[0]), _linear(x_lat, stack[1]), *self._clips())  # [E, N, I]
        expert_out = _linear(hidden, stack[2])  # [E, N, R]
        picked = expert_out.permute(1, 0, 2).gather(1, ids[..., None].expand(-1, -1, expert_out.shape[-1]))
        y = _round((weights.unsqueeze(-1) * picked).sum(1))
        if cfg.latent_moe_use_norm:
            y = _rms_norm(y, self.w(b + "routed_expert_norm.weight"), cfg.rms_norm_eps)
        routed = _linear(y, self.w(b + "routed_expert_up_proj.weight"))
        shared = self._gated_mlp(b + "shared_experts.", rows)
        return _round(routed + shared).view(shape)
