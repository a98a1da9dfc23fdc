"""Closed-form estimates from the literature, to check captured graphs against. Torch-free."""
from __future__ import annotations


def layer_activation_bytes(seq: int, batch: int, hidden: int, heads: int, *,
                           flash: bool = False, full_recompute: bool = False) -> int:
    """Bytes one transformer layer keeps for the backward with 16-bit activations (Korthikanti
    et al., 2022): s*b*h*(34 + 5*a*s/h) when everything is stored; 34*s*b*h when the attention
    kernel never stores the s x s scores; 2*s*b*h when only the layer's input is kept."""
    sbh = seq * batch * hidden
    if full_recompute:
        return 2 * sbh
    if flash:
        return 34 * sbh
    return 34 * sbh + 5 * heads * seq * seq * batch
