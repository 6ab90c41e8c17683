"""Deterministic, resumable, re-shardable token streams shared by both backends (numpy only):
flat token files, and Megatron-format indexed datasets with blends and splits."""
from ms_llm.data.corpus import build_stdlib_corpus, load_tokens
from ms_llm.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab
from ms_llm.data.sampler import BatchSampler, GlobalBatchSampler, IndexedBatchSampler, SamplerState, ValidBatches
from ms_llm.data.tokenizer import ByteTokenizer

__all__ = ["BatchSampler", "ByteTokenizer", "GlobalBatchSampler", "IndexedBatchSampler", "IndexedDataset",
           "IndexedDatasetWriter", "SamplerState", "ValidBatches", "build_stdlib_corpus", "dtype_for_vocab",
           "load_tokens"]
