"""The checkpoint index: where every byte of every tensor lives.

    step_00000100/
      index.json                  the head
      index_00000.json            the shards rank 0 saved (index_parts.py; one per rank)
      rank_00000.safetensors      what rank 0 held (only the copies it is primary for)
      rank_00001.safetensors      (one per rank)

index.json (the head) holds the format version, the step, the run config it was saved under
(model, strategy, world size, backend), the training state (step, LR scheduler, data sampler,
loss scaler: plain JSON, identical on every rank), each rank's own state (RNG states), every
tensor's global shape, dtype and the layout it was saved under, the ranks whose parts hold its
shards (`parts`) and, when they tile it evenly, how (`split`: commit.even_split), and a record
of each rank's index part. A part lists, for every tensor, the shards its rank saved: file, key
in that file, region in the global tensor (boxes.Region), where its bytes start in the file
(`start`, so a load reads no safetensors header; the header says the same for peer readers,
and verify holds the two to each other) and checksums of consecutive blocks of its bytes, under
the name of their algorithm (checksum.py: "crc32c"; checkpoints written before it hold "crc32",
and no `start`). Version 1 (still read) kept the shards in index.json itself. Tensor names are
Hugging Face LLaMA names for weights; optimizer states are `optim.<state>.<param name>` (see
`optim_name`).
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from ms_llm.checkpoint.storage.boxes import Region, intersect
from ms_llm.checkpoint.storage.checksum import ALGORITHMS, DEFAULT
from ms_llm.checkpoint.storage.index_parts import (Grid, IndexParts, PartRecord, RawShards, parse_rank_ranges,
                                          parse_split, savers_meeting)
from ms_llm.checkpoint.storage.safetensors_io import DTYPES, storage_dtype
from ms_llm.checkpoint.storage.untrusted import MAX_COUNT, CheckedOnUse, integer, integers
from ms_llm.config.schema import to_dict
from ms_llm.errors import CheckpointError
from ms_llm.strategy.ir import MAX_WORLD_SIZE

FORMAT = "ms_llm.checkpoint"
VERSION = 2                         # the head and per-rank parts; READS lists what this reader opens
READS = (1, 2)
INDEX = "index.json"
OPTIM_PREFIX = "optim."


def optim_name(state: str, param: str) -> str:
    """Checkpoint name of optimizer state `state` (exp_avg, exp_avg_sq, master, ...) of `param`."""
    return f"{OPTIM_PREFIX}{state}.{param}"


def split_optim_name(name: str) -> Optional[tuple[str, str]]:
    """(state, param) for an optimizer-state name, None for a model tensor."""
    if not name.startswith(OPTIM_PREFIX):
        return None
    state, _, param = name[len(OPTIM_PREFIX):].partition(".")
    return state, param


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


class ShardEntry(NamedTuple):
    """One saved shard of a tensor (a NamedTuple: a load builds one per piece it plans)."""
    file: str
    key: str
    region: Region
    block: int                      # bytes per checksum block
    sums: tuple[int, ...]           # one per block of the shard's bytes; empty for foreign files
    checksum: str = DEFAULT         # their algorithm (checksum.ALGORITHMS)
    start: Optional[int] = None     # file offset of its first byte; None: the file's header says

    def to_json(self) -> dict:
        where = {} if self.start is None else {"start": self.start}
        return {"file": self.file, "key": self.key, **self.region.to_json(), **where, "block": self.block,
                self.checksum: list(self.sums)}

    @classmethod
    def from_json(cls, data: object, where: str, shape: tuple[int, ...], itemsize: int) -> "ShardEntry":
        """Parse and check one shard of a tensor of `shape`: its box lies inside the tensor and
        it has one checksum per block of its bytes (none for foreign files), under one algorithm."""
        data = _mapping(data, where)
        file, key = data.get("file"), data.get("key")
        if type(file) is not str or type(key) is not str:
            raise CheckpointError(f"{where}: 'file' and 'key' must be strings, got {file!r} and {key!r}")
        offsets = integers(data.get("offsets"), where, "offsets", length=len(shape))
        sizes = integers(data.get("sizes"), where, "sizes", length=len(shape))
        numel = 1
        for d, (o, n, total) in enumerate(zip(offsets, sizes, shape)):
            if o + n > total:
                raise CheckpointError(f"{where}: dimension {d} spans [{o}, {o + n}), outside the tensor's {total}")
            numel *= n
        flat = data.get("flat")
        if flat is not None:
            a, b = integers(flat, where, "flat", length=2)
            if not a <= b <= numel:
                raise CheckpointError(f"{where}: 'flat' is {flat}; expected 0 <= start <= stop <= {numel}")
            region = Region(offsets, sizes, (a, b))
        else:                           # the common case, its integers checked above
            region = Region.of_ints(offsets, sizes)
        named = [a for a in ALGORITHMS if a in data]
        if len(named) > 1:
            raise CheckpointError(f"{where}: checksums under both {named[0]!r} and {named[1]!r}; expected one")
        algorithm = named[0] if named else DEFAULT
        sums = integers(data.get(algorithm), where, algorithm, 0, 0xFFFFFFFF)
        block = integer(data.get("block"), where, "block", 1 if sums else 0)
        if sums and len(sums) != -(-region.numel * itemsize // block):
            raise CheckpointError(f"{where}: {len(sums)} checksums for {region.numel * itemsize} bytes in blocks "
                                  f"of {block}")
        start = data.get("start")
        if start is not None:
            start = integer(start, where, "start", 8, MAX_COUNT)
        return cls(file, key, region, block, sums, algorithm, start)

    @classmethod
    def from_written_json(cls, data: object, shape: tuple[int, ...], itemsize: int) -> Optional["ShardEntry"]:
        """What from_json returns for an entry as ms_llm writes it (file, key, offsets, sizes,
        an optional flat range, start, block and its crc32c sums, every value well formed), in
        one pass; None for anything else, which from_json then parses or says what is wrong with.
        A load parses one entry per piece it plans: this pass is most of that."""
        if type(data) is not dict:
            return None
        file, key, offsets, sizes = data.get("file"), data.get("key"), data.get("offsets"), data.get("sizes")
        flat, start, block, sums = data.get("flat"), data.get("start"), data.get("block"), data.get(DEFAULT)
        if (len(data) != 6 + (flat is not None) + (start is not None) or type(file) is not str
                or type(key) is not str or start is not None and (type(start) is not int or not 8 <= start <= MAX_COUNT)
                or type(offsets) is not list or type(sizes) is not list or len(offsets) != len(shape)
                or len(sizes) != len(shape) or type(block) is not int or not 1 <= block <= MAX_COUNT
                or type(sums) is not list or not sums):
            return None
        numel = 1
        for o, s, d in zip(offsets, sizes, shape):
            if type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > d:
                return None
            numel *= s
        if flat is None:
            region = Region.of_ints(tuple(offsets), tuple(sizes))
        elif (type(flat) is list and len(flat) == 2 and type(flat[0]) is int and type(flat[1]) is int
              and 0 <= flat[0] <= flat[1] <= numel):
            region = Region(tuple(offsets), tuple(sizes), (flat[0], flat[1]))
        else:
            return None
        if (len(sums) != -(-region.numel * itemsize // block) or not set(map(type, sums)) <= {int}
                or min(sums) < 0 or max(sums) > 0xFFFFFFFF):
            return None
        return cls(file, key, region, block, tuple(sums), DEFAULT, start)


@dataclass
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = ""                # how it was split when saved (TensorLayout.describe), informative
    shards: Sequence[ShardEntry] = field(default_factory=list)     # ParsedShards when read from an index

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return storage_dtype(self.dtype).itemsize

    @classmethod
    def from_json(cls, name: str, data: object, where: str,
                  parts: Optional[IndexParts] = None) -> "TensorEntry":
        """Parse and check a tensor entry: a supported dtype, a shape of bounded size, shards
        inside it that together hold every element (in `parts` for a version-2 head)."""
        path, where = where, f"{where}: tensor {name!r}"
        data = _mapping(data, where)
        shape = integers(data.get("shape"), where, "shape")
        if math.prod(shape) > MAX_COUNT:
            raise CheckpointError(f"{where}: 'shape' {list(shape)} has more than {MAX_COUNT} elements")
        dtype = data.get("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{where}: 'dtype' is {dtype!r}; expected one of {', '.join(DTYPES)}")
        layout = data.get("layout", "")
        if not isinstance(layout, str):
            raise CheckpointError(f"{where}: 'layout' must be a string, got {type(layout).__name__}")
        if parts is not None:
            saved = SavedBy(parts, name, data.get("parts"), data.get("split"), shape, where)
            return cls(name, shape, dtype, layout, ParsedShards(saved.shards, path, name, shape, dtype, saved.narrow))
        shards = data.get("shards")
        if not isinstance(shards, list):
            raise CheckpointError(f"{where}: 'shards' must be a list, got {type(shards).__name__}")
        return cls(name, shape, dtype, layout,
                   ParsedShards(lambda: RawShards(shards, [(path, len(shards))]), path, name, shape, dtype))

    def exact_shard(self, region: Region) -> Optional[int]:
        """The index of the shard saved with exactly `region` (what a same-strategy load wants), or None."""
        if isinstance(self.shards, ParsedShards):
            return self.shards.find(region)
        return next((k for k, s in enumerate(self.shards) if s.region == region), None)

    def shards_near(self, region: Region) -> list[tuple[int, ShardEntry]]:
        """The shards whose box meets `region`'s box, each with its position in the list it was
        found in (all the tensor's shards, or those of the savers a split narrows the read to)."""
        return [(k, s) for k, s in self.maybe_near(region)
                if intersect(region.offsets, region.sizes, s.region.offsets, s.region.sizes)]

    def maybe_near(self, region: Region) -> list[tuple[int, ShardEntry]]:
        """shards_near without its last check, for a caller that intersects the boxes anyway:
        a few shards that miss the region may remain."""
        return self.shards.maybe_near(region) if isinstance(self.shards, ParsedShards) else list(enumerate(self.shards))


class SavedBy:
    """Which index parts hold a tensor's shards, from its head entry's `parts` (the savers' rank
    runs) and `split` (how they tile it, commit.even_split), each parsed when a load first needs
    it: a same-layout load, which reads its own parts, needs neither."""

    def __init__(self, parts: IndexParts, name: str, holders: object, split: object, shape: tuple[int, ...],
                 where: str):
        self.parts, self.name, self._holders, self.split, self.shape, self.where = (parts, name, holders, split,
                                                                                     shape, where)

    @cached_property
    def holders(self) -> Optional[tuple[range, ...]]:
        """The savers' rank runs; None for a head that does not name them (every part holds some)."""
        if self._holders is None:
            return None
        return self.parts.once(("parts", str(self._holders)),
                               lambda: parse_rank_ranges(self._holders, len(self.parts.records), self.where))

    @cached_property
    def grids(self) -> tuple[Grid, ...]:
        savers = sum(len(run) for run in self.holders)
        return self.parts.once(("split", str(self.split), savers, len(self.shape)),
                               lambda: parse_split(self.split, savers, len(self.shape), self.where))

    def shards(self) -> RawShards:
        """Every saved shard, from every saver's part."""
        return self.parts.shards(self.name, self.holders)

    def narrow(self, region: Region) -> Optional[RawShards]:
        """The shards `region` may meet, from the parts of the savers whose cells meet it only
        (None without a split, or without holders to number)."""
        if self.split is None or self.holders is None:
            return None
        extents = [region.extent(grid.dim, self.shape) for grid in self.grids]
        return self.parts.shards(self.name, savers_meeting(self.holders, self.grids, extents))


class ParsedShards(Sequence):
    """A saved tensor's shards, each parsed and checked (ShardEntry.from_json) when first used:
    a load parses the shards it reads from (`find`, `maybe_near`), where a tensor of a
    thousand-rank job has a thousand. The raw entries come from `source` when first needed
    (a version-2 index reads its parts then), with where each came from for error messages.
    Going through all of them also checks that together they hold every element of the tensor
    (check_coverage)."""

    def __init__(self, source: Callable[[], RawShards], where: str, name: str,
                 shape: tuple[int, ...], dtype: str, narrow: Optional[Callable[[Region], Optional[RawShards]]] = None):
        self._source, self._narrow, self._where, self._name = source, narrow, where, name
        self._shape, self._itemsize = shape, storage_dtype(dtype).itemsize
        self._parsed: dict[int, ShardEntry] = {}
        self._covered = False

    @cached_property
    def _raw(self) -> RawShards:
        return self._source()

    def __len__(self) -> int:
        return len(self._raw.entries)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(len(self))[i]]
        i = range(len(self))[i]
        shard = self._parsed.get(i)
        if shard is None:
            raw = self._raw
            shard = self._parsed[i] = parse_shard(raw, i, self._name, self._shape, self._itemsize)
        return shard

    def __iter__(self) -> Iterator[ShardEntry]:
        shards = [self[i] for i in range(len(self))]
        if not self._covered:
            check_coverage(self._name, self._shape, sum(s.region.numel for s in shards), self._where)
            self._covered = True
        return iter(shards)

    def maybe_near(self, region: Region) -> list[tuple[int, ShardEntry]]:
        """The shards that may meet `region`'s box, parsed, with their positions: all but those
        whose raw box is well formed, inside the tensor and away from it (a shard this read does
        not touch is not parsed; the read itself checks that the shards it touches cover what it
        wants). For an evenly split tensor whose shards are not all read yet, only the parts of
        the savers whose cells meet the region are read (`narrow`), positions counting in those."""
        lo, hi = region.offsets, tuple(o + s for o, s in zip(region.offsets, region.sizes))
        raw = self._narrow(region) if self._narrow is not None and "_raw" not in self.__dict__ else None
        if raw is None:
            return [(i, self[i]) for i, entry in enumerate(self._raw.entries)
                    if not _surely_apart(entry, lo, hi, self._shape)]
        return [(i, parse_shard(raw, i, self._name, self._shape, self._itemsize))
                for i, entry in enumerate(raw.entries) if not _surely_apart(entry, lo, hi, self._shape)]

    def find(self, region: Region) -> Optional[int]:
        """`TensorEntry.exact_shard`, comparing the raw JSON first (find_raw); the match stays parsed."""
        found = find_raw(self._raw, region, self._name, self._shape, self._itemsize)
        if found is None:
            return None
        self._parsed[found[0]] = found[1]
        return found[0]


def _surely_apart(raw: object, lo: tuple[int, ...], hi: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether a raw shard entry's box is well formed, inside the tensor, and misses [lo, hi)."""
    if type(raw) is not dict:
        return False
    offsets, sizes = raw.get("offsets"), raw.get("sizes")
    if type(offsets) is not list or type(sizes) is not list or not len(offsets) == len(sizes) == len(lo):
        return False
    apart = False
    for o, s, l, h, d in zip(offsets, sizes, lo, hi, shape):
        if type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > d:
            return False
        apart = apart or o >= h or o + s <= l
    return apart


def parse_shard(shards: RawShards, i: int, name: str, shape: tuple[int, ...], itemsize: int) -> ShardEntry:
    """Raw shard entry `i` of tensor `name`, checked; errors name its file and position."""
    raw = shards.entries[i]
    shard = ShardEntry.from_written_json(raw, shape, itemsize)
    if shard is None:
        file, position = shards.origin(i)
        shard = ShardEntry.from_json(raw, f"{file}: tensor {name!r} shard {position}", shape, itemsize)
    return shard


def find_raw(shards: RawShards, region: Region, name: str, shape: tuple[int, ...],
             itemsize: int) -> Optional[tuple[int, ShardEntry]]:
    """The position and parsed entry of the raw shard saved with exactly `region`, or None. The
    raw JSON is compared first and the match parsed and checked before it is used (a bool there
    compares equal to an int)."""
    offsets, sizes, flat = list(region.offsets), list(region.sizes), list(region.flat) if region.flat else None
    for i, raw in enumerate(shards.entries):
        if (isinstance(raw, dict) and raw.get("offsets") == offsets and raw.get("sizes") == sizes
                and raw.get("flat") == flat):
            shard = parse_shard(shards, i, name, shape, itemsize)
            if shard.region == region:
                return i, shard
    return None


@dataclass
class Index:
    step: int
    world_size: int
    config: dict[str, Any]          # {"model": ..., "strategy": ..., "backend": ...}
    state: dict[str, Any]           # training state shared by all ranks
    rank_states: dict[int, dict[str, Any]]
    tensors: Mapping[str, TensorEntry]
    save_stats: dict[str, float] = field(default_factory=dict)
    parts: Optional[IndexParts] = None      # version 2: each rank's shards, read when first needed

    def exact_shard(self, name: str, region: Region, rank: Optional[int] = None) -> Optional[ShardEntry]:
        """The shard of `name` saved with exactly `region`, or None. Given the loading `rank`, a
        version-2 index looks only in the parts that rank reads (index_parts.IndexParts.rank_shards),
        so a rank resuming under the layout it saved parses no other rank's part; a region saved
        by another rank is then read through the intersection of boxes, the same bytes."""
        entry = self.tensors[name]
        if self.parts is not None and rank is not None:
            found = find_raw(self.parts.rank_shards(rank, name), region, name, entry.shape, entry.itemsize)
            return None if found is None else found[1]
        k = entry.exact_shard(region)
        return None if k is None else entry.shards[k]

    @classmethod
    def from_json(cls, data: dict, where: str, folder: Path) -> "Index":
        """A parsed index.json of `folder` (version 1, or a version-2 head whose parts are there)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not an ms_llm checkpoint index (format field missing)")
        version = data.get("version")
        if version not in READS:
            raise CheckpointError(f"{where}: format version {version!r} but this ms_llm reads versions "
                                  f"{', '.join(map(str, READS))}; convert it with the ms_llm that wrote it")
        step = integer(data.get("step"), where, "step")
        world_size = integer(data.get("world_size"), where, "world_size", 1, MAX_WORLD_SIZE)
        config = _mapping(data.get("config"), f"{where}: 'config'")
        state = _mapping(data.get("state"), f"{where}: 'state'")
        ranks = _mapping(data.get("rank_states"), f"{where}: 'rank_states'")
        tensors = _mapping(data.get("tensors"), f"{where}: 'tensors'")
        rank_states = {}
        for r, s in ranks.items():
            if not (r.isascii() and r.isdigit()):
                raise CheckpointError(f"{where}: 'rank_states' key {r!r} is not a rank number")
            rank_states[int(r)] = _mapping(s, f"{where}: 'rank_states' of rank {r}")
        for value, what in [(state, "state")] + [(s, f"rank_states[{r}]") for r, s in rank_states.items()]:
            _check_decodes(value, f"{where}: '{what}'")
        parts = None
        if version == 2:
            records = data.get("parts")
            if not isinstance(records, list) or len(records) != world_size:
                raise CheckpointError(f"{where}: 'parts' must list one record per rank ({world_size}), got "
                                      f"{type(records).__name__}")
            parts = IndexParts(folder, [PartRecord.from_json(r, k, world_size, where) for k, r in enumerate(records)],
                               step, tensors, where)
        entries = CheckedOnUse(tensors, lambda name, value: TensorEntry.from_json(name, value, where, parts))
        return cls(step, world_size, config, state, rank_states, entries,
                   _mapping(data.get("save_stats", {}), f"{where}: 'save_stats'"), parts)


def encode_head(step: int, world_size: int, config: dict, state: dict, rank_states: dict[int, dict],
                tensors: dict[str, dict], records: Sequence[PartRecord], save_stats: dict) -> bytes:
    """index.json of a version-2 checkpoint: `tensors` maps each name to its shape, dtype and
    layout, `records` describe the parts, rank by rank. Compact JSON: json's C
    encoder runs only without `indent`."""
    return json.dumps({"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
                       "config": config, "state": state, "save_stats": save_stats,
                       "rank_states": {str(r): s for r, s in sorted(rank_states.items())},
                       "tensors": dict(sorted(tensors.items())), "parts": [r.to_json() for r in records]},
                      separators=(",", ":")).encode()


def _mapping(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _check_decodes(state: dict, where: str) -> None:
    """A state tree's byte strings are valid base64 (decode_state would fail later, outside the
    code that falls back to the previous checkpoint)."""
    try:
        decode_state(state)
    except (TypeError, ValueError, binascii.Error) as exc:
        raise CheckpointError(f"{where}: a stored byte string does not decode ({exc})") from None


def check_coverage(name: str, shape: tuple[int, ...], total: int, where: str) -> None:
    """The tensor's shards hold `total` elements, as many as it has: every element is in some
    shard exactly once (counts, not positions: overlapping shards would be a writer bug the
    reader also tolerates)."""
    if total != math.prod(shape):
        raise CheckpointError(f"{where}: tensor {name!r} has {total} elements in its shards but shape "
                              f"{shape} needs {math.prod(shape)}; a rank's shards are missing")


def encode_state(value: Any) -> Any:
    """JSON form of a state tree; bytes (RNG states) become {"__bytes__": base64}."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dict):
        return {str(k): encode_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_state(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "item") and callable(value.item):          # numpy scalars
        return value.item()
    raise CheckpointError(f"training state value of type {type(value).__name__} is not JSON, bytes or a "
                          "number; store tensors as checkpoint tensors instead")


def decode_state(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"], validate=True)
        return {k: decode_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_state(v) for v in value]
    return value


def run_config(plan=None, backend: str = "", **extra: Any) -> dict[str, Any]:
    """The `config` section: model, strategy and world size of a ModelPlan, and the backend."""
    out: dict[str, Any] = {"backend": backend, **extra}
    if plan is not None:
        out.update(model=to_dict(plan.model, full=True), strategy=to_dict(plan.strategy, full=True),
                   world_size=plan.world_size)
    return out
