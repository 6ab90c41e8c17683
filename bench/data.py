"""Data path costs, side by side in one run: prepare-data throughput vs the `tokenizers` library's
own batch encoding; fetching a global batch vs the tiny model's step; the sample-index build.

    .venv/bin/python bench/data.py [--vocab-size 32000] [--rounds 5] [--max-mb 8] [--skip-prepare]

1. prepare-data

Documents: the embedded corpus (the standard library's sources, as `--input stdlib`), written
once as a JSON Lines file. Tokenizer: a byte-level BPE trained on it by prepare-data itself
(not timed). Then, interleaved round by round so machine noise hits every row alike:

  library encode_batch       Tokenizer.encode_batch(all documents) in one call, ids read out:
                             documents already in memory, nothing read or written
  library encode_batch_fast  the same with encode_batch_fast (no offsets), its fastest API
  prepare-data, N workers    the whole job: read and parse the JSONL, encode, append EOS, write
                             PREFIX.bin/.idx and the summary

Ratios are throughput / the library's (>= 0.9 at 1 worker is the goal), from the best and the
median of the rounds. Both library rows use the library's own thread pool over every core; so
does prepare-data's 1-worker row; with N workers each process encodes on one thread.

2. Batch fetch vs step (goal: under 1%). A synthetic indexed dataset (IndexedDatasetWriter,
random document lengths, `--fetch-tokens` tokens) and its sample order built as the launcher
builds it (samples.build), opened as a worker opens it (samples.train_sampler); then,
interleaved round by round: `local_batch(k)` for random steps k, for the whole global batch and
for one rank of configs/train/tiny_torch_dp2.yaml's dp2, and a single-process torch step of
the tiny model on that whole global batch (forward, cross entropy, backward, clip, AdamW), on
this machine's CPU as the config says. Ratios: fetch time / step time.

3. Sample-index build (goal: under 30 s and 2 GB): megatron-core's three indices
(gpt.build_indices, one epoch) over document sizes alone, summing to `--index-tokens`, each
build in a fresh process. Memory: the build's tracemalloc peak (numpy's allocations, a second
build), its peak RSS over the RSS before it (VmHWM reset through /proc/self/clear_refs, minus
VmRSS; Linux), and the process's whole peak RSS (interpreter, numpy and the sizes included).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from ms_llm.data import IndexedDatasetWriter, dtype_for_vocab, readers, samples  # noqa: E402
from ms_llm.data.gpt import build_indices  # noqa: E402
from ms_llm.data.prepare import TextJob, prepare_text  # noqa: E402
from ms_llm.job import load_job  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_JOB = ROOT / "configs/train/tiny_torch_dp2.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-mb", type=float, default=8.0, help="MB of standard-library sources")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--skip-prepare", action="store_true", help="only the batch fetch and the index build")
    ap.add_argument("--fetch-tokens", type=float, default=50e6, help="tokens in the synthetic indexed dataset")
    ap.add_argument("--fetches", type=int, default=200, help="local_batch calls timed per round")
    ap.add_argument("--steps", type=int, default=5, help="torch steps timed per round")
    ap.add_argument("--index-tokens", type=float, default=1e9)
    ap.add_argument("--index-doc-tokens", type=int, nargs="+", default=[100, 1000], help="mean document length")
    ap.add_argument("--index-seq-len", type=int, nargs="+", default=[128, 2048])
    args = ap.parse_args()
    if not args.skip_prepare:
        prepare_bench(args)
    fetch_bench(args)
    index_bench(args)


def prepare_bench(args: argparse.Namespace) -> None:
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tmp = Path(tmp)
        texts = [p.read_bytes().decode("utf-8") for p in readers.stdlib_files(int(args.max_mb * 2**20))]
        texts = [t for t in texts if t.strip()]
        src = tmp / "stdlib.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        mb = sum(len(t.encode()) for t in texts) / 1e6
        trained = prepare_text(TextJob(inputs=(str(src),), output=tmp / "trained" / "ds", train_tokenizer="bpe",
                                       vocab_size=args.vocab_size))
        tok_path = tmp / "trained" / "tokenizer.json"
        tok = Tokenizer.from_file(str(tok_path))

        def library(fast: bool):
            def run():
                enc = tok.encode_batch_fast if fast else tok.encode_batch
                return sum(len(e.ids) for e in enc(texts, add_special_tokens=False))
            return run

        def ours(workers: int):
            def run():
                out = prepare_text(TextJob(inputs=(str(src),), output=tmp / "out" / f"w{workers}",
                                           tokenizer=str(tok_path), workers=workers, overwrite=True))
                return out["tokens"] - out["documents"]      # less the EOS per document
            return run

        rows = {"library encode_batch": library(False), "library encode_batch_fast": library(True)}
        rows |= {f"prepare-data, {w} worker{'s' if w > 1 else ''}": ours(w) for w in args.workers}
        times: dict[str, list[float]] = {name: [] for name in rows}
        tokens: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, fn in rows.items():
                start = time.perf_counter()
                tokens[name] = fn()
                times[name].append(time.perf_counter() - start)
        if len(set(tokens.values())) != 1:
            raise SystemExit(f"token counts differ: {tokens}")
        outputs = [(tmp / "out" / f"w{w}.bin").read_bytes() for w in args.workers]
        identical = all(o == outputs[0] for o in outputs)

    print(f"{len(texts)} documents, {mb:.1f} MB of standard-library source, {tokens[name]:,} tokens, "
          f"byte-level BPE vocab {trained['vocab_size']} trained by prepare-data; {args.rounds} interleaved "
          f"rounds, best (least disturbed by other load) and median")
    for label, pick in (("best", min), ("median", statistics.median)):
        sec = {name: pick(t) for name, t in times.items()}
        base, fast = sec["library encode_batch"], sec["library encode_batch_fast"]
        print(f"{label:<28} {'seconds':>8} {'MB/s':>7} {'vs encode_batch':>16} {'vs encode_batch_fast':>21}")
        for name, t in sec.items():
            print(f"  {name:<26} {t:>8.2f} {mb / t:>7.2f} {base / t:>16.2f} {fast / t:>21.2f}")
    print(f"prepare-data outputs byte-identical across workers {args.workers}: {identical}")


def random_sizes(tokens: int, mean: int, rng: np.random.Generator) -> np.ndarray:
    """int32 document lengths, uniform in [1, 2 * mean), the last cut so they sum to `tokens`."""
    lengths = rng.integers(1, 2 * mean, int(tokens / mean * 1.1) + 10, dtype=np.int64)
    ends = np.cumsum(lengths)
    n = int(np.searchsorted(ends, tokens)) + 1
    sizes = lengths[:n].copy()
    sizes[-1] = tokens - (ends[n - 2] if n > 1 else 0)
    return sizes.astype(np.int32)


def fetch_bench(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    from torch_backend.model import Transformer

    job = load_job(TINY_JOB)
    train, dp = job.train, job.strategy.dp
    steps = max(1000, args.fetches)                         # steps in the order; fetched at random
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="bench-fetch-") as tmp:
        tmp = Path(tmp)
        sizes = random_sizes(int(args.fetch_tokens), 1000, rng)
        tokens = rng.integers(0, job.model.vocab_size, int(sizes.sum()), dtype=dtype_for_vocab(job.model.vocab_size))
        writer = IndexedDatasetWriter(tmp / "synthetic", tokens.dtype)
        for doc in np.split(tokens, np.cumsum(sizes)[:-1]):
            writer.add_document(doc)
        writer.finalize()
        del tokens
        train = dataclasses.replace(train, steps=steps,
                                    data=dataclasses.replace(train.data, paths=(str(tmp / "synthetic"),)))
        start = time.perf_counter()
        samples.build(samples.DataSpec.of(train), tmp / "run-data")
        order_s = time.perf_counter() - start
        sampler = samples.train_sampler(train, tmp / "run-data")

        torch.manual_seed(0)
        model = Transformer(job.model)
        model.init_weights(train.seed)
        opt = train.optimizer
        optim = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                  weight_decay=opt.weight_decay)

        def fetch(dp_size: int):
            def run():
                for k in rng.integers(0, steps, args.fetches):
                    sampler.local_batch(int(k), 0, dp_size)                   # (B / dp_size, T + 1)
                return args.fetches
            return run

        def step():
            for k in range(args.steps):
                batch = torch.from_numpy(sampler.local_batch(k))              # (B, T + 1), the global batch
                loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
                optim.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), opt.grad_clip)
                optim.step()
            return args.steps

        g, t = train.global_batch_size, train.seq_len
        rows = {f"fetch global batch ({g}x{t + 1})": fetch(1),
                f"fetch one rank's batch, dp{dp} ({g // dp}x{t + 1})": fetch(dp),
                "torch step, whole global batch": step}
        step()                                                                # warm-up, not timed
        times: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, fn in rows.items():
                start = time.perf_counter()
                n = fn()
                times[name].append((time.perf_counter() - start) / n)

    print()
    print(f"batch fetch vs step: synthetic indexed dataset of {int(sizes.sum()):,} tokens in {sizes.size:,} "
          f"documents, sample order for {steps} steps built in {order_s:.2f} s; tiny model "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), global batch {g} x seq_len {t}, "
          f"torch {torch.__version__} on CPU, {torch.get_num_threads()} threads; {args.rounds} interleaved rounds of "
          f"{args.fetches} fetches (random steps) and {args.steps} steps")
    step_name = "torch step, whole global batch"
    for label, pick in (("best", min), ("median", statistics.median)):
        sec = {name: pick(ts) for name, ts in times.items()}
        print(f"{label:<40} {'ms':>9} {'vs step':>9}")
        for name, s in sec.items():
            print(f"  {name:<38} {s * 1e3:>9.3f} {s / sec[step_name]:>9.3%}")


def rss_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (peak) of this process, in KiB, from /proc (Linux). Not ru_maxrss: a
    spawned child's ru_maxrss starts at its parent's peak (Linux carries it over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise SystemExit(f"/proc/self/status has no {field}; this measurement needs Linux")


def build_once(tokens: int, mean: int, seq_len: int) -> dict:
    """In a fresh process: one untraced build for time and peak RSS, one under tracemalloc for
    its peak of numpy's allocations."""
    import tracemalloc

    sizes = random_sizes(tokens, mean, np.random.default_rng(0))
    documents = np.arange(sizes.size, dtype=np.int32)
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")          # reset VmHWM to the current RSS
    start = time.perf_counter()
    ix = build_indices(sizes, documents, seq_len, None, 1234)
    seconds = time.perf_counter() - start
    peak = rss_kib("VmHWM")
    samples_n = int(ix.shuffle.size)
    del ix
    tracemalloc.start()
    build_indices(sizes, documents, seq_len, None, 1234)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"documents": int(sizes.size), "samples": samples_n, "seconds": seconds, "traced": traced,
            "rss_delta": (peak - before) * 1024, "peak_rss": peak * 1024}


def index_bench(args: argparse.Namespace) -> None:
    tokens = int(args.index_tokens)
    print()
    print(f"sample-index build (gpt.build_indices, one epoch) over {tokens:,} tokens of synthetic documents, "
          f"lengths uniform in [1, 2 * mean), each in a fresh process; goal < 30 s and < 2 GB")
    print(f"  {'mean doc':>9} {'seq_len':>8} {'documents':>11} {'samples':>12} {'seconds':>8} "
          f"{'tracemalloc peak':>17} {'peak RSS delta':>15} {'process peak RSS':>17}")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        for mean in args.index_doc_tokens:
            for seq_len in args.index_seq_len:
                r = pool.apply(build_once, (tokens, mean, seq_len))
                print(f"  {mean:>9} {seq_len:>8} {r['documents']:>11,} {r['samples']:>12,} {r['seconds']:>8.2f} "
                      f"{r['traced'] / 2**30:>13.2f} GiB {r['rss_delta'] / 2**30:>11.2f} GiB "
                      f"{r['peak_rss'] / 2**30:>13.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
