"""ms_llm checkpoint -> a MindFormers 2.1 training run in its 2.x layout (`ms-llm export-run --to
mindformers2`); `import-run` reads it back through mindformers.py, which recognises both layouts.

The checkpoint is one rank's save by mindformers.checkpoint.save_checkpoint (use_legacy_format: False):
    <out>/latest_checkpointed_iteration.txt        the step
    <out>/iteration_<8 digits>/model-0000000-0000001.safetensors   weights, named as the 2.x network holds
                                                   them (mindformers_names: linear_qkv and linear_fc1 fused)
                              opt-0000000-0000001.safetensors     adam_m.<name>, adam_v.<name>, global_step
                              common.json          epoch_num, step_num, global_step, loss_scale,
                                                   global_batch_size, consumed_samples
No metadata.json: for one rank MindFormers' loader (mindformers.checkpoint.load_checkpoint) builds it
from the files, and reshards the whole tensors to the run's parallel config. With --job,
<out>/mindformers2.yaml is the job's 2.x YAML (`convert-strategy --to mindformers2`) with
`checkpoint: {load_path: <out>, no_load_optim: False}`, which makes MindFormers resume from it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from ms_llm.checkpoint import Checkpoint, split_optim_name
from ms_llm.checkpoint.storage.safetensors_io import write_file
from ms_llm.config.schema import to_dict
from ms_llm.config.train import TrainConfig
from ms_llm.convert import from_job
from ms_llm.convert.mindformers import write2
from ms_llm.errors import CheckpointError
from ms_llm.job import dump_yaml, job_from_dict, load_section, parse_yaml
from ms_llm.mindspore.interop import mindformers_names as mcore
from ms_llm.mindspore.interop.mindformers import MODEL_KEY, MOMENTS, TRACKER, read_run  # noqa: F401 (peer API)

YAML = "mindformers2.yaml"
_PREFIXES = {v: k for k, v in MOMENTS.items()}


def detect(folder: Path) -> bool:
    """Never: mindformers.py recognises and reads both layouts (`--format mindformers`)."""
    return False


def write_run(ckpt: Checkpoint, out: Path, job: Optional[dict]) -> Path:
    out, step, state = Path(out), ckpt.step, ckpt.state
    model = ckpt.model_config()
    mcore.check_model(model)
    folder = out / f"iteration_{step:08d}"
    if folder.exists():
        raise CheckpointError(f"{folder}: exists; write to another folder")
    train = load_section("train", job.get("train", {})) if job else TrainConfig()
    groups: dict[tuple[str, str], dict[int, str]] = {}          # (moment prefix, 2.x name) -> {part: ms_llm name}
    for ours in ckpt.names():
        owned = split_optim_name(ours)
        if owned and owned[0] not in _PREFIXES:
            continue                                   # fp32 masters: MindFormers keeps none apart
        name, part = mcore.mcore_name(owned[1] if owned else ours)
        groups.setdefault((_PREFIXES[owned[0]] + "." if owned else "", name), {})[part] = ours
    sources: dict[str, list[str]] = {}
    for (prefix, name), parts in groups.items():
        key, want = prefix + name, mcore.part_count(name)
        if sorted(parts) != list(range(want)):
            raise CheckpointError(f"{ckpt.folder}: {key} fuses {want} tensors; the checkpoint holds "
                                  f"{sorted(parts.values())}")
        sources[key] = [parts[i] for i in range(want)]

    def entry(key: str) -> tuple[str, str, tuple[int, ...]]:
        first = ckpt.entry(sources[key][0])
        rows = sum(ckpt.entry(n).shape[0] for n in sources[key])
        return key, first.dtype, (rows, *first.shape[1:]) if len(sources[key]) > 1 else tuple(first.shape)

    def fetch(key: str) -> np.ndarray:
        if key == "global_step":
            return np.array([optimizer_step], dtype=np.int32)
        names = sources[key]
        return ckpt.read_full(names[0]) if len(names) == 1 else \
            mcore.fuse(key, [ckpt.read_full(n) for n in names], model)

    optimizer_step = int(state.get("optimizer_step", step))
    weights = [entry(k) for k in sources if k.split(".", 1)[0] not in MOMENTS]
    moments = [entry(k) for k in sources if k.split(".", 1)[0] in MOMENTS] + [("global_step", "int32", (1,))]
    folder.mkdir(parents=True)
    metadata = {"format": "safetensors", MODEL_KEY: json.dumps(to_dict(model))}
    write_file(str(folder / "model-0000000-0000001.safetensors"), weights, fetch, metadata)
    write_file(str(folder / "opt-0000000-0000001.safetensors"), moments, fetch, metadata)
    epoch = int((state.get("sampler") or {}).get("epoch", 0)) + 1
    common = {"epoch_num": epoch, "step_num": step, "global_step": optimizer_step,
              "loss_scale": float((state.get("loss_scale") or {}).get("scale", 1.0)),
              "global_batch_size": train.global_batch_size, "consumed_samples": step * train.global_batch_size}
    (folder / "common.json").write_text(json.dumps(common, indent=4))
    if job:
        (out / YAML).write_text(_yaml(job, out))
    (out / TRACKER).write_text(str(step))                 # last, as MindFormers' save finalizes
    return folder


def _yaml(job: dict, out: Path) -> str:
    """The job's 2.x YAML, resuming from `out` with MindFormers' 2.x checkpoint loader."""
    config = job_from_dict(job, None, "--job: ")
    s = config.strategy
    canonical = from_job(config, s.world_size() if s.dp != -1 else s.tp * s.cp * s.pp)   # dp -1: one replica
    written = write2.write(canonical.job, canonical.world_size)
    header = "".join(line + "\n" for line in written.text.splitlines() if line.startswith("#"))
    doc = parse_yaml(written.text, YAML)
    doc.pop("load_checkpoint", None)
    doc["checkpoint"] = {"load_path": str(out.resolve()), "no_load_optim": False}
    return header + dump_yaml(doc)
