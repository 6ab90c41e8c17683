"""The per-rank parts of a checkpoint index (format version 2), written and read.

    step_00000100/
      index.json            the head: config, training state, every tensor's shape, dtype and
                            the ranks whose parts hold its shards (`parts`, as rank ranges), and
                            one record per part (its size, CRC32C and `also`)
      index_00000.json      the shards rank 0 saved: {tensor name: [shard entries]}
      index_00001.json      (one per rank)

A single index grows with ranks x tensors and every rank used to parse all of it to resume:
about 100 ms at 32 ranks of an 80-layer ZeRO-3 model, seconds at a thousand. With parts, a
rank resuming under the layout it saved reads the head, its own part and the parts its record
names in `also` (the ranks that saved the replicated pieces it holds); a reshard or an export
reads, for each tensor it wants, the parts of the ranks that saved it (under pipeline
parallelism a stage's tensors are in that stage's ranks' parts only), a verify all of them. A
part is checked against its record before it is parsed, so a part left over from another save,
truncated or swapped is a CheckpointError naming its file.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Optional, TypeVar

from ms_llm.checkpoint.storage.checksum import ALGORITHMS, DEFAULT as CHECKSUM
from ms_llm.checkpoint.storage.collector import collector_paused
from ms_llm.checkpoint.storage.untrusted import MAX_COUNT, confined, integer, integers, parse_json, read_regular
from ms_llm.errors import CheckpointError

PART_FORMAT = "ms_llm.checkpoint.part"
T = TypeVar("T")


class RawShards(NamedTuple):
    """A tensor's raw shard entries as read (parsed and checked only where used: format.py), and
    the files they came from, as runs of consecutive entries, for error messages."""
    entries: list
    files: list[tuple[str, int]]        # (file, how many consecutive entries it gave)

    def origin(self, i: int) -> tuple[str, int]:
        """The file entry `i` came from and its position there."""
        for file, count in self.files:
            if i < count:
                return file, i
            i -= count
        raise IndexError(i)


def part_name(rank: int) -> str:
    return f"index_{rank:05d}.json"


def parse_rank_ranges(value: object, world_size: int, where: str) -> tuple[range, ...]:
    """A head's `parts` list of [start, stop) rank runs, each in range and after the last."""
    if not isinstance(value, list) or not value:
        raise CheckpointError(f"{where}: 'parts' must be a non-empty list of [start, stop) rank runs")
    runs, last = [], 0
    for run in value:
        start, stop = integers(run, where, "parts", 0, world_size, length=2)
        if not last <= start < stop:
            raise CheckpointError(f"{where}: 'parts' run {list(run)} is empty or not after the run before it")
        runs.append(range(start, stop))
        last = stop
    return tuple(runs)


class Grid(NamedTuple):
    """One dimension of an even split (the head's `split`, commit.even_split): slabs of `size`
    elements along `dim` (-1: of the row-major order); saver i holds slab sum of ((i // stride) %
    count) * weight over `digits` ((stride, count) pairs, weights 1, count, count * count2...)."""
    dim: int
    size: int
    digits: tuple[tuple[int, int], ...]

    @property
    def count(self) -> int:
        return math.prod(c for _, c in self.digits)

    def positions(self, lo: int, hi: int) -> list[int]:
        """For each slab meeting [lo, hi) along this dimension, what its digits add to the position
        of the savers holding it (summed over every split dimension: the saver's position)."""
        out = []
        for k in range(lo // self.size, min((hi - 1) // self.size, self.count - 1) + 1):
            i = 0
            for stride, count in self.digits:
                k, digit = divmod(k, count)
                i += digit * stride
            out.append(i)
        return out


def parse_split(value: object, savers: int, ndim: int, where: str) -> tuple[Grid, ...]:
    """A head's `split` for a tensor of `ndim` dimensions held by `savers` savers: its digits
    number each saver once (their counts multiply to `savers`, every position below it)."""
    if not isinstance(value, list) or not 1 <= len(value) <= max(ndim, 1):
        raise CheckpointError(f"{where}: 'split' is {value!r:.60}; expected a list of [dim, size, digits] per split "
                              "dimension")
    grids = []
    for entry in value:
        if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[2], list) or not entry[2]:
            raise CheckpointError(f"{where}: 'split' entry {entry!r:.60} is not [dim, size, [[stride, count], ...]]")
        dim, size = integers(entry[:2], where, "split", -1, MAX_COUNT)
        digits = tuple(integers(d, where, "split digits", 1, savers, length=2) for d in entry[2])
        grids.append(Grid(dim, size, digits))
    dims = [g.dim for g in grids]
    if (len(set(dims)) != len(dims) or max(dims) >= ndim or (-1 in dims and len(dims) > 1)
            or min(g.size for g in grids) < 1 or math.prod(g.count for g in grids) != savers
            or sum((c - 1) * s for g in grids for s, c in g.digits) >= savers):
        raise CheckpointError(f"{where}: 'split' {value!r:.80} does not number {savers} savers over distinct "
                              f"dimensions in [-1, {ndim - 1}]")
    return tuple(grids)


def savers_meeting(holders: Sequence[range], grids: Sequence[Grid], extents: Sequence[tuple[int, int]]) -> list[range]:
    """The ranks (`holders`, the savers in order) whose cells of an evenly split tensor meet a
    region spanning `extents` ([lo, hi) along each grid's dimension), as runs of one rank."""
    found = {0}
    for grid, (lo, hi) in zip(grids, extents):
        found = {i + j for i in found for j in grid.positions(lo, hi)}
    runs, wanted = [], sorted(found)
    i, k = 0, 0
    for run in holders:
        while k < len(wanted) and wanted[k] < i + len(run):
            rank = run[wanted[k] - i]
            runs.append(range(rank, rank + 1))
            k += 1
        i += len(run)
    return runs


@dataclass(frozen=True)
class PartRecord:
    """What the head says of rank r's part: its size and checksum, and the other parts holding
    the replicated pieces rank r held but did not save (another replica was primary)."""
    nbytes: int
    crc: int
    also: tuple[int, ...]

    def reads(self, rank: int) -> tuple[int, ...]:
        """The parts a same-layout load of `rank` (this record's) reads, each once."""
        return tuple(dict.fromkeys((rank, *self.also)))

    def to_json(self) -> dict:
        return {"bytes": self.nbytes, CHECKSUM: self.crc, "also": list(self.also)}

    @classmethod
    def of(cls, data: bytes, also: Sequence[int]) -> "PartRecord":
        return cls(len(data), ALGORITHMS[CHECKSUM](data, 0), tuple(sorted(also)))

    @classmethod
    def from_json(cls, value: object, rank: int, world_size: int, where: str) -> "PartRecord":
        where = f"{where}: 'parts'[{rank}]"
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: expected a JSON object, got {type(value).__name__}")
        return cls(integer(value.get("bytes"), where, "bytes", 0, MAX_COUNT),
                   integer(value.get(CHECKSUM), where, CHECKSUM, 0, 0xFFFFFFFF),
                   integers(value.get("also"), where, "also", 0, world_size - 1))


def encode_part(rank: int, step: int, shards: dict[str, list[dict]]) -> bytes:
    """A part's bytes: the shards rank `rank` saved, as index shard entries by tensor name."""
    return json.dumps({"format": PART_FORMAT, "step": step, "rank": rank, "tensors": shards},
                      separators=(",", ":")).encode()


class IndexParts:
    """The parts of one committed index, each read, checked against its record and parsed when
    first needed. Entries stay raw JSON; format.ParsedShards parses the shards a load touches."""

    def __init__(self, folder: Path, records: list[PartRecord], step: int, tensors: Mapping[str, object], where: str):
        self.folder, self.records, self.step, self._tensors, self._where = folder, records, step, tensors, where
        self._parts: dict[int, dict[str, list]] = {}
        self._files: dict[int, str] = {}
        self._reads: dict[int, tuple[int, ...]] = {}
        self._once: dict[tuple, object] = {}

    def once(self, key: tuple, parse: Callable[[], T]) -> T:
        """`parse()` of a head value, run once per distinct `key` (the value's text and what else
        its meaning depends on): a layout's tensors repeat the same `parts` runs and `split`, and
        a load parses them for every tensor it reads. A value that fails raises every time."""
        found = self._once.get(key, self)
        if found is self:
            found = self._once[key] = parse()
        return found

    def shards(self, name: str, holders: Optional[Sequence[range]] = None) -> RawShards:
        """Every saved shard of tensor `name`, in rank order, from the parts of `holders` (the
        runs of ranks the head says saved it; every rank for a head that does not say)."""
        ranks = range(len(self.records)) if holders is None else [r for run in holders for r in run]
        if len(self._parts) < len(self.records) and any(rank not in self._parts for rank in ranks):
            with collector_paused():        # else collections between parts traverse all parsed so far
                for rank in ranks:
                    self.part(rank)
        return self._gather(ranks, name)

    def parsed(self) -> list[int]:
        """The ranks whose parts were read so far (what a load needed of the index)."""
        return sorted(self._parts)

    def rank_shards(self, rank: int, name: str) -> RawShards:
        """The shards of `name` in the parts a same-layout load of rank `rank` reads: its own and
        those its record names in `also` (each once, however often a crafted list repeats it)."""
        ranks = self._reads.get(rank)
        if ranks is None:
            if not 0 <= rank < len(self.records):
                return RawShards([], [])
            ranks = self._reads[rank] = self.records[rank].reads(rank)
        return self._gather(ranks, name)

    def _gather(self, ranks, name: str) -> RawShards:
        entries, files = [], []
        for rank in ranks:
            found = self.part(rank).get(name)
            if found:
                entries += found
                file = self._files.get(rank) or self._files.setdefault(rank, str(self.folder / part_name(rank)))
                files.append((file, len(found)))
        return RawShards(entries, files)

    def part(self, rank: int) -> dict[str, list]:
        """Part `rank`'s raw shard entries by tensor name, read and checked when first asked for."""
        part = self._parts.get(rank)
        if part is None:
            part = self._parts[rank] = self._read(rank)
        return part

    def _read(self, rank: int) -> dict[str, list]:
        """Part `rank`, after its size and checksum match its record, its shape checked."""
        record, name = self.records[rank], part_name(rank)
        path = confined(self.folder, name, f"index part of rank {rank}")
        try:
            data = read_regular(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing; {self._where} names {len(self.records)} index parts and this "
                                  "load needs the shards listed in it (copy the whole checkpoint folder)") from None
        if len(data) != record.nbytes or ALGORITHMS[CHECKSUM](data, 0) != record.crc:
            raise CheckpointError(f"{path}: {len(data)} bytes that do not match the size ({record.nbytes}) and "
                                  f"{CHECKSUM} {self._where} records; the part is damaged or from another save")
        with collector_paused():
            tree = parse_json(data, str(path))
        if (not isinstance(tree, dict) or tree.get("format") != PART_FORMAT or tree.get("rank") != rank
                or tree.get("step") != self.step or not isinstance(tree.get("tensors"), dict)):
            raise CheckpointError(f"{path}: not the index part of rank {rank} at step {self.step}")
        tensors = tree["tensors"]
        if not tensors.keys() <= self._tensors.keys() or not set(map(type, tensors.values())) <= {list}:
            for tensor, shards in tensors.items():      # the common case is checked above in one pass
                if tensor not in self._tensors:
                    raise CheckpointError(f"{path}: has shards of tensor {tensor!r}, which {self._where} does not list")
                if not isinstance(shards, list):
                    raise CheckpointError(f"{path}: tensor {tensor!r}: expected a list of shards, got "
                                          f"{type(shards).__name__}")
        return tensors
