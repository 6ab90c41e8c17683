"""Issue 12: property-based tests (hypothesis) of untrusted inputs, bounded and reproducible.

1. Random mutations of the shipped job YAMLs through `ms-llm plan`, `train --dry-run` and
   `convert-strategy`, in process: exit 0, or exit 2 with one error (a line, plus the bullet
   list of a multi-problem StrategyError); never an exception out of `main`.
2. Random mutations of a real checkpoint's index.json, its index parts (re-recorded in the
   head, as a crafted checkpoint would be) and safetensors headers through the reader: a
   CheckpointError or a load that returns the saved values; never another exception, never a
   file opened outside the checkpoint folder (audited by ckpt_guard).

Each test is derandomized (the same examples on every run) with a fixed example count; the
counts are printed and recorded as test properties for the closing note.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import struct
import tempfile
import time
import typing
from pathlib import Path

import crc32c
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_guard import confine_opens
from ckpt_helpers import cut, plan_for, rank_pieces, reference
from ms_llm.checkpoint import Checkpoint, CheckpointWriter, Region, SaveItem, run_config
from ms_llm.checkpoint.storage.format import ShardEntry
from ms_llm.cli import main
from ms_llm.errors import CheckpointError
from ms_llm.job import SECTIONS, job_to_dict, load_job

ROOT = Path(__file__).resolve().parents[2]
BASES = {p.stem: job_to_dict(load_job(p)) for p in sorted((ROOT / "configs" / "train").glob("*.yaml"))}
FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])

# Values a user (or a corrupted file) might put anywhere: boundaries, huge, non-finite, wrong types.
# Strings leave out control characters: an error message that echoes a value unquoted would split its line.
NASTY = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63, 10 ** 12, 1.0e308, -1.0e308, 1e-308, 0.5, float("nan"),
                     float("inf"), -float("inf"), True, False, None, "", "abc", "auto", "../x", "/etc/passwd",
                     [], {}, [1, 2], {"a": 1}]),
    st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=6),   # control characters: see below
    st.lists(st.integers(min_value=-4, max_value=10 ** 13), max_size=4),
)


def _schema_paths(cls, prefix: tuple = ()) -> list[tuple]:
    """Every field of a config section as a key path, nested sections included."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = prefix + (f.name,)
        out.append(path)
        if dataclasses.is_dataclass(hints[f.name]):
            out += _schema_paths(hints[f.name], path)
    return out


FIELDS = [(section,) + p for section, cls in SECTIONS.items() for p in _schema_paths(cls)]


@st.composite
def mutated_job(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(sorted(BASES)))
    job = json.loads(json.dumps(BASES[name]))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(FIELDS))
        node = job
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        if draw(st.integers(0, 9)) == 0:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = draw(NASTY)
    return name, job


def _cli(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, err.getvalue()


def _one_error(command: str, rc: int, err: str) -> None:
    """Exit 0, or exit 2 with one error: one line (and a multi-problem StrategyError's bullets)."""
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err
    if rc == 2:
        lines = [line for line in err.splitlines() if line and not line.startswith("warning:")]
        assert lines and lines[0].startswith(f"ms-llm {command}"), err
        assert all(line.startswith("  - ") for line in lines[1:]), err


CONFIG_EXAMPLES = 500


def test_fuzz_job_yaml_through_the_cli(tmp_path, record_property):
    counts = {"examples": 0, "exit0": 0, "exit2": 0}
    path = tmp_path / "job.yaml"

    @settings(FUZZ, max_examples=CONFIG_EXAMPLES)
    @given(mutated_job(), st.sampled_from(["plan", "train", "convert-strategy"]))
    def run(case, command):
        _, job = case
        path.write_text(yaml.safe_dump(job))
        argv = {"plan": ["plan", str(path)], "train": ["train", str(path), "--dry-run"],
                "convert-strategy": ["convert-strategy", str(path), "--to", "megatron"]}[command]
        rc, err = _cli(argv)
        _one_error(command, rc, err)
        counts["examples"] += 1
        counts[f"exit{rc}"] += 1

    start = time.perf_counter()
    run()
    _report(record_property, "config", counts, start)


# ---- checkpoints -------------------------------------------------------------------------------
PLAN = plan_for({"tp": 2}, 2)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz_ckpt")
    ref = reference()
    for rank in reversed(range(PLAN.world_size)):
        w = CheckpointWriter(root, rank, PLAN.world_size, session="fuzz")
        w.save(1, [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(PLAN, rank).items()],
               state={"step": 1, "sampler": {"epoch": 0, "position": 8}}, rank_state={"rng": bytes([rank])},
               config=run_config(PLAN, "test"))
        w.close()
    return root / "step_00000001"


def _json_paths(node, prefix=()) -> list[tuple]:
    """Paths to every value of a JSON tree (containers included, the root excluded)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    out = []
    for key, value in items:
        out.append(prefix + (key,))
        out += _json_paths(value, prefix + (key,))
    return out


@st.composite
def json_mutation(draw, tree) -> tuple[tuple, object]:
    """(path, new value) for one random place in `tree`; the value None-sentinel `...` deletes."""
    paths = _json_paths(tree)
    path = draw(st.sampled_from(paths))
    value = draw(st.one_of(NASTY, st.just(...), st.sampled_from(["rank_00000.safetensors", "index.json",
                                                               "../step_00000001/rank_00000.safetensors"])))
    return path, value


def _apply(tree, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_part(folder: Path, name: str, tree) -> None:
    """An index part, with its record in the head made to match."""
    data = json.dumps(tree).encode()
    (folder / name).write_bytes(data)
    head = json.loads((folder / "index.json").read_text())
    head["parts"][int(name[6:11])].update(bytes=len(data), crc32c=crc32c.crc32c(data))
    (folder / "index.json").write_text(json.dumps(head))


def _write_header(path: Path, header, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


CKPT_EXAMPLES = 400
LATEST = st.sampled_from(["step_00000001", "step_00000001/", "./step_00000001", "../run/step_00000001", "..", ".",
                          "/etc", "step_00000001/../../x", "step_00000002", "step_00000001\0", "latest"])


def test_fuzz_checkpoint_index_and_headers_through_the_reader(pristine, record_property):
    index = json.loads((pristine / "index.json").read_text())
    parts = {f.name: json.loads(f.read_text()) for f in sorted(pristine.glob("index_*.json"))}
    headers = {f.name: _header(f) for f in sorted(pristine.glob("rank_*.safetensors"))}
    targets = {"index.json": index, "latest": None} | parts | {name: h for name, (h, _) in headers.items()}
    ref = reference()
    pieces = rank_pieces(plan_for({"dp": 2}, 2), 1) | rank_pieces(plan_for({"tp": 2}, 2), 0)
    counts = {"examples": 0, "CheckpointError": 0, "loaded": 0}

    @settings(FUZZ, max_examples=CKPT_EXAMPLES)
    @given(st.data())
    def run(data):
        target = data.draw(st.sampled_from(sorted(targets)))
        tree = json.loads(json.dumps(targets[target]))
        for _ in range(data.draw(st.integers(1, 2)) if tree else 0):
            _apply(tree, *data.draw(json_mutation(tree)))
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "run" / "step_00000001"
            shutil.copytree(pristine, folder)
            if target == "latest":
                (folder.parent / "latest").write_text(data.draw(st.one_of(st.text(max_size=40), LATEST)))
            elif target == "index.json":
                (folder / "index.json").write_text(json.dumps(tree))
            elif target in parts:
                _write_part(folder, target, tree)
            else:
                _write_header(folder / target, tree, headers[target][1])
            with confine_opens(folder.parent) as escapes:
                outcome = _load(folder.parent if target == "latest" else folder, pieces, ref)
            assert escapes == []
        counts["examples"] += 1
        counts[outcome] += 1

    start = time.perf_counter()
    run()
    _report(record_property, "checkpoint", counts, start)


SHARD_EXAMPLES = 600


def test_fuzz_the_one_pass_shard_parse_agrees_with_from_json(record_property):
    """ShardEntry.from_written_json, the one-pass parse a load runs for every piece it plans,
    returns what from_json returns, or None (from_json then decides): over mutated entries of
    both kinds the writer makes (a box, and a ZeRO flat run of one) it never accepts an entry
    from_json refuses, nor reads one differently."""
    shape, itemsize = (4, 6), 4
    written = [ShardEntry("rank_00000.safetensors", "a", Region((0, 0), (2, 6)), 16, (1, 2, 3), start=80).to_json(),
               ShardEntry("rank_00001.safetensors", "a#1", Region((0, 0), (4, 6), (3, 17)), 16, (4, 5, 6, 7)).to_json()]
    counts = {"examples": 0, "one pass": 0, "from_json only": 0, "refused": 0}

    @settings(FUZZ, max_examples=SHARD_EXAMPLES)
    @given(st.data())
    def run(data):
        tree = json.loads(json.dumps(data.draw(st.sampled_from(written))))
        for _ in range(data.draw(st.integers(0, 2))):
            if _json_paths(tree) and data.draw(st.booleans()):
                _apply(tree, *data.draw(json_mutation(tree)))
            else:
                tree[data.draw(st.sampled_from(["flat", "start", "crc32", "crc32c", "block", "extra"]))] = data.draw(NASTY)
        fast = ShardEntry.from_written_json(tree, shape, itemsize)
        try:
            slow = ShardEntry.from_json(tree, "entry", shape, itemsize)
        except CheckpointError:
            slow = None
        assert fast is None or fast == slow, (tree, fast, slow)
        counts["examples"] += 1
        counts["one pass" if fast else "from_json only" if slow else "refused"] += 1

    start = time.perf_counter()
    run()
    assert counts["one pass"] and counts["refused"]
    _report(record_property, "shard_entry", counts, start)


def _load(folder: Path, pieces: dict, ref: dict) -> str:
    """'loaded' when every piece reads back as saved, 'CheckpointError' when refused."""
    try:
        with Checkpoint.open(folder, rank=0) as ckpt:       # rank 0's parts first, then all (Index.exact_shard)
            arrays = ckpt.read_pieces(pieces)
            ckpt.state, ckpt.rank_state(0), ckpt.model_config()
    except CheckpointError:
        return "CheckpointError"
    for name, piece in pieces.items():
        assert np.array_equal(arrays[name], cut(ref[name], piece.region)), name
    return "loaded"


def _report(record_property, what: str, counts: dict, start: float) -> None:
    seconds = time.perf_counter() - start
    record_property(f"fuzz_{what}", {**counts, "seconds": round(seconds, 1)})
    print(f"\nfuzz {what}: {counts} in {seconds:.1f} s, 0 tracebacks")
