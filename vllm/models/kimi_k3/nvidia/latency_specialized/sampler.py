"""The standard sampler, identical whichever decode path produced the logits.

Per request: an optional token mask (structured output: a grammar's bitmask, applied
first), then greedy (temperature 0) or temperature → top-k → top-p → a draw from the
request's own seeded generator, so a seeded request gives the same tokens on every path
and in any batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

TokenMask = Callable[[Sequence[int]], torch.Tensor]  # output ids so far -> bool [V] allowed
MIN_TEMPERATURE = 1e-2  # vLLM's: a smaller positive temperature is raised to it


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: Optional[int] = None
    max_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    token_mask: Optional[TokenMask] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), found {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # as vLLM: below it the softmax overflows to inf/NaN; raised to it, not failed later
            self.temperature = MIN_TEMPERATURE
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), found {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], found {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, found {self.max_tokens}")


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p on one row of fp32 logits (masked entries become -inf)."""
    x = logits / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return x


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]], outputs: Sequence[Sequence[int]]) -> list[int]:
    """One token per row of `logits` [B, V] (fp32)."""
    tokens = []
    for row, p, g, out in zip(logits.to(torch.float32).cpu(), params, generators, outputs):
        if p.token_mask is not None:
            allowed = p.token_mask(out).to(torch.bool)
            if not allowed.any():
                raise RuntimeError("structured output: the grammar allows no token at this point")
            row = row.masked_fill(~allowed, float("-inf"))
        if p.temperature == 0.0:
            tokens.append(int(torch.argmax(row)))
            continue
        probs = torch.softmax(filter_logits(row, p), dim=-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=g)))
    return tokens
