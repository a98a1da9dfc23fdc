"""The action order of a `torch.distributed.pipelining` schedule, per rank, as the runtime runs it
(checked on torch 2.13).

API
---
``schedule_actions(schedule, *, ranks, microbatches, stages=None) -> ScheduleOrder``
    `schedule` is a schedule class or its name ("GPipe", "1F1B", "Interleaved1F1B",
    "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"); `stages` defaults to
    one a rank for the single-stage schedules and two a rank for the others.

Where the order comes from:
- Multi-stage schedules (`PipelineScheduleMulti`, torch's runtime): the compute actions of the
  schedule's own ``pipeline_order_with_comms`` (what `_PipelineScheduleRuntime` executes; an
  ``OVERLAP_F_B`` action runs its sub-actions in order). The schedule is built on stand-ins
  for the stages: it reads only their indices and counts.
- GPipe and 1F1B run their own loops (`_step_microbatches`), not their ``pipeline_order``,
  which for 1F1B in torch 2.13 starts the last rank at micro-batch 1: the order is their
  loops', written out here. GPipe: every forward, then every backward in order. 1F1B: stage s
  of p runs min(M, p - s) forwards, then a backward and a forward in turn, then the remaining
  backwards.
- torch's first stage skips I under split backward and runs its whole backward at W
  (`backward_weight_one_chunk`); the order keeps I and W, and the stage's memory says so
  (`remat.planner.parallel.pipeline`).

``ScheduleOrder.kept(rank, output, input_grad)``: what each runtime keeps of the tensors a
stage hands on after the micro-batch is done with them
(`remat.solvers.timeline.pipeline_rank.Kept`), read in torch 2.13's loops and checked against the
allocator (a gloo send's work keeps its tensor while the work object lives):
- GPipe keeps the works of every forward and backward send in lists to the end of the step,
  and the last forward's output in its loop variable to the end.
- 1F1B keeps a forward's output (its send ops and the loop's variable) to the end of the next
  forward, and the warmup's last fired send (`send_work`, the forward before the last warmup
  one) until the backward that follows the last forward; an input gradient (its send ops) to
  the end of the next backward.
- Every schedule keeps the last stage's loss of each micro-batch (`_internal_losses`) to the
  end of the step, after its backward is done with it (4 bytes each, measured).
- The multi-stage runtime keeps every send's works to the end of the step. A V-shaped
  schedule hands tensors between the two stages of its turn on one rank without a send
  (`set_local_fwd_input`, `set_local_bwd_input`): the output becomes the next stage's input
  buffer and the input gradient the previous stage's output-gradient buffer. Those buffers
  are receive buffers, which the rank holds from step to step (counted with its state); each
  hand-on replaces the last step's tensor there, which is freed. So an input gradient handed
  back costs nothing beyond its buffer once made, and an output handed on costs nothing
  beyond its buffer once its own stage lets it go (its W or B); until then it is counted
  twice, in the buffer and in its micro-batch, and a negative `Kept` takes one count off.
  Measured with the allocator counting every free (remat.fx_passes.measuring.every_thread):
  the CPU profiler alone reports no free of a block allocated before it started, and read
  the handed-on tensors on top of the buffers.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

from remat.errors import RematError
from remat.solvers.timeline.pipeline_rank import Action, ActionKind, Kept

__all__ = ["ScheduleOrder", "schedule_actions", "SPLIT_BACKWARD"]

_KINDS = {"F": ActionKind.FORWARD, "B": ActionKind.BACKWARD, "I": ActionKind.INPUT,
          "W": ActionKind.WEIGHT}
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""The schedules that split a backward into I and W (the zero-bubble family)."""
_V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class ScheduleOrder:
    schedule: str
    ranks: int
    stages: int
    microbatches: int
    stage_rank: dict[int, int]
    """Stage -> the rank that runs it."""
    actions: dict[int, tuple[Action, ...]]
    """Rank -> its compute actions, in the order it runs them."""

    def stages_of(self, rank: int) -> list[int]:
        return sorted(s for s, r in self.stage_rank.items() if r == rank)

    def kept(self, rank: int, output: dict[int, int], input_grad: dict[int, int],
             loss: int = 0) -> list[Kept]:
        """What rank `rank`'s runtime keeps of the outputs (`output[s]` bytes a micro-batch)
        and input gradients (`input_grad[s]`) its stages hand on, and of the last stage's
        losses (`loss` bytes a micro-batch) (module doc)."""
        acts = self.actions[rank]
        at = {(a.stage, a.kind, a.microbatch): t for t, a in enumerate(acts)}
        F, B, I, W = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.INPUT,
                      ActionKind.WEIGHT)
        out: list[Kept] = []
        for s in self.stages_of(rank):
            last = s == self.stages - 1
            sends = not last and self.stage_rank[s + 1] != rank
            receives = s != 0 and self.stage_rank[s - 1] != rank
            mbs = range(self.microbatches)
            # When the micro-batch lets its output go (its backward, or W after an I), and
            # when its input gradient is made (B or I).
            freed = {m: at.get((s, W, m), at.get((s, B, m))) for m in mbs}
            made = {m: at.get((s, I, m), at.get((s, B, m))) for m in mbs}
            forwards = [at[(s, F, m)] for m in mbs]
            backwards = [made[m] for m in mbs]

            if last and loss:
                for m in mbs:
                    out.append(Kept(loss, freed[m], None, f"{s}F{m} loss"))

            def next_after(times, t):
                return min((u for u in times if u > t), default=None)

            if self.schedule == "GPipe":
                for m in mbs:
                    if sends:
                        out.append(Kept(output[s], freed[m], None, f"{s}F{m} sent"))
                    if receives:
                        out.append(Kept(input_grad[s], made[m], None, f"{s}B{m} sent"))
                if last:
                    out.append(Kept(output[s], freed[mbs[-1]], None, f"{s}F{mbs[-1]} output"))
            elif self.schedule == "1F1B":
                warmup = min(self.microbatches, self.stages - s)
                if sends or last:
                    for m in mbs:
                        out.append(Kept(output[s], freed[m], next_after(forwards, forwards[m]),
                                        f"{s}F{m} sends"))
                if sends and warmup >= 2:
                    m = warmup - 2
                    out.append(Kept(output[s], freed[m], next_after(backwards, forwards[-1]),
                                    f"{s}F{m} send work"))
                if receives:
                    for m in mbs:
                        out.append(Kept(input_grad[s], made[m], next_after(backwards, made[m]),
                                        f"{s}B{m} sends"))
            else:
                hands_on = not last and self.stage_rank[s + 1] == rank  # a V's turn
                hands_back = s != 0 and self.stage_rank[s - 1] == rank
                for m in mbs:
                    if sends:
                        out.append(Kept(output[s], freed[m], None, f"{s}F{m} sent"))
                    # Handed on to the next stage on the same rank, the output replaces
                    # the last step's in that stage's input buffer, a receive buffer (held
                    # anyway), which is freed: from then on, while the micro-batch still
                    # holds its output (to its W), the buffer's bytes are counted twice.
                    if hands_on:
                        out.append(Kept(-output[s], forwards[m], freed[m],
                                        f"{s}F{m} handed on: the last step's freed"))
                    # Sent back, the input gradient stays to the end of the step with its
                    # send's work (measured); handed back to the previous stage on the same
                    # rank, it replaces the last step's in that stage's output-gradient
                    # buffer, a receive buffer: nothing beyond it.
                    if s != 0 and not hands_back:
                        out.append(Kept(input_grad[s], made[m], None, f"{s}B{m} sent"))
        return [k for k in out if k.until is None or k.until > k.after]

    @property
    def split_backward(self) -> bool:
        return any(a.kind is ActionKind.INPUT for acts in self.actions.values() for a in acts)


def _name(schedule) -> str:
    from torch.distributed.pipelining import schedules as S

    if isinstance(schedule, str):
        try:
            cls = S.get_schedule_class(schedule)
        except ValueError as e:
            raise RematError(f"unknown pipeline schedule {schedule!r} ({e}); give one of "
                             "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                             "ZBVZeroBubble, DualPipeV") from None
    else:
        cls = schedule
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", *SPLIT_BACKWARD):
        if cls is S.get_schedule_class(name):
            return name
    raise RematError(f"schedule {cls.__name__}: remat knows the action order of GPipe, 1F1B, "
                     "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and "
                     "DualPipeV; for your own schedule, pass its actions per rank "
                     "(remat.solvers.timeline.pipeline_rank.Action) to plan_pipeline(actions=...)")


def schedule_actions(schedule, *, ranks: int, microbatches: int,
                     stages: int | None = None) -> ScheduleOrder:
    from torch.distributed.pipelining import schedules as S
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    name = _name(schedule)
    single = name in ("GPipe", "1F1B")
    stages = stages or (ranks if single else 2 * ranks)
    if ranks < 1 or microbatches < 1:
        raise ValueError("ranks and microbatches must be >= 1")
    if single and stages != ranks:
        raise RematError(f"{name} runs one stage a rank: stages={stages} with ranks={ranks}")
    style = "v" if name in _V_SHAPED else "loop"
    stage_rank = generate_stage_to_rank_mapping(ranks, stages, style=style)
    if single:
        actions = {r: tuple(_single(name, r, stages, microbatches)) for r in range(ranks)}
        return ScheduleOrder(name, ranks, stages, microbatches, stage_rank, actions)
    cls = S.get_schedule_class(name)
    actions = {}
    for rank in range(ranks):
        mine = [s for s in range(stages) if stage_rank[s] == rank]
        stand_ins = [types.SimpleNamespace(
            num_stages=stages, group_size=ranks, group_rank=rank, stage_index=s,
            is_first=s == 0, is_last=s == stages - 1, stage_index_to_group_rank=None,
            submod=_Module()) for s in mine]
        try:
            runtime = cls(stand_ins, microbatches)
        except Exception as e:  # the schedule's own check of stages and micro-batches
            raise RematError(f"{name} with {stages} stages on {ranks} ranks and "
                             f"{microbatches} micro-batches: {e}") from e
        actions[rank] = tuple(_compute_actions(runtime.pipeline_order_with_comms[rank]))
    return ScheduleOrder(name, ranks, stages, microbatches, stage_rank, actions)


def _Module():
    import torch

    return torch.nn.Module()


def _compute_actions(order) -> list[Action]:
    out = []
    for a in order:
        if a is None:
            continue
        for sub in (a.sub_actions or (a,)):
            kind = _KINDS.get(sub.computation_type.value)
            if kind is not None:
                out.append(Action(sub.stage_index, kind, sub.microbatch_index))
    return out


def _single(name: str, stage: int, stages: int, m: int) -> list[Action]:
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    if name == "GPipe":
        return [Action(stage, F, i) for i in range(m)] + [Action(stage, B, i) for i in range(m)]
    warmup = min(m, stages - stage)
    out = [Action(stage, F, i) for i in range(warmup)]
    forward = warmup
    for backward in range(m):
        out.append(Action(stage, B, backward))
        if forward < m:
            out.append(Action(stage, F, forward))
            forward += 1
    return out
