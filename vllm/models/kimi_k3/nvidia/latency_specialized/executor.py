"""`SpecializedDecode`: the decode step on prepared kernels, one CUDA graph per (rows, q) bucket.

| stage | what happens |
| --- | --- |
| build | owns the `DecodeState` it serves (KDA pools, MLA cache; slot 0 / block 0 are the null slot and block), allocated or over adopted `pools` (vLLM's, whose slots are pages apart); each MoE layer's weights as the op table takes them (`prepare_moe`: `KernelOps` zero-pads a model smaller than K3 to the MoE kernels' granularity, `moe_padding.py`); per bucket: static `StepMeta` buffers set to all-padding, one eager warm-up step (compiles every kernel of the step, allocates kernel scratch; touches only the null slot and block), then one capture; reports seconds and graph memory |
| `plan(facts)` | the bucket for the step's rows and tokens per request, or None (the dispatcher then runs the standard path) |
| `__call__(ids, segments, state)` | (executors built with `inputs="ids"`; with `"embeddings"` the caller fills `StepMeta.embeds` and replays, as `vllm_executor` does) pads the step to its bucket with dummy requests on the null slot (`buckets.pad_to_bucket`), writes ids and slots into the bucket's `StepMeta` in place, replays the graph (eager where graphs are off), commits the segments to the state, returns the real rows' full-vocab fp32 logits (with `output="hidden"`: the hidden states [rows, H] bf16 before the final norm, what vLLM's `compute_logits` takes) |

The step itself (`_forward`) is written once against an op table (`decode_ops.py`):
`KernelOps` runs CuTe DSL kernels, `ReferenceOps` the reference functions on the same
tensors and metadata, so CPU tests check this file's plumbing exactly against
`ReferenceModel` and GPU tests check the kernels against the reference. Per layer:

    u = AttnRes(blocks, prefix + m_{i-1})       one kernel; a completing block is written in place
    KDA:  z = u·W_inᵀ;  g = f_a·W_fbᵀ;  y = kda_decode(z, g, state);  a = Σ_ranks y·W_oᵀ
    MLA:  [q_c|kv_c|k_pe|g] = u·W_aᵀ;  norms;  q = q_c·W_qbᵀ;  q_lat = [q_nope·W_UK | q_pe];
          cache[slot] ← [c | k_pe];  ol = mla_decode(q_lat, cache);  a = Σ_ranks bf16(ol·W_UVᵀ ⊙ σ(g))·W_oᵀ
    v = AttnRes(blocks, prefix + a)
    MoE:  route(v·W_gᵀ) → experts(v·W_downᵀ) → norm → ·W_upᵀ, + shared SiTU MLP;  dense: SiTU MLP
    (with CUDA graphs, v·W_downᵀ and the shared MLP run on side lanes beside the routing, and
    MLA's cache write beside the query's GEMMs: `lanes.py`; `overlap=False` keeps one stream)
    h = AttnRes_final(blocks, prefix + m_last) fused with the final norm;  logits = Σ_ranks-gather h·W_lmᵀ

Buffers a replay writes outside the state (activations, logits) live in one graph memory
pool shared by all buckets: the output a call returns is valid until the next call.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..reference.dense_mlp import activation_clips
from ..reference.mla import split_kv_b
from ..reference.model import ReferenceModel
from ..reference.ops import F32
from ..reference.params import DenseMLPWeights, KDAWeights, MoEWeights
from ..reference.state import DecodeState, KDALayerState, MLALayerState, Segment
from .buckets import bucket_for, pad_to_bucket
from .decode_ops import DecodeOps, KernelOps, MLAAbsorption, ReferenceOps
from .deployment import StepFacts
from .lanes import Lanes


OUTPUTS = ("logits", "hidden")  # what a step returns: vLLM's model forward returns the hidden states
INPUTS = ("ids", "embeddings")  # what a step starts from: vLLM's multimodal runner passes embeddings


class ExecutorError(RuntimeError):
    """The executor cannot serve what it was asked (a step it did not plan, a foreign state)."""


@dataclass
class StepMeta:
    """Device-side description of one bucketed step: everything a captured graph reads per step.

    R = rows // q requests of q tokens; request r owns rows r·q … r·q + q − 1. A padding
    request has every slot 0 and a zero block table (the null slot and block)."""

    q: int
    ids: torch.Tensor  # [rows] int64 token ids
    conv_slot: torch.Tensor  # [R] int32
    rec_read_slot: torch.Tensor  # [R] int32
    rec_slots: torch.Tensor  # [R, q] int32
    accepted: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [R, max_blocks] int32
    seq_lens: torch.Tensor  # [R] int32: cached positions after this step's tokens
    query_start: torch.Tensor  # [R + 1] int32
    cache_index: torch.Tensor  # [rows] int64: flat cache row of each new token
    embeds: torch.Tensor | None = None  # [rows, H] bf16 when the step starts from embeddings, not ids

    @classmethod
    def padding(cls, rows: int, q: int, max_blocks: int, device: torch.device,
                hidden: int | None = None) -> "StepMeta":
        """A step of nothing but padding requests (what warm-up and capture run on); with `hidden`,
        one that starts from embeddings [rows, hidden] (zeros) instead of token ids."""
        if rows % q:
            raise ExecutorError(f"a bucket of {rows} rows does not hold whole {q}-token requests")
        r = rows // q

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)
        meta = cls(q=q, ids=torch.zeros(rows, dtype=torch.int64, device=device), conv_slot=i32(r),
                   rec_read_slot=i32(r), rec_slots=i32(r, q), accepted=i32(r) + 1,
                   block_table=i32(r, max_blocks), seq_lens=i32(r) + q,
                   query_start=torch.arange(0, rows + 1, q, dtype=torch.int32, device=device),
                   cache_index=torch.arange(rows, dtype=torch.int64, device=device),
                   embeds=None if hidden is None else torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device))
        return meta

    @property
    def requests(self) -> int:
        return self.conv_slot.shape[0]

    def fill(self, ids: torch.Tensor, segments: Sequence[Segment], block_size: int) -> None:
        """Write a padded step's ids and slots into these buffers in place (graph inputs)."""
        q, rows = self.q, self.ids.shape[0]
        if len(segments) != self.requests or any(s.n != q or s.row0 != r * q for r, s in enumerate(segments)):
            raise ExecutorError(f"the step must be {self.requests} requests of {q} tokens in row order")
        host = {name: torch.zeros_like(getattr(self, name), device="cpu")
                for name in ("conv_slot", "rec_read_slot", "rec_slots", "accepted", "seq_lens", "cache_index")}
        table = torch.zeros_like(self.block_table, device="cpu")
        for r, s in enumerate(segments):
            host["conv_slot"][r], host["rec_read_slot"][r], host["accepted"][r] = (
                s.conv_slot, s.rec_read_slot, s.accepted)
            host["rec_slots"][r] = torch.tensor(s.rec_slots, dtype=torch.int32)
            host["seq_lens"][r] = s.pos0 + q
            bt = s.block_table.cpu().to(torch.int64)
            table[r, :bt.numel()] = bt.to(torch.int32)
            if s.request < 0:  # padding: distinct rows of the null block 0, one per row of the step
                host["cache_index"][r * q:(r + 1) * q] = torch.arange(r * q, (r + 1) * q)
                continue
            pos = torch.arange(s.pos0, s.pos0 + q)
            host["cache_index"][r * q:(r + 1) * q] = bt[pos // block_size] * block_size + pos % block_size
        host_ids = torch.zeros(rows, dtype=torch.int64)  # padding rows look up token 0
        host_ids[:ids.numel()] = ids.reshape(-1).cpu()
        self.ids.copy_(host_ids, non_blocking=True)
        self.block_table.copy_(table, non_blocking=True)
        for name, t in host.items():
            getattr(self, name).copy_(t, non_blocking=True)

    def kda_segments(self) -> list[Segment]:
        """The KDA view of these buffers as reference `Segment`s (what `ReferenceOps` runs)."""
        q = self.q
        return [Segment(request=r, row0=r * q, n=q, prefill=False, pos0=0,
                        rec_slots=self.rec_slots[r].tolist(), rec_read_slot=int(self.rec_read_slot[r]),
                        conv_slot=int(self.conv_slot[r]), accepted=int(self.accepted[r]),
                        block_table=self.block_table[r])
                for r in range(self.requests)]


@dataclass
class BuildReport:
    buckets: list[tuple[int, int]]
    seconds: float
    graph_bytes: int
    graphs: bool

    def line(self) -> str:
        mode = "CUDA graphs" if self.graphs else "eager (no CUDA graphs)"
        return (f"specialized executor: {len(self.buckets)} buckets (rows, q) "
                f"{', '.join(f'({r},{q})' for r, q in self.buckets)}; {mode}; built in {self.seconds:.1f} s; "
                f"graph memory {self.graph_bytes / 2**20:.1f} MiB")


def _check_step(ids: torch.Tensor, segments: list[Segment], rows: int, state: DecodeState) -> None:
    """Refuse a step the state cannot have produced: a wrong input would otherwise run, on
    whatever the buffers held (missing ids decode token 0; a freed or padding slot is written as
    if it were a request; a request twice races its own state; a segment taken before the last
    commit rewrites cached rows)."""
    if ids.numel() != rows:
        raise ExecutorError(f"{ids.numel()} token ids for a step of {rows} rows: give one id per row")
    seen: set[int] = set()
    for s in segments:
        if not (0 <= s.request < state.max_requests and state.in_use[s.request]):
            raise ExecutorError(f"segment request={s.request} is not an allocated request slot of the state (0.."
                                f"{state.max_requests - 1}); take segments from state.segment() on a slot from "
                                "state.allocate() (the executor pads the step itself)")
        if s.request in seen:
            raise ExecutorError(f"request {s.request} appears twice in one step; give each request one segment")
        seen.add(s.request)
        if s.pos0 != state.seq_lens[s.request] or s.accepted != state.accepted[s.request]:
            raise ExecutorError(f"request {s.request}'s segment starts at position {s.pos0} after {s.accepted} "
                                f"accepted token(s), but the state holds {state.seq_lens[s.request]} after "
                                f"{state.accepted[s.request]}: take segments from state.segment() after the last "
                                "step's commit")


class SpecializedDecode:
    """Serves admitted decode steps of one rank from prepared kernels (module docstring)."""

    def __init__(self, model: ReferenceModel, *, max_requests: int, max_len: int,
                 buckets: Sequence[tuple[int, int]], ops: DecodeOps | None = None, graphs: bool | None = None,
                 block_size: int = 64, output: str = "logits", inputs: str = "ids",
                 pools: tuple[dict[int, KDALayerState], dict[int, MLALayerState]] | None = None,
                 log: Callable[[str], None] | None = None, overlap: bool | None = None):
        self.model, self.cfg, self.shard, self.coll = model, model.cfg, model.shard, model.coll
        self.w = model.w
        device = self.w.embed.device
        self.ops = ops or (KernelOps() if device.type == "cuda" else ReferenceOps())
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if self.graphs and device.type != "cuda":
            raise ExecutorError("CUDA graphs need the weights on a CUDA device; pass graphs=False on CPU")
        # independent ops of a layer on side streams, which a graph replays side by side (lanes.py);
        # eager steps stay on one stream, as tests that read the ops in order expect
        overlap = self.graphs if overlap is None else overlap
        if overlap and not self.graphs:
            raise ExecutorError("overlap needs CUDA graphs (the lanes become graph branches); pass overlap=False")
        self.lanes = Lanes(device if overlap else None)
        if output not in OUTPUTS:
            raise ExecutorError(f"output must be one of {', '.join(map(repr, OUTPUTS))}, got {output!r}: 'logits' "
                                "for full-vocab fp32 logits, 'hidden' for the hidden states before the final norm")
        if inputs not in INPUTS:
            raise ExecutorError(f"inputs must be one of {', '.join(map(repr, INPUTS))}, got {inputs!r}: 'ids' "
                                "for token ids (embedded here), 'embeddings' for rows someone else embedded")
        self.output, self.inputs = output, inputs
        self.buckets = sorted(set((int(r), int(q)) for r, q in buckets))
        bad = [(r, q) for r, q in self.buckets if not (1 <= q <= 8 and r >= q and r % q == 0)]
        if not self.buckets or bad:
            raise ExecutorError(f"buckets must be (rows, q) with 1 <= q <= 8 and rows a multiple of q; got "
                                f"{bad or 'none'}")
        max_q = max(q for _, q in self.buckets)
        if block_size < max(r for r, _ in self.buckets):
            raise ExecutorError(f"block_size {block_size} is below the largest bucket's {max(self.buckets)[0]} rows: "
                                "each padding row writes its own row of the null block 0, so raise block_size")
        self.state = DecodeState(self.cfg, self.shard, max_requests=max_requests, max_len=max_len, max_q=max_q,
                                 block_size=block_size, device=device, pools=pools)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        d_n = self.cfg.qk_nope_head_dim
        self.tau = 1.0 / math.sqrt(d_n + self.cfg.qk_rope_head_dim)
        # per-head absorption matrices, contiguous once (views of kv_b otherwise)
        self.absorb = {i: MLAAbsorption.of(*split_kv_b(lw.attn.kv_b, self.cfg, self.shard.mla_heads),
                                           self.cfg.qk_rope_head_dim)
                       for i, lw in enumerate(self.w.layers) if not isinstance(lw.attn, KDAWeights)}
        self.moe = {i: self.ops.prepare_moe(lw.mlp) for i, lw in enumerate(self.w.layers)
                    if isinstance(lw.mlp, MoEWeights)}
        self.meta: dict[tuple[int, int], StepMeta] = {}
        self.out: dict[tuple[int, int], torch.Tensor] = {}
        self.graph: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.kernels: dict[tuple[int, int], list[tuple[str, str]]] = {}
        self.routed: dict[tuple[int, int], list[torch.Tensor]] = {}  # per MoE layer, the last step's expert ids
        self.report = self._build(device)

    # ------------------------------------------------------------------ build

    def _build(self, device: torch.device) -> BuildReport:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.graphs else None
        before = torch.cuda.memory_allocated(device) if self.graphs else 0
        for n, key in enumerate(self.buckets, 1):
            rows, q = key
            tb = time.perf_counter()
            meta = self.meta[key] = StepMeta.padding(rows, q, self.state.blocks_per_req, device,
                                                     self.cfg.hidden_size if self.inputs == "embeddings" else None)
            self.ops.reset()
            if not self.graphs:
                self._forward(meta)  # a first run checks every op's envelope before any step is served
            else:
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._forward(meta)  # compiles every kernel, allocates their scratch
                torch.cuda.current_stream(device).wait_stream(side)
                torch.cuda.synchronize(device)
                self.ops.reset()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.out[key] = self._forward(meta)
                self.graph[key] = graph
            self.kernels[key], self.routed[key] = list(self.ops.trace), list(self.ops.routed)
            self.log(f"[executor] bucket {n}/{len(self.buckets)} (rows {rows}, q {q}): "
                     f"{len(self.kernels[key])} ops over {self.cfg.num_hidden_layers} layers, "
                     f"{time.perf_counter() - tb:.1f} s")
        graph_bytes = torch.cuda.memory_allocated(device) - before if self.graphs else 0
        report = BuildReport(self.buckets, time.perf_counter() - t0, graph_bytes, self.graphs)
        self.log(report.line())
        return report

    # ------------------------------------------------------------------ serve

    def plan(self, facts: StepFacts) -> tuple[int, int] | None:
        """The (rows, q) bucket that serves the step, or None (standard path)."""
        q = facts.tokens_per_request
        if not facts.pure_decode or q is None or facts.max_context > self.state.max_len:
            return None
        rows = bucket_for(facts.rows, q, [r for r, qq in self.buckets if qq == q])
        return None if rows is None else (rows, q)

    def __call__(self, ids: torch.Tensor, segments: list[Segment], state: DecodeState) -> torch.Tensor:
        """Full-vocab fp32 logits [rows, V] (or hidden states [rows, H], `output`) of a pure decode
        step; commits it to the state."""
        if state is not self.state:
            raise ExecutorError("the executor serves only the DecodeState it owns (executor.state); "
                                "allocate the requests there")
        if self.inputs != "ids":
            raise ExecutorError("this executor starts from embeddings: fill its StepMeta (vllm_step) and replay")
        q = segments[0].n if segments else 0
        rows = sum(s.n for s in segments)
        _check_step(ids, segments, rows, state)
        key = self.plan(StepFacts(rows=rows, tokens_per_request=q if all(s.n == q for s in segments) else None,
                                  max_context=max((s.pos0 + s.n for s in segments), default=0),
                                  pure_decode=not any(s.prefill for s in segments)))
        if key is None:
            raise ExecutorError(f"no bucket serves {rows} rows of {q}-token requests; route it to the standard path")
        meta = self.meta[key]
        meta.fill(ids, pad_to_bucket(segments, q, key[0], state), state.block_size)
        if self.graphs:
            self.graph[key].replay()
            out = self.out[key]
        else:
            self.ops.reset()
            out = self._forward(meta)
            self.kernels[key], self.routed[key] = list(self.ops.trace), list(self.ops.routed)
        for seg in segments:
            state.commit(seg)
        return out[:rows]

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        """Run the bucket's step again on the metadata its last call wrote (benchmarks time this:
        the device work of a step without the host's metadata fill). Commits nothing."""
        if self.graphs:
            self.graph[key].replay()
            return self.out[key]
        self.ops.reset()  # the op trace is the last step's, not every replay's
        return self._forward(self.meta[key])

    def launches(self, key: tuple[int, int]) -> list[str]:
        """Names of the ops one step of this bucket runs, in order (the graph's kernels)."""
        return [op if impl in ("cute", "reference") else f"{op} ({impl})" for op, impl in self.kernels[key]]

    # ------------------------------------------------------------------ the step

    def _forward(self, meta: StepMeta) -> torch.Tensor:
        cfg, w, ops, coll = self.cfg, self.w, self.ops, self.coll
        eps, block = cfg.rms_norm_eps, cfg.attn_res_block_size
        rows = meta.ids.shape[0]
        # slot 0: the embedding; slot j: the sum of block j − 1, written when layer j·block starts
        blocks = torch.empty(1 + (cfg.num_hidden_layers - 1) // block, rows, cfg.hidden_size,
                             dtype=w.embed.dtype, device=w.embed.device)
        if meta.embeds is not None:  # embedded by the caller (vLLM), over every vocabulary shard
            blocks[0].copy_(ops.copy(meta.embeds))
        else:
            e = coll.all_reduce(ops.embed(meta.ids, w.embed, self.shard, cfg.vocab_size, out=blocks[0]))
            if e.data_ptr() != blocks[0].data_ptr():
                blocks[0].copy_(e)
        n_blocks, partial, m = 1, None, None
        for i, lw in enumerate(w.layers):
            ar = lw.attn_res
            if m is None:
                u = ops.attn_res(blocks, n_blocks, None, ar.attn_norm, ar.attn_proj, eps, out_w=ar.input_norm)
            elif i % block == 0:  # the running block completes: its sum becomes a block slot
                u = ops.attn_res(blocks, n_blocks, partial, ar.attn_norm, ar.attn_proj, eps, addend=m,
                                 live_out=blocks[n_blocks], out_w=ar.input_norm)
                n_blocks, partial = n_blocks + 1, None
            else:
                u = ops.attn_res(blocks, n_blocks, partial, ar.attn_norm, ar.attn_proj, eps, addend=m,
                                 live_out=partial, out_w=ar.input_norm)
            a = self._kda(i, lw.attn, u, meta) if isinstance(lw.attn, KDAWeights) else self._mla(i, lw.attn, u, meta)
            if partial is None:
                partial = a
                v = ops.attn_res(blocks, n_blocks, partial, ar.mlp_norm, ar.mlp_proj, eps, out_w=ar.post_norm)
            else:
                v = ops.attn_res(blocks, n_blocks, partial, ar.mlp_norm, ar.mlp_proj, eps, addend=a,
                                 live_out=partial, out_w=ar.post_norm)
            m = self._moe(self.moe[i], v) if i in self.moe else self._dense(lw.mlp, v)
        if self.output == "hidden":  # vLLM's compute_logits applies the final norm itself
            return ops.attn_res(blocks, n_blocks, partial, w.out_res_norm, w.out_res_proj, eps, addend=m)
        h = ops.attn_res(blocks, n_blocks, partial, w.out_res_norm, w.out_res_proj, eps, addend=m,
                         final_norm=w.final_norm)
        # each shard's logits scaled before the gather, which only concatenates them
        return coll.all_gather(ops.linear(h, w.lm_head, out_dtype=F32, scale=cfg.logit_scale), dim=-1)

    def _kda(self, i: int, w: KDAWeights, u: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        ops, p, d = self.ops, self.shard.kda_proj, self.cfg.kda_head_dim
        z = ops.linear(u, w.in_proj)
        g_raw = ops.linear(z[:, 4 * p:4 * p + d], w.f_b)
        y = ops.kda_core(z, g_raw, w, self.state.kda[i], meta, self.cfg, self.shard)
        return self.coll.all_reduce(ops.linear(y, w.o_proj))

    def _mla(self, i: int, w, u: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        cfg, ops = self.cfg, self.ops
        heads, eps = self.shard.mla_heads, cfg.rms_norm_eps
        r_q, r_kv, d_r, d_n, d_v = (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                                    cfg.v_head_dim)
        q_c, kv_c, k_pe, gate = ops.linear(u, w.fused_a).split([r_q, r_kv, d_r, heads * d_v], dim=-1)
        cache = self.state.mla[i].cache
        with self.lanes.beside(0):  # the new rows' cache write beside the query's norm and GEMMs
            ops.mla_cache_write(kv_c, k_pe, w.kv_a_norm, eps, cache, meta.cache_index)
        q = ops.linear(ops.rms_norm(q_c, w.q_a_norm, eps), w.q_b).view(-1, heads, d_n + d_r)
        q_lat = ops.mla_absorb(q, self.absorb[i])
        self.lanes.join(0)
        o = ops.mla_unabsorb(ops.mla_attend(q_lat, cache, meta, r_kv, self.tau), self.absorb[i], gate)
        return self.coll.all_reduce(ops.linear(o, w.o_proj))

    def _moe(self, w: MoEWeights, v: torch.Tensor) -> torch.Tensor:
        cfg, ops, lanes = self.cfg, self.ops, self.lanes
        # neither the latent down-projection nor the shared experts wait for the routing: they run
        # beside the router (the shared experts also beside the routed ones)
        with lanes.beside(0):
            x_lat = ops.linear(v, w.latent_down)
        with lanes.beside(1):
            shared_part = self._gated_mlp_rank(w.shared_gate_up, w.shared_down, v)
        weights, ids = ops.route(ops.linear(v, w.router, out_dtype=F32), w.bias, cfg)
        lanes.join(0)
        y = self.coll.all_reduce(ops.routed_experts(x_lat, ids, weights, w, cfg, self.shard))
        y = y[:, :cfg.routed_expert_hidden_size]  # a padded latent's columns are zero (moe_padding.py)
        if cfg.latent_moe_use_norm:
            y = ops.rms_norm(y, w.latent_norm, cfg.rms_norm_eps)
        # routed + shared in the up-projection's epilogue: both are whole here (after their
        # all-reduces, in this order on every rank; latent_up is replicated)
        lanes.join(1)
        shared = self.coll.all_reduce(shared_part)
        return ops.linear(y, w.latent_up, addend=shared)

    def _dense(self, w: DenseMLPWeights, v: torch.Tensor) -> torch.Tensor:
        return self.coll.all_reduce(self._gated_mlp_rank(w.gate_up, w.down, v))

    def _gated_mlp_rank(self, gate_up: torch.Tensor, down: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's share of a SiTU MLP (its intermediate columns), before the all-reduce."""
        h = self.ops.situ_and_mul(self.ops.linear(v, gate_up), *activation_clips(self.cfg))
        return self.ops.linear(h, down)
