"""The transfers of a compiled plan's offloads: four ops of the rewritten graphs, which run the
copies on copy streams beside the compute on a GPU (one stream per direction, with events),
and as plain copies on the CPU. The rewrite places them where `remat.solvers.timeline.overlap`'s
timeline does (`rewrite.py`):

- ``remat::offload(x, pool, key) -> host``: after x's last forward reader, copy x into a host
  buffer of the pool, on the device-to-host stream once the compute stream has made x;
- ``remat::offload_done(x, host, pool)``: where the timeline says that copy has ended (at the
  forward's end at the latest), the compute stream waits for it; x's last reader, so x's
  memory is freed right after (never while the copy still reads it);
- ``remat::reload(host, pool, key) -> y``: at the load's place in the backward, y is allocated
  on the device and filled from the host buffer on the host-to-device stream, once the compute
  stream has reached this point and the copy to host has ended;
- ``remat::reload_done(y, host, pool)``: before y's first reader, the compute stream waits for
  the load.

Host buffers are allocated ahead (`HostPool`, when the graphs are made: pinned memory on a
GPU, whose allocation is slow and synchronizing), and reused step after step: a buffer is
taken by an offload and given back by its reload. Another is allocated on the fly only when
more forwards than one run before their backward (gradient accumulation over retained
graphs), so no step ever overwrites a host copy that a backward still needs.

The ops are `torch.library` custom ops, opaque to tracing, so that a graph keeps them as they
are; the wait ops are marked as side effects, which no pass removes.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
import torch.fx as fx

from remat.errors import RematError
from remat.solvers.timeline.overlap import transfers
from remat.solvers.core.problem import Problem
from remat.solvers.core.schedule import Schedule
from remat.solvers.timeline.simulate import StepKind, step_order

__all__ = ["GraphOffloads", "HostPool"]

# node.meta["remat"]["role"] of the ops placed here.
ROLE = "host copy"

_POOLS: "weakref.WeakValueDictionary[int, HostPool]" = weakref.WeakValueDictionary()
_IDS = itertools.count()


class HostPool:
    """Host buffers for a plan's offloaded values, by key (the value's op index), and the
    events of the copies in flight. `specs`: key -> (shape, stride, dtype, device)."""

    def __init__(self, specs: dict[int, tuple]):
        self.id = next(_IDS)
        _POOLS[self.id] = self
        self.specs = dict(specs)
        self.free: dict[int, list[torch.Tensor]] = {k: [self._buffer(k)] for k in self.specs}
        self.copied: dict[int, Any] = {}  # host buffer's data_ptr -> event of its copy in
        self.loaded: dict[int, Any] = {}  # host buffer's data_ptr -> event of its load out
        self.streams: dict[torch.device, tuple[Any, Any]] = {}
        self.allocated = len(self.specs)  # buffers made, ahead and on the fly

    def _buffer(self, key: int) -> torch.Tensor:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        shape, stride, dtype, device = self.specs[key]
        pin = device.type != "cpu" and torch.cuda.is_available()
        with unset_fake_temporarily():  # the pool is made while the graphs are traced
            return torch.empty_strided(shape, stride, dtype=dtype, device="cpu",
                                       pin_memory=pin)

    def nbytes(self) -> int:
        """Bytes of host memory the pool holds."""
        return sum(b.untyped_storage().nbytes() for bs in self.free.values() for b in bs)

    def take(self, key: int) -> torch.Tensor:
        if self.free[key]:
            return self.free[key].pop()
        self.allocated += 1  # a second forward before the first's backward
        return self._buffer(key)

    def give_back(self, key: int, host: torch.Tensor) -> None:
        self.free[key].append(host)

    def copy_streams(self, device: torch.device):
        """(device to host, host to device) streams of an accelerator."""
        if device not in self.streams:
            self.streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self.streams[device]


def _accelerated(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


@torch.library.custom_op("remat::offload", mutates_args=())
def offload(x: torch.Tensor, pool: int, key: int) -> torch.Tensor:
    owner = _POOLS[pool]
    host = owner.take(key)
    if not _accelerated(x):
        host.copy_(x)
        return host
    out, _ = owner.copy_streams(x.device)
    out.wait_stream(torch.cuda.current_stream(x.device))  # x is made
    last_read = owner.loaded.pop(host.data_ptr(), None)
    if last_read is not None:  # the buffer's previous load has read it
        out.wait_event(last_read)
    with torch.cuda.stream(out):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(out)
    owner.copied[host.data_ptr()] = done
    return host


@offload.register_fake
def _(x, pool, key):
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")


@torch.library.custom_op("remat::offload_done", mutates_args=())
def offload_done(x: torch.Tensor, host: torch.Tensor, pool: int) -> None:
    _wait_for(x, _POOLS[pool].copied if _accelerated(x) else {}, host)


@offload_done.register_fake
def _(x, host, pool):
    return None


@torch.library.custom_op("remat::reload", mutates_args=())
def reload(host: torch.Tensor, pool: int, key: int) -> torch.Tensor:
    owner = _POOLS[pool]
    device = owner.specs[key][3]
    y = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    if y.device.type != "cuda":
        y.copy_(host)
        owner.give_back(key, host)
        return y
    _, into = owner.copy_streams(y.device)
    into.wait_stream(torch.cuda.current_stream(y.device))  # this point reached; y allocated
    copied = owner.copied.pop(host.data_ptr(), None)
    if copied is not None:
        into.wait_event(copied)
    with torch.cuda.stream(into):
        y.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(into)
    owner.loaded[host.data_ptr()] = done
    owner.give_back(key, host)
    return y


@reload.register_fake
def _(host, pool, key):
    device = _POOLS[pool].specs[key][3] if pool in _POOLS else host.device
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)


@torch.library.custom_op("remat::reload_done", mutates_args=())
def reload_done(y: torch.Tensor, host: torch.Tensor, pool: int) -> None:
    _wait_for(y, _POOLS[pool].loaded if _accelerated(y) else {}, host)


def _wait_for(x: torch.Tensor, events: dict, host: torch.Tensor) -> None:
    """The compute stream waits for the copy into or out of `host` (its event in `events`, by
    the host buffer's address), where one is pending."""
    done = events.get(host.data_ptr())
    if done is not None:
        torch.cuda.current_stream(x.device).wait_event(done)


@reload_done.register_fake
def _(y, host, pool):
    return None


for _op in (torch.ops.remat.offload_done.default, torch.ops.remat.reload_done.default):
    torch.fx.node.has_side_effect(_op)

OFFLOAD = torch.ops.remat.offload.default
OFFLOAD_DONE = torch.ops.remat.offload_done.default
RELOAD = torch.ops.remat.reload.default
RELOAD_DONE = torch.ops.remat.reload_done.default


class GraphOffloads:
    """Where the rewritten graphs copy offloaded values to host and back, and wait for the
    copies: `remat.solvers.timeline.overlap`'s timeline, on one `HostPool`. The rewrite calls
    `release` and `copy_out` around each forward step, `load` at each RELOAD step and `wait`
    before each backward step."""

    def __init__(self, problem: Problem, schedule: Schedule, nodes: list[fx.Node]):
        self.nodes = nodes
        order = step_order(problem, schedule)
        timeline = transfers(problem, schedule, order)
        forward_end = order.index((problem.num_forward - 1, StepKind.FORWARD)) + 1
        self.copy_after: dict[int, list[int]] = {}
        self.release_at: dict[int, list[int]] = {}  # step -> copies to wait for before it
        self.wait_at: dict[int, list[int]] = {}  # step -> loads to wait for before it
        for v, t in sorted(timeline.by_value.items()):
            self.copy_after.setdefault(t.issued_after, []).append(v)
            self.release_at.setdefault(min(t.released + 1, forward_end), []).append(v)
            if t.first_read is not None:
                self.wait_at.setdefault(t.first_read, []).append(v)
        specs = {}
        for v in timeline.by_value:
            val = nodes[v].meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise RematError(f"cannot offload {nodes[v].name!r}: its node has no tensor "
                                 "metadata to size a host buffer by")
            specs[v] = (tuple(val.shape), tuple(val.stride()), val.dtype, val.device)
        self.pool = HostPool(specs)
        self.device: dict[int, fx.Node] = {}  # the device copy, in the forward
        self.host: dict[int, fx.Node] = {}  # the host copy, in the graph being built
        self.loaded: dict[int, fx.Node] = {}

    def copy_out(self, graph: fx.Graph, env: dict, t: int) -> None:
        """After forward step t: copy the values whose last forward read it was to host."""
        for v in self.copy_after.get(t, ()):
            device = self.device[v] = env[self.nodes[v]]
            host = self.host[v] = graph.call_function(OFFLOAD, (device, self.pool.id, v))
            val = device.meta.get("val")
            if isinstance(val, torch.Tensor):
                host.meta["val"] = val.new_empty_strided(val.shape, val.stride(),
                                                         device="cpu")
            _role(host)
            env[self.nodes[v]] = host  # what the forward hands to the backward

    def release(self, graph: fx.Graph, t: int) -> None:
        """Before forward step t: wait for the copies to host that have ended by then (the
        timeline's), and let their device copies go."""
        for v in self.release_at.pop(t, ()):
            _role(graph.call_function(OFFLOAD_DONE, (self.device[v], self.host[v],
                                                     self.pool.id)))

    def load(self, graph: fx.Graph, v: int, host: fx.Node) -> fx.Node:
        """At v's load: allocate it on the device and start filling it from host."""
        self.host[v] = host
        loaded = self.loaded[v] = graph.call_function(RELOAD, (host, self.pool.id, v))
        loaded.meta["val"] = self.nodes[v].meta.get("val")
        _role(loaded)
        return loaded

    def wait(self, graph: fx.Graph, t: int) -> None:
        """Before step t, the first reader of loaded values: wait for their loads."""
        for v in self.wait_at.get(t, ()):
            _role(graph.call_function(RELOAD_DONE, (self.loaded[v], self.host[v],
                                                    self.pool.id)))


def _role(node: fx.Node) -> fx.Node:
    node.meta["remat"] = {**node.meta.get("remat", {}), "role": ROLE}
    return node
