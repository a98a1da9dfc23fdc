"""One training step of a plan as it will run compiled, read by the allocator: the reading
that `remat.planner.plans.inductor_check` accepts a plan on.

- A compiled plan (execution="compiled", compile=True): its whole step compiled by Inductor
  (`plan.module`).
- An eager plan (execution="eager", compile=True): the plan applied to the model and the model
  compiled by ``torch.compile``, as its user runs it; the model is unwrapped afterwards.

The first call compiles (Inductor's compile allocates), the second is the step read. The step
changes nothing the user sees: gradients, buffers (BatchNorm's running statistics) and the
random generators are put back as they were."""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from remat.errors import RematError
from remat.fx_passes.measuring.storage import held_bytes
from remat.planner.job.budget import format_size

log = logging.getLogger(__name__)

__all__ = ["compile_applied", "measure_activations", "step_reading"]


def compile_applied(model: Any, blocks: Sequence[str] | None = None) -> Any:
    """``torch.compile(model)`` with its defaults, as the user of an eager plan compiles the
    applied model; what an eager plan made with compile=True is read on, and its `module`.
    With `blocks` (module paths, ``compile="blocks"``): each of those modules compiled in place
    instead (``nn.Module.compile``, torchtitan's per-block compile), and `model` returned."""
    import torch

    if blocks is None:
        return torch.compile(model)
    for path in blocks:
        model.get_submodule(path).compile()
    return model


def compiled_blocks(plan: Any) -> list[str] | None:
    """The module paths an eager plan with compile="blocks" compiles one by one, else None."""
    if plan.compile != "blocks":
        return None
    from remat.fx_passes.eager.runs import module_path

    return sorted({module_path(name) for name in plan.policies})


def step_reading(plan: Any, model: Any, example_inputs: Sequence[Any],
                 example_kwargs: dict) -> tuple[Any, int]:
    """(the compiled module measured, or None for an eager plan; the allocator's activation
    peak of one step of it)."""
    if getattr(plan, "execution", "compiled") == "eager":
        return _applied_reading(plan, model, example_inputs, example_kwargs)
    return _compiled_reading(plan, model, example_inputs, example_kwargs)


def _applied_reading(plan: Any, model: Any, example_inputs: Sequence[Any],
                     example_kwargs: dict) -> tuple[None, int]:
    """The allocator's reading of one step of ``torch.compile(plan.apply(model))`` (or of
    the model with each block compiled, `compiled_blocks`), with torch.compile's defaults and
    Inductor's configuration as they stand at the call; the model is unwrapped again
    afterwards (`remove_eager`). Dynamo traces each block's checkpoint with
    the plan's policy, and AOTAutograd's partitioner decides again, within it, what the
    compiled graphs save: the eager timeline does not predict that step (fused pointwise ops
    take less; random ops, always cached under torch.compile, take more)."""
    import torch

    from remat.fx_passes.eager.apply import remove_eager

    blocks = compiled_blocks(plan)
    # Each reading compiles from a fresh dynamo state, as the run it stands for will: entries
    # an earlier reading left would count towards dynamo's recompile limit. Past that limit
    # dynamo runs a frame uncompiled without a word, so a reading would be eager PyTorch's:
    # here that is an error.
    torch._dynamo.reset()
    plan.apply(model)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            compiled = compile_applied(model, blocks)
            for _ in range(2):  # the first call compiles
                measured = measure_activations(compiled, model, example_inputs,
                                               example_kwargs, plan.prepared.loss_fn)
    except RematError:
        raise
    except Exception as e:
        if isinstance(e, torch._dynamo.exc.FailOnRecompileLimitHit):
            limit = torch._dynamo.config.recompile_limit
            raise RematError(
                f"compile={plan.compile!r}: torch.compile reached its recompile limit "
                f"(torch._dynamo.config.recompile_limit = {limit}) and would run the rest "
                f"uncompiled: each of the plan's {len(plan.policies)} blocks checkpoints its "
                "own ops, a graph of its own where blocks are compiled one by one; raise the "
                f"limit to at least {len(plan.policies)} before planning and training, or "
                "plan with compile=True (the whole model compiled)") from e
        raise RematError(f"compile=True: the applied eager plan failed under torch.compile "
                         f"({_cause(e)}); plan with compile=False and run the "
                         "applied model eagerly, or plan with execution=\"compiled\", "
                         "compile=True (remat compiles the whole step)") from e
    finally:
        for path in blocks or ():  # nn.Module.compile's, undone
            model.get_submodule(path)._compiled_call_impl = None
        remove_eager(model)
        torch._dynamo.reset()  # the run planned compiles afresh: no reading's entries left
    log.info("under torch.compile: %s of activations measured, %s predicted eagerly",
             format_size(measured), format_size(plan.memory.activation_peak))
    return None, measured


def _cause(e: Exception) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def _compiled_reading(plan: Any, model: Any, example_inputs: Sequence[Any],
                      example_kwargs: dict) -> tuple[Any, int]:
    """`plan`'s step compiled by Inductor, and the allocator's reading of one step of it."""
    plan.compile = True
    module = plan.apply(model)
    # The first call compiles (and Inductor's compile allocates): the second is the step.
    try:
        for _ in range(2):
            measured = measure_activations(module, model, example_inputs, example_kwargs)
    except RematError:
        raise
    except Exception as e:  # the op-by-op step traced and lowered: Inductor failed
        raise RematError(f"compile=True: the planned step failed under Inductor "
                         f"({_cause(e)}); plan with compile=False to run "
                         "it op by op") from e
    log.info("under Inductor: %s of activations measured, %s simulated",
             format_size(measured), format_size(plan.memory.activation_peak))
    return module, measured


def measure_activations(module: Any, model: Any, example_inputs: Sequence[Any],
                        example_kwargs: dict, loss_fn: Callable | None = None) -> int:
    """The allocator's activation peak of one step of `module` (the step's peak less the
    gradients it leaves), with the model's gradients, buffers and random generators put back
    as they were. Compiles on this first call. `loss_fn`: the loss of the module's output,
    where the output is not the loss or a model output carrying it."""
    import torch

    from remat.fx_passes.measuring.allocator import step_peak

    params = [p for p in model.parameters()]
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    generators = _generator_states()
    device = next((p.device for p in params), torch.device("cpu"))
    try:
        for p in params:
            p.grad = None
        peak, held = step_peak(lambda: _Held(module(*example_inputs, **example_kwargs),
                                             loss_fn),
                               lambda h, seed: h.loss.backward(seed), device)
        del held
        left = sum(held_bytes(p.grad.untyped_storage()) for p in params if p.grad is not None)
    finally:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
        _restore_generators(generators)
    return peak - left


class _Held:
    """The step's output, held through the backward as a training loop holds it, and its
    loss (what `plan.module` returns: the loss, or the model's output carrying it)."""

    def __init__(self, out: Any, loss_fn: Callable | None = None):
        import torch

        self.out = out
        if loss_fn is not None:
            self.loss = loss_fn(out)
            return
        self.loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
        if self.loss is None:
            self.loss = out["loss"] if isinstance(out, dict) else out[0]


def _generator_states() -> tuple[Any, Any]:
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore_generators(states: tuple[Any, Any]) -> None:
    import torch

    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
