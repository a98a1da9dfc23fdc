"""Offload in eager plans: the inputs that checkpoint saves for a block, moved to
host memory through saved-tensor hooks around the block, and back one block ahead.

`torch.utils.checkpoint` (non-reentrant) saves a block's tensor inputs through the saved-tensor
hooks active when it is called, before it enters its own; inside the block its own hooks and
the selective policy's cache hold everything. So a hook pair entered around the checkpoint call
sees exactly the block's inputs (`remat.solvers.timeline.eager_offload` says which may go):
- pack: an input the plan offloads (matched by shape and dtype, in order) is kept as a handle;
  every other input passes through, wrapped so that its unpacking can start loads;
- when the block's checkpoint returns, the offloaded inputs are copied to host buffers (pinned,
  from a pool filled in the first step and reused; on a GPU on a copy stream, the device
  tensor's memory left to the allocator until the copy ends: `record_stream`) and the device
  tensors let go;
- unpack (checkpoint's recomputation asks for the block's inputs, at the block's trigger): the
  loads of the blocks the plan prefetches here are issued first (on a GPU on a second copy
  stream, after the copy to host), then the block's own inputs are handed over, waiting for
  their loads if they were offloaded.
On the CPU the copies are plain copies.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch

from remat.errors import RematError
from remat.fx_passes.eager.block_policy import BlockPolicy

__all__ = ["EagerOffloads"]


class _Input:
    """One input a block's checkpoint saved: passed through, or kept in host memory."""

    def __init__(self, owner: "EagerOffloads", tensor: torch.Tensor, offloaded: bool):
        self.owner, self.device, self.offloaded = owner, tensor, offloaded
        self.host: torch.Tensor | None = None
        self.loaded: torch.Tensor | None = None
        self.copied = self.arrived = None  # events, on a GPU

    def copy_out(self) -> None:
        x = self.device
        self.host = self.owner.host_buffer(x)
        if x.device.type == "cuda":
            out, _ = self.owner.streams(x.device)
            out.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(out):
                self.host.copy_(x, non_blocking=True)
                self.copied = torch.cuda.Event()
                self.copied.record(out)
            x.record_stream(out)  # its memory is not reused before the copy ends
        else:
            self.host.copy_(x)
        self.device = None

    def load(self) -> None:
        if not self.offloaded or self.loaded is not None or self.host is None:
            return
        host, where = self.host, self.owner.device
        y = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=where)
        if y.device.type == "cuda":
            _, into = self.owner.streams(y.device)
            into.wait_stream(torch.cuda.current_stream(y.device))
            if self.copied is not None:
                into.wait_event(self.copied)
            with torch.cuda.stream(into):
                y.copy_(host, non_blocking=True)
                self.arrived = torch.cuda.Event()
                self.arrived.record(into)
        else:
            y.copy_(host)
        self.loaded = y

    def get(self) -> torch.Tensor:
        if not self.offloaded:
            return self.device
        if self.host is None:  # unpacked before its block's forward returned
            return self.device
        self.load()
        y = self.loaded
        if self.arrived is not None:
            torch.cuda.current_stream(y.device).wait_event(self.arrived)
            self.owner.give_back(self.host, self.arrived)
        else:
            self.owner.give_back(self.host, None)
        self.host = self.loaded = None
        return y


class EagerOffloads:
    """The offloads of an eager plan's blocks, as each call's policy says (its `offload`: the
    (shape, dtype) of each input the block offloads; its `prefetch`: the paths of the blocks
    whose offloaded inputs load when it unpacks its own)."""

    def __init__(self):
        self.pending: dict[str, list[list[_Input]]] = defaultdict(list)
        self.pool: dict[tuple, list[tuple[torch.Tensor, Any]]] = defaultdict(list)
        self.allocated = 0
        self.device: torch.device | None = None
        self._streams: dict[torch.device, tuple[Any, Any]] = {}

    @staticmethod
    def of(policies: dict) -> "EagerOffloads | None":
        """Offloads for `policies` (BlockPolicy, or GuardedPolicy: one per bucket), None when
        no policy offloads or prefetches anything."""
        each = [p for pol in policies.values()
                for p in ([b for _, b in pol.by_bucket] if hasattr(pol, "by_bucket") else [pol])]
        return EagerOffloads() if any(p.offload or p.prefetch for p in each) else None

    def wrap(self, policy: BlockPolicy, call: Callable) -> Callable:
        """`call` (the block's checkpoint call) with the hooks of `policy` (the block's policy
        for this call) around it."""
        if not policy.offload and not policy.prefetch:
            return call
        path = policy.path

        def run(*args: Any, **kwargs: Any) -> Any:
            specs = list(policy.offload)
            inputs: list[_Input] = []

            def pack(t: torch.Tensor) -> _Input:
                key = (tuple(t.shape), str(t.dtype))
                offloaded = key in specs and not isinstance(t, torch.nn.Parameter)
                if offloaded:
                    specs.remove(key)
                    self.device = t.device
                inputs.append(_Input(self, t, offloaded))
                return inputs[-1]

            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack(policy.prefetch)):
                out = call(*args, **kwargs)
            if specs and torch.is_grad_enabled():
                raise RematError(
                    f"block {path!r}: the plan offloads inputs of shapes {specs} that the "
                    "block's checkpoint did not save in this run (other shapes or inputs than "
                    "planned): plan with the inputs you train with")
            offloaded = [item for item in inputs if item.offloaded]
            for item in offloaded:
                item.copy_out()
            if offloaded:  # for the block that loads them ahead of their need
                self.pending[path].append(offloaded)
            return out

        return run

    def _unpack(self, prefetch: tuple[str, ...]) -> Callable[[_Input], torch.Tensor]:
        def unpack(item: _Input) -> torch.Tensor:
            for other in prefetch:  # prefetch: issue those loads now
                if self.pending[other]:
                    for waiting in self.pending[other].pop():
                        waiting.load()
            return item.get()

        return unpack

    # --- host buffers, reused step after step

    def host_buffer(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), tuple(x.stride()), x.dtype)
        free = self.pool[key]
        for k, (buffer, last_read) in enumerate(free):
            if last_read is None or last_read.query():
                del free[k]
                return buffer
        self.allocated += 1
        pin = x.device.type == "cuda"
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu",
                                   pin_memory=pin)

    def give_back(self, buffer: torch.Tensor, last_read: Any) -> None:
        self.pool[(tuple(buffer.shape), tuple(buffer.stride()), buffer.dtype)].append(
            (buffer, last_read))

    def streams(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]
