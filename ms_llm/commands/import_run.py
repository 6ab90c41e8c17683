"""Import a Megatron-LM, DeepSpeed, torchtitan or MindFormers run to continue it with ms_llm: its
checkpoint (weights, Adam moments and step count, learning-rate position, loss scale and data position
where the peer records them) becomes an ms_llm checkpoint under DIR/checkpoints, and its config
(--config) an ms_llm job, DIR/job.yaml, that resumes from that checkpoint on either backend, under
any strategy and world size. The format is recognised from the files unless --format names it.

examples:
  ms-llm import-run megatron/checkpoints -o runs/imported --config train_llama3_8b.sh
  ms-llm import-run ds_ckpt/global_step100 -o runs/imported --config ds_config.json --format deepspeed
  ms-llm train runs/imported/job.yaml --backend mindspore
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ms_llm.checkpoint.interop.peers import PEERS, detect_format, peer_module
from ms_llm.checkpoint.interop.run_state import ForeignRun, write_foreign_run
from ms_llm.checkpoint.reshard import layout_plan
from ms_llm.checkpoint.storage.commit import step_dir
from ms_llm.config.model import ModelConfig
from ms_llm.config.schema import to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.errors import CheckpointError, ConfigError
from ms_llm.job import dump_yaml, job_from_dict, job_name_from
from ms_llm.run.saved_state import check_saved_state
from ms_llm.strategy.ir import ParallelStrategy

JOB_FILE = "job.yaml"
CHECKPOINTS = "checkpoints"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the peer's run folder or checkpoint folder")
    parser.add_argument("-o", "--output", required=True, metavar="DIR",
                        help=f"folder to write {JOB_FILE} and {CHECKPOINTS}/ into")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="the peer's own config: Megatron-LM train script or arguments, DeepSpeed JSON (the model "
                             "from the checkpoint), torchtitan TOML or launch script, MindFormers YAML; without it "
                             f"{JOB_FILE} holds the model and ms_llm's default training settings")
    parser.add_argument("--format", choices=tuple(PEERS), default=None, help="default: recognised from the files")
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace the {JOB_FILE} and the checkpoint step DIR already holds")


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.src), Path(args.output)
    config = Path(args.config) if args.config else None
    if config is not None and not config.is_file():
        raise ConfigError(f"--config: {config} is not a file")
    fmt = args.format or detect_format(src)
    try:
        foreign = peer_module(fmt).read_run(src, config)
        job_path, folder, notes = write_import(foreign, out, overwrite=args.overwrite)
    except OSError as exc:
        raise CheckpointError(f"import-run: {exc.filename or out}: {exc.strerror or exc}") from None
    for note in foreign.notes + notes:
        print(f"note: {note}", file=sys.stderr)
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    print(f"wrote {job_path} and {folder} ({fmt} step {foreign.step}: {len(foreign.tensors)} tensors, "
          f"{size / 1e6:.1f} MB); continue it with: ms-llm train {job_path}")
    return 0


def write_import(run: ForeignRun, out: Path, *, overwrite: bool = False) -> tuple[Path, Path, list[str]]:
    """DIR/checkpoints/step_N from `run` and DIR/job.yaml that resumes from it (train.checkpoint.load
    names the checkpoints, absolute, so the job trains from any folder). Everything is checked
    before anything is written. Returns the job file, the step folder and notes for the user."""
    job_path, root = out / JOB_FILE, out / CHECKPOINTS
    if not overwrite:
        for path in (job_path, step_dir(root, run.step)):
            if path.exists():
                raise CheckpointError(f"{out}: already holds {path.relative_to(out)}; pass --overwrite to replace "
                                      "it, or import into another folder")
    check_saved_state({"step": run.step, **run.state}, {}, run.step, f"{run.source} checkpoint's training state")
    doc, notes = job_document(run, root.resolve())
    job = job_from_dict(doc, None, f"{run.source} config as an ms_llm job: ")
    _same_shapes(job.model, run.model, run.source)
    _same_data_position(run, job.train)
    if job.train.steps <= run.step:
        notes.append(f"train.steps is {job.train.steps}, not past the imported step {run.step}: training would stop "
                     f"at once; raise it (ms-llm train {job_path} --steps N)")
    folder = write_foreign_run(run, root, overwrite=overwrite)
    job_path.write_text(dump_yaml(doc))
    return job_path, folder, notes


def job_document(run: ForeignRun, checkpoints: Path) -> tuple[dict, list[str]]:
    """The peer's config as a job (or, without one, the model with ms_llm's default settings and
    as many steps again as the defaults run), loading the imported checkpoints."""
    notes = []
    if run.job is not None:
        doc = dict(run.job)
    else:
        steps = run.step + TrainConfig().steps
        train = {"steps": steps}
        sampler = run.state.get("sampler")
        if sampler:                              # the data order the peer's position counts in
            train["seed"] = sampler["seed"]
            if sampler["epoch"] == 0 and run.step and sampler["position"] % run.step == 0:
                train["global_batch_size"] = sampler["position"] // run.step
        doc = {"name": job_name_from(f"{run.source}_{run.model.name}"), "model": to_dict(run.model, full=True),
               "train": train}
        notes.append(f"no --config: {JOB_FILE} holds the model with ms_llm's default strategy and training settings "
                     f"(train.steps {steps}); set the batch, learning rate and data before training")
    train = dict(doc.get("train") or {})
    train["checkpoint"] = {**(train.get("checkpoint") or {}), "load": str(checkpoints)}
    doc["train"] = train
    return doc, notes


def _same_shapes(ours: ModelConfig, theirs: ModelConfig, source: str) -> None:
    """The job's model has the checkpoint's tensors, name for name and shape for shape."""
    want = layout_plan(theirs, ParallelStrategy(dp=1), 1).params
    have = layout_plan(ours, ParallelStrategy(dp=1), 1).params
    for name in [*want, *(n for n in have if n not in want)]:       # the model's order: embedding first
        a = list(have[name].shape) if name in have else "absent"
        b = list(want[name].shape) if name in want else "absent"
        if a != b:
            raise ConfigError(f"model: the {source} config gives {name} {a}, the checkpoint holds {b}; "
                              "a config of another model?")


def _same_data_position(run: ForeignRun, train: TrainConfig) -> None:
    """The peer's data position is the job's step: same seed and, in the first epoch, as many
    global batches consumed as the checkpoint's steps (the resume holds the two to each other and
    would refuse the import otherwise)."""
    sampler = run.state.get("sampler")
    if not sampler:
        return
    if sampler["seed"] != train.seed:
        raise ConfigError(f"train.seed: the {run.source} run's data order used seed {sampler['seed']}, the job "
                          f"{train.seed}; keep the seed to continue on the same data")
    if sampler["epoch"] == 0 and sampler["position"] // train.global_batch_size != run.step:
        raise ConfigError(f"train.global_batch_size: the {run.source} run consumed {sampler['position']} samples, "
                          f"{sampler['position'] // train.global_batch_size} steps of {train.global_batch_size}, but "
                          f"its checkpoint is of step {run.step}; give the peer's global batch size")
