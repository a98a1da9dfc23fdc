"""The memory of a pipeline-parallel rank, composed from one micro-batch's passes. Torch-free.

A pipeline stage runs the forward of every micro-batch and, later, its backward, in the order
its schedule says (`Action`s: torch.distributed.pipelining's F, B, I and W). Between its
forward and its backward a micro-batch holds what its backward needs (the saved activations
and the stage's output, which the runtime keeps for the backward); a rank therefore holds the
activations of every micro-batch in flight at once: GPipe all of them, 1F1B at stage s of p
(one stage a rank) p - s, the interleaved and zero-bubble schedules what their action order
says. Zero-bubble schedules split the backward into the input gradient (I), which the previous
stage waits for, and the weight gradient (W), deferred: between the two a micro-batch holds
what W needs (`MicrobatchMemory.input.after`).

`compose(actions, memory)` replays one rank's actions: each pass of a micro-batch peaks at its
own `Pass.peak` (everything it holds included) above what the other micro-batches hold and
the gradients already made; after it the micro-batch holds `Pass.after`. The parameters'
gradients are made by the stage's first backward (B, or W) and then stay (`.grad`, summed over
the micro-batches in place): that first pass is costed with `backward`, which counts them as
they are made, every later one with `backward_accumulating`, whose new gradients live only
until they are added.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = ["Action", "ActionKind", "Kept", "MicrobatchMemory", "Pass", "RankMemory",
           "compose", "in_flight", "passes_from_live"]


class ActionKind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    """The whole backward of a micro-batch: input and weight gradients."""
    INPUT = "I"
    """The input gradient alone (zero-bubble schedules)."""
    WEIGHT = "W"
    """The weight gradient of a micro-batch whose input gradient ran (zero-bubble schedules)."""


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"


@dataclass(frozen=True)
class Pass:
    """One pass of one micro-batch on one stage: the most bytes the micro-batch holds while it
    runs (what it held before included) and what it still holds when the pass ends."""

    peak: int
    after: int


@dataclass(frozen=True)
class Kept:
    """A tensor that the runtime keeps after the micro-batch's own passes are done with it (a
    stage's output sent on, its input's gradient sent back, the logits in a loop variable):
    `size` bytes, live while the rank runs its actions after action `after` up to action
    `until` (indices into its action order; None: to the end of the step). A negative size
    takes bytes off for that while: a tensor that replaces one counted elsewhere, such as the
    last step's in a receive buffer, which is freed as it is replaced."""

    size: int
    after: int
    until: int | None = None
    what: str = ""


@dataclass(frozen=True)
class MicrobatchMemory:
    """One micro-batch on one stage under one plan, in bytes above what the rank holds anyway
    (parameters, optimizer state, the runtime's receive buffers, the batch)."""

    forward: Pass
    backward: Pass
    """The stage's first backward: the gradients it makes stay (they are in its peak)."""
    backward_accumulating: Pass
    """A later backward: its gradients are added to `.grad` as they are made."""
    gradients: int
    """The parameters' gradients, held from the stage's first backward on."""
    input: Pass | None = None
    weight: Pass | None = None
    weight_accumulating: Pass | None = None
    recompute_flops: int = 0
    """FLOPs one micro-batch recomputes on this stage (all its passes)."""
    source: str = "simulated"
    """"simulated" (remat's eager timeline) or "measured" (a probe of the passes)."""

    def split(self) -> bool:
        return self.input is not None


@dataclass(frozen=True)
class RankMemory:
    """A rank's memory over one step of its schedule."""

    actions: tuple[Action, ...]
    peaks: tuple[int, ...]
    """Bytes held while each action runs (its peak), above what the rank holds anyway."""
    in_flight: Mapping[int, int] = field(default_factory=dict)
    """Stage -> the most micro-batches it held activations for at once."""

    @property
    def peak(self) -> int:
        return max(self.peaks, default=0)

    @property
    def peak_action(self) -> Action | None:
        return self.actions[self.peaks.index(self.peak)] if self.actions else None

    def to_dict(self) -> dict:
        return {"peak": self.peak, "peak_action": str(self.peak_action),
                "in_flight": dict(self.in_flight),
                "actions": [(str(a), p) for a, p in zip(self.actions, self.peaks)]}


def in_flight(actions: Iterable[Action]) -> dict[int, int]:
    """Stage -> the most micro-batches whose forward ran and whose backward (B, or W) did not,
    at once, in `actions` (one rank's, in order)."""
    open_: dict[int, set[int]] = {}
    most: dict[int, int] = {}
    for a in actions:
        mbs = open_.setdefault(a.stage, set())
        if a.kind is ActionKind.FORWARD:
            mbs.add(a.microbatch)
            most[a.stage] = max(most.get(a.stage, 0), len(mbs))
        elif a.kind in (ActionKind.BACKWARD, ActionKind.WEIGHT):
            mbs.discard(a.microbatch)
    return most


def compose(actions: Sequence[Action], memory: Mapping[int, MicrobatchMemory],
            kept: Sequence[Kept] = ()) -> RankMemory:
    """One rank's memory under its action order (module doc): each action's peak is its pass's
    peak plus what the other micro-batches hold, the gradients made so far and what the
    runtime keeps of the tensors handed on (`kept`)."""
    held: dict[tuple[int, int], int] = {}
    made: set[int] = set()  # stages whose gradients exist
    peaks = []
    for t, a in enumerate(actions):
        m = memory[a.stage]
        key = (a.stage, a.microbatch)
        others = sum(v for k, v in held.items() if k != key)
        others += sum(memory[s].gradients for s in made)
        others += sum(k.size for k in kept if k.after < t and (k.until is None or t <= k.until))
        makes_gradients = a.kind in (ActionKind.BACKWARD, ActionKind.WEIGHT)
        first = makes_gradients and a.stage not in made
        if a.kind is ActionKind.FORWARD:
            p = m.forward
        elif a.kind is ActionKind.BACKWARD:
            p = m.backward if first else m.backward_accumulating
        elif not m.split():
            raise ValueError(f"action {a}: stage {a.stage}'s memory has no split backward "
                             "(input and weight passes); plan it for its schedule")
        elif a.kind is ActionKind.INPUT:
            p = m.input
        else:
            p = m.weight if first else m.weight_accumulating
        peaks.append(others + p.peak)
        held[key] = p.after
        if makes_gradients:
            made.add(a.stage)
    return RankMemory(tuple(actions), tuple(peaks), in_flight(actions))


def passes_from_live(live: Sequence[int], boundary: int, held: int,
                     gradients: Iterable[tuple[int, int, int]]) -> tuple[Pass, Pass, Pass, int]:
    """(forward, backward, backward_accumulating, gradients) from one micro-batch's timeline:
    `live[t]` the bytes live at step t (the micro-batch's own, from 0), the forward the steps
    before `boundary`, `held` what it holds between its forward and its backward, and
    `gradients` the parameter gradients as (bytes, the step that makes one, the last step of
    its autograd node): in the timeline each lives from its step to the end. Nothing stays
    after the backward but the gradients: the stage's output and input gradient are handed on."""
    if not 0 < boundary <= len(live):
        raise ValueError(f"boundary {boundary} outside a timeline of {len(live)} steps")
    gradients = list(gradients)
    forward = Pass(max(live[:boundary]), held)
    backward = live[boundary:]
    first = Pass(max(backward, default=held), 0)
    # Later micro-batches: a new gradient is added to .grad when its autograd node returns
    # (autograd's AccumulateGrad runs then), so it lives to the node's last step only.
    later = [value - sum(size for size, _, until in gradients if until < t)
             for t, value in enumerate(backward, start=boundary)]
    return forward, first, Pass(max(later, default=held), 0), sum(s for s, _, _ in gradients)
