"""Tokenizers for data preparation: a Hugging Face `tokenizer.json`, a SentencePiece `.model`
(LLaMA-2 style) and the byte tokenizer, behind one small interface; plus training a byte-level
BPE tokenizer on the user's own text, so a machine with no model hub still gets a real one.

The tokenizer libraries (`tokenizers`, `sentencepiece`) are imported inside the functions that
need them: importing this module loads numpy and the standard library only, and training reads
token files, never a tokenizer.

A tokenizer is described by a `TokenizerSpec` (kind + path), which is what worker processes
receive and what the dataset summary records; `load_tokenizer(spec)` builds the object.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol, Sequence

import numpy as np

from ms_llm.data.tokenizer import ByteTokenizer
from ms_llm.errors import ConfigError

KINDS = ("huggingface", "sentencepiece", "bytes")
# End-of-document tokens, in the order they are looked for in a tokenizer.json: GPT-2 / ours,
# LLaMA-1/2 and Mistral, LLaMA-3, Gemma.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
BPE_EOS = "<|endoftext|>"


class Tokenizer(Protocol):
    """What preparation needs from a tokenizer. `encode_batch` adds no special tokens: the caller
    appends `eos_id` per document."""

    spec: "TokenizerSpec"
    vocab_size: int
    eos_id: int | None

    def encode_batch(self, texts: list[str]) -> Sequence[Sequence[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True)
class TokenizerSpec:
    """kind: one of KINDS; path: the tokenizer file (None for bytes); eos_token: the end-of-document
    token's text, when the tokenizer's own is not found or is not the one wanted."""

    kind: str
    path: str | None = None
    eos_token: str | None = None

    @classmethod
    def from_arg(cls, arg: str, eos_token: str | None = None) -> "TokenizerSpec":
        """`--tokenizer` value: 'bytes', a tokenizer.json (or a folder holding one), or a SentencePiece .model."""
        if arg == "bytes":
            return cls("bytes")
        path = Path(arg)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"--tokenizer: {arg} does not exist; give a tokenizer.json, a SentencePiece .model, "
                              f"'bytes', or train one with --train-tokenizer bpe --vocab-size N")
        if path.suffix == ".json":
            return cls("huggingface", str(path.resolve()), eos_token)
        if path.suffix == ".model":
            return cls("sentencepiece", str(path.resolve()), eos_token)
        raise ConfigError(f"--tokenizer: {arg} is neither a tokenizer.json (Hugging Face) nor a .model "
                          f"(SentencePiece); rename it or give one of those")

    def describe(self) -> dict:
        """What the dataset summary records: kind, path and the file's sha256 (the path may move)."""
        out: dict = {"kind": self.kind, "path": self.path}
        if self.path:
            out["sha256"] = hashlib.sha256(Path(self.path).read_bytes()).hexdigest()
        return out


class HuggingFaceTokenizer:
    def __init__(self, spec: TokenizerSpec):
        from tokenizers import Tokenizer as HFTokenizer

        self.spec = spec
        try:
            self._tok = HFTokenizer.from_file(spec.path)
        except Exception as exc:  # the library raises its own Exception type with the parse error
            raise ConfigError(f"--tokenizer: {spec.path} is not a tokenizer.json the tokenizers library can "
                              f"read ({exc})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = (spec.eos_token,) if spec.eos_token else EOS_CANDIDATES
        self.eos_id = next((i for i in map(self._tok.token_to_id, names) if i is not None), None)
        if spec.eos_token and self.eos_id is None:
            raise ConfigError(f"--eos-token: {spec.path} has no token {spec.eos_token!r}")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast: no character offsets, which preparation never needs.
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class SentencePieceTokenizer:
    def __init__(self, spec: TokenizerSpec):
        import sentencepiece

        self.spec = spec
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=spec.path)
        except (OSError, RuntimeError) as exc:
            raise ConfigError(f"--tokenizer: {spec.path} is not a SentencePiece model ({exc})") from None
        self.vocab_size = self._sp.get_piece_size()
        eos = self._sp.piece_to_id(spec.eos_token) if spec.eos_token else self._sp.eos_id()
        self.eos_id = eos if eos >= 0 and eos != self._sp.unk_id() else None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # No BOS, no EOS: the caller appends EOS, as for every other tokenizer.
        return self._sp.encode(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class BytesTokenizer:
    """ms_llm.data.tokenizer.ByteTokenizer behind the common interface: UTF-8 bytes are ids 0-255."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._tok = ByteTokenizer()
        self.vocab_size, self.eos_id = ByteTokenizer.vocab_size, ByteTokenizer.EOS

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self._tok.encode(t.encode("utf-8"), eos=False) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(ids).decode("utf-8", errors="replace")


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    if spec.kind == "huggingface":
        return HuggingFaceTokenizer(spec)
    if spec.kind == "sentencepiece":
        return SentencePieceTokenizer(spec)
    if spec.kind == "bytes":
        return BytesTokenizer(spec)
    raise ConfigError(f"tokenizer kind {spec.kind!r}: expected one of {', '.join(KINDS)}")


def train_bpe(batches: Iterable[list[str]], vocab_size: int, path: Path) -> TokenizerSpec:
    """Train a byte-level BPE tokenizer (GPT-2 style: any UTF-8 text round-trips exactly, no unknown
    token) on `batches` of documents and save it as a tokenizer.json at `path` (the caller renames it
    into place once the dataset is written). Its one special token, <|endoftext|>, is the end of a document."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ConfigError(f"--vocab-size: {vocab_size} is too small for a byte-level BPE tokenizer: its "
                          f"{len(alphabet)} byte symbols and {BPE_EOS} take {len(alphabet) + 1}; give at least "
                          f"{len(alphabet) + 2} (32000 or more for real training)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(batches, trainer)
    tok.save(str(path))
    return TokenizerSpec("huggingface", str(Path(path).resolve()))
