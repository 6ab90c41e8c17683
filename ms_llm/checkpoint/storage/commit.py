"""Atomic commit of a checkpoint folder written by many ranks, and retention.

    <root>/latest                 text file naming the newest committed folder
    <root>/step_00000200.tmp/     being written: rank_*.safetensors, then rank_*.json
    <root>/step_00000100/         committed: has index.json

Each rank writes its shard file into the temporary folder, fsyncs it, then publishes a
small fragment (rank_XXXXX.json) by write-fsync-rename, after its index part (index_XXXXX.json,
index_parts.py: the shards it saved). The committing rank waits for every rank's fragment of
this save session, writes index.json, the head that names the parts, fsyncs, renames the
folder to its final name, fsyncs the root, then replaces `latest` the same way.
A crash at any point leaves `latest` naming the previous complete checkpoint; nothing
partial is ever named by it. Ranks coordinate only through the file system, so the same
code serves both backends and a shared file system across nodes.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ms_llm.checkpoint.storage.checksum import DEFAULT as CHECKSUM
from ms_llm.checkpoint.storage.collector import collector_paused
from ms_llm.checkpoint.storage.format import INDEX, check_coverage, encode_head
from ms_llm.checkpoint.storage.index_parts import PartRecord, part_name
from ms_llm.checkpoint.storage.untrusted import confined, read_regular
from ms_llm.durable import fsync_dir, write_durable
from ms_llm.errors import CheckpointError
from ms_llm.processes import die_with_parent

log = logging.getLogger("ms_llm.checkpoint")
LATEST = "latest"
CHILD_SHARDS = 16384                # commit_beside commits in a child process from this many shards on
_CHILD = "import sys; from ms_llm.checkpoint.storage.commit import main; sys.exit(main(sys.argv[1:]))"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}.tmp"


def fragment_name(rank: int) -> str:
    return f"rank_{rank:05d}.json"


def write_fragment(folder: Path, rank: int, fragment: dict, part: bytes) -> None:
    """Publish this rank's index part, then its fragment, which records the part's size and
    checksum for the head: the commit never reads the shards themselves."""
    write_durable(confined(folder, part_name(rank), "an index part"), part)
    record = PartRecord.of(part, ()).to_json()
    write_durable(folder / fragment_name(rank), json.dumps({**fragment, "part": record}).encode())


def _read_fragments(folder: Path, world_size: int, session: str, have: dict[int, dict]) -> bool:
    """Add to `have` the fragments of `session` that arrived since the last call: each is
    parsed once, however many times the wait for the slowest rank polls. True once all are."""
    for rank in range(world_size):
        if rank in have:
            continue
        try:
            with collector_paused():
                frag = json.loads((folder / fragment_name(rank)).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if frag.get("session") == session:    # else left over from an earlier, crashed attempt
            have[rank] = frag
    return len(have) == world_size


def index_head(frags: list[dict], step: int, world_size: int, folder: Path) -> bytes:
    """index.json from every rank's fragment, in rank order (rank 0's training state is the
    shared one); the ranks wrote their parts beside. Each tensor's saved elements must add up to
    its size, and the head names the ranks whose parts hold its shards, as [start, stop) runs,
    and for a tensor split evenly over them how (`split`, see even_split)."""
    tensors: dict[str, dict] = {}
    elements: dict[str, int] = {}
    holders: dict[str, list[list[int]]] = {}
    cuts: dict[str, list[Optional[list[list[int]]]]] = {}
    for frag in frags:
        rank, saved_cuts = frag["rank"], frag.get("cuts", {})
        for name, info in frag["tensors"].items():
            entry = tensors.setdefault(name, info)
            if entry["shape"] != info["shape"] or entry["dtype"] != info["dtype"]:
                raise CheckpointError(f"tensor {name!r}: rank {rank} saved shape {info['shape']} "
                                      f"{info['dtype']}, another rank {entry['shape']} {entry['dtype']}")
            runs = holders.setdefault(name, [])
            if runs and runs[-1][1] == rank:
                runs[-1][1] = rank + 1
            else:
                runs.append([rank, rank + 1])
            cuts.setdefault(name, []).append(saved_cuts.get(name))
        for name, count in frag["elements"].items():
            elements[name] = elements.get(name, 0) + count
    for name, info in tensors.items():
        check_coverage(name, tuple(info["shape"]), elements.get(name, 0), f"step {step}")
        info["parts"] = holders[name]
        split = even_split(cuts[name], tuple(info["shape"]))
        if split is not None:
            info["split"] = split
    records = [PartRecord(f["part"]["bytes"], f["part"][CHECKSUM], tuple(sorted(also)))
               for f, also in zip(frags, _also(frags, folder, holders))]
    first = frags[0]
    return encode_head(step, world_size, first["config"], first["state"],
                       {f["rank"]: f["rank_state"] for f in frags if f.get("rank_state")}, tensors, records,
                       first.get("stats", {}))


def even_split(savers: list[Optional[list[list[int]]]], shape: tuple[int, ...]) -> Optional[list]:
    """How a tensor's savers tile it evenly, or None. `savers` holds each saver's cuts in rank
    order (Region.cuts; None for a saver whose shards are no one box). Even: every saver cuts
    the same dimensions (-1: ZeRO slices of the row-major order) into slabs of one size per
    dimension (the last possibly shorter), each cell of that grid held once, and a saver's slab
    index along each dimension a mixed-radix number whose digits are digits of its position i
    among the savers: sum of ((i // stride) % count) * weight, weights 1, count, count * count2...
    That is how a device mesh lays out tensor parallel, ZeRO-3 and both together. The head keeps
    [[dim, size, [[stride, count], ...]], ...] (digits by weight), and a reshard reads the parts
    of the savers whose cells meet what it wants, not every saver's (index_parts.savers_meeting)."""
    n = len(savers)
    if n < 2 or None in savers:
        return None
    if len(savers[0]) == 1:             # the common case, slabs in rank order, in one pass
        dim, lo, size = savers[0][0][0], savers[0][0][1], savers[0][0][2] - savers[0][0][1]
        extent = math.prod(shape) if dim == -1 else shape[dim]
        if lo == 0 and size >= 1 and (n - 1) * size < extent <= n * size and all(
                len(cuts) == 1 and cuts[0][0] == dim and cuts[0][1] == i * size
                and cuts[0][2] == min((i + 1) * size, extent) for i, cuts in enumerate(savers)):
            return [[dim, size, [[1, n]]]]
    try:
        cuts = np.array(savers, dtype=np.int64)         # (saver, cut dimension, (dim, lo, hi)): a few numpy
    except (ValueError, OverflowError):                 # passes, where a 1024-rank job has 1024 savers a tensor
        return None
    if cuts.ndim != 3 or not cuts.shape[1] or (cuts[:, :, 0] != cuts[0, :, 0]).any():
        return None
    dims = [int(d) for d in cuts[0, :, 0]]
    extents = np.array([math.prod(shape) if d == -1 else shape[d] for d in dims], dtype=np.int64)
    lo, hi = cuts[:, :, 1], cuts[:, :, 2]
    sizes = (hi - lo).max(axis=0)
    if (sizes < 1).any() or (lo % sizes).any() or (hi <= lo).any() or (hi != np.minimum(lo + sizes, extents)).any():
        return None
    cells, counts = lo // sizes, -(-extents // sizes)
    if math.prod(int(c) for c in counts) != n or len(np.unique(np.ravel_multi_index(cells.T, counts))) != n:
        return None
    digits, stride = [], 1              # (stride, count, position of its dimension, weight)
    while stride < n:
        moved = np.flatnonzero(cells[stride])
        if len(moved) != 1:
            return None
        pos = int(moved[0])
        weight = int(cells[stride, pos])
        steps = np.arange(1, (n - 1) // stride + 1)
        expected = np.zeros((len(steps), len(dims)), dtype=np.int64)
        expected[:, pos] = steps * weight
        wrong = np.flatnonzero((cells[steps * stride] != expected).any(axis=1))
        count = int(wrong[0]) + 1 if len(wrong) else len(steps) + 1
        digits.append((stride, count, pos, weight))
        stride *= count
    split = []
    for pos, dim in enumerate(dims):
        mine, radix = sorted((w, s, c) for s, c, q, w in digits if q == pos), 1
        for weight, _, count in mine:
            if weight != radix:
                return None
            radix *= count
        if radix != counts[pos]:
            return None
        split.append([dim, int(sizes[pos]), [[s, c] for _, s, c in mine]])
    numbered = np.zeros_like(cells)
    for s, c, pos, w in digits:
        numbered[:, pos] += np.arange(n) // s % c * w
    return split if np.array_equal(numbered, cells) else None


def _also(frags: list[dict], folder: Path, holders: dict[str, list[list[int]]]) -> list[set[int]]:
    """For each rank, the other ranks that saved the replicated pieces it holds (its fragment's
    `held`): the parts its same-layout load reads besides its own. Only the parts of the ranks
    that saved the held tensors are read (under data parallelism the weights' savers are the
    first replica's ranks, however many replicas hold them), and only when some rank holds one."""
    held = {h["name"] for f in frags for h in f.get("held", [])}
    if not held:
        return [set() for _ in frags]

    def key(name: str, box: dict) -> tuple:
        return name, tuple(box["offsets"]), tuple(box["sizes"]), tuple(box.get("flat", ()))
    saved_by = {}
    for rank in sorted({r for name in held for start, stop in holders.get(name, ()) for r in range(start, stop)}):
        for name, shards in json.loads((folder / part_name(rank)).read_bytes())["tensors"].items():
            if name in held:
                saved_by.update((key(name, s), rank) for s in shards)
    return [{saved_by[k] for h in f.get("held", []) if (k := key(h["name"], h)) in saved_by} - {f["rank"]}
            for f in frags]


def commit_beside(root: Path, step: int, world_size: int, session: str, timeout_s: float = 1800.0,
                  shards: int = 0) -> Path:
    """`commit`, in a child process when the ranks saved about `shards` shards (CHILD_SHARDS or
    more: about 50 ms of reading their fragments, at the 3 us a shard a 32-rank ZeRO-3 commit
    took): parsing every rank's fragment and encoding the head hold the interpreter lock
    throughout, and the training thread, which takes it between its ops, would wait. In
    bench/checkpoint.py (e) the forward and backward beside a 32-rank ZeRO-3 commit (69,408
    shards) took 1.74x their time alone with the commit on rank 0's writer thread, 1.46x with it in
    the child. The child dies with this process; its CheckpointError comes back as this one's."""
    if shards < CHILD_SHARDS:
        return commit(root, step, world_size, session, timeout_s)
    cmd = die_with_parent([sys.executable, "-c", _CHILD, "--timeout", str(timeout_s), "--", str(root), str(step),
                           str(world_size), session])
    try:
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        raise CheckpointError(f"{tmp_dir(root, step)}: the commit's child process did not finish in "
                              f"{timeout_s + 60:.0f} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise CheckpointError(lines[-1] if lines else f"{tmp_dir(root, step)}: the commit's child process "
                              f"exited with {done.returncode}")
    return step_dir(root, step)


def commit(root: Path, step: int, world_size: int, session: str, timeout_s: float = 1800.0) -> Path:
    """Wait for all fragments of `session`, write the index, publish the folder. Returns it."""
    root = Path(root)
    folder = tmp_dir(root, step)
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    frags: dict[int, dict] = {}
    while not _read_fragments(folder, world_size, session, frags):
        if time.monotonic() > deadline:
            have = sorted(p.name for p in folder.glob("rank_*.json")) if folder.exists() else []
            raise CheckpointError(f"{folder}: gave up after {timeout_s:.0f} s waiting for {world_size} rank "
                                  f"fragments of this save (have {have}); a rank died or could not write")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    with collector_paused():
        head = index_head([frags[r] for r in range(world_size)], step, world_size, folder)
    write_durable(folder / INDEX, head)
    for rank in range(world_size):
        (folder / fragment_name(rank)).unlink()
    fsync_dir(folder)
    final = step_dir(root, step)
    if final.exists():                        # the same step saved again (a resumed run)
        old = final.with_name(final.name + ".old")
        os.replace(final, old)
        os.replace(folder, final)
        shutil.rmtree(old)
    else:
        os.replace(folder, final)
    fsync_dir(root)
    write_durable(root / LATEST, final.name.encode())
    return final


def committed(root: Path) -> list[Path]:
    """Committed checkpoint folders under `root`, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / INDEX).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def latest(root: Path) -> Optional[Path]:
    """The folder `latest` names, or None when nothing was committed under `root`. A pointer
    that leaves `root` is refused; one naming a folder that is gone (removed by hand) is
    logged and the newest committed folder is used instead."""
    pointer = Path(root) / LATEST
    try:
        name = read_regular(confined(root, LATEST, "the 'latest' pointer")).decode().strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{pointer}: cannot read ({exc})") from None
    folder = confined(root, name, f"'{LATEST}' (the pointer to the newest checkpoint)")
    if not _STEP_DIR.match(name) or not (folder / INDEX).is_file():
        newest = committed(root)
        log.warning("%s names %r, which is not a committed checkpoint folder (removed by hand?); using %s",
                    pointer, name, newest[0].name if newest else "none")
        return newest[0] if newest else None
    return folder


def retain(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` committed folders (always the one `latest` names) and drop
    temporary folders of steps older than the newest commit (crashed saves)."""
    folders = committed(root)
    if not folders:
        return
    newest_step = int(_STEP_DIR.match(folders[0].name).group(1))
    pinned = latest(root)
    for old in folders[keep_last:]:
        if old != pinned:
            shutil.rmtree(old, ignore_errors=True)
    for p in Path(root).glob("step_*.tmp"):
        if int(p.name[5:-4]) < newest_step:
            shutil.rmtree(p, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    """`commit` for commit_beside: the error, if any, as the last line of stderr."""
    parser = argparse.ArgumentParser(prog="ms_llm.checkpoint.storage.commit", description=commit.__doc__)
    parser.add_argument("root", type=Path)
    parser.add_argument("step", type=int)
    parser.add_argument("world_size", type=int)
    parser.add_argument("session")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    try:
        commit(args.root, args.step, args.world_size, args.session, args.timeout)
    except CheckpointError as exc:
        print(str(exc).replace("\n", " "), file=sys.stderr)
        return 2
    return 0
