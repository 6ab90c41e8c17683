"""Issue 12: property-based tests (hypothesis) of untrusted inputs, bounded and reproducible.

1. Random mutations of the shipped job YAMLs through `ms-llm plan`, `train --dry-run` and
   `convert-strategy`, in process: exit 0, or exit 2 with one error (a line, plus the bullet
   list of a multi-problem StrategyError); never an exception out of `main`.
2. Random mutations of a real checkpoint's index.json, its index parts (re-recorded in the
   head, as a crafted checkpoint would be) and safetensors headers through the reader: a
   CheckpointError or a load that returns the saved values; never another exception, never a
   file opened outside the checkpoint folder (audited by ckpt_guard).
3. YAML built to hurt the loader through `ms-llm plan`: alias chains (expanding to up to 9**14
   values), nesting thousands deep, job names of any text: one error line of bounded length,
   at once; an accepted name is a safe path component.
4. Crafted trainer checkpoints through `ms-llm checkpoint verify`: the training state's fields
   and each rank's generator state mutated, JSON nested up to 100,000 deep in the head or a
   part, a FIFO, a folder or a link to a FIFO in place of any file it reads: exit 0 with OK, or
   exit 2 with one line per problem; never a traceback, a hang or a file opened outside.

Each test is derandomized (the same examples on every run) with a fixed example count; the
counts are printed and recorded as test properties for the closing note.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import signal
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
from ms_llm.job import JOB_NAME, SECTIONS, job_to_dict, load_job

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


# ---- YAML structure and names --------------------------------------------------------------------
YAML_EXAMPLES = 150
NAMES = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=140),
    st.from_regex(r"[A-Za-z0-9._-]{1,130}", fullmatch=True),
    st.sampled_from(["../../x", ".", "..", ".hidden", "a" * 128, "a" * 129, "x" * 100_000, "a/b", "a\\b", "job\n",
                     " job", "job ", "jöb", "123", "null", "~", "-"]),
)


@st.composite
def hostile_yaml(draw, bases: list[str]) -> tuple[str, str]:
    """(kind, YAML text): one of the shipped `bases` with an alias chain or a deep nest as one
    field's value (the chain's anchors defined first, under a key of their own), or another name."""
    job = json.loads(json.dumps(BASES[draw(st.sampled_from(bases))]))
    kind = draw(st.sampled_from(["aliases", "nesting", "name"]))
    if kind == "name":
        job["name"] = draw(NAMES)
        return kind, yaml.safe_dump(job, allow_unicode=True, width=1 << 30)
    path = draw(st.sampled_from(FIELDS))
    node = job
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[path[-1]] = "__HOSTILE__"
    text, head = yaml.safe_dump(job), ""
    if kind == "aliases":
        levels, fan = draw(st.integers(1, 14)), draw(st.integers(1, 9))
        chain = [f"&l0 [{', '.join(['x'] * fan)}]"] + [f"&l{i} [{', '.join([f'*l{i - 1}'] * fan)}]"
                                                        for i in range(1, levels)]
        head, value = f"anchors: [{', '.join(chain)}]\n", f"*l{levels - 1}"
    else:
        depth = draw(st.sampled_from([2, 63, 64, 65, 1000, 100_000]))
        value = "[" * depth + "]" * depth
    return kind, head + text.replace("__HOSTILE__", value)


def test_fuzz_yaml_aliases_nesting_and_names_through_plan(tmp_path, record_property):
    path = tmp_path / "job.yaml"
    bases = []                                      # the shipped jobs `plan` accepts as they are
    for name in sorted(BASES):
        path.write_text(yaml.safe_dump(BASES[name]))
        if _cli(["plan", str(path)])[0] == 0:
            bases.append(name)
    assert bases
    counts = {"examples": 0, "exit0": 0, "exit2": 0}

    @settings(FUZZ, max_examples=YAML_EXAMPLES)
    @given(hostile_yaml(bases))
    def run(case):
        kind, text = case
        path.write_text(text, encoding="utf-8")
        rc, err = _cli(["plan", str(path)])
        _one_error("plan", rc, err)
        assert len(err) < 2_000, (kind, len(err))          # a value quoted in an error is cut short
        if kind == "name":
            name = yaml.safe_load(text)["name"]
            safe = isinstance(name, str) and JOB_NAME.fullmatch(name) is not None and not name.startswith(".")
            assert (rc == 0) == safe, (name, err)          # accepted exactly when it is a safe path component
            assert safe or "name: got " in err, err
        elif kind == "aliases" or text.count("[") > 64:
            assert rc == 2, (kind, err)
        counts["examples"] += 1
        counts[f"exit{rc}"] += 1

    start = time.perf_counter()
    run()
    _report(record_property, "yaml", counts, start)


# ---- trainer checkpoints through `ms-llm checkpoint verify` ---------------------------------------
VERIFY_EXAMPLES = 150
STEP = 6


def _torch_rng() -> bytes:
    """A valid torch CPU generator state (5056 bytes: seed, left, seeded, next, then the words)."""
    state = bytearray(5056)
    struct.pack_into("<QiiQ", state, 0, 3, 620, 1, 5)
    return bytes(state)


@pytest.fixture(scope="module")
def trainer_ckpt(tmp_path_factory) -> Path:
    """A 2-rank checkpoint root of step 6 with the training state a trainer saves and a torch
    generator state per rank, and `latest` naming it."""
    root = tmp_path_factory.mktemp("fuzz_verify") / "checkpoints"
    ref = reference()
    state = {"step": STEP, "optimizer_step": STEP - 1, "lr": 3e-4,
             "sampler": {"seed": 7, "epoch": 0, "position": 8 * STEP, "index": ""},
             "loss_scale": {"mode": "dynamic", "scale": 32768.0, "good_steps": 3, "skipped": 1}}
    for rank in reversed(range(PLAN.world_size)):
        w = CheckpointWriter(root, rank, PLAN.world_size, session="fuzz-verify")
        w.save(STEP, [SaveItem(p, cut(ref[n], p.region)) for n, p in rank_pieces(PLAN, rank).items()],
               state=state, rank_state={"torch_rng": _torch_rng()}, config=run_config(PLAN, "test"))
        w.close()
    rc, err = _cli(["checkpoint", "verify", str(root)])
    assert rc == 0, err
    return root


class _Hung(Exception):
    pass


def _alarm(signum, frame):
    raise _Hung("ms-llm checkpoint verify blocked for 30 s")


def _replace_with(path: Path, kind: str) -> None:
    """`path` (a file the reader opens) as something no reader should block on or read."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:                                               # a link to a FIFO beside it
        os.mkfifo(path.with_name(path.name + ".fifo"))
        path.symlink_to(path.name + ".fifo")


def test_fuzz_trainer_checkpoints_through_checkpoint_verify(trainer_ckpt, record_property):
    folder = trainer_ckpt / f"step_{STEP:08d}"
    head = json.loads((folder / "index.json").read_text())
    parts = sorted(f.name for f in folder.glob("index_*.json"))
    files = ["index.json", "latest", *parts, *sorted(f.name for f in folder.glob("rank_*.safetensors"))]
    state_paths = [("state",) + p for p in _json_paths(head["state"])] + \
                  [("rank_states",) + p for p in _json_paths(head["rank_states"])]
    counts = {"examples": 0, "exit0": 0, "exit2": 0}

    @settings(FUZZ, max_examples=VERIFY_EXAMPLES)
    @given(st.data())
    def run(data):
        kind = data.draw(st.sampled_from(["state", "nesting", "file"]))
        deep = 0
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "checkpoints"
            shutil.copytree(trainer_ckpt, root, symlinks=True)
            step = root / folder.name
            if kind == "state":
                tree = json.loads(json.dumps(head))
                for _ in range(data.draw(st.integers(1, 2))):
                    path = data.draw(st.sampled_from(state_paths))
                    if all(_has(tree, path[:i]) for i in range(1, len(path) + 1)):
                        _apply(tree, path, data.draw(st.one_of(NASTY, st.just(...))))
                (step / "index.json").write_text(json.dumps(tree))
            elif kind == "nesting":
                target = data.draw(st.sampled_from(["index.json", *parts]))
                tree = json.loads((step / target).read_text())
                _apply(tree, data.draw(st.sampled_from(_json_paths(tree))), "__DEEP__")
                deep = data.draw(st.sampled_from([1, 60, 65, 1000, 100_000]))
                text = json.dumps(tree).replace('"__DEEP__"', "[" * deep + "]" * deep).encode()
                (step / target).write_bytes(text)
                if target != "index.json":               # re-recorded in the head, as a crafted part would be
                    tree = json.loads((step / "index.json").read_text())
                    tree["parts"][int(target[6:11])].update(bytes=len(text), crc32c=crc32c.crc32c(text))
                    (step / "index.json").write_text(json.dumps(tree))
            else:
                name = data.draw(st.sampled_from(files))
                _replace_with(root / name if name == "latest" else step / name,
                              data.draw(st.sampled_from(["fifo", "folder", "link to a fifo"])))
            previous = signal.signal(signal.SIGALRM, _alarm)
            signal.alarm(30)
            try:
                with confine_opens(root) as escapes:
                    out, err = io.StringIO(), io.StringIO()
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                        rc = main(["checkpoint", "verify", str(root)])
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
            assert escapes == []
        err = err.getvalue()
        assert rc in (0, 2) and "Traceback" not in err, (kind, rc, err)
        assert all(line.startswith("ms-llm checkpoint") for line in err.splitlines() if line), err
        assert rc == 2 or out.getvalue().startswith("OK: "), (kind, out.getvalue())
        if kind == "file" or deep > 64:
            assert rc == 2, (kind, deep, out.getvalue())
        counts["examples"] += 1
        counts[f"exit{rc}"] += 1

    start = time.perf_counter()
    run()
    assert counts["exit0"] and counts["exit2"]
    _report(record_property, "verify", counts, start)


def _has(tree, path: tuple) -> bool:
    """Whether `path` still leads somewhere in `tree` (an earlier mutation may have replaced a parent)."""
    node = tree
    for key in path:
        in_list = isinstance(node, list) and isinstance(key, int) and key < len(node)
        if not (in_list or isinstance(node, dict) and key in node):
            return False
        node = node[key]
    return True


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
