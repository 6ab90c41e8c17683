"""The MindSpore compiled step in two graphs (step.TrainCell: forward and backward, then the
update), stand-alone on CPU at world 1, built as the worker builds it: the shared loop's fence
contract. The step calls the fence once, after its forward and backward (the gradient buffers
already hold this step's gradients) and before anything writes the training state, so an
overlapped snapshot of the last step's state, copying beside that forward and backward, is saved
with the last step's values exactly. Each cell lists the weights its graph reads: a graph loaded
from the compile cache binds those alone (test_ms_compile_cache loads them and trains the same
losses; test_ms_worker's torch reference checks the step's numbers).
"""
import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from ms_llm.checkpoint import Checkpoint, CheckpointWriter  # noqa: E402
from ms_llm.job import job_from_dict  # noqa: E402
from ms_llm.run import RunFolder  # noqa: E402
from ms_llm.strategy.plan import plan  # noqa: E402

pytestmark = pytest.mark.mindspore
JOB = {"model": {"name": "tiny_overlap", "vocab_size": 64, "hidden_size": 16, "num_layers": 1, "num_heads": 2,
                 "num_kv_heads": 1, "ffn_hidden_size": 32, "max_seq_len": 8, "dtype": "float32"},
       "strategy": {"dp": 1, "precision": {"param_dtype": "float32", "compute_dtype": "float32"}},
       "train": {"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 8, "steps": 2, "seed": 5,
                 "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.5}}}


def state_values(state) -> dict[str, np.ndarray]:
    return {name: t.asnumpy().copy() for name, (_, t) in state.held(create=False).items()}


def test_the_snapshot_beside_the_next_forward_backward_holds_the_last_steps_values(tmp_path):
    from ms_llm.mindspore.state import MsTrainerState
    from ms_llm.mindspore.worker import build_graph_step

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    job = job_from_dict(JOB)
    p = plan(job.model, job.strategy, job.train)
    step = build_graph_step(job, p, RunFolder(tmp_path / "run"), rank=0, world=1, ascend=False)
    weights = {q.name for q in step.optimizer.parameters}
    for cell in (step.cell.forward_backward, step.cell.update):
        assert weights <= cell.parameters_dict().keys(), type(cell).__name__
    state = MsTrainerState(step, p, 0, 1)
    grads = step.cell.forward_backward.grads
    rng = np.random.default_rng(1)
    first, second = (rng.integers(0, 64, (4, 9)).astype(np.int32) for _ in range(2))
    fences = []
    step(0, first, lambda: fences.append(0))
    saved = state_values(state)                       # the state after step 1, which the checkpoint must hold
    first_grads = [g.asnumpy().copy() for g in grads]
    writer = CheckpointWriter(tmp_path / "checkpoints", 0, 1, session="overlap")
    held = state.held(create=False)
    pieces = {n: piece for n, (piece, _) in held.items()}
    stats = writer.save(1, state.save_items(pieces, {n: t for n, (_, t) in held.items()}), overlap=True)
    seen = {}

    def fence() -> None:
        fences.append(1)
        now = state_values(state)
        seen["written"] = [n for n in saved if not np.array_equal(now[n], saved[n])]
        seen["new_grads"] = all(not np.array_equal(g.asnumpy(), f) for g, f in zip(grads, first_grads))
        writer.fence()
        seen["copied"] = stats.copied.is_set()
    _, norm = step(1, second, fence)
    writer.close()
    assert fences == [0, 1] and seen == {"written": [], "new_grads": True, "copied": True}
    assert norm > JOB["train"]["optimizer"]["grad_clip"]          # the clip is engaged
    after = state_values(state)
    assert [n for n in saved if np.array_equal(after[n], saved[n])] == []     # the update, after the fence
    with Checkpoint.open(tmp_path / "checkpoints", rank=0) as ckpt:
        loaded = ckpt.read_pieces(pieces)
    assert loaded.keys() == saved.keys()
    assert [n for n in saved if not np.array_equal(loaded[n], saved[n])] == []
