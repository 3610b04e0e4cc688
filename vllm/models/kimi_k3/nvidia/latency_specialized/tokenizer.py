"""A byte-level tokenizer for the small models we ship: ids 0–255 are bytes, then specials."""

from __future__ import annotations


class ByteTokenizer:
    BOS, EOS, PAD, SEP = 256, 257, 258, 259
    SPECIALS = {"<bos>": BOS, "<eos>": EOS, "<pad>": PAD, "<sep>": SEP}
    vocab_size = 260

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        return ([self.BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; specials are dropped, ids beyond the byte range shown as '\ufffd'."""
        out, raw = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                raw.append(i)
                continue
            if raw:
                out.append(raw.decode("utf-8", errors="replace"))
                raw = bytearray()
            if i not in self.SPECIALS.values():
                out.append("\ufffd")
        if raw:
            out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)
