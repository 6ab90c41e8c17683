"""Text -> tokens -> indexed dataset (PREFIX.bin / PREFIX.idx, Megatron's format), streamed.

    documents (ms_llm.data.readers, one at a time)  ->  batches of ~1 MB  ->  encode (here, or in
    --workers processes, results taken back in submission order)  ->  IndexedDatasetWriter

Nothing holds the input whole: readers yield one document at a time, at most 2 x workers
batches are in flight, and the writer appends to a temporary file. Output becomes visible
only when complete: the writer renames .bin/.idx into place on finalize; a trained tokenizer
and then the summary (PREFIX.json) are written under temporary names and renamed after it, so
a PREFIX.json means the whole run finished.

Bad input policy: a document that is not UTF-8 stops the run with its file and line (usually
the whole file is in another encoding, and silently dropping text is data loss nobody sees);
`skip_invalid_utf8` counts and skips such documents instead, for web crawls. Empty and
whitespace-only documents are skipped and counted.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ms_llm.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from ms_llm.data.readers import Counts, batched, expand_inputs, read_documents
from ms_llm.data.tokenizers import TokenizerSpec, load_tokenizer
from ms_llm.durable import replace_durably
from ms_llm.errors import ConfigError


# ---------------------------------------------------------------- encoding, here or in worker processes

_worker: tuple | None = None
IN_FLIGHT = 4           # batches queued at once with one worker (a few MB of text)
# What the fork server imports once for every worker it forks (a library not installed is
# skipped). '__main__' is multiprocessing's default; Python 3.11's server skips it, and each
# worker imports the caller's script itself.
FORKSERVER_PRELOAD = ["__main__", __name__, "tokenizers", "sentencepiece"]
START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
# Characters per batch with several worker processes: a worker's last batch is the run's tail,
# so smaller than the one-worker batches (whose threads share each batch).
WORKER_BATCH_CHARS = 256 << 10
PER_WORKER = 4          # batches in flight per worker process: results are taken in order, and a
                        # slow one holds up the next submissions while the others finish


def _init_worker(spec: TokenizerSpec, dtype: str, eos: int | None) -> None:
    global _worker
    # One thread per worker process: the processes are the parallelism (N workers x every core's
    # worth of tokenizer threads would oversubscribe the machine).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker = (load_tokenizer(spec), np.dtype(dtype), eos)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    return encode_batch(*_worker, texts)


def encode_batch(tokenizer, dtype: np.dtype, eos: int | None, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """One flat token array for the batch (EOS after each document when eos is not None), the
    documents' lengths and the batch's character count (for the MB/s figure)."""
    ids = tokenizer.encode_batch(texts)
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    parts = [np.asarray(x, dtype=dtype) for x in ids]
    if eos is not None:
        tail = np.array([eos], dtype=dtype)
        parts = [p for x in parts for p in (x, tail)]
        lengths += 1
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype)
    return flat, lengths, sum(map(len, texts))


def encoded(batches: Iterable[list[str]], tokenizer, dtype: np.dtype, eos: int | None,
            workers: int) -> Iterator[tuple[np.ndarray, np.ndarray, int]]:
    """encode_batch over `batches`, results in submission order, a few batches in flight so a
    large input never piles up in memory.

    workers == 1: this process, IN_FLIGHT threads. The tokenizer libraries release the GIL while
    they encode, so reading and writing overlap with encoding. `tokenizers` spreads each batch
    over its own thread pool, whose threads take the next queued batch while the last documents
    of one finish: with only two in flight, both ended together and the cores idled until the
    next two came.
    workers > 1: that many processes, each encoding on one thread. Not forked from this process:
    the tokenizer libraries keep thread pools that a fork would copy mid-flight. They are forked
    from multiprocessing's fork server, a clean single-threaded process started once (per process
    that asks), with this module and the tokenizer libraries already imported: spawning each
    worker afresh cost it 0.25 s of CPU, 2 workers a fifth of bench/data.py's whole encoding."""
    if workers <= 1:
        executor, limit = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="encode"), IN_FLIGHT
        submit = lambda texts: executor.submit(encode_batch, tokenizer, dtype, eos, texts)  # noqa: E731
    else:   # each worker loads its own copy from the spec
        context = multiprocessing.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            context.set_forkserver_preload(FORKSERVER_PRELOAD)      # read when the server starts
        executor = context.Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec, dtype.str, eos))
        submit = lambda texts: executor.apply_async(_encode_in_worker, (texts,))  # noqa: E731
        limit = PER_WORKER * workers
    pending: deque = deque()
    try:
        for texts in batches:
            pending.append(submit(texts))
            if len(pending) >= limit:
                yield _result(pending.popleft())
        while pending:
            yield _result(pending.popleft())
    finally:
        if workers <= 1:
            executor.shutdown(wait=True, cancel_futures=True)
        else:
            executor.terminate()
            executor.join()


def _result(pending):
    return pending.result() if hasattr(pending, "result") else pending.get()


# ---------------------------------------------------------------- writing


class Progress:
    """Documents, tokens and MB/s on stderr: rewritten in place on a terminal, a line every 30 s otherwise."""

    def __init__(self, counts: Counts, start: float):
        self.counts, self.start, self.tty = counts, start, sys.stderr.isatty()
        self.last = start

    def update(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < (0.5 if self.tty else 30.0):
            return
        self.last, c = now, self.counts
        rate = c.characters / max(now - self.start, 1e-9) / 1e6
        line = f"prepare-data: {c.documents:,} documents, {c.tokens:,} tokens, {rate:.1f} MB/s"
        if self.tty:
            print(f"\r{line}", end="\n" if final else "", file=sys.stderr, flush=True)
        elif not final:
            print(line, file=sys.stderr, flush=True)


def write_dataset(prefix: Path, vocab_size: int, chunks: Iterable[tuple[np.ndarray, np.ndarray, int]],
                  counts: Counts, progress: Progress | None = None) -> None:
    """Append each chunk's documents to PREFIX.bin/.idx through the indexed-dataset writer, refusing
    any id >= vocab_size before it is written."""
    dtype = dtype_for_vocab(vocab_size)
    with IndexedDatasetWriter(str(prefix), dtype) as writer:
        for flat, lengths, chars in chunks:
            top = int(flat.max()) if flat.size else -1
            if top >= vocab_size:
                raise ConfigError(f"--vocab-size: the input holds token id {top}, not below the vocabulary size "
                                  f"{vocab_size}; give the tokenizer the input was made with")
            offsets = np.zeros(len(lengths) + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
                writer.add_document(flat[a:b])
            counts.max_token_id = max(counts.max_token_id, top)
            counts.documents += len(lengths)
            counts.tokens += int(flat.size)
            counts.characters += chars
            if progress:
                progress.update()


@dataclass
class Outputs:
    """The final names one run writes, checked before any work starts."""

    prefix: Path
    tokenizer: Path | None = None      # set when a tokenizer is trained into the output folder
    temporaries: list[Path] = field(default_factory=list)

    @property
    def summary(self) -> Path:
        return self.prefix.with_name(self.prefix.name + ".json")

    def final_paths(self) -> list[Path]:
        paths = [self.prefix.with_name(self.prefix.name + s) for s in (".bin", ".idx")] + [self.summary]
        return paths + ([self.tokenizer] if self.tokenizer else [])

    def check(self, overwrite: bool) -> None:
        if self.prefix.name in ("", ".", "..") or self.prefix.is_dir():
            raise ConfigError(f"--output: {self.prefix} is a folder; give a prefix such as {self.prefix}/corpus "
                              f"(writes corpus.bin and corpus.idx there)")
        existing = [str(p) for p in self.final_paths() if p.exists()]
        if existing and not overwrite:
            raise ConfigError(f"--output: {', '.join(existing)} already exist(s); pass --overwrite to replace, or "
                              f"choose another prefix")
        try:
            self.prefix.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--output: cannot create folder {self.prefix.parent} ({exc.strerror})") from None

    def temporary(self, final: Path) -> Path:
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        self.temporaries.append(tmp)
        return tmp

    def commit(self, tmp: Path, final: Path) -> None:
        replace_durably(tmp, final)
        self.temporaries.remove(tmp)

    def write_json(self, final: Path, data: dict) -> None:
        tmp = self.temporary(final)
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        self.commit(tmp, final)

    def clean(self) -> None:
        for tmp in self.temporaries:
            tmp.unlink(missing_ok=True)


def summary(outputs: Outputs, counts: Counts, tokenizer: dict, vocab_size: int, dtype: np.dtype, eos: int | None,
            workers: int, inputs: list[str], seconds: float, training_seconds: float = 0.0) -> dict:
    """What PREFIX.json records; mb_per_s is the tokenizing pass's (characters / s, training excluded)."""
    return {
        "output": str(outputs.prefix),
        "inputs": inputs,
        "documents": counts.documents,
        "tokens": counts.tokens,
        "tokens_per_document": round(counts.tokens / max(counts.documents, 1), 1),
        "skipped": {"empty": counts.skipped_empty, "invalid_utf8": counts.skipped_invalid_utf8},
        "tokenizer": tokenizer,
        "vocab_size": vocab_size,
        "max_token_id": counts.max_token_id,
        "eos_id": eos,
        "dtype": dtype.name,
        "workers": workers,
        "characters": counts.characters,
        "seconds": round(seconds, 2),
        "tokenizer_training_seconds": round(training_seconds, 2),
        "mb_per_s": round(counts.characters / max(seconds - training_seconds, 1e-9) / 1e6, 2),
    }


# ---------------------------------------------------------------- the two pipelines


@dataclass(frozen=True)
class TextJob:
    """What `ms-llm prepare-data` asks for when its input is text (every format but MindRecord)."""

    inputs: tuple[str, ...]
    output: Path
    tokenizer: str | None = None          # --tokenizer: a tokenizer.json, a .model or 'bytes'
    train_tokenizer: str | None = None    # --train-tokenizer: 'bpe'
    vocab_size: int | None = None         # for --train-tokenizer
    input_format: str = "auto"
    text_key: str = "text"
    hf_split: str = "train"
    eos_token: str | None = None
    append_eod: bool = True
    workers: int = 1
    overwrite: bool = False
    skip_invalid_utf8: bool = False


def prepare_text(job: TextJob) -> dict:
    """Tokenize job.inputs into job.output.bin/.idx; return the summary (also written to PREFIX.json)."""
    if (job.tokenizer is None) == (job.train_tokenizer is None):
        raise ConfigError("--tokenizer / --train-tokenizer: give exactly one: --tokenizer tokenizer.json, a "
                          "SentencePiece .model or 'bytes', or --train-tokenizer bpe --vocab-size N")
    if job.train_tokenizer is not None and job.train_tokenizer != "bpe":
        raise ConfigError(f"--train-tokenizer {job.train_tokenizer}: only 'bpe' (byte-level BPE) is supported")
    if job.train_tokenizer and not job.vocab_size:
        raise ConfigError("--vocab-size: --train-tokenizer bpe needs the vocabulary size, e.g. --vocab-size 32000")
    if job.workers < 1:
        raise ConfigError(f"--workers: got {job.workers}; need at least 1")
    files = expand_inputs(list(job.inputs), job.input_format)
    outputs = Outputs(Path(job.output), Path(job.output).parent / "tokenizer.json" if job.train_tokenizer else None)
    outputs.check(job.overwrite)
    start = time.perf_counter()
    try:
        if job.train_tokenizer:
            scratch = Counts()   # the training pass meets bad input first and stops on it the same way
            docs = read_documents(files, scratch, job.text_key, job.skip_invalid_utf8, job.hf_split)
            from ms_llm.data.tokenizers import train_bpe
            trained = outputs.temporary(outputs.tokenizer)
            spec = train_bpe(batched(docs), job.vocab_size, trained)
        else:
            spec = TokenizerSpec.from_arg(job.tokenizer, job.eos_token)
        trained_at = time.perf_counter()
        tok = load_tokenizer(spec)
        if job.append_eod and tok.eos_id is None:
            raise ConfigError(f"--tokenizer: {spec.path} has no end-of-document token; name it with --eos-token "
                              f"or pass --no-append-eod")
        eos = tok.eos_id if job.append_eod else None
        dtype, counts = dtype_for_vocab(tok.vocab_size), Counts()
        progress = Progress(counts, trained_at)
        docs = read_documents(files, counts, job.text_key, job.skip_invalid_utf8, job.hf_split)
        batches = batched(docs, None if job.workers == 1 else WORKER_BATCH_CHARS)
        chunks = encoded(batches, tok, dtype, eos, job.workers)
        write_dataset(outputs.prefix, tok.vocab_size, chunks, counts, progress)
        if job.train_tokenizer:
            outputs.commit(trained, outputs.tokenizer)
            spec = TokenizerSpec(spec.kind, str(outputs.tokenizer.resolve()))
        progress.update(final=True)
        out = summary(outputs, counts, spec.describe(), tok.vocab_size, dtype, eos, job.workers, list(job.inputs),
                      time.perf_counter() - start, trained_at - start if job.train_tokenizer else 0.0)
        outputs.write_json(outputs.summary, out)
        return out
    finally:
        outputs.clean()


def prepare_tokens(chunks: Iterable[tuple[np.ndarray, np.ndarray, int]], output: Path, vocab_size: int,
                   tokenizer: dict | None, inputs: list[str], overwrite: bool = False) -> dict:
    """Already-tokenized documents (MindRecord's input_ids, as (flat ids, lengths, 0) chunks) into
    output.bin/.idx; ids are copied as they are (no EOS added)."""
    outputs = Outputs(Path(output))
    outputs.check(overwrite)
    start, counts, dtype = time.perf_counter(), Counts(), dtype_for_vocab(vocab_size)
    try:
        write_dataset(outputs.prefix, vocab_size, chunks, counts)
        out = summary(outputs, counts, tokenizer, vocab_size, dtype, None, 1, inputs, time.perf_counter() - start)
        outputs.write_json(outputs.summary, out)
        return out
    finally:
        outputs.clean()
