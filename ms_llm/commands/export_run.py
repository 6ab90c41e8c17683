"""Export an ms_llm checkpoint as a run a peer's own trainer continues: Megatron-LM, DeepSpeed,
torchtitan or MindFormers (weights, Adam moments, step, and the learning-rate and loss-scale state
where the peer keeps them), or Hugging Face weights (--to hf). --job gives the ms_llm job whose
strategy and training settings the peer's config is written from, where the format writes one.

examples:
  ms-llm export-run runs/tiny-20250101-120000/checkpoints --to megatron -o megatron_ckpt
  ms-llm export-run runs/tiny-20250101-120000/checkpoints/step_00000030 --to hf -o tiny_hf
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ms_llm.checkpoint.interop.hf import export_hf
from ms_llm.checkpoint.interop.peers import PEERS, peer_module
from ms_llm.checkpoint.reader import Checkpoint
from ms_llm.errors import CheckpointError
from ms_llm.job import job_to_dict, load_job

FORMATS = (*PEERS, "hf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="an ms_llm checkpoint: a run's checkpoints folder (its newest step) or a step "
                                    "folder")
    parser.add_argument("--to", required=True, choices=FORMATS, help="the format to write")
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help="folder to write the export into")
    parser.add_argument("--job", default=None, metavar="FILE",
                        help="the ms_llm job YAML the peer's config is written from (e.g. <run>/config.yaml)")
    parser.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.src), Path(args.output)
    job = job_to_dict(load_job(args.job)) if args.job else None
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise CheckpointError(f"export-run: {out} is not empty; pass --overwrite to write the {args.to} export over "
                              "it, or choose an empty folder")
    with Checkpoint.open(src) as ckpt:
        try:
            if args.to == "hf":
                written = export_hf(ckpt.folder, out)
            else:
                written = peer_module(args.to).write_run(ckpt, out, job)
        except OSError as exc:
            raise CheckpointError(f"export-run: {exc.filename or out}: {exc.strerror or exc}") from None
        step = ckpt.step
    files = [p for p in Path(written).rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    print(f"wrote {written}: {args.to} format, step {step}, {len(files)} files, {size / 1e6:.1f} MB")
    return 0
