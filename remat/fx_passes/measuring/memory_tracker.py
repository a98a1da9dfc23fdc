"""Exact live bytes of a step on any device: a dispatch mode that watches storages.

`MemoryTracker` is a TorchDispatchMode. Each op output's ``untyped_storage()`` is registered
once (views and in-place results share their base's storage and add nothing) and its release
is watched with ``weakref.finalize``; ``live`` is the bytes of registered storages still alive
and ``peak`` the most seen right after any op, when the op's inputs and outputs are alive
together. Storages that existed before the tracker saw them (parameters, the batch, tangents
made by autograd) are never counted: the baseline is what was alive before.

The trap: a dispatch mode active around a ``torch.compile``d call makes dynamo
run the original eager code. So enter the tracker inside the compiled graphs instead:
``tracking_compilers(tracker)`` gives forward/backward compilers (``boxed_nop`` wrapped) that
enter it around every graph call and count the calls in ``tracker.graph_calls``, which proves
that the compiled graphs ran. `measure_eager` measures a plain PyTorch step.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from remat.fx_passes.measuring.storage import held_bytes

__all__ = ["MemoryTracker", "measure_eager", "tracking_compiler", "tracking_compilers"]


class MemoryTracker(TorchDispatchMode):
    def __init__(self, *, record: bool = False):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self.graph_calls = {"forward": 0, "backward": 0}
        self.record = record
        self.timeline: list[tuple[str, int]] = []
        self._owned: dict[int, int] = {}
        self._external: set[int] = set()

    def reset_peak(self) -> None:
        self.peak, self.peak_op = self.live, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in _tensors((args, kwargs)):
            self._note_external(t)
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self._register(t)
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, str(func)
        if self.record:
            self.timeline.append((str(func), self.live))
        return out

    def _key(self, t: torch.Tensor):
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return None, None
        return storage._cdata, storage

    def _note_external(self, t: torch.Tensor) -> None:
        key, storage = self._key(t)
        if key is None or key in self._owned or key in self._external:
            return
        self._external.add(key)
        weakref.finalize(storage, self._external.discard, key)

    def _register(self, t: torch.Tensor) -> None:
        key, storage = self._key(t)
        if key is None or key in self._owned or key in self._external:
            return
        size = held_bytes(storage)
        self._owned[key] = size
        self.live += size
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._owned.pop(key, 0)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def tracking_compiler(tracker: MemoryTracker, which: str,
                      compiler: Callable | None = None) -> Callable:
    """A compiler for AOTAutograd that enters `tracker` around every call of the graph it
    compiles (with ``compiler``, ``boxed_nop`` by default)."""
    from torch._dynamo.backends.debugging import boxed_nop

    inner_compiler = compiler or boxed_nop

    def compile_graph(gm, example_inputs):
        inner = inner_compiler(gm, example_inputs)
        boxed = getattr(inner, "_boxed_call", False)

        def run(args):
            tracker.graph_calls[which] = tracker.graph_calls.get(which, 0) + 1
            with tracker:
                return inner(args) if boxed else inner(*args)

        run._boxed_call = True
        return run

    return compile_graph


def tracking_compilers(tracker: MemoryTracker, compiler: Callable | None = None) -> dict:
    """``fw_compiler`` and ``bw_compiler`` keyword arguments for `compile_step`."""
    return {"fw_compiler": tracking_compiler(tracker, "forward", compiler),
            "bw_compiler": tracking_compiler(tracker, "backward", compiler)}


def measure_eager(step: Callable[[], Any]) -> MemoryTracker:
    """Run ``step()`` (forward and backward of plain PyTorch) under a tracker; return it."""
    tracker = MemoryTracker()
    with tracker:
        result = step()
    del result
    return tracker


def measure_partitioned(model: torch.nn.Module, inputs, partition_fn: Callable, *,
                        loss_fn: Callable | None = None) -> MemoryTracker:
    """One training step of `model` compiled with `partition_fn` (PyTorch's `default_partition`
    saves everything the backward needs), with a tracker inside its graphs. Gradients are
    cleared again afterwards; `graph_calls` proves the compiled graphs ran."""
    from remat.fx_passes.tracing.capture import compile_step

    tracker = MemoryTracker()
    step = compile_step(model, partition_fn, loss_fn=loss_fn, **tracking_compilers(tracker))
    loss = step(*inputs)
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    return tracker
