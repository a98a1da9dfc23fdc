"""Planning with the objects that exist before it kept out of the garbage collector's scans.

Python's cyclic garbage collector scans every tracked object of the oldest generation on each
full collection, and planning allocates enough (fx nodes, the CP-SAT model's variables) to
trigger one every second or so. With a captured model in the heap, each such scan costs about
0.5 s: planning Gemma-2-9B's eager mode (14,276 ops, on meta tensors) ran 9 full collections
over 1.8 million objects, 4.6 s of its 15.3 s, on a quiet core (gc.callbacks timing, around
`benchmarks/real_sizes.py`'s planning call).

`frozen_heap()` moves every object alive at its entry into the collector's permanent
generation (`gc.freeze`): reference counting still frees them, and objects made inside are
collected as usual, but full collections no longer rescan what was there before. Nested
entries freeze what exists then too (the capture's graphs, before the solve); the outermost
exit moves everything back (`gc.unfreeze`). Where the caller already froze objects or turned
the collector off, nothing is changed: the collector is theirs to manage.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["frozen_heap"]

_lock = threading.Lock()
_depth = 0  # entries of frozen_heap that froze and have not exited


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within: what was alive at entry is not rescanned by full collections (see the module)."""
    global _depth
    with _lock:
        if _depth == 0 and (gc.get_freeze_count() or not gc.isenabled()):
            owned = False  # the caller's own freeze or gc.disable(): left alone
        else:
            owned = True
            _depth += 1
            gc.freeze()
    try:
        yield
    finally:
        if owned:
            with _lock:
                _depth -= 1
                if _depth == 0:
                    gc.unfreeze()
