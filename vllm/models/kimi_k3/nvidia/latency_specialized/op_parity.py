"""Per-op parity of two op tables inside one executor step: which op makes two paths differ.

`ComparedOps(test, oracle)` runs every op of a step on both tables with the same inputs (the
stateful ops on a copy of the state for the `test` table), records ‖test − oracle‖ / ‖oracle‖
per call and hands the oracle's result on, so errors never compound: a whole-step difference
between the specialized and the standard path is traced to the one op that causes it.

    python -m vllm.models.kimi_k3.nvidia.latency_specialized.op_parity [--tp 16] [--rows 4] [--q 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

import torch

from .decode_ops import DecodeOps


def _rel(a: Any, b: Any) -> float:
    if isinstance(b, tuple):
        return max(_rel(x, y) for x, y in zip(a, b))
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class ComparedOps(DecodeOps):
    """Both tables op by op; `report` lists (op, call index, relative error)."""

    impl = "compared"

    def __init__(self, test: DecodeOps, oracle: DecodeOps):
        super().__init__()
        self.test, self.oracle = test, oracle
        self.report: list[tuple[str, int, float]] = []

    def _both(self, op: str, *args: Any, **kw: Any) -> Any:
        self._rec(op)
        want = getattr(self.oracle, op)(*args, **kw)
        got = getattr(self.test, op)(*args, **kw)
        self.report.append((op, sum(o == op for o, _, _ in self.report), _rel(got, want)))
        return want

    def prepare_moe(self, w):
        # the test table's layout (KernelOps pads small models); the reference ops take it too
        return self.test.prepare_moe(w)

    def linear(self, *a: Any, **k: Any) -> torch.Tensor:
        return self._both("linear", *a, **k)

    def rms_norm(self, *a: Any, **k: Any) -> torch.Tensor:
        return self._both("rms_norm", *a, **k)

    def embed(self, ids, table, shard, vocab_size, out):
        want = self.oracle.embed(ids, table, shard, vocab_size, torch.empty_like(out))
        got = self.test.embed(ids, table, shard, vocab_size, out)
        self.report.append(("embed", 0, _rel(got, want)))
        return out.copy_(want)

    def attn_res(self, blocks, n_blocks, prefix, *a: Any, live_out=None, **k: Any) -> torch.Tensor:
        # the test table may update the prefix (or a block slot) in place: give it copies
        t_blocks = blocks.clone()
        t_prefix = None if prefix is None else prefix.clone()
        t_live = None if live_out is None else (t_prefix if live_out is prefix else t_blocks[n_blocks])
        got = self.test.attn_res(t_blocks, n_blocks, t_prefix, *a, live_out=t_live, **k)
        want = self.oracle.attn_res(blocks, n_blocks, prefix, *a, live_out=live_out, **k)
        self.report.append(("attn_res", sum(o == "attn_res" for o, _, _ in self.report), _rel(got, want)))
        if live_out is not None:
            self.report.append(("attn_res.live", 0, _rel(t_live, live_out)))
        return want

    def kda_core(self, z, g_raw, w, st, meta, cfg, shard):
        copy = type(st)(**{f.name: getattr(st, f.name).clone() for f in dataclasses.fields(st)})
        got = self.test.kda_core(z, g_raw, w, copy, meta, cfg, shard)
        want = self.oracle.kda_core(z, g_raw, w, st, meta, cfg, shard)
        self.report.append(("kda_core", 0, _rel(got, want)))
        # every pool the step writes (recurrent state, short-conv window): an error there shows
        # only in later steps. Slot 0 is the null slot that padding rows write.
        for f in dataclasses.fields(st):
            self.report.append((f"kda_core.{f.name}", 0, _rel(getattr(copy, f.name)[1:], getattr(st, f.name)[1:])))
        return want

    def mla_cache_write(self, kv_c, k_pe, norm_w, eps, cache, index) -> None:
        copy = cache.clone()
        self.test.mla_cache_write(kv_c, k_pe, norm_w, eps, copy, index)
        self.oracle.mla_cache_write(kv_c, k_pe, norm_w, eps, cache, index)
        self.report.append(("mla_cache_write", 0, _rel(copy[1:], cache[1:])))

    def mla_absorb(self, *a: Any, **k: Any) -> torch.Tensor:
        return self._both("mla_absorb", *a, **k)

    def mla_attend(self, *a: Any, **k: Any) -> torch.Tensor:
        return self._both("mla_attend", *a, **k)

    def mla_unabsorb(self, *a: Any, **k: Any) -> torch.Tensor:
        return self._both("mla_unabsorb", *a, **k)

    def route(self, logits, bias, cfg):
        want = self.oracle.route(logits, bias, cfg)
        got = self.test.route(logits, bias, cfg)
        same = float((got[1].long() == want[1].long()).float().mean())
        self.report.append(("route.ids_equal", 0, same))
        self.report.append(("route.weights", 0, _rel(got[0], want[0])))
        self.routed.append(want[1])
        return want

    def routed_experts(self, *a: Any, **k: Any) -> torch.Tensor:
        return self._both("routed_experts", *a, **k)

    def situ_and_mul(self, *a: Any, **k: Any) -> torch.Tensor:
        return self._both("situ_and_mul", *a, **k)


def main(argv: list[str] | None = None) -> int:
    from ..benchmarks.block_parity import fill_state, k3_block
    from .decode_ops import KernelOps, ReferenceOps
    from .executor import SpecializedDecode

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--q", type=int, default=1)
    ap.add_argument("--experts", type=int, default=64)
    args = ap.parse_args(argv)
    model = k3_block(args.tp, experts=args.experts)
    ops = ComparedOps(KernelOps(), ReferenceOps())
    ex = SpecializedDecode(model, max_requests=args.rows // args.q, max_len=600, buckets=[(args.rows, args.q)],
                           ops=ops, graphs=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = fill_state(ex.state, args.rows // args.q, 500, gen)
    ops.report.clear()
    ids = torch.randint(0, model.w.lm_head.shape[0], (args.rows,), generator=gen, device="cuda")
    ex(ids, [ex.state.segment(r, j * args.q, args.q, prefill=False) for j, r in enumerate(slots)], ex.state)
    worst: dict[str, float] = {}
    for op, _, err in ops.report:
        worst[op] = max(worst.get(op, 0.0), err) if op != "route.ids_equal" else min(worst.get(op, 1.0), err)
    for op, err in worst.items():
        print(f"{op:20s} {err:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
