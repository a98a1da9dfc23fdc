"""Hugging Face's `Trainer` with a remat plan in one line:

    model = remat.for_trainer(model, budget="20GB", example_kwargs=batch)
    trainer = Trainer(model, TrainingArguments(..., activation_checkpointing=True), ...)

The Trainer turns activation checkpointing on by calling ``model.activation_checkpointing_enable()``
at the start of ``train()``, after it has put the model on its device and before accelerate
wraps it (transformers 5.x; ``gradient_checkpointing_enable`` is its deprecated alias).
`for_trainer` replaces that method on the instance: when the Trainer calls it, the model is
planned for eager training (``optimize(..., execution="eager")``) on the device it trains on,
in train mode, under the autocast the Trainer trains with (its ``bf16=`` / ``fp16=`` mixed
precision, on its device), and the plan is applied in place (`EagerPlan.apply`). Hugging
Face's own checkpointing is then not enabled: the plan decides what each block recomputes.

Evaluation (``Trainer.evaluate()``, ``generate()``) runs the model plainly, without the plan
(`remat.fx_passes.tracing.plain`). A model that would train before its plan was made (the
Trainer run without ``activation_checkpointing=True``) is refused at its first training
forward, not trained silently without it.

`remat.every_expert(model)`: transformers' DBRX as remat can plan it.

DBRX's experts (`DbrxExperts`, transformers 5.x) loop ``for expert_idx in expert_hit``, over
the experts this batch routes a token to: a loop whose length is read from the data, which no
one graph holds (capture stops there with a CaptureError naming this call), and which DBRX
offers no ``experts_implementation`` to replace. `every_expert` runs every expert instead, in
the same order: an expert no token picked gets ``torch.where`` of nothing and adds nothing, so
the sums, the loss and the gradients are the same. Each expert's tokens stay a size read from
the data (``torch.where(mask)``), which remat plans at its worst case: every token. The change
is per instance (the class is left as it is) and stays: the plan is made and run on it.
"""
from __future__ import annotations

import contextlib
import logging
import types
from typing import Any, Sequence

import torch

from remat.errors import RematError
from remat.planner.job.training import Training
from remat.solvers import SolverOptions, Strategy

log = logging.getLogger(__name__)

__all__ = ["every_expert", "for_trainer"]


def for_trainer(model: Any, budget: int | str | None = None, *,
                activation_budget: int | str | None = None,
                example_kwargs: dict[str, Any], training: Training = Training(),
                target: str = "h100", solver: Strategy | str = Strategy.OPTIMAL,
                solver_options: SolverOptions | None = None,
                blocks: Sequence[str] | None = None, dynamic: dict | None = None,
                dynamic_dims: dict | None = None) -> Any:
    """`model` (a Hugging Face ``PreTrainedModel``, or a PEFT model around one) set up to be
    planned and checkpointed by remat when a ``Trainer`` with
    ``TrainingArguments(activation_checkpointing=True)`` starts training. Returns `model`.

    `example_kwargs` is one batch as the Trainer's data collator makes it (``input_ids``,
    ``labels``, ``attention_mask`` if the collator adds one): the blocks are planned for the
    ops they run on it; with a collator that pads each batch to its longest sequence, give
    the range of batch sizes and lengths the Trainer will feed, e.g.
    ``dynamic={"batch": (1, 8), "seq": (8, 512)}`` (docs/shapes.md): a batch outside the
    plan's shapes is refused. The other arguments are `remat.optimize`'s. After ``train()`` began,
    ``model.activation_checkpointing_enable.plan`` is the plan (its ``report()``...)."""
    from remat.planner.plans.eager_plan import check_no_cache

    if not hasattr(model, "activation_checkpointing_enable"):
        raise RematError(
            f"for_trainer: {type(model).__name__} has no activation_checkpointing_enable(), the "
            "method Hugging Face's Trainer (transformers >= 5) calls to turn checkpointing on; "
            "for another model or loop plan it with remat.optimize(..., execution=\"eager\") "
            "and apply the plan with plan.apply(model)")
    if isinstance(model.activation_checkpointing_enable, _PlanWhenEnabled):
        raise RematError("for_trainer: this model is already set up for remat; call it once")
    if (budget is None) == (activation_budget is None):
        raise ValueError("give exactly one of budget= (the whole step, e.g. \"20GB\") and "
                         "activation_budget= (the activations alone)")
    check_no_cache(model, "for_trainer")
    options = dict(budget=budget, activation_budget=activation_budget, training=training,
                   target=target, solver=solver, solver_options=solver_options, blocks=blocks,
                   dynamic=dynamic, dynamic_dims=dynamic_dims)
    enable = _PlanWhenEnabled(model, dict(example_kwargs), options)
    model.activation_checkpointing_enable = enable
    enable.guard = model.register_forward_pre_hook(enable.refuse_training, with_kwargs=True)
    return model


class _PlanWhenEnabled:
    """``model.activation_checkpointing_enable`` replaced: plans and applies on its first call."""

    def __init__(self, model: Any, example_kwargs: dict[str, Any], options: dict[str, Any]):
        self.model = model
        self.example_kwargs = example_kwargs
        self.options = options
        self.plan = None
        self.planning = False
        self.guard = None

    def __call__(self, activation_checkpointing_kwargs: dict | None = None,
                 every_n_layers: int = 1, offload: bool = False) -> None:
        _refuse_options(activation_checkpointing_kwargs, every_n_layers, offload)
        if self.plan is not None:  # a second train(): the blocks are wrapped already
            return
        import remat

        model = self.model
        autocast = _trainer_autocast()  # refused before any planning where unsupported
        # The Trainer trains in train mode; evaluation may have left the model in eval.
        modes = {module: module.training for module in model.modules()}
        model.train()
        self.planning = True  # planning runs the model's forward itself
        try:
            with autocast:
                plan = remat.optimize(model,
                                      example_kwargs=_on_device(self.example_kwargs, model),
                                      execution="eager", **self.options)
        finally:
            self.planning = False
            for module, mode in modes.items():
                module.training = mode
        plan.apply(model)
        self.plan = plan
        self.guard.remove()
        log.info("remat: %r applied to %s for the Trainer", plan, type(model).__name__)

    def refuse_training(self, module: Any, args: tuple, kwargs: dict) -> None:
        from remat.fx_passes.tracing.plain import records_graph

        if self.planning or self.plan is not None:
            return
        if module.training and records_graph(module.parameters(), args, kwargs):
            raise RematError(
                "remat.for_trainer: the model trains before its plan was made; pass "
                "TrainingArguments(activation_checkpointing=True): the Trainer then calls "
                "model.activation_checkpointing_enable() at the start of train(), which plans "
                "the model and applies the plan (or call it yourself before a loop of your own)")


def _refuse_options(kwargs: dict | None, every_n_layers: int, offload: bool) -> None:
    """Hugging Face's checkpointing options have no meaning for a plan, which chooses per op
    what each block recomputes; ignoring them would be silent."""
    extra = {k: v for k, v in (kwargs or {}).items() if (k, v) != ("use_reentrant", False)}
    if extra or every_n_layers != 1 or offload:
        given = {**extra, **({"every_n_layers": every_n_layers} if every_n_layers != 1 else {}),
                 **({"offload": True} if offload else {})}
        raise RematError(
            f"remat plans what each block recomputes; Hugging Face's checkpointing options "
            f"{given} have no meaning for its plan: remove them from "
            "TrainingArguments(activation_checkpointing_kwargs=...) (remat uses non-reentrant "
            "checkpoint; for host offload plan with execution=\"compiled\", offload=True)")


def _trainer_autocast() -> contextlib.AbstractContextManager:
    """The autocast the Trainer's training forward runs under, to plan under. accelerate wraps
    the model's forward in it when ``train()`` prepares the model, right after calling
    ``activation_checkpointing_enable()`` outside any autocast, from its state, which the
    Trainer's ``TrainingArguments`` set (``bf16=`` or ``fp16=``; the device: ``use_cpu=`` or
    the accelerator); the rules are accelerate's (``Accelerator.native_amp``,
    ``get_mixed_precision_context_manager``). Called under an autocast of its own (a loop of
    the user's), or with no accelerate state (no Trainer made one), the current state is the
    one planned for."""
    import torch

    from remat.fx_passes.tracing.call_checks import autocast_state

    try:
        from accelerate.state import AcceleratorState
        from accelerate.utils import DistributedType
    except ImportError:
        return contextlib.nullcontext()
    if autocast_state() or not AcceleratorState._shared_state:
        return contextlib.nullcontext()
    state = AcceleratorState()
    precision, device = state.mixed_precision, state.device.type
    if state.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM) \
            or precision not in ("fp16", "bf16", "fp8"):
        return contextlib.nullcontext()  # the engine's own precision, or full precision
    if precision == "fp8":
        raise RematError(
            "remat.for_trainer: mixed precision fp8 replaces the model's linear layers when the "
            "Trainer prepares it, after the plan would be made, so the plan would not describe "
            "the blocks that train; train with TrainingArguments(bf16=True) (or fp16=True)")
    if precision == "fp16" and device == "cpu":
        return contextlib.nullcontext()  # accelerate runs fp16 on a CPU without autocast
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    log.info("remat.for_trainer: planning under torch.autocast(%r, dtype=%s), the Trainer's "
             "mixed precision %s", device, dtype, precision)
    return torch.autocast(device, dtype=dtype)


def _on_device(kwargs: dict[str, Any], model: Any) -> dict[str, Any]:
    """The example batch on the device the Trainer put the model on."""
    import torch

    device = next((p.device for p in model.parameters()), None)
    return {k: v.to(device) if isinstance(v, torch.Tensor) and device is not None else v
            for k, v in kwargs.items()}


LOOPS_OVER_HITS = ("DbrxExperts",)  # transformers' experts modules this rewrites


def every_expert(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with each `DbrxExperts` looping over every expert (see the module); returns
    the model itself. Refused where there is none."""
    found = [m for m in model.modules() if type(m).__name__ in LOOPS_OVER_HITS]
    if not found:
        raise RematError(f"every_expert: {type(model).__name__} holds no {LOOPS_OVER_HITS[0]} "
                         "(transformers' DBRX experts); nothing to rewrite")
    for module in found:
        module.forward = types.MethodType(_every_expert_forward, module)
    return model


def _every_expert_forward(self, hidden_states, top_k_index, top_k_weights):
    """`DbrxExperts.forward` (transformers 5.24) with ``range(self.num_experts)`` for
    ``expert_hit``."""
    batch_size = hidden_states.shape[0]
    hidden_states = hidden_states.reshape(-1, self.hidden_size)
    next_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = torch.nn.functional.one_hot(top_k_index, self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
    shape = (-1, self.ffn_hidden_size, self.hidden_size)
    for expert_idx in range(self.num_experts):
        with torch.no_grad():
            idx, token_idx = torch.where(expert_mask[expert_idx])
        # top-k picks an expert at most once per token, so at most every token comes here:
        # the worst case remat plans for (torch alone bounds it by the mask's top_k * tokens)
        torch._check(token_idx.shape[0] <= hidden_states.shape[0])
        v1 = self.mlp.v1.view(shape)[expert_idx]
        w1 = self.mlp.w1.view(shape)[expert_idx]
        w2 = self.mlp.w2.view(shape)[expert_idx]
        states = self.mlp(hidden_states[token_idx], w1, v1, w2)
        states = states.view(-1, self.hidden_size) * top_k_weights[token_idx, idx, None]
        next_states.index_add_(0, token_idx, states)
    return next_states.view(batch_size, -1, self.hidden_size)
