"""prepare-data throughput vs the `tokenizers` library's own batch encoding, side by side in one run.

    .venv/bin/python bench/data.py [--vocab-size 32000] [--rounds 5] [--max-mb 8]

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
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ms_llm.data import readers  # noqa: E402
from ms_llm.data.prepare import TextJob, prepare_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-mb", type=float, default=8.0, help="MB of standard-library sources")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
