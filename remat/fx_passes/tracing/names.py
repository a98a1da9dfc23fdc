"""How remat names the things of a captured graph: an fx node's target as `Op.target` spells
it, and dynamo's module paths as the user writes them. Shared by the profile pass, the
lowering, the replicated capture and the joint-graph matching, so one spelling holds in all."""
from __future__ import annotations

import operator
import re
from typing import Any

import torch

from remat.fx_passes.tracing.rng import RandomOp

__all__ = ["module_path", "name_gaps", "node_number", "numbered", "target_name"]


def target_name(target: Any) -> str:
    """The name of an fx node's target as `Op.target` spells it ("aten.mm.default")."""
    if isinstance(target, (torch._ops.OpOverload, RandomOp)):
        return str(target)
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", "") or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    return f"{module}.{name}" if module and module != "_operator" else name


_PREFIX = re.compile(r"^(?:L|G)\[['\"][^'\"]*['\"]\]\.?")
_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def module_path(qualified: str) -> str:
    """dynamo's "L['self'].h[3].attn" or "G['model'].layers['0']" -> "h.3.attn"; a wrapper
    that forwards attributes (PEFT's) is traced through its ``__dict__['_modules']``:
    "L['model'].__dict__['_modules']['base_model'].model" -> "base_model.model", the path
    ``get_submodule`` takes."""
    path = _PREFIX.sub("", qualified)
    path = _INDEX.sub(r".\1", path)
    path = re.sub(r"(?:^|\.)(?:__dict__\.)?_modules\.|\.modules\.", ".", path)
    return path.strip(".")


# fx's own split of a node name into its base and number ("mm_12": "mm", 12).
_NUMBERED = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")


def node_number(name: str) -> tuple[str, int]:
    """(base, number) of an fx node name as fx numbers it: "mm_12" is ("mm", 12), "mm" is
    ("mm", 0)."""
    match = _NUMBERED.match(name)
    if match is None:
        return name, 0
    return match.group(1), int(match.group(2) or 0)


def name_gaps(names: list[str]) -> list[int]:
    """For each name of a graph, in order, how many numbers of its base fx gave to nodes
    that are gone (dead code removed after tracing) since the last name of that base: the
    names a graph built anew must skip to be named as the traced one."""
    last: dict[str, int] = {}
    gaps = []
    for name in names:
        base, number = node_number(name)
        gaps.append(max(0, number - last.get(base, -1) - 1))
        last[base] = number
    return gaps


def numbered(base: str, last: dict[str, int], gap: int) -> str:
    """The name to ask fx for: the next number of `base` after `last[base]`, `gap` numbers
    skipped."""
    number = last.get(base, -1) + 1 + gap
    return base if number == 0 else f"{base}_{number}"
