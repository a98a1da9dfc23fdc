"""Synthetic training steps, torch-free: chains, diamonds, U-Nets, transformer stacks, and
random graphs for property tests. Sizes and costs are realistic in shape: bytes from tensor
shapes, cost from a roofline (FLOPs over peak, or bytes over bandwidth, whichever is larger)."""
from __future__ import annotations

import random
from dataclasses import replace
from typing import Callable, Sequence

from remat.solvers.core.problem import Kind, Op, Phase, Problem, Reason, tuple_of

PEAK_FLOPS = 400e12  # the roofline of a current accelerator, bf16
BANDWIDTH = 3e12  # bytes per second


class Builder:
    """Appends ops in execution order and returns their indices."""

    def __init__(self):
        self.ops: list[Op] = []
        self.phase = Phase.FORWARD

    def add(self, name: str, inputs: Sequence[int] = (), size: int = 0, *, flops: int = 0,
            kind: Kind = Kind.TENSOR, temp: int = 0, module: str = "", target: str = "",
            not_recomputable: Reason | None = None, is_output: bool = False,
            forward_output: bool = False, cost: float | None = None) -> int:
        if cost is None:
            moved = size + temp + sum(self.ops[i].size for i in inputs)
            cost = max(flops / PEAK_FLOPS, moved / BANDWIDTH)
        self.ops.append(Op(name=name, phase=self.phase, inputs=tuple(inputs), size=size,
                           kind=kind, temp=temp, cost=cost, flops=flops, module=module,
                           target=target, not_recomputable=not_recomputable,
                           is_output=is_output, forward_output=forward_output))
        return len(self.ops) - 1

    def backward(self) -> None:
        self.phase = Phase.BACKWARD

    def problem(self, name: str, **source) -> Problem:
        return Problem(tuple(self.ops), name=name, source=source)


def chain(layers: int = 8, width: int = 1024, batch: int = 4096, dtype_bytes: int = 2) -> Problem:
    """An MLP: linear and relu per layer, a loss, and the backward mirroring it."""
    g = Builder()
    act = batch * width * dtype_bytes
    mm_flops = 2 * batch * width * width
    h, acts = None, []
    for i in range(layers):
        mm = g.add(f"mm_{i}", [h] if h is not None else [], act, flops=mm_flops,
                   module=f"layers.{i}.linear", target="aten.mm.default")
        h = g.add(f"relu_{i}", [mm], act, module=f"layers.{i}.act", target="aten.relu.default")
        acts.append((mm, h))
    loss = g.add("loss", [h], dtype_bytes, is_output=True, target="aten.mean.default")
    g.backward()
    grad = g.add("grad_loss", [loss], act)
    for i in reversed(range(layers)):
        mm, relu = acts[i]
        prev = acts[i - 1][1] if i else None
        mod = f"layers.{i}"
        d_mm = g.add(f"relu_bwd_{i}", [grad, relu], act, module=f"{mod}.act")
        g.add(f"wgrad_{i}", [d_mm] + ([prev] if prev is not None else []),
              width * width * dtype_bytes, flops=mm_flops, module=f"{mod}.linear",
              is_output=True)
        if i:
            grad = g.add(f"dgrad_{i}", [d_mm], act, flops=mm_flops, module=f"{mod}.linear")
    return g.problem(f"chain{layers}", generator="chain", layers=layers, width=width, batch=batch)


def diamond(size: int = 1 << 20) -> Problem:
    """a -> (b, c) -> d -> loss: two branches that the backward needs at different times."""
    g = Builder()
    a = g.add("a", [], size, flops=size * 4)
    b = g.add("b", [a], 2 * size, flops=size * 8)
    c = g.add("c", [a], size // 2, flops=size * 64)
    d = g.add("d", [b, c], size, flops=size * 2)
    loss = g.add("loss", [d], 4, is_output=True)
    g.backward()
    gd = g.add("grad_d", [loss, d], size)
    gb = g.add("grad_b", [gd, c], 2 * size)
    gc = g.add("grad_c", [gd, b], size // 2)
    ga = g.add("grad_a", [gb, gc, a], size)
    g.add("wgrad_a", [ga], 4096, is_output=True)
    return g.problem("diamond", generator="diamond", size=size)


def unet(depth: int = 4, channels: int = 32, resolution: int = 128, batch: int = 8,
         dtype_bytes: int = 2) -> Problem:
    """A U-Net: conv, relu and downsampling on the way down, upsampling and a concatenation
    with the long skip connection on the way up; the skips keep early activations alive."""
    g = Builder()

    def shape_bytes(level: int, mult: int = 1) -> int:
        r = resolution >> level
        return batch * channels * (2 ** level) * mult * r * r * dtype_bytes

    def conv_flops(level: int) -> int:
        return 2 * 9 * shape_bytes(level) // dtype_bytes * channels * (2 ** level)

    x, skips, saved = None, [], []
    for lv in range(depth):
        mod = f"down.{lv}"
        conv = g.add(f"down_conv_{lv}", [x] if x is not None else [], shape_bytes(lv),
                     flops=conv_flops(lv), module=f"{mod}.conv", target="aten.convolution")
        act = g.add(f"down_relu_{lv}", [conv], shape_bytes(lv), module=f"{mod}.act")
        skips.append(act)
        saved.append((conv, act))
        x = g.add(f"pool_{lv}", [act], shape_bytes(lv + 1) // 2, module=f"{mod}.pool")
    ups = []
    for lv in reversed(range(depth)):
        mod = f"up.{lv}"
        up = g.add(f"upsample_{lv}", [x], shape_bytes(lv), module=f"{mod}.up")
        cat = g.add(f"cat_{lv}", [up, skips[lv]], shape_bytes(lv, 2), module=f"{mod}.cat")
        conv = g.add(f"up_conv_{lv}", [cat], shape_bytes(lv), flops=2 * conv_flops(lv),
                     module=f"{mod}.conv")
        x = g.add(f"up_relu_{lv}", [conv], shape_bytes(lv), module=f"{mod}.act")
        ups.append((lv, up, cat, conv, x))
    loss = g.add("loss", [x], 4, is_output=True)
    g.backward()
    grad = g.add("grad_loss", [loss], shape_bytes(0))
    skip_grads = {}
    for lv, up, cat, conv, act in ups:
        mod = f"up.{lv}"
        d_conv = g.add(f"up_relu_bwd_{lv}", [grad, act], shape_bytes(lv), module=f"{mod}.act")
        g.add(f"up_wgrad_{lv}", [d_conv, cat], 9 * channels * channels * 8 * dtype_bytes,
              flops=2 * conv_flops(lv), module=f"{mod}.conv", is_output=True)
        d_cat = g.add(f"up_dgrad_{lv}", [d_conv], shape_bytes(lv, 2), flops=2 * conv_flops(lv),
                      module=f"{mod}.conv")
        skip_grads[lv] = g.add(f"split_skip_{lv}", [d_cat], shape_bytes(lv), module=f"{mod}.cat")
        grad = g.add(f"upsample_bwd_{lv}", [d_cat], shape_bytes(lv + 1) // 2, module=f"{mod}.up")
    for lv in reversed(range(depth)):
        mod = f"down.{lv}"
        conv, act = saved[lv]
        d_pool = g.add(f"pool_bwd_{lv}", [grad, act], shape_bytes(lv), module=f"{mod}.pool")
        d_act = g.add(f"skip_add_{lv}", [d_pool, skip_grads[lv]], shape_bytes(lv))
        d_conv = g.add(f"down_relu_bwd_{lv}", [d_act, conv], shape_bytes(lv), module=f"{mod}.act")
        prev = [saved[lv - 1][1]] if lv else []
        g.add(f"down_wgrad_{lv}", [d_conv, *prev], 9 * channels * channels * 4 * dtype_bytes,
              flops=conv_flops(lv), module=f"{mod}.conv", is_output=True)
        if lv:
            grad = g.add(f"down_dgrad_{lv}", [d_conv], shape_bytes(lv), flops=conv_flops(lv),
                         module=f"{mod}.conv")
    return g.problem(f"unet{depth}", generator="unet", depth=depth, channels=channels,
                     resolution=resolution, batch=batch)


def transformer(layers: int = 4, seq: int = 1024, d_model: int = 1024, heads: int = 16,
                batch: int = 4, dtype_bytes: int = 2, dropout: bool = True) -> Problem:
    """A GPT-style stack: per block a layer-norm (a tuple op with getitems), q/k/v matmuls with
    views, attention scores, softmax, dropout (random: a tuple op of output and mask), the
    attention matmul, projection, residual, a second layer-norm, an MLP with gelu, a residual;
    then a loss and the backward in autograd's order. About 22 forward and 30 backward ops per
    block, so `layers` = 10 gives ~500 ops and `layers` = 190 ~10,000."""
    g = Builder()
    tok = batch * seq
    act = tok * d_model * dtype_bytes
    scores = batch * heads * seq * seq * dtype_bytes
    stats = tok * 4 * 2  # fp32 mean and rstd
    mm = 2 * tok * d_model * d_model
    att_flops = 2 * batch * seq * seq * d_model
    w = d_model * d_model * dtype_bytes
    x = g.add("embed", [], act, module="embed", not_recomputable=None)
    blocks = []
    for i in range(layers):
        p = f"layers.{i}"
        f = {}
        f["ln1"] = g.add(f"{p}.ln1", [x], kind=Kind.TUPLE, temp=act + stats, module=f"{p}.ln1",
                         target="aten.native_layer_norm")
        f["ln1_y"] = g.add(f"{p}.ln1.y", [f["ln1"]], act, module=f"{p}.ln1", cost=0.0)
        f["ln1_s"] = g.add(f"{p}.ln1.stats", [f["ln1"]], stats, module=f"{p}.ln1", cost=0.0)
        for n in "qkv":
            f[n] = g.add(f"{p}.attn.{n}", [f["ln1_y"]], act, flops=mm, module=f"{p}.attn.{n}_proj",
                         target="aten.mm.default")
            f[n + "_h"] = g.add(f"{p}.attn.{n}.view", [f[n]], kind=Kind.VIEW, module=f"{p}.attn")
        f["kT"] = g.add(f"{p}.attn.k.transpose", [f["k_h"]], kind=Kind.VIEW, module=f"{p}.attn")
        f["scores"] = g.add(f"{p}.attn.scores", [f["q_h"], f["kT"]], scores, flops=att_flops,
                            module=f"{p}.attn", target="aten.bmm.default")
        f["softmax"] = g.add(f"{p}.attn.softmax", [f["scores"]], scores, module=f"{p}.attn")
        probs = f["softmax"]
        if dropout:
            f["drop"] = g.add(f"{p}.attn.dropout", [f["softmax"]], kind=Kind.TUPLE,
                              temp=scores + scores // dtype_bytes, module=f"{p}.attn.dropout",
                              not_recomputable=Reason.RANDOM, target="aten.native_dropout")
            f["drop_y"] = g.add(f"{p}.attn.dropout.y", [f["drop"]], scores, cost=0.0,
                                module=f"{p}.attn.dropout")
            f["mask"] = g.add(f"{p}.attn.dropout.mask", [f["drop"]], scores // dtype_bytes,
                              cost=0.0, module=f"{p}.attn.dropout")
            probs = f["drop_y"]
        f["probs"] = probs
        f["ctx"] = g.add(f"{p}.attn.ctx", [probs, f["v_h"]], act, flops=att_flops,
                         module=f"{p}.attn", target="aten.bmm.default")
        f["ctx_v"] = g.add(f"{p}.attn.ctx.view", [f["ctx"]], kind=Kind.VIEW, module=f"{p}.attn")
        f["proj"] = g.add(f"{p}.attn.proj", [f["ctx_v"]], act, flops=mm, module=f"{p}.attn.proj")
        f["res1"] = g.add(f"{p}.res1", [x, f["proj"]], act, module=p)
        f["ln2"] = g.add(f"{p}.ln2", [f["res1"]], kind=Kind.TUPLE, temp=act + stats,
                         module=f"{p}.ln2")
        f["ln2_y"] = g.add(f"{p}.ln2.y", [f["ln2"]], act, module=f"{p}.ln2", cost=0.0)
        f["ln2_s"] = g.add(f"{p}.ln2.stats", [f["ln2"]], stats, module=f"{p}.ln2", cost=0.0)
        f["fc1"] = g.add(f"{p}.mlp.fc1", [f["ln2_y"]], 4 * act, flops=4 * mm,
                         module=f"{p}.mlp.fc1")
        f["gelu"] = g.add(f"{p}.mlp.gelu", [f["fc1"]], 4 * act, module=f"{p}.mlp.act")
        f["fc2"] = g.add(f"{p}.mlp.fc2", [f["gelu"]], act, flops=4 * mm, module=f"{p}.mlp.fc2")
        x = f["res2"] = g.add(f"{p}.res2", [f["res1"], f["fc2"]], act, module=p)
        f["input"] = blocks[-1]["res2"] if blocks else 0
        blocks.append(f)
    lnf = g.add("ln_f", [x], act, module="ln_f")
    loss = g.add("loss", [lnf], 4, flops=2 * tok * d_model * 1000, is_output=True, module="head")
    g.backward()
    grad = g.add("grad.ln_f", [loss, x], act, module="ln_f")
    for i in reversed(range(layers)):
        p, f = f"layers.{i}", blocks[i]
        x_in = f["input"]

        def wgrad(name, inputs, n=1):
            g.add(f"{p}.{name}.wgrad", inputs, n * w, flops=n * mm, module=f"{p}.{name}",
                  is_output=True)

        # MLP
        wgrad("mlp.fc2", [grad, f["gelu"]], 4)
        d_gelu = g.add(f"{p}.mlp.fc2.dgrad", [grad], 4 * act, flops=4 * mm, module=f"{p}.mlp.fc2")
        d_fc1 = g.add(f"{p}.mlp.gelu.bwd", [d_gelu, f["fc1"]], 4 * act, module=f"{p}.mlp.act")
        wgrad("mlp.fc1", [d_fc1, f["ln2_y"]], 4)
        d_ln2 = g.add(f"{p}.mlp.fc1.dgrad", [d_fc1], act, flops=4 * mm, module=f"{p}.mlp.fc1")
        d_res1 = g.add(f"{p}.ln2.bwd", [d_ln2, f["res1"], f["ln2_s"]], act, module=f"{p}.ln2")
        grad = g.add(f"{p}.res2.bwd", [d_res1, grad], act, module=p)
        # attention
        wgrad("attn.proj", [grad, f["ctx_v"]])
        d_ctx = g.add(f"{p}.attn.proj.dgrad", [grad], act, flops=mm, module=f"{p}.attn.proj")
        d_ctx_v = g.add(f"{p}.attn.ctx.dview", [d_ctx], kind=Kind.VIEW, module=f"{p}.attn")
        d_probs = g.add(f"{p}.attn.ctx.bwd_probs", [d_ctx_v, f["v_h"]], scores,
                        flops=att_flops, module=f"{p}.attn")
        d_v = g.add(f"{p}.attn.ctx.bwd_v", [d_ctx_v, f["probs"]], act, flops=att_flops,
                    module=f"{p}.attn")
        if dropout:
            d_soft = g.add(f"{p}.attn.dropout.bwd", [d_probs, f["mask"]], scores,
                           module=f"{p}.attn.dropout")
        else:
            d_soft = d_probs
        d_scores = g.add(f"{p}.attn.softmax.bwd", [d_soft, f["softmax"]], scores,
                         module=f"{p}.attn")
        d_q = g.add(f"{p}.attn.scores.bwd_q", [d_scores, f["kT"]], act, flops=att_flops,
                    module=f"{p}.attn")
        d_k = g.add(f"{p}.attn.scores.bwd_k", [d_scores, f["q_h"]], act, flops=att_flops,
                    module=f"{p}.attn")
        d_ln1 = None
        for n, d in (("v", d_v), ("k", d_k), ("q", d_q)):
            wgrad(f"attn.{n}_proj", [d, f["ln1_y"]])
            dx = g.add(f"{p}.attn.{n}_proj.dgrad", [d] + ([d_ln1] if d_ln1 is not None else []),
                       act, flops=mm, module=f"{p}.attn.{n}_proj")
            d_ln1 = dx
        d_x = g.add(f"{p}.ln1.bwd", [d_ln1, x_in, f["ln1_s"]], act, module=f"{p}.ln1")
        grad = g.add(f"{p}.res1.bwd", [d_x, grad], act, module=p)
    g.add("embed.wgrad", [grad], 50_000 * d_model * dtype_bytes // 64, is_output=True,
          module="embed")
    return g.problem(f"transformer{layers}", generator="transformer", layers=layers, seq=seq,
                     d_model=d_model, heads=heads, batch=batch)


def transformer_ops(target: int, **kwargs) -> Problem:
    """A transformer stack with about `target` ops."""
    per_block = len(transformer(layers=2, **kwargs)) - len(transformer(layers=1, **kwargs))
    return transformer(layers=max(1, round((target - 5) / per_block)), **kwargs)


def random_problem(source: random.Random | int | Callable, *, max_forward: int = 10,
                   max_backward: int = 8, max_size: int = 100, max_cost: int = 10,
                   p_view: float = 0.1, p_tuple: float = 0.1, p_fixed: float = 0.1,
                   p_temp: float = 0.2, p_zero: float = 0.05) -> Problem:
    """A random step: a forward DAG (some views, some tuple ops with two getitems, some ops
    that may not be recomputed, some zero-byte tensors), a loss, and a backward whose ops read
    forward values and earlier gradients, some of them parameter gradients. Costs are whole
    seconds, so that sums compare exactly. `source` is a Random, a seed, or hypothesis's
    `draw` (then the seed is drawn)."""
    if isinstance(source, random.Random):
        rng = source
    elif isinstance(source, int):
        rng = random.Random(source)
    else:
        from hypothesis import strategies as st

        rng = random.Random(source(st.integers(0, 2 ** 32 - 1)))
    g = Builder()
    n_forward = rng.randint(1, max_forward)
    tensors: list[int] = []  # forward values an op may read (no tuple ops)

    def size() -> int:
        return 0 if rng.random() < p_zero else rng.randint(1, max_size)

    def temp() -> int:
        return rng.randint(1, max_size) if rng.random() < p_temp else 0

    def cost() -> float:
        return float(rng.randint(0, max_cost))

    def fixed() -> Reason | None:
        return Reason.RANDOM if rng.random() < p_fixed else None

    while len(g.ops) < n_forward:
        k = len(g.ops)
        inputs = rng.sample(tensors, min(len(tensors), rng.randint(0, 2)))
        roll = rng.random()
        if inputs and roll < p_view:
            tensors.append(g.add(f"view{k}", inputs[:1], kind=Kind.VIEW, cost=0.0))
        elif roll < p_view + p_tuple:
            t = g.add(f"tuple{k}", inputs, kind=Kind.TUPLE, temp=temp(), cost=cost(),
                      not_recomputable=fixed())
            for j in range(2):
                tensors.append(g.add(f"get{k}_{j}", [t], size(), cost=0.0))
        else:
            # Some are handed back when the forward ends (a buffer's new value).
            tensors.append(g.add(f"op{k}", inputs, size(), temp=temp(), cost=cost(),
                                 not_recomputable=fixed(), forward_output=rng.random() < 0.1))
    loss = g.add("loss", [tensors[-1]], rng.randint(1, 4), cost=1.0, is_output=True)
    g.backward()
    grads = [loss]
    for k in range(rng.randint(0, max_backward)):
        inputs = rng.sample(tensors, min(len(tensors), rng.randint(0, 2)))
        inputs += rng.sample(grads, min(len(grads), rng.randint(1, 2)))
        grads.append(g.add(f"bwd{k}", sorted(set(inputs)), size(), temp=temp(), cost=cost(),
                           is_output=rng.random() < 0.2))
    return g.problem("random")


def with_free_values(problem: Problem, rng: random.Random, share: float = 0.5) -> Problem:
    """`problem` with about `share` of its forward tensor ops (recomputable, not outputs, of
    some bytes) made values a compiled step fuses into their readers
    (`Problem.fused_recomputations`): no cost, no FLOPs, named in ``source["free_recompute"]``.
    The simulator then holds a recomputed copy of one serving one op at no bytes. A tensor
    taken out of a tuple is never one (a real step's are pointwise ops' values)."""
    ops, names = list(problem.ops), {}
    for i in problem.forward:
        op = ops[i]
        if (op.kind is Kind.TENSOR and op.size and op.not_recomputable is None
                and tuple_of(problem, i) is None
                and not op.is_output and not op.forward_output and rng.random() < share):
            names[op.name] = op.cost
            ops[i] = replace(op, cost=0.0, flops=0)
    return Problem(tuple(ops), name=problem.name,
                   source={**problem.source, "free_recompute": names})
