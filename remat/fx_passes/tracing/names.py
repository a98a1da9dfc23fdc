"""How remat names the things of a captured graph: an fx node's target as `Op.target` spells
it, and dynamo's module paths as the user writes them. Shared by the profile pass, the
lowering, the replicated capture and the joint-graph matching, so one spelling holds in all."""
from __future__ import annotations

import operator
import re
from typing import Any

import torch

from remat.fx_passes.tracing.rng import RandomOp

__all__ = ["module_path", "target_name"]


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
