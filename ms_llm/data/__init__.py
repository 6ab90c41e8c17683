"""Deterministic, resumable, re-shardable token stream shared by both backends (numpy only)."""
from ms_llm.data.corpus import build_stdlib_corpus, load_tokens
from ms_llm.data.sampler import GlobalBatchSampler, SamplerState
from ms_llm.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "GlobalBatchSampler", "SamplerState", "build_stdlib_corpus", "load_tokens"]
