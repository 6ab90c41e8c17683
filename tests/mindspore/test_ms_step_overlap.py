"""The MindSpore compiled step in two graphs (step.TrainCell: forward and backward, then the
update), stand-alone on CPU at world 1, built as the worker builds it:

- the two graphs give the losses, norms and training state of the same cells compiled as one
  graph, bit for bit;
- the shared loop's fence contract: the step calls the fence after its forward and backward
  (the gradient buffers already hold this step's gradients) and before anything writes the
  training state, so an overlapped snapshot of the last step's state, copying beside that
  forward and backward, is saved with the last step's values exactly.
"""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import nn  # noqa: E402

from ms_llm.checkpoint import Checkpoint, CheckpointWriter  # noqa: E402
from ms_llm.job import job_from_dict  # noqa: E402
from ms_llm.run import RunFolder, lr_at  # noqa: E402
from ms_llm.strategy.plan import plan  # noqa: E402

pytestmark = pytest.mark.mindspore
JOB = {"model": {"name": "tiny_overlap", "vocab_size": 96, "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                 "num_kv_heads": 2, "ffn_hidden_size": 64, "max_seq_len": 16, "dtype": "float32"},
       "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
       "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 16, "steps": 3, "seed": 5,
                 "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.5}}}
STEPS = 3


class OneGraph(nn.Cell):
    """The step's two cells called from one construct: MindSpore compiles them as one graph."""

    def __init__(self, forward_backward: nn.Cell, update: nn.Cell):
        super().__init__(auto_prefix=False)
        self.forward_backward, self.update = forward_backward, update

    def construct(self, inputs, labels, scale, lr):
        return self.forward_backward(inputs, labels, scale), self.update(lr)


def batches() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    return [rng.integers(0, 96, (4, 17)).astype(np.int32) for _ in range(STEPS)]


def graph_step(tmp_path):
    from ms_llm.mindspore.worker import build_graph_step

    job = job_from_dict(JOB)
    p = plan(job.model, job.strategy, job.train)
    return build_graph_step(job, p, RunFolder(tmp_path), rank=0, world=1, ascend=False), p


def state_values(state) -> dict[str, np.ndarray]:
    return {name: t.asnumpy().copy() for name, (_, t) in state.held(create=False).items()}


@pytest.fixture(scope="module", autouse=True)
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")


def test_two_graphs_give_the_one_graph_step_bit_for_bit(tmp_path):
    from ms_llm.mindspore.state import MsTrainerState

    split, p = graph_step(tmp_path / "split")
    whole, _ = graph_step(tmp_path / "whole")
    one = OneGraph(whole.cell.forward_backward, whole.cell.update)
    fences = []
    for k, rows in enumerate(batches()):
        loss, norm = split(k, rows, lambda: fences.append(k))
        ref_loss, ref_norm = (t.asnumpy() for t in one(*whole._inputs(rows, 1.0, lr_at(k, whole.train))))
        assert (loss, norm) == (float(ref_loss), float(ref_norm.reshape(-1)[0]))
    assert fences == list(range(STEPS))
    assert norm > JOB["train"]["optimizer"]["grad_clip"]          # the clip is engaged
    ours, ref = state_values(MsTrainerState(split, p, 0, 1)), state_values(MsTrainerState(whole, p, 0, 1))
    assert ours.keys() == ref.keys()
    assert [n for n in ours if not np.array_equal(ours[n], ref[n])] == []


def test_the_snapshot_beside_the_next_forward_backward_holds_the_last_steps_values(tmp_path):
    from ms_llm.mindspore.state import MsTrainerState

    step, p = graph_step(tmp_path / "run")
    state = MsTrainerState(step, p, 0, 1)
    grads = step.cell.forward_backward.grads
    first, second = batches()[:2]
    step(0, first, lambda: None)
    saved = state_values(state)                       # the state after step 1, which the checkpoint must hold
    first_grads = [g.asnumpy().copy() for g in grads]
    writer = CheckpointWriter(tmp_path / "checkpoints", 0, 1, session="overlap")
    held = state.held(create=False)
    pieces = {n: piece for n, (piece, _) in held.items()}
    stats = writer.save(1, state.save_items(pieces, {n: t for n, (_, t) in held.items()}), overlap=True)
    seen = {}

    def fence() -> None:
        now = state_values(state)
        seen["written"] = [n for n in saved if not np.array_equal(now[n], saved[n])]
        seen["new_grads"] = all(not np.array_equal(g.asnumpy(), f) for g, f in zip(grads, first_grads))
        writer.fence()
        seen["copied"] = stats.copied.is_set()
    step(1, second, fence)
    writer.close()
    assert seen == {"written": [], "new_grads": True, "copied": True}
    after = state_values(state)
    assert [n for n in saved if np.array_equal(after[n], saved[n])] == []     # the update, after the fence
    with Checkpoint.open(tmp_path / "checkpoints", rank=0) as ckpt:
        loaded = ckpt.read_pieces(pieces)
    assert loaded.keys() == saved.keys()
    assert [n for n in saved if not np.array_equal(loaded[n], saved[n])] == []
