"""Structured output: an xgrammar matcher (the grammar engine vLLM uses) as a token mask.

`GrammarConstraint` compiles a regex or JSON schema against the byte tokenizer's vocab
and is passed as `SamplingParams.token_mask`; the sampler applies it to the full-vocab
logits after either decode path, so a constrained request behaves identically on both.
It advances its matcher by the tokens sampled since its last call; output that does not
continue what it last saw (another request sharing the object, or a new run of the same
request) starts the matcher over on that output, so sharing or reusing one is correct,
only slower. The tokenizer's special tokens have no text (the grammar masks them out, as
vLLM's tokenizer info does): they decode to nothing, so no grammar may count on them.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .tokenizer import ByteTokenizer


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency: say how to get it
        raise ImportError("structured output needs xgrammar: pip install xgrammar "
                          "(or this package's [structured] extra)") from e
    return xgrammar


class GrammarConstraint:
    def __init__(self, compiled, vocab_size: int):
        xgr = _xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._consumed: list[int] = []  # the output the matcher has accepted, in order
        self.vocab_size = vocab_size

    @staticmethod
    def _compiler(vocab_size: int, tok: ByteTokenizer):
        xgr = _xgrammar()
        # specials as empty strings: xgrammar takes those for special tokens and never allows them
        # inside the grammar (EOS, a stop token, still ends it)
        vocab = [bytes([i]) for i in range(256)] + [b""] * (tok.vocab_size - 256)
        info = xgr.TokenizerInfo(encoded_vocab=vocab, vocab_type=xgr.VocabType.RAW,
                                 vocab_size=vocab_size, stop_token_ids=[tok.EOS])
        return xgr.GrammarCompiler(info)

    @classmethod
    def regex(cls, pattern: str, vocab_size: int, tok: ByteTokenizer | None = None) -> "GrammarConstraint":
        return cls(cls._compiler(vocab_size, tok or ByteTokenizer()).compile_regex(pattern), vocab_size)

    @classmethod
    def json_schema(cls, schema: str, vocab_size: int, tok: ByteTokenizer | None = None, *,
                    any_whitespace: bool = True) -> "GrammarConstraint":
        """`any_whitespace=False`: compact JSON only (vLLM's `disable_any_whitespace`), so a model that
        favours whitespace cannot pad the object until max_tokens."""
        compiler = cls._compiler(vocab_size, tok or ByteTokenizer())
        return cls(compiler.compile_json_schema(schema, any_whitespace=any_whitespace), vocab_size)

    def __call__(self, output_ids: Sequence[int]) -> torch.Tensor:
        xgr = _xgrammar()
        ids = [int(t) for t in output_ids]
        if ids[:len(self._consumed)] != self._consumed:  # not a continuation: start over on this output
            self._matcher.reset()
            self._consumed = []
        for t in ids[len(self._consumed):]:
            if not self._matcher.accept_token(t):
                raise RuntimeError(f"structured output: token {t} was sampled but the grammar rejects it")
            self._consumed.append(t)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        probe = torch.zeros(1, self.vocab_size)
        xgr.apply_token_bitmask_inplace(probe, self._bitmask)
        return probe[0] == 0  # disallowed entries became -inf

    @property
    def finished(self) -> bool:
        return self._matcher.is_terminated()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end this grammar (the tokenizer's EOS): sampling one ends the request."""
        return tuple(self._matcher.stop_token_ids)
