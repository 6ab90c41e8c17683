"""Python's cyclic garbage collector paused while a load parses its index and plans its reads.

Both build thousands of dicts, lists and tuples, none of them in a reference cycle. With the
collector on, every 700 new ones start a collection, and each collection of the oldest
generation traverses every tracked object of the process: the growing index, and in a trainer
all of torch's or MindSpore's own. bench/checkpoint.py (e) reads every part of a 32-rank ZeRO-3
index (15.1 MB) in such a process: a plain json.loads of them took 622 ms, an open that reads
them all 163 ms. The planning is paused too: otherwise the collection the open put off falls
due inside it, over the whole live index (a 64-rank plan and read then took 187 ms instead of
77).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the body with the collector off; leave it as found (off stays off)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
