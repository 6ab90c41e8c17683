"""Python's cyclic garbage collector paused while a load parses its index and plans its reads.

Both build thousands of dicts, lists and tuples, none of them in a reference cycle. With the
collector on, every 700 new ones start a collection, and the older generations' collections
traverse the growing index again and again. A ZeRO-3 checkpoint of 80 layers with both Adam
moments, opened on one rank: at 32 ranks (an 18.6 MB index) the open took 214 ms with the
collector on and 105 ms paused, at 64 ranks (36.8 MB) 458 and 249 ms. The planning is paused
too: otherwise the collection the open put off falls due inside it, over the whole live index
(a 64-rank plan and read then took 187 ms instead of 77).
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
