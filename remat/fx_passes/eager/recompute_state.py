"""The recomputation of a checkpointed block leaves the model's state as the forward left it.

`torch.utils.checkpoint` reruns a block's forward in the backward, and with it every write the
forward made into the block's buffers: a BatchNorm in training updates its running mean and
variance a second time and counts ``num_batches_tracked`` twice (measured on a U-Net with
BatchNorm: ``num_batches_tracked`` 2 after one step where eager PyTorch has 1, and running
statistics off by a second momentum step). `KeepState`, entered in the recomputation only,
sends those writes to throwaway copies: the op still runs (selective checkpoint counts and
matches the ops it dispatches), its outputs are the forward's (batch norm in training
normalizes with the batch's statistics, not the running ones), and the buffers keep the
forward's values.

Writes are found from the op's schema (``Tensor(a!)``) and, for the batch norm kernels whose
schema does not mark them (``native_batch_norm``, ``cudnn_batch_norm``,
``miopen_batch_norm``), from their running statistics in training."""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from remat.fx_passes.eager.block_policy import canonical, counterpart
from remat.solvers.core.problem import Problem, Reason

__all__ = ["KeepState", "state_kept_recomputable", "with_state_kept", "writes_state",
           "written_positions"]

# Batch norm kernels that update their running statistics (arguments 3 and 4) when
# `training` (argument 5) is true, without saying so in their schema.
_UNMARKED_BATCH_NORMS = frozenset({"native_batch_norm", "cudnn_batch_norm",
                                   "miopen_batch_norm"})


class KeepState(TorchDispatchMode):
    """While entered, an op that writes into one of `module`'s buffers or parameters writes
    into a copy of it instead."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.state: set[int] | None = None

    def __enter__(self):
        # Read at entry: `.to()` or `load_state_dict(assign=True)` may have replaced tensors.
        self.state = {key for t in (*self.module.buffers(), *self.module.parameters())
                      if (key := _storage_key(t)) is not None}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = written_positions(func, args, kwargs)
        if written:
            args, kwargs = list(args), dict(kwargs)
            for where in written:
                value = args[where] if isinstance(where, int) else kwargs[where]
                if self._is_state(value):
                    with _disable_current_modes():  # a copy selective checkpoint never sees
                        copy = value.clone()
                    if isinstance(where, int):
                        args[where] = copy
                    else:
                        kwargs[where] = copy
        return func(*args, **kwargs)

    def _is_state(self, value: Any) -> bool:
        key = _storage_key(value)
        return key is not None and key in self.state


def _storage_key(value: Any) -> int | None:
    """Where a tensor's data lives (a DTensor's: its local shard's), or None: not a tensor,
    no data (an empty storage), or none to read (a fake or meta tensor)."""
    if not isinstance(value, torch.Tensor):
        return None
    local = getattr(value, "_local_tensor", value)
    try:
        storage = local.untyped_storage()
        return storage.data_ptr() if storage.nbytes() > 0 else None
    except (RuntimeError, NotImplementedError):
        return None


def written_positions(func, args, kwargs, *, unmarked: bool = True) -> list[int | str]:
    """Where op `func`'s call holds the tensors it writes into: argument positions, or
    keyword names, from its schema (``Tensor(a!)``); with `unmarked`, also the running
    statistics of the batch norm kernels whose schema does not mark them."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    if unmarked and schema.name.split("::")[-1] in _UNMARKED_BATCH_NORMS:
        return [3, 4] if len(args) > 5 and args[5] else []
    if not schema.is_mutable:
        return []
    where: list[int | str] = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if i < len(args):
            where.append(i)
        elif argument.name in kwargs:
            where.append(argument.name)
    return where


def writes_state(ops) -> bool:
    """Whether a block's op sequence (`BlockPolicy.ops`) may write into the model's state:
    a batch norm or an in-place op among them (the ops whose joint-graph counterpart is
    another op, `counterpart`)."""
    return any(counterpart(op) != canonical(op) for op in ops)


@contextlib.contextmanager
def _both(first, second):
    """Two context managers entered in order and left in reverse."""
    with first, second:
        yield


def with_state_kept(contexts: tuple, module: torch.nn.Module, ops) -> tuple:
    """Checkpoint's (forward, recomputation) `contexts` with `KeepState(module)` entered last
    in the recomputation, so it sees each op before selective checkpoint's own mode does;
    `contexts` as they are where the block's `ops` write into no state (`writes_state`): a
    dispatch mode costs time at every op."""
    if not writes_state(ops):
        return contexts
    forward, recomputation = contexts
    return forward, _both(recomputation, KeepState(module))


def state_kept_recomputable(problem: Problem, nodes: list[fx.Node]) -> Problem:
    """The problem with batch norm in training recomputable, as eager checkpoint runs it. The
    joint graph's batch norm reads the running statistics it updates (placeholders written
    back at the step's end), so the compiled mode never recomputes it. In eager mode
    checkpoint reruns it, with its writes into the buffers sent to copies
    (`KeepState`), and in training its output is normalized by
    the batch's own statistics: the recomputation gives the forward's values. Counted as
    held instead, its output made the eager plans of a U-Net with BatchNorm predict 45 %
    above the allocator."""
    ops = list(problem.ops)
    for v, node in enumerate(nodes):
        if v >= problem.num_forward or ops[v].not_recomputable is not Reason.MUTATION:
            continue
        if (node.target in _BATCH_NORM_TRAINING and len(node.args) > 5
                and node.args[5] is True) or _buffer_update(node):
            ops[v] = replace(ops[v], not_recomputable=None)
    return problem if ops == list(problem.ops) else replace(problem, ops=tuple(ops))


_BATCH_NORM_TRAINING = (torch.ops.aten._native_batch_norm_legit_functional.default,)


def _buffer_update(node: fx.Node) -> bool:
    """A buffer's new value that only the step's write-back reads (BatchNorm's
    ``num_batches_tracked + 1``): eager PyTorch writes it in place, and its recomputation
    writes into a copy; held to the block's backward, its 8 bytes put eager predictions of
    BatchNorm models above the allocator."""
    return bool(node.users) and all(user.op == "output" for user in node.users)
