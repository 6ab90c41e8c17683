"""Byte-level tokenizer: ids 0-255 are bytes, then a few specials. Needs no vocabulary file."""
from __future__ import annotations

import numpy as np


class ByteTokenizer:
    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    def encode(self, data: bytes, eos: bool = True) -> np.ndarray:
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
        return np.append(ids, np.uint16(self.EOS)) if eos else ids

    def decode(self, ids) -> bytes:
        return bytes(int(i) for i in ids if int(i) < 256)
