"""Compiles that an active ``torch.profiler`` does not see.

With ``with_flops=True`` (and so ``record_shapes``) the profiler reads the sizes of every op's
inputs as it records the op, to count its FLOPs, including the fake tensors that dynamo and
AOTAutograd trace with. Reading a symbolic size as a number specializes it: the graph of a
planned range of shapes (`remat.fx_passes.tracing.dynamic`) comes out with fixed sizes, other
nodes than the problem's, and the plan cannot be matched to it ("graph nodes ['add', ...] are
not ops of the problem"); a size read from the data would fail outright. So while dynamo
compiles inside `compiles_unprofiled`, this thread's op recording is off; the compiled graphs
then run recorded, as any other op.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

__all__ = ["compiles_unprofiled"]


@contextlib.contextmanager
def compiles_unprofiled() -> Iterator[None]:
    """Dynamo's compiles that start on this thread inside this context run with the
    profiler's op recording off (`torch._C._autograd._enable_record_function`, a per-thread
    switch), through dynamo's compile callbacks; nothing is done while no profiler runs.
    Dynamo runs its callbacks when the first of the compiles in flight starts and the last
    ends: a compile that starts while another thread's is in flight is not covered. Where
    this torch has no compile callbacks, the whole call goes unrecorded instead."""
    if not torch.autograd._profiler_enabled():
        yield
        return
    handler = getattr(torch._dynamo, "callback_handler", None)
    if handler is None or not hasattr(handler, "remove_start_callback"):
        _record(False)
        try:
            yield
        finally:
            _record(True)
        return
    thread, paused = threading.get_ident(), []

    def start(*_: Any) -> None:
        if threading.get_ident() == thread:
            _record(False)
            paused.append(True)

    def end(*_: Any) -> None:
        if paused and threading.get_ident() == thread:
            _record(True)
            paused.clear()

    handler.register_start_callback(start)
    handler.register_end_callback(end)
    try:
        yield
    finally:
        for remove, callback in ((handler.remove_start_callback, start),
                                 (handler.remove_end_callback, end)):
            try:
                remove(callback)
            except ValueError:  # torch._dynamo.reset() cleared the callbacks meanwhile
                pass
        if paused:
            _record(True)


def _record(on: bool) -> None:
    torch._C._autograd._enable_record_function(on)
