"""`DecodeState`: every per-request state of one rank, shared by both decode paths.

| state | tensor per layer | dtype | slot rule |
|---|---|---|---|
| KDA recurrent | `rec [1 + R·Q, h_r, d (value), d (key)]` | fp32 | request r owns slots `1 + r·Q + j`, j < Q |
| KDA conv | `conv [1 + R, 2 + Q, 3·P_r]` (time-major, channels q‖k‖v) | bf16 | request r owns slot `1 + r` |
| MLA latent | `cache [num_blocks, block_size, r_kv + d_r]` paged | bf16 | block table row r |

R = request capacity, Q = max tokens per request in a step (1 + speculative drafts).
The pools are allocated here, or adopted (`pools=`): tensors someone else owns, e.g. views
into vLLM's cache pages, whose slots may lie further apart than a slot's size. Adopted pools
smaller than the slot rule above needs are addressed only by their owner's metadata
(`latency_specialized/vllm_step.py`): `segment` then refuses, rather than index past them.
Slot 0 of each pool is the null slot: padding rows read it and never write real state.
AttnRes keeps nothing across steps (K3_MATH.md §3.2).

Verify steps and rollback follow K3_MATH.md §3.4 (7): a step of q tokens for request r
reads the recurrent state of slot `accepted[r] − 1`, writes the state after token t into
slot t, and rewrites the conv window as `[C[a], C[a+1], x_0 … x_{q−1}]`. Accepting a
prefix of k tokens (`accept(r, k)`) is then exact and free: the next step reads slot
k − 1 and conv taps `C[k−1 … k+1]`, and the MLA length drops to the accepted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..latency_specialized.config import K3TextConfig, ShardShapes


class StateError(RuntimeError):
    """A request does not fit the state pool (capacity, context length)."""


@dataclass
class Segment:
    """One request's tokens inside a step's flattened [N, H] activations."""

    request: int  # request slot index r (0-based)
    row0: int  # first row of the request in the step
    n: int  # tokens of this request in the step
    prefill: bool  # True: extend the prompt (state written once at the end)
    pos0: int  # position of the first token = tokens already cached
    rec_slots: list[int]  # recurrent slots: decode one per token; prefill [final slot]
    rec_read_slot: int  # recurrent slot the step starts from
    conv_slot: int
    accepted: int  # tokens accepted by the previous verify step (1 otherwise)
    block_table: torch.Tensor  # int32 [max_blocks] MLA block ids of this request


@dataclass
class KDALayerState:
    rec: torch.Tensor
    conv: torch.Tensor


@dataclass
class MLALayerState:
    cache: torch.Tensor


def _check_pool(what: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """An adopted pool: slots of `shape` and `dtype` on `device` (the null slot at least), each slot contiguous."""
    ok = (t.dim() == 1 + len(shape) and tuple(t.shape[1:]) == shape and t.shape[0] >= 1 and t.dtype == dtype
          and t.device.type == device.type and device.index in (None, t.device.index)
          and t[0].is_contiguous() and t.stride(0) >= t[0].numel())
    if not ok:
        raise StateError(f"pools: {what} must be a [slots, {', '.join(map(str, shape))}] "
                         f"{str(dtype).removeprefix('torch.')} tensor on {device} with each slot contiguous; got "
                         f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}, strides {tuple(t.stride())}")


class DecodeState:
    def __init__(self, cfg: K3TextConfig, shard: ShardShapes, *, max_requests: int,
                 max_len: int, max_q: int = 1, block_size: int = 64,
                 device: torch.device | str = "cpu",
                 pools: tuple[dict[int, KDALayerState], dict[int, MLALayerState]] | None = None):
        if not 1 <= max_q <= 8:
            raise StateError(f"max_q (tokens per request in a step) must be in 1..8, found {max_q}")
        self.cfg, self.shard, self.device = cfg, shard, torch.device(device)
        self.max_requests, self.max_len, self.max_q, self.block_size = max_requests, max_len, max_q, block_size
        self.blocks_per_req = -(-max_len // block_size)
        num_blocks = 1 + max_requests * self.blocks_per_req  # block 0 is the null block
        d, h = cfg.kda_head_dim, shard.kda_heads
        # per layer kind: (pool name, slots this state's slot rule needs, one slot's shape, dtype)
        shapes = {"kda": (("rec", 1 + max_requests * max_q, (h, d, d), torch.float32),
                          ("conv", 1 + max_requests, (2 + max_q, 3 * shard.kda_proj), torch.bfloat16)),
                  "mla": (("cache", num_blocks, (block_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim),
                           torch.bfloat16),)}
        kinds = {i: cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)}
        if pools is None:
            pools = ({i: KDALayerState(*(torch.zeros(n, *shape, dtype=dt, device=self.device)
                                         for _, n, shape, dt in shapes["kda"]))
                      for i, k in kinds.items() if k == "kda"},
                     {i: MLALayerState(*(torch.zeros(n, *shape, dtype=dt, device=self.device)
                                         for _, n, shape, dt in shapes["mla"]))
                      for i, k in kinds.items() if k != "kda"})
        self.kda, self.mla = pools
        self.addressable = True  # the slot rule and the static block tables stay inside every pool
        for i, kind in kinds.items():
            layer = (self.kda if kind == "kda" else self.mla).get(i)
            if layer is None:
                raise StateError(f"pools: layer {i} ({kind.upper()}) has no state; pass one for every layer")
            for name, n, shape, dtype in shapes["kda" if kind == "kda" else "mla"]:
                _check_pool(f"layer {i} {name}", getattr(layer, name), shape, dtype, self.device)
                self.addressable &= getattr(layer, name).shape[0] >= n
        # static block tables: request r owns blocks 1 + r·blocks_per_req …
        ar = torch.arange(self.blocks_per_req, dtype=torch.int32)
        self.block_table = torch.stack([1 + r * self.blocks_per_req + ar for r in range(max_requests)]).to(self.device)
        self.seq_lens = [0] * max_requests
        self.accepted = [1] * max_requests
        self.in_use = [False] * max_requests

    # ------------------------------------------------------------------ slots

    def rec_slot(self, r: int, j: int) -> int:
        return 1 + r * self.max_q + j

    def conv_slot(self, r: int) -> int:
        return 1 + r

    def _check_addressable(self) -> None:
        if not self.addressable:
            raise StateError("the adopted pools are smaller than this state's slot rule needs (max_requests "
                             f"{self.max_requests} × max_q {self.max_q}, max_len {self.max_len}): their owner's "
                             "metadata addresses them (vllm_step.fill_step_meta), not requests and segments")

    def allocate(self) -> int:
        self._check_addressable()
        for r, used in enumerate(self.in_use):
            if not used:
                self.in_use[r] = True
                self.seq_lens[r], self.accepted[r] = 0, 1
                self._clear(r)
                return r
        raise StateError(f"all {self.max_requests} request slots are in use; raise max_requests")

    def free(self, r: int) -> None:
        self.in_use[r] = False

    def _clear(self, r: int) -> None:
        for st in self.kda.values():
            st.rec[self.rec_slot(r, 0):self.rec_slot(r, self.max_q)].zero_()
            st.conv[self.conv_slot(r)].zero_()

    # ------------------------------------------------------------------ steps

    def padding(self, row0: int, n: int) -> Segment:
        """n rows of a dummy request that pad a step to its CUDA-graph bucket: every slot is
        the null slot 0 and every block the null block 0, so it reads scratch, writes
        nothing a request owns, and its rows are discarded."""
        return Segment(request=-1, row0=row0, n=n, prefill=False, pos0=0, rec_slots=[0] * n,
                       rec_read_slot=0, conv_slot=0, accepted=1,
                       block_table=torch.zeros_like(self.block_table[0]))

    def segment(self, r: int, row0: int, n: int, prefill: bool) -> Segment:
        self._check_addressable()
        if not self.in_use[r]:
            raise StateError(f"request slot {r} is not allocated")
        if self.seq_lens[r] + n > self.max_len:
            raise StateError(
                f"request {r}: {self.seq_lens[r]} cached + {n} new tokens exceed max_len {self.max_len}")
        if not prefill and n > self.max_q:
            raise StateError(f"request {r}: {n} tokens in a decode step exceed max_q {self.max_q}")
        a = self.accepted[r]
        slots = [self.rec_slot(r, 0)] if prefill else [self.rec_slot(r, j) for j in range(n)]
        return Segment(request=r, row0=row0, n=n, prefill=prefill, pos0=self.seq_lens[r],
                       rec_slots=slots, rec_read_slot=self.rec_slot(r, a - 1),
                       conv_slot=self.conv_slot(r), accepted=a, block_table=self.block_table[r])

    def commit(self, seg: Segment) -> None:
        """Record that the step ran: all n tokens are cached; prefill/plain decode accept all.
        Padding segments (request < 0) belong to no request and change nothing."""
        if seg.request < 0:
            return
        self.seq_lens[seg.request] = seg.pos0 + seg.n
        self.accepted[seg.request] = 1 if (seg.prefill or seg.n == 1) else seg.n

    def accept(self, r: int, k: int) -> None:
        """After a verify step of q tokens keep only the first k (1 ≤ k ≤ q) of them."""
        q = self.accepted[r]
        if not 1 <= k <= q:
            raise StateError(f"request {r}: accepted {k} must be in 1..{q} (tokens of its last step)")
        self.seq_lens[r] -= q - k
        self.accepted[r] = k
