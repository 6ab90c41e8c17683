"""The optimizer and lr-schedule sections every MindFormers layout shares (mindformers.py reads
r1.x / 2.x, mindformers_pynative.py the pynative trainer's)."""
from __future__ import annotations

from ms_llm.convert.common import Fields

LR_SCHEDULES = {"CosineWithWarmUpLR": "cosine", "LinearWithWarmUpLR": "linear", "ConstantWarmUpLR": "constant"}
OPTIMIZERS = ("AdamW", "AdamWeightDecay", "FP32StateAdamWeightDecay", "FusedAdamWeightDecay")


def read_schedule(f: Fields, ls: str, lr: float | None, dataset_steps: int,
                  warnings: list[str]) -> tuple[dict, int, float]:
    """The lr schedule section `ls` (its rate wins over the optimizer's `lr`, None when unset), and
    the step count: total_steps, or with -1 ("the dataset's") `dataset_steps` (epochs * training
    samples // global batch; 0 when unknown)."""
    if not f.has(ls):
        peak = 3e-4 if lr is None else lr
        return {"warmup_steps": 0, "decay": "constant"}, dataset_steps, peak
    kind = f.get(f"{ls}.type", str, ir="train.schedule.decay")
    if kind not in LR_SCHEDULES:
        warnings.append(f"{ls}.type = {kind}: read as cosine decay")
    peak = f.get(f"{ls}.learning_rate", float, 3e-4 if lr is None else lr, ir="train.optimizer.lr")
    if lr is not None and peak != lr:
        warnings.append(f"{ls}.learning_rate = {peak:g} overrides optimizer.learning_rate = {lr:g}, as in MindFormers")
    steps = f.get(f"{ls}.total_steps", int, -1, ir="train.steps")
    steps = dataset_steps if steps < 1 else steps
    if f.has(f"{ls}.warmup_steps"):
        warmup = f.get(f"{ls}.warmup_steps", int, ir="train.schedule.warmup_steps")
    else:
        ratio = f.get(f"{ls}.warmup_ratio", float, 0.0, ir="train.schedule.warmup_steps")
        warmup = round(ratio * steps) if steps > 0 else 0
        if ratio and steps <= 0:
            warnings.append(f"{ls}.warmup_ratio = {ratio} of a dataset-sized run: the step count is unknown here; "
                            "no warmup")
    end = f.get(f"{ls}.lr_end", float, 0.0, ir="train.schedule.min_lr_ratio")
    # warmup_from_zero: the *WithWarmUpLR schedules get global_step before the optimizer increments it, so
    # update k runs at lr*(k-1)/warmup; the first update at rate 0. Without warmup the flag changes nothing:
    # left false, so a job without warmup round-trips unchanged.
    schedule = {"warmup_steps": warmup, "decay": LR_SCHEDULES.get(kind, "cosine"),
                "min_lr_ratio": end / peak if peak else 0.0, "warmup_from_zero": warmup > 0}
    f.sources["train.optimizer.lr"] = f"{ls}.learning_rate"
    return schedule, max(steps, 0), peak
