"""Measuring one training step the same way for every strategy of `peers.py`.

The peak is the CPU allocator's (torch.profiler's memory events,
remat.fx_passes.measuring.allocator): it sees kernel scratch, a convolution backward's oneDNN
workspace among it, which a dispatch-mode tracker of the storages ops return does not (on the
U-Net, 24 MiB of its 123 MiB step). remat plans that scratch; a tracker's peak would credit
every other strategy with it. FLOPs (the formulas of `torch.utils.flop_counter`) come from a
dispatch mode. For eager strategies it wraps the whole step. For compiled ones a mode around
the call would make dynamo run the eager code instead of the graphs, so `Probe` enters the
modes inside every compiled forward and backward graph and counts the graph calls, and
`measure` refuses a compiled step whose graphs did not run. The profiler is no dispatch mode:
it wraps the compiled call, whose graph calls are counted and checked the same way.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

from remat.fx_passes.measuring.allocator import peak_and_result
from remat.fx_passes.measuring.flops import FlopCounter, register_cpu_attention

# PyTorch has no formula for the CPU attention kernels: attention would count zero FLOPs.
register_cpu_attention()


# Total FLOPs by FlopCounterMode's formulas, without its module hooks (it works inside
# AOTAutograd's graphs) and without decomposing ops (which would allocate).
FlopCount = FlopCounter


class Probe:
    """Compilers for AOTAutograd that run each graph op by op (`boxed_nop`) with the modes of
    `inside(...)` entered inside the graph, and count the graph calls."""

    def __init__(self) -> None:
        self.active: list[Any] = []
        self.calls = {"forward": 0, "backward": 0}

    def compiler(self, which: str) -> Callable:
        from torch._dynamo.backends.debugging import boxed_nop

        def compile_graph(gm, example_inputs):
            inner = boxed_nop(gm, example_inputs)

            def run(args):
                self.calls[which] += 1
                with contextlib.ExitStack() as stack:
                    for mode in self.active:
                        stack.enter_context(mode)
                    return inner(args)

            # Boxed: the graph clears its argument list as it goes, so the backward frees saved
            # tensors after their last use instead of at its end.
            run._boxed_call = True
            return run

        return compile_graph

    @contextlib.contextmanager
    def inside(self, *modes) -> Iterator[Callable[[], dict[str, int]]]:
        """Enter `modes` inside every graph call; yields a function giving the calls so far."""
        self.active = list(modes)
        before = dict(self.calls)
        try:
            yield lambda: {k: self.calls[k] - before[k] for k in self.calls}
        finally:
            self.active = []


@contextlib.contextmanager
def inside_planned(module, *modes) -> Iterator[Callable[[], dict[str, int]]]:
    """`Probe.inside` for remat's PlannedModule, through its own instrument() hook."""
    with module.instrument(*[lambda phase, m=m: m for m in modes]) as calls:
        yield lambda: {"forward": calls.forward, "backward": calls.backward}


@dataclass
class Measured:
    peak: int  # the allocator's peak of the step above what was allocated before it
    flops: int  # FLOPs of the whole step
    grads: list[torch.Tensor | None] = field(repr=False)
    seconds: float  # fastest of the timed steps (the machine may be shared: the least noisy)
    graph_calls: dict[str, int] | None = None  # compiled strategies: graph calls per step


def run_step(step: Callable, inputs: tuple, params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = None
    loss = step(*inputs)
    loss.backward()


def measure(step: Callable, inputs: tuple, model: torch.nn.Module, *, seed: int,
            reset: Callable[[], None], inside: Callable[..., ContextManager] | None = None,
            repeats: int = 2) -> Measured:
    """Peak bytes and gradients (one step under the profiler), FLOPs (one under FlopCount) and
    the fastest of `repeats` steps without modes. Every step starts from the same seed and
    buffers. `inside` (Probe.inside, inside_planned) is given for compiled steps: the modes then
    go inside their graphs, and a step whose graphs did not run raises."""
    params = [p for p in model.parameters() if p.requires_grad]

    def one(*modes) -> dict[str, int] | None:
        reset()
        torch.manual_seed(seed)
        if inside is None:
            with contextlib.ExitStack() as stack:
                for mode in modes:
                    stack.enter_context(mode)
                run_step(step, inputs, params)
            return None
        with inside(*modes) as calls:
            run_step(step, inputs, params)
            return calls()

    # A mode that does nothing, so that the graph calls are counted (remat's hooks count
    # them only while an instrument is entered) with nothing but the allocator watching.
    peak, calls = peak_and_result(lambda: one(contextlib.nullcontext()))
    if inside is not None and not (calls["forward"] >= 1 and calls["backward"] >= 1):
        # The trap: a mode around a compiled call runs eager code. Here the modes sit inside
        # the graphs; a step that ran no graph measured nothing.
        raise RuntimeError(f"the compiled graphs did not run during the measured step: {calls}")
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    counter = FlopCount()
    one(counter)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        one()
        seconds.append(time.perf_counter() - start)
    return Measured(peak=peak, flops=counter.total, grads=grads,
                    seconds=min(seconds), graph_calls=calls)


def compare_grads(grads: list, reference: list, *, rtol: float = 1e-5,
                  atol: float = 1e-6) -> tuple[str, float]:
    """("bitwise" | "close" | "WRONG", largest absolute difference) against eager's gradients."""
    worst = 0.0
    exact = True
    close = True
    for g, r in zip(grads, reference, strict=True):
        if g is None or r is None:
            if (g is None) != (r is None):
                return "WRONG", float("inf")
            continue
        if not torch.equal(g, r):
            exact = False
            worst = max(worst, (g - r).abs().max().item())
            close = close and torch.allclose(g, r, rtol=rtol, atol=atol)
    return ("bitwise" if exact else "close" if close else "WRONG"), worst
