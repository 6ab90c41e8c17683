"""Turn text into a training dataset: PREFIX.bin + PREFIX.idx (Megatron-LM's indexed format, one
document per sequence, EOS appended), the tokenizer beside it and a summary (PREFIX.json, also
printed). Input: JSON Lines (--text-key), plain text files (one file, one document), folders of
them, Parquet, a Hugging Face dataset saved with save_to_disk, 'stdlib' (the embedded corpus),
or a MindFormers MindRecord dataset's input_ids (--input-format mindrecord, copied as they are).

Tokenizer: --tokenizer with a Hugging Face tokenizer.json, a SentencePiece .model or 'bytes', or
--train-tokenizer bpe --vocab-size N to train a byte-level BPE tokenizer on the input and save
it as tokenizer.json in the output folder (no model hub needed).

Bad input stops the run with one line naming the file and line (exit status 2): text that is
not UTF-8 (--skip-invalid-utf8 counts and skips such documents instead), a missing --text-key,
an output that exists (--overwrite replaces it). Empty documents are skipped and counted. A
killed run leaves nothing under a final name.

examples:
  ms-llm prepare-data --input docs/ --train-tokenizer bpe --vocab-size 32000 --output data/docs
  ms-llm prepare-data --input web.jsonl --text-key content --tokenizer llama2/tokenizer.model \\
      --output data/web --workers 8
  ms-llm prepare-data --input wiki.mindrecord --input-format mindrecord --tokenizer tokenizer.model \\
      --output data/wiki
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ms_llm.data.readers import FORMATS
from ms_llm.errors import ConfigError



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                        help="files, folders (walked in sorted order), a saved Hugging Face dataset, or 'stdlib'")
    parser.add_argument("--input-format", choices=FORMATS, default="auto",
                        help="default: by suffix (.jsonl/.json: JSON Lines, .parquet: Parquet, a folder with "
                             "dataset_info.json: Hugging Face, anything else: text)")
    parser.add_argument("--output", "-o", required=True, metavar="PREFIX",
                        help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    tok = parser.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", default=None, metavar="PATH",
                     help="a tokenizer.json (or its folder), a SentencePiece .model, or 'bytes'")
    tok.add_argument("--train-tokenizer", choices=("bpe",), default=None,
                     help="train a byte-level BPE tokenizer on the input; saved as tokenizer.json beside PREFIX")
    parser.add_argument("--vocab-size", type=int, default=None, metavar="N",
                        help="the trained tokenizer's vocabulary size (MindRecord without --tokenizer: the "
                             "vocabulary size of its ids; default there: the largest id + 1)")
    parser.add_argument("--text-key", default="text", help="JSON Lines key / Parquet or dataset column (default: text)")
    parser.add_argument("--hf-split", default="train", help="split of a saved DatasetDict (default: train)")
    parser.add_argument("--eos-token", default=None,
                        help="end-of-document token's text, when the tokenizer's own is not found")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=None,
                        help="append the end-of-document token to each document (default: on for text, off for "
                             "MindRecord, whose rows are already packed samples)")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="tokenizer processes (default: 1)")
    parser.add_argument("--skip-invalid-utf8", action="store_true",
                        help="count and skip documents that are not UTF-8 instead of stopping")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset at PREFIX")


def run(args: argparse.Namespace) -> int:
    from ms_llm.data.prepare import TextJob, prepare_text

    if args.input_format == "mindrecord" or (args.input_format == "auto" and ".mindrecord" in args.input[0]):
        out = import_mindrecord(args)
    else:
        out = prepare_text(TextJob(
            inputs=tuple(args.input), output=Path(args.output), tokenizer=args.tokenizer,
            train_tokenizer=args.train_tokenizer, vocab_size=args.vocab_size, input_format=args.input_format,
            text_key=args.text_key, hf_split=args.hf_split, eos_token=args.eos_token,
            append_eod=args.append_eod is not False, workers=args.workers, overwrite=args.overwrite,
            skip_invalid_utf8=args.skip_invalid_utf8))
    print(json.dumps(out, indent=1))
    return 0


# ---------------------------------------------------------------- MindRecord (mindspore.mindrecord, here only)


def import_mindrecord(args: argparse.Namespace) -> dict:
    """Copy a MindRecord dataset's input_ids rows (what MindFormers' conversion scripts write) into
    the indexed format, one row per document."""
    from ms_llm.data.prepare import Outputs, prepare_tokens
    from ms_llm.data.tokenizers import TokenizerSpec, load_tokenizer

    if args.train_tokenizer:
        raise ConfigError("--train-tokenizer: MindRecord input is already tokenized; give the --tokenizer it was "
                          "made with, or --vocab-size")
    if args.append_eod:
        raise ConfigError("--append-eod: MindRecord input_ids are copied as they are (MindFormers packs samples "
                          "with their EOS already); drop the flag")
    if len(args.input) != 1:
        raise ConfigError(f"--input: give one MindRecord file (its other shards are found from it), got "
                          f"{len(args.input)}")
    path = args.input[0]
    Outputs(Path(args.output)).check(args.overwrite)    # before a pass over the input, not after
    try:
        from ms_llm.mindspore.mindrecord import mindrecord_chunks    # the CLI layer reaches into the backend
    except ImportError:
        raise ConfigError(f"{path}: MindRecord input needs MindSpore: pip install 'ms_llm[mindspore]'") from None
    tokenizer = None
    if args.tokenizer:
        spec = TokenizerSpec.from_arg(args.tokenizer, args.eos_token)
        vocab_size, tokenizer = load_tokenizer(spec).vocab_size, spec.describe()
    elif args.vocab_size:
        vocab_size = args.vocab_size
    else:   # one pass for the largest id: the dtype must be known before the first row is written
        vocab_size = 1 + max((int(ids.max()) for ids, _, _ in mindrecord_chunks(path) if ids.size), default=0)
    return prepare_tokens(mindrecord_chunks(path), Path(args.output), vocab_size, tokenizer, [path],
                          overwrite=args.overwrite)
