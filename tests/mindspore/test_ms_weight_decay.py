"""train.optimizer.weight_decay_1d false on MindSpore: the compiled step (TrainCell + AdamW, what
semi_auto_parallel compiles on Ascend) and the shared ZeRO engine (msrun, dp2, ZeRO-2) equal
torch.optim.AdamW with Megatron-LM's param groups (no decay on biases and 1-D parameters) within
1e-5 over 3 steps; the engine's update on MindSpore (MsOps) equals torch's on ranged decay."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

ms = pytest.importorskip("mindspore")
pytestmark = pytest.mark.mindspore

from ms_llm.config.model import ModelConfig
from ms_llm.config.train import OptimizerConfig
from ms_llm.mindspore.model import LossCell, Transformer
from ms_llm.mindspore.optim import AdamW
from ms_llm.mindspore.step import TrainCell
from ms_llm.mindspore.zero import MsOps
from ms_llm.nodes import free_port
from ms_llm.zero.protocol import SGD, AdamW as AdamWHyper
from torch_backend.zero.ops import TorchOps

from decay_cases import MICRO, MODEL, OPT, SEED, batches
from decay_reference import reference, worst

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def references():
    """Megatron's groups, and decay on everything as the control (1e-3 away on the norm weights)."""
    return reference(), reference(exempt=False)[0]


def test_graph_step_exempts_1d_parameters(references):
    ms.set_context(mode=ms.GRAPH_MODE)
    net = Transformer(ModelConfig(**MODEL))
    net.init_weights(SEED)
    loss_cell = LossCell(net)
    opt = OptimizerConfig(**OPT)
    step = TrainCell(loss_cell, AdamW(loss_cell.trainable_params(), opt), MICRO, opt.grad_clip)
    losses = []
    for rows in batches():
        micro = rows.reshape(MICRO, -1, rows.shape[-1]).astype(np.int32)
        loss, _ = step(ms.Tensor(micro[:, :, :-1]), ms.Tensor(micro[:, :, 1:]), ms.Tensor(1.0, ms.float32),
                       ms.Tensor(opt.lr, ms.float32))
        losses.append(float(loss.asnumpy()))
    got = {n: p.asnumpy() for n, p in net.parameters_and_names()}
    (want, want_losses), control = references
    assert worst(got, want) <= 1e-5
    assert np.abs(np.array(losses) - want_losses).max() <= 1e-5
    assert worst(got, control) > 1e-3


@pytest.mark.slow
def test_zero_engine_at_dp2_exempts_1d_parameters(references, tmp_path):
    env = dict(os.environ, GLOG_v="3")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    cmd = [shutil.which("msrun", path=env["PATH"]), "--worker_num=2", "--local_worker_num=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", f"--log_dir={tmp_path / 'logs'}",
           "--join=True", "python", str(ROOT / "tests" / "helpers" / "decay_ms_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT / "tests", capture_output=True, text=True, timeout=600, env=env)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("worker_*.log")))
    assert proc.returncode == 0, logs
    got = load_file(str(tmp_path / "zero2.safetensors"))
    (want, _), control = references
    assert worst(got, want) <= 1e-5
    assert worst(got, control) > 1e-3


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_engine_update_decays_only_the_given_ranges_as_torch_does(kind):
    """MsOps (no writable views: it concatenates) against TorchOps (in-place views) on a flat
    segment whose decay skips three pieces, two steps; the whole range is the same as no ranges."""
    rng = np.random.default_rng(0)
    p, g1, g2 = (rng.standard_normal(40).astype(np.float32) for _ in range(3))
    hp = AdamWHyper(0.9, 0.95, 1e-8, 0.1) if kind == "adamw" else SGD(0.1)
    decay = ((0, 10), (13, 30), (35, 38))
    results = []
    for ops_, as_t in ((MsOps(), ms.Tensor), (TorchOps(torch.device("cpu")), torch.from_numpy)):
        for ranges in (decay, None, ((0, 40),)):
            x, m, v = as_t(p.copy()), as_t(np.zeros(40, np.float32)), as_t(np.zeros(40, np.float32))
            for step, g in enumerate((g1, g2), 1):
                if kind == "adamw":
                    x, m, v = ops_.adamw(x, as_t(g.copy()), m, v, step, 0.05, hp, ranges)
                else:
                    x = ops_.sgd(x, as_t(g.copy()), 0.05, hp, ranges)
            results.append(x.asnumpy() if hasattr(x, "asnumpy") else x.numpy())
    ms_ranged, ms_none, ms_whole, t_ranged, t_none, t_whole = results
    assert np.abs(ms_ranged - t_ranged).max() <= 1e-6
    assert np.array_equal(ms_none, ms_whole) and np.array_equal(t_none, t_whole)
    moved = np.abs(ms_ranged - ms_none)         # undecayed pieces differ from decay everywhere, the rest not
    assert moved[np.r_[10:13, 30:35, 38:40]].min() > 1e-4 and moved[np.r_[0:10, 13:30, 35:38]].max() == 0
