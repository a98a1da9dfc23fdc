"""Bytes by storage: which fx nodes own a new storage, and which alias another node's.

One pass over the joint graph writes into ``node.meta["remat"]``:
- ``alias_of``: the input node whose storage this node's value lives in (the base of a view,
  the target of an in-place op, the ``split`` a getitem takes a view from), or None when the
  value owns its storage; `storage_root` follows the chain to the owner;
- ``bytes``: the bytes of the storage the node owns (0 for aliases), dtype-exact from the fake
  value's ``untyped_storage().nbytes()``, which is also what the memory tracker counts;
- ``tuple_bytes``: for an op with several fresh outputs, the bytes of all of them (the op
  allocates them together; its getitems then own one each);
- ``view_tuple``: True for a multi-output op whose outputs all alias an input (split, unbind).

Symbolic graphs (a range of shapes, `remat.fx_passes.tracing.dynamic`): a value whose sizes are
symbols has symbolic bytes, kept as a SymInt (turning it into an int would specialize the graph
being compiled to one shape). A graph that capture concretized keeps each node's symbolic value
in ``node.meta["symbolic_val"]``; the pass then also writes ``bytes_expr`` and
``tuple_bytes_expr``, the same bytes as expressions in the range's names ("12288*batch*seq"),
which the range's proof bounds (`remat.fx_passes.lowering.shape_bound`).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from remat.fx_passes.tracing.dynamic import in_names

__all__ = ["aliased_input", "allocated_bytes", "distinct_storage_bytes", "held_bytes", "remat_meta",
           "storage_bytes", "storage_pass", "storage_root"]

# Ops whose schema promises a fresh tensor but whose kernels return a view of their input.
_ALIASING_WITHOUT_SCHEMA = {"_unsafe_view", "_reshape_alias", "lift_fresh"}


def _reduced_loss_keeps_buffer(node: fx.Node, key: str = "val") -> Any:
    # The CPU kernels of these losses reduce in place into their unreduced buffer and return
    # a 0-dim tensor over it: the loss holds the whole buffer for as long as it lives.
    value = node.meta.get(key)
    reduction = node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or reduction == 0:
        return None
    source = node.args[0].meta.get(key) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(source, torch.Tensor):
        return None
    return source.numel() * value.element_size()


# Kernels whose real output storage is not what their fake value says (checked on torch 2.13).
_KERNEL_STORAGE = {"mse_loss": _reduced_loss_keeps_buffer}


def remat_meta(node: fx.Node) -> dict:
    return node.meta.setdefault("remat", {})


# PyTorch's CUDA caching allocator hands out blocks in multiples of 512 bytes (a 2-byte loss
# takes 512), and max_memory_allocated counts the blocks: a CUDA storage is counted so.
CUDA_BLOCK = 512


def allocated_bytes(nbytes: Any, device: torch.device | None) -> Any:
    """What the allocator of `device` holds for a storage of `nbytes` bytes."""
    if device is None or device.type != "cuda" or isinstance(nbytes, torch.SymInt) or not nbytes:
        return nbytes
    return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK


def held_bytes(storage: torch.UntypedStorage) -> int:
    """What the allocator holds for a real `storage`."""
    return allocated_bytes(storage.nbytes(), storage.device)


def storage_bytes(value: Any) -> Any:
    """The bytes the allocator holds for `value`'s storage: an int, or a SymInt for symbolic
    sizes (never forced to an int, which would specialize the graph being compiled)."""
    if isinstance(value, torch.Tensor):
        try:
            nbytes = value.untyped_storage().nbytes()
        except (NotImplementedError, RuntimeError):  # sparse or other storage-less tensors
            nbytes = value.numel() * value.element_size()
        nbytes = nbytes if isinstance(nbytes, torch.SymInt) else int(nbytes)
        return allocated_bytes(nbytes, value.device)
    return 0


def distinct_storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of `tensors` (None skipped): views and tensors that share
    a storage count once, as the allocator holds them."""
    seen = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = held_bytes(s)
    return sum(seen.values())


def aliased_input(node: fx.Node) -> tuple[fx.Node | None, bool]:
    """(the input node the output aliases, whether it writes into it), or (None, False)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None, False
    name = schema.name.split("::")[-1]
    tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
    if name in _ALIASING_WITHOUT_SCHEMA:
        return (tensor_args[0] if tensor_args else None), False
    returns = [r.alias_info for r in schema.returns]
    if not returns or any(r is None for r in returns):
        return None, False
    alias_sets = [set(r.before_set) for r in returns]
    writes = any(r.is_write for r in returns)
    for i, argument in enumerate(schema.arguments):
        info = argument.alias_info
        # A list return ("Tensor(a)[]" of split, unbind) exposes no alias set of its own.
        if info is None or (alias_sets[0] and not set(info.before_set) & alias_sets[0]):
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
        if isinstance(value, fx.Node):
            return value, writes
    return None, False


def storage_pass(gm: fx.GraphModule) -> None:
    names = gm.meta.get("remat_symbol_names", {})
    for node in gm.graph.nodes:
        meta = remat_meta(node)
        meta.update(_storage(node, "val"))
        if "symbolic_val" in node.meta:
            symbolic = _storage(node, "symbolic_val")
            meta["bytes_expr"] = in_names(symbolic["bytes"], names)
            meta["tuple_bytes_expr"] = in_names(symbolic["tuple_bytes"], names)


def _storage(node: fx.Node, key: str) -> dict:
    """The storage pass's fields for one node, read from ``node.meta[key]``."""
    value = node.meta.get(key)
    meta = dict(alias_of=None, bytes=0, tuple_bytes=0, view_tuple=False, writes=False)
    if node.op == "placeholder":
        meta["bytes"] = storage_bytes(value)
    elif node.op != "call_function":
        pass
    elif node.target is operator.getitem:
        parent = node.args[0]
        if isinstance(parent, fx.Node) and remat_meta(parent).get("view_tuple"):
            meta["alias_of"] = parent
        else:
            meta["bytes"] = storage_bytes(value)
    else:
        base, writes = aliased_input(node)
        if isinstance(value, (tuple, list)):
            if base is not None and not writes:
                meta.update(view_tuple=True, alias_of=base)
            else:
                meta["tuple_bytes"] = sum(storage_bytes(v) for v in value)
        elif base is not None:
            meta.update(alias_of=base, writes=writes)
        else:
            quirk = _kernel_bytes(node, key)
            unknown = quirk is None or (isinstance(quirk, int) and quirk == 0)
            meta["bytes"] = storage_bytes(value) if unknown else quirk
    return meta


def _kernel_bytes(node: fx.Node, key: str = "val") -> Any:
    schema = getattr(node.target, "_schema", None)
    quirk = _KERNEL_STORAGE.get(schema.name.split("::")[-1]) if schema is not None else None
    return quirk(node, key) if quirk is not None else None


def storage_root(node: fx.Node) -> fx.Node:
    """The node that owns the storage `node`'s value lives in."""
    seen = 0
    while True:
        alias = node.meta.get("remat", {}).get("alias_of")
        if alias is None or alias is node or seen > 10_000:
            return node
        node, seen = alias, seen + 1
