"""Megatron-LM runs move to ms_llm and back, with megatron-core's own code in the loop
(tests/helpers/megatron_run_probe.py under torchrun on gloo, PYTHONPATH=.oracles).

1. megatron-core trains a tiny GPT under tensor parallel 2 (GPTModel with the local layer spec, its
   DistributedDataParallel and DistributedOptimizer over torch AdamW: the probe's docstring says why that
   is Megatron-LM's step), saves at step 3 as Megatron-LM does (torch_dist with the distributed
   optimizer's dp_reshardable state, and the legacy per-rank files), and continues to step 6;
2. `ms-llm import-run` converts the torch_dist checkpoint, the train script as --config;
3. ms_llm continues steps 4-6 on the same batches, on torch under dp2 ZeRO-3 (the strategy change: tp2
   Megatron -> dp2 ZeRO-3) and on MindSpore: the losses equal Megatron's own within 1e-5 / 1e-4;
4. `ms-llm export-run --to megatron` of ms_llm's step 5 loads into megatron-core under tp1 (the export
   reshards) the way Megatron-LM's load_checkpoint does, and its step 6 loss equals ms_llm's; imported back
   without --config (the job from the arguments the export saved) it is the same model, settings and tensors.
The legacy files read to the same tensors, the Adam moments from distrib_optim.pt (distributed optimizer)
or from model_optim_rng.pt itself (a twin trained under megatron-core's non-distributed optimizer); bad
inputs are one CheckpointError line each.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ms_llm.checkpoint import Checkpoint
from ms_llm.cli import main as cli
from ms_llm.convert.megatron.read import parse_args
from ms_llm.convert.shell import launch_command
from ms_llm.data import GlobalBatchSampler, load_tokens
from ms_llm.errors import CheckpointError
from ms_llm.job import load_job
from torch_backend.interop import megatron
from torch_backend.interop.megatron_buckets import place
from torch_backend.interop.megatron_files import PeerValue, unpickle
from peer_probe import ProbeProcess
from train_run import train_losses

ROOT = Path(__file__).resolve().parents[2]
ORACLES = ROOT / ".oracles"
PROBE = ROOT / "tests" / "helpers" / "megatron_run_probe.py"
SEED, BATCH, SEQ, STEPS, SAVED = 7, 4, 16, 6, 3
SCRIPT = f"""#!/bin/bash
torchrun --nproc_per_node 2 pretrain_gpt.py \\
  --tensor-model-parallel-size 2 --use-distributed-optimizer --transformer-impl local \\
  --num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \\
  --ffn-hidden-size 64 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope \\
  --rotary-base 10000 --disable-bias-linear --untie-embeddings-and-output-weights \\
  --attention-dropout 0.0 --hidden-dropout 0.0 --vocab-size 128 --make-vocab-size-divisible-by 64 \\
  --seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size {BATCH} --global-batch-size {BATCH} \\
  --train-iters {STEPS} --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 0 \\
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --clip-grad 1.0 --seed {SEED} \\
  --ckpt-format torch_dist --save ckpt --save-interval {SAVED}
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Megatron(ProbeProcess):
    """megatron_run_probe.py under torchrun (2 ranks, tp2) for the module: it trains, then rank 0 waits
    while ms_llm makes the export it loads under tp1, so torch and megatron-core are imported once."""

    def __init__(self, tmp: Path, spec: dict):
        if not (ORACLES / "megatron").is_dir():
            pytest.fail(".oracles/ is missing: run `make oracles`")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "spec.json").write_text(json.dumps({**spec, "out": str(tmp), "then": str(tmp / "load.json")}))
        env = {**os.environ, "PYTHONPATH": str(ORACLES), "OMP_NUM_THREADS": "1"}
        super().__init__("megatron", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                      "--master-addr", "127.0.0.1", "--master-port", str(_port()), str(PROBE),
                                      str(tmp / "spec.json")], tmp, env, tmp / "load.json")

    def result(self, out: Path) -> dict:
        """Rank 0's result.json in `out`, once written (bounded by the probe's own wait)."""
        result = self.read(out / "result.json")
        return {**result, **{key: {int(k): v for k, v in result[key].items()} for key in ("losses", "lrs")}}

    def load(self, out: Path, spec: dict) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        self.send({**spec, "mode": "load", "out": str(out)})
        return self.result(out)


def _train(job: dict, path: Path, backend: str) -> dict[int, float]:
    path.write_text(yaml.safe_dump(job))
    return train_losses(path, path.parent / f"run_{backend}", backend)


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    """Megatron's own run: 6 steps under tp2 on the batches ms_llm's sampler gives, saved at step 3."""
    tmp = tmp_path_factory.mktemp("megatron")
    tokens = tmp / "tokens.bin"
    np.random.default_rng(0).integers(0, 128, 4096).astype(np.uint16).tofile(tokens)
    sampler = GlobalBatchSampler(load_tokens(tokens), SEQ, BATCH, SEED)
    np.save(tmp / "batches.npy", np.stack([sampler.local_batch(k) for k in range(STEPS)]))
    (tmp / "train.sh").write_text(SCRIPT)
    flags = parse_args(launch_command(SCRIPT, "train.sh").args, "train.sh")
    probe = Megatron(tmp / "megatron", {"mode": "train", "flags": flags, "batches": str(tmp / "batches.npy"),
                                        "save_at": SAVED, "plain": True})
    try:
        ours = probe.result(tmp / "megatron")
        yield {"tmp": tmp, "tokens": tokens, "flags": flags, "megatron": ours["losses"], "lrs": ours["lrs"],
               "probe": probe}
    finally:
        probe.stop()


@pytest.fixture(scope="module")
def peer(megatron_run):
    """import-run of Megatron's step 3 and ms_llm's continuation on torch under dp2 ZeRO-3."""
    tmp = megatron_run["tmp"]
    assert cli(["import-run", str(tmp / "megatron" / "torch_dist"), "-o", str(tmp / "imported"),
                "--config", str(tmp / "train.sh")]) == 0
    job = yaml.safe_load((tmp / "imported" / "job.yaml").read_text())
    precision = job["strategy"]["precision"]                 # fp32, as the script trains
    job.update(device="cpu", strategy={"dp": 2, "zero": {"stage": 3}, "precision": precision})
    job["train"].update(data={"source": str(megatron_run["tokens"])}, log_every=1, micro_batch_size=BATCH // 2)
    job["train"]["checkpoint"].update(interval=1, async_save=False)
    return {**megatron_run, "job": job, "torch": _train(job, tmp / "torch.yaml", "torch")}


@pytest.mark.slow
def test_torch_continues_megatron_under_another_strategy(peer):
    """tp2 Megatron -> dp2 ZeRO-3 ms_llm: steps 4-6 equal Megatron's own continuation."""
    assert sorted(peer["torch"]) == [4, 5, 6]
    for step in (4, 5, 6):
        assert peer["torch"][step] == pytest.approx(peer["megatron"][step], abs=1e-5), step
    assert peer["megatron"][6] != pytest.approx(peer["megatron"][4], abs=1e-3)     # the steps moved the loss


@pytest.mark.slow
@pytest.mark.mindspore
def test_mindspore_continues_megatron(peer):
    pytest.importorskip("mindspore")
    job = {**peer["job"], "strategy": {"dp": 1, "precision": peer["job"]["strategy"]["precision"]}}
    losses = _train(job, peer["tmp"] / "mindspore.yaml", "mindspore")
    assert sorted(losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert losses[step] == pytest.approx(peer["megatron"][step], abs=1e-4), step


@pytest.mark.slow
def test_export_loads_in_megatron_with_the_same_next_loss(peer):
    tmp = peer["tmp"]
    step5 = tmp / "run_torch" / "checkpoints" / "step_00000005"
    assert cli(["export-run", str(step5), "--to", "megatron", "-o", str(tmp / "export"),
                "--job", str(tmp / "torch.yaml")]) == 0
    assert (tmp / "export" / "latest_checkpointed_iteration.txt").read_text() == "5"
    flags = {**peer["flags"], "--tensor-model-parallel-size": "1"}
    back = peer["probe"].load(tmp / "reload", {"flags": flags, "batches": str(tmp / "batches.npy"),
                                               "load": str(tmp / "export")})
    assert back["start"] == 5 and back["consumed_samples"] == STEPS * BATCH
    assert back["losses"][6] == pytest.approx(peer["torch"][6], abs=1e-5)
    # ms_llm imports its own export back exactly (the fully_reshardable optimizer layout), without --config:
    # the arguments the export saved give the job's model, strategy and training settings.
    assert cli(["import-run", str(tmp / "export"), "-o", str(tmp / "reimport")]) == 0
    ours, back = load_job(tmp / "torch.yaml"), load_job(tmp / "reimport" / "job.yaml")
    assert dataclasses.replace(back.model, name=ours.model.name) == ours.model
    assert back.strategy == ours.strategy
    for field in ("global_batch_size", "micro_batch_size", "seq_len", "seed", "optimizer", "schedule"):
        assert getattr(back.train, field) == getattr(ours.train, field), field
    with Checkpoint.open(step5) as ckpt, Checkpoint.open(tmp / "reimport" / "checkpoints") as again:
        assert sorted(again.names()) == sorted(ckpt.names())
        for name in ckpt.names():
            assert np.array_equal(again.read_full(name), ckpt.read_full(name)), name
        assert again.step == 5 and again.state["optimizer_step"] == 5


@pytest.mark.slow
def test_legacy_files_and_saved_arguments_read_as_torch_dist(megatron_run):
    """mp_rank_0X/model_optim_rng.pt + distrib_optim.pt (tp shards, memory-mapped) give the torch_dist
    checkpoint's tensors; without --config the job comes from the arguments Megatron-LM saved."""
    root = megatron_run["tmp"] / "megatron"
    assert megatron.detect(root / "torch_dist") and megatron.detect(root / "legacy")
    dist = megatron.read_run(root / "torch_dist", megatron_run["tmp"] / "train.sh")
    legacy = megatron.read_run(root / "legacy")
    assert dataclasses.replace(legacy.model, name="train") == dist.model and legacy.step == dist.step == SAVED
    # The next iteration's rate as megatron-core's OptimizerParamScheduler gave it; 3 batches consumed.
    assert legacy.state == dist.state == {"optimizer_step": 3, "lr": pytest.approx(megatron_run["lrs"][4], rel=1e-12),
                                          "sampler": {"seed": SEED, "epoch": 0, "position": 12, "index": ""}}
    assert sorted(legacy.tensors) == sorted(dist.tensors) and len(dist.tensors) == 3 * 21
    for name, t in dist.tensors.items():
        assert np.array_equal(t.read(), legacy.tensors[name].read()), name
    # The non-distributed optimizer's twin: its state_dict in model_optim_rng.pt (param groups in model
    # order) gives the moments its torch_dist save holds in model space, bit for bit.
    plain_dist = megatron.read_run(root / "plain_torch_dist", megatron_run["tmp"] / "train.sh")
    plain = megatron.read_run(root / "plain_legacy")
    assert plain.state == plain_dist.state == legacy.state and not any("moments" in n for n in plain.notes)
    assert sorted(plain.tensors) == sorted(dist.tensors)
    for name, t in plain_dist.tensors.items():
        assert np.array_equal(t.read(), plain.tensors[name].read()), name


def test_bucket_layout_follows_megatron_core():
    """_ParamAndGradBuffer with a 100-element bucket size: walking (10,), (100,), (32,) in reverse, 32 sits at
    0, 100 at 64 (padded) and closes bucket 0 at 164, 10 opens bucket 1; chunk edges elsewhere refuse it."""
    params = [("a", None, (10,)), ("b", None, (100,)), ("c", None, (32,))]
    assert place(params, [164, 10], [{0, 32, 64, 164}, {0, 10}]) == [(1, 0), (0, 64), (0, 0)]
    assert place(params, [164, 10], [{0, 32, 164}, {0, 10}]) is None             # no chunk edge at 64
    assert place(params, [174], None) is None                                    # one bucket cannot hold them so
    assert place(params, [32, 164], None) is None


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_bad_inputs_are_one_line(megatron_run, tmp_path):
    root = megatron_run["tmp"] / "megatron"
    cases = []
    # A truncated shard: its storage no longer holds the bytes the metadata names.
    bad = _copy(root / "torch_dist", tmp_path / "truncated")
    shard = next((bad / "iter_0000003").glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    cases.append((bad, r"__1_\d\.distcp has \d+"))
    # A pickle weights_only refuses.
    bad = _copy(root / "legacy", tmp_path / "pickle")
    path = bad / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt"
    torch.save({"model": {}, "surprise": Fraction(1, 3)}, path)
    cases.append((bad, r"model_optim_rng\.pt: the pickle refers to fractions\.Fraction, which torch\.load"))
    # A missing tensor-parallel rank.
    bad = _copy(root / "legacy", tmp_path / "rank")
    shutil.rmtree(bad / "iter_0000003" / "mp_rank_01")
    cases.append((bad, "holds 1 tensor-parallel rank folder.*tensor_model_parallel_size 2: a rank's folder is missing"))
    # Optimizer state of another model: distributed-optimizer buffers 64 elements longer.
    bad = _copy(root / "legacy", tmp_path / "other")
    path = bad / "iter_0000003" / "mp_rank_00" / "distrib_optim.pt"
    state = torch.load(path, weights_only=True)
    for flat in state[0].values():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            flat[key] = torch.cat([flat[key], torch.zeros(64)])
        flat["numel_unpadded"] += 64
    torch.save(state, path)
    cases.append((bad, "do not hold this model's parameters in megatron-core's layout: the optimizer state of "
                       "another model"))
    # The non-distributed optimizer's state of another model: a moment of another shape.
    bad = _copy(root / "plain_legacy", tmp_path / "plain_other")
    path = bad / "iter_0000003" / "mp_rank_01" / "model_optim_rng.pt"
    state = unpickle(path, str(path))            # written back without megatron's enums (read as PeerValue)
    state["args"] = argparse.Namespace(**{k: v for k, v in vars(state["args"]).items() if not isinstance(v, PeerValue)})
    state["optimizer"]["state"][3]["exp_avg"] = torch.zeros(7)
    torch.save(state, path)
    cases.append((bad, r"mp_rank_01/model_optim_rng\.pt: the optimizer state of parameter 3 is not "
                       r"'decoder\.layers\.mlp\.linear_fc1\.weight' \[64, 32\] of layer 0"))
    for folder, match in cases:
        with pytest.raises(CheckpointError, match=match) as info:
            megatron.read_run(folder, megatron_run["tmp"] / "train.sh")
        assert "\n" not in str(info.value)
    # Param groups other than megatron-core's defaults: the weights are read, the moments are not, and a
    # note says so.
    state["optimizer"]["param_groups"][1]["wd_mult"] = 0.5
    torch.save(state, path)
    run = megatron.read_run(bad, megatron_run["tmp"] / "train.sh")
    assert [n for n in run.notes if "moments" in n] == [
        "the legacy checkpoint's param groups (wd_mult [1.0, 0.5]) are not megatron-core's default ones for this "
        "model's parameters: the Adam moments were not carried and start from zero"]
    assert len(run.tensors) == 21 and run.state["optimizer_step"] == 0
