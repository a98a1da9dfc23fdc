"""Which torch is running, for the few places where torch 2.11 (the GPU machines') and 2.13
differ (docs/limitations.md)."""
from __future__ import annotations

import torch

__all__ = ["torch_at_least"]


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the running torch is `major.minor` or later (read at each call: "2.11.0+cu130",
    "2.13.0+cpu", "2.14.0.dev20260101")."""
    release = torch.__version__.split("+")[0].split(".")
    return (int(release[0]), int(release[1])) >= (major, minor)
