"""Inductor as the forward and backward compiler of a planned step.

AOTAutograd hands each compiler a graph that the plan partitioned and fake example inputs; what
Inductor expects is what its own pipeline would have produced: ATen decomposed by its table,
no Python targets, random ops it knows how to run. Three things stand between the two:

- Decomposition. The plan names the nodes of the joint graph as captured, so the graphs are
  decomposed only after partitioning (recomputations stay in the backward). The retrace must
  run inside the inputs' fake mode, as AOTAutograd's own trace does: outside it, a
  decomposition's scalar (``torch.where(mask, target, 0)`` in ``nll_loss_backward``) becomes a
  real tensor beside fake ones, and fake propagation stops at "Please convert all Tensors to
  FakeTensors first".
- Random numbers. Inductor normally replaces aten's random ops by its own generator in a joint
  graph pass that a custom partition never reaches (hence "should have been handled in
  replace_random.py"). With ``fallback_random`` the step runs aten's random kernels instead,
  in eager's order on eager's generator: the same masks as eager, so the same gradients.
- Snapshots. remat's `RandomOp` and `rng_state` targets become PyTorch's RNG-state operators,
  which Inductor runs as fallbacks (`remat.fx_passes.tracing.rng.as_rng_state_ops`); a recomputed
  dropout then replays the mask its forward drew.

Two of Inductor's own memory decisions would undo the plan's, so they are turned off
(`PLAN_KEEPING`), and horizontal fusion is kept to neighbouring kernels (below); fusion of a
producer into its readers, buffer reuse and in-place updates stay:
- Layout optimization converts a convolution's input and weight to channels-last and saves the
  converted copies for the backward: tensors the plan never saved. A planned transformers ViT
  (2 layers, hidden 192, 224 px, batch 4) held 3.0 MB more after its forward by the
  allocator, the image and the patch weight copied. Where convolutions are most of the work
  it is left on (`layout_optimization`): there every activation is made channels-last by its
  convolution, so only the input batch and the weights are copied, and the convolutions'
  backwards need no reordering scratch. On the U-Net of `benchmarks/inductor.py`
  (`tests.models.UNet`, channels 16/32/64, batch 4, 64 x 64) torch.compile at budget 1.0
  read 9.40 MiB with it and 12.00 MiB without, and remat's plan asked for 9.40 MiB read
  9.40 MiB with it, where without it the plan had to recompute 0.13 GFLOP of convolutions.
  The rule is Inductor's own for CUDA graphs: at least one convolution per 300 nodes of the
  joint graph (the ViT above has one in about 600).
- The locality and peak-memory reorderings move the backward's recomputations away from
  where the plan put them (the same ViT: a 2.4 MB gradient kept alive across a recomputed
  attention). With all three off the step measured 10.92 MB by the allocator against the
  11.44 MB the plan predicts; with them on, 17.29 MB (+51 %).

Horizontal fusion (two kernels that read the same buffers and not each other's outputs) runs
the fused kernel where the earlier one was, so the later one's outputs are made early and held
across every kernel between: Inductor's own limit lets kernels up to 64 nodes apart fuse. The
plan recomputes a value just before its reader, and recomputations of the same inputs in
different layers (a Qwen2's attention masks) fused into one kernel at the first layer's,
holding every layer's mask from there on. `_PlanKeepingChoices` fuses horizontally only
kernels with no other kernel between them; vertical fusion (a producer into its reader)
stays. On `benchmarks/inductor.py`'s Qwen2, its plan of least simulated peak (27.93 MB) read
33.39 MB with Inductor's limit and 30.24 MB with this rule, its step as fast (0.199 s both,
the fastest of five on the CPU; a script not in the repository). Inductor's graph cache does
not key on this rule, so remat's graphs are compiled without it (`fx_graph_cache`): a graph
cached by another compile would otherwise come back fused as that compile fused it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import fx

from remat.errors import RematError
from remat.fx_passes.tracing.rng import as_rng_state_ops

__all__ = ["PLAN_KEEPING", "conv_heavy", "inductor_compilers"]


def _decomposed(gm: fx.GraphModule, example_inputs: Any) -> fx.GraphModule:
    from torch._dispatch.python import enable_python_dispatcher
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = as_rng_state_ops(gm)
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    with fake_mode or contextlib.nullcontext(), enable_python_dispatcher():
        return make_fx(gm, decomposition_table=select_decomp_table())(
            *_as_traced(gm, example_inputs))


def _as_traced(gm: fx.GraphModule, example_inputs: Any) -> list[Any]:
    """`example_inputs` with the strides the graph was traced with. A backward's inputs are
    handed over with the strides the compiled forward gave its saved values, which Inductor
    chooses (its layout optimization makes a convolution's activations channels-last), and
    the graph's views were traced against the traced strides: retraced with the forward's,
    a `view` may not apply (transformers' ConvNeXt: "Cannot view a tensor with shape
    [13, 2, 2, 30] and strides (120, 30, 60, 1) as a tensor with shape (52, 30)"). Inductor
    compiles the retraced graph for the inputs' real strides, copying where a view needs it.
    Call inside the inputs' fake mode."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    traced = []
    for node, x in zip(placeholders, example_inputs):
        val = node.meta.get("val")
        if (isinstance(x, torch.Tensor) and isinstance(val, torch.Tensor)
                and val.shape == x.shape and val.stride() != x.stride()
                and not any(isinstance(d, torch.SymInt) for d in (*x.shape, *val.stride()))):
            x = torch.empty_strided(x.shape, val.stride(), dtype=x.dtype, device=x.device)
        traced.append(x)
    return traced


# Inductor options that would move or add saved memory behind the plan's back (see above).
PLAN_KEEPING = {"layout_optimization": False, "reorder_for_locality": False,
                "reorder_for_peak_memory": False}


def conv_heavy(problem: Any) -> bool:
    """Whether `problem`'s graph is a convolutional one, where Inductor's layout optimization
    stays on (see the module's docstring): a convolution per 300 nodes of the joint graph or
    more, as Inductor decides for CUDA graphs."""
    convolutions = sum(op.target == "aten.convolution.default" for op in problem.ops)
    nodes = problem.source.get("graph_nodes", len(problem.ops))
    return convolutions > 0 and nodes < 300 * convolutions


# The most positions apart (in Inductor's node order) two kernels fuse horizontally: 1, next
# to each other (module doc). At 4 or 16 the Qwen2's masks fused as without the rule (33.39
# MB read); at 1 a Llama plan at 66,485,264 B reads 1 MiB above its simulation, which it
# met to 4 bytes at 4 (`benchmarks/inductor.py`'s cases, a script not in the repository).
HORIZONTAL_REACH = 1


def _plan_keeping_choices() -> Any:
    """Inductor's heuristics (its current choices handler) with horizontal fusion limited to
    adjacent kernels (module doc)."""
    from torch._inductor.virtualized import V

    base = type(V.choices)

    class _PlanKeepingChoices(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def can_fuse_horizontal(scheduler: Any, node1: Any, node2: Any,
                                shared_data_score: int) -> bool:
            # Kernels between them would run with the later one's outputs already made.
            between = max(node2.min_order - node1.max_order, node1.min_order - node2.max_order)
            if between > HORIZONTAL_REACH:
                return False
            return base.can_fuse_horizontal(scheduler, node1, node2, shared_data_score)

    return _PlanKeepingChoices()


def _inductor_config(layout_optimization: bool) -> contextlib.AbstractContextManager:
    import torch._inductor.config as config
    from torch._inductor.virtualized import V

    if not hasattr(config, "fallback_random"):
        raise RematError(f"this torch ({torch.__version__}) has no Inductor option "
                         "fallback_random, which a planned step needs to draw eager's random "
                         "numbers; run the plan op by op (compile=False)")
    # An option this torch does not have cannot reorder anything: only known ones are set.
    keeping = {name: value for name, value in PLAN_KEEPING.items() if hasattr(config, name)}
    if layout_optimization:
        keeping.pop("layout_optimization", None)
    stack = contextlib.ExitStack()
    stack.enter_context(config.patch(fallback_random=True, fx_graph_cache=False, **keeping))
    stack.enter_context(V.set_choices_handler(_plan_keeping_choices()))
    return stack


def inductor_compilers(layout_optimization: bool = False) -> tuple[Callable, Callable]:
    """The forward and backward compilers: each graph decomposed and compiled by Inductor's
    `compile_fx_inner`, random ops on aten's generator; Inductor's layout optimization on
    where `layout_optimization` (`conv_heavy`), else off with the rest of `PLAN_KEEPING`."""
    from torch._inductor.compile_fx import compile_fx_inner

    def compiler(is_backward: bool) -> Callable:
        def compile_graph(gm: fx.GraphModule, example_inputs: Any) -> Callable:
            with _inductor_config(layout_optimization):
                return compile_fx_inner(_decomposed(gm, example_inputs), example_inputs,
                                        is_backward=is_backward)

        return compile_graph

    return compiler(False), compiler(True)
