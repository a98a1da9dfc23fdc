"""CNN-shaped synthetic training steps with long skip connections (U-Nets, VGG-like chains
with skips): the graphs on which a second recomputation or one within the forward pays, small
enough for the exhaustive search over the richer execution model (`tests.oracles.rich_brute`).
Backward ops read what autograd's would: ReLU backward its output, a convolution's weight
gradient its input, concatenation's backward only views of its gradient, average pooling's
backward its input, the MSE loss's backward the prediction."""
from __future__ import annotations

import random

from remat.solvers.core.problem import Kind, Problem
from tests.synthetic.problems import Builder


class _ConvNet:
    """Builds CNN training steps the way autograd records them: a conv with its ReLU in place
    (one storage) whose backward reads the ReLU's output (threshold_backward), the conv's input
    (the weight gradient) and nothing else (the data gradient needs only the weight, a
    parameter); average pooling whose backward reads its input; nearest upsampling and
    concatenation whose backwards read only their gradient (a concatenation's gradient is
    views of it); an MSE loss whose backward reads the prediction. Activations are
    batch x channels x side x side in bf16; costs are a roofline (`Builder.add`)."""

    def __init__(self, batch: int, dtype_bytes: int = 2):
        self.g = Builder()
        self.batch, self.dtype_bytes = batch, dtype_bytes
        self.shape: dict[int, tuple[int, int]] = {}  # value -> (channels, side)
        self.convs: list[tuple[int, int | None, int, int]] = []  # (out, input, c_in, kernel)

    def nbytes(self, channels: int, side: int) -> int:
        return self.batch * channels * side * side * self.dtype_bytes

    def conv(self, name: str, x: int | None, c_in: int, c_out: int, side: int,
             kernel: int = 3) -> int:
        flops = 2 * self.batch * side * side * c_in * c_out * kernel * kernel
        out = self.g.add(name, [x] if x is not None else [], self.nbytes(c_out, side),
                         flops=flops, module=name, target="aten.convolution+relu_")
        self.shape[out] = (c_out, side)
        self.convs.append((out, x, c_in, kernel))
        return out

    def pool(self, name: str, x: int) -> int:
        c, side = self.shape[x]
        out = self.g.add(name, [x], self.nbytes(c, side // 2), module=name,
                         target="aten.avg_pool2d")
        self.shape[out] = (c, side // 2)
        return out

    def upsample(self, name: str, x: int) -> int:
        c, side = self.shape[x]
        out = self.g.add(name, [x], self.nbytes(c, side * 2), module=name,
                         target="aten.upsample_nearest2d")
        self.shape[out] = (c, side * 2)
        return out

    def cat(self, name: str, a: int, b: int) -> int:
        (ca, side), (cb, _) = self.shape[a], self.shape[b]
        out = self.g.add(name, [a, b], self.nbytes(ca + cb, side), module=name,
                         target="aten.cat")
        self.shape[out] = (ca + cb, side)
        return out

    def add(self, name: str, a: int, b: int) -> int:
        out = self.g.add(name, [a, b], self.g.ops[a].size, module=name, target="aten.add")
        self.shape[out] = self.shape[a]
        return out

    def loss(self, x: int) -> int:
        return self.g.add("loss", [x], 4, is_output=True, target="aten.mse_loss")


def _conv_backward(net: _ConvNet, out: int, grad: int) -> int | None:
    """The ReLU and conv backward of `out` (from the conv's record); the data gradient, or
    None for the first conv (its input is the batch, which needs no gradient)."""
    g = net.g
    _, x, c_in, kernel = next(c for c in net.convs if c[0] == out)
    c_out, side = net.shape[out]
    name = g.ops[out].name
    d = g.add(f"{name}.relu_bwd", [grad, out], g.ops[out].size, module=name)
    flops = 2 * net.batch * side * side * c_in * c_out * kernel * kernel
    g.add(f"{name}.wgrad", [d] + ([x] if x is not None else []),
          c_in * c_out * kernel * kernel * net.dtype_bytes, flops=flops, module=name,
          is_output=True)
    if x is None:
        return None
    return g.add(f"{name}.dgrad", [d], g.ops[x].size, flops=flops, module=name)


def _jitter(rng: random.Random, value: int, spread: float = 0.25) -> int:
    """`value` scaled by a random factor in [1 - spread, 1 + spread], at least 1."""
    return max(1, round(value * rng.uniform(1 - spread, 1 + spread)))


def unet_problem(levels: int = 2, width: int = 16, seed: int = 0, *, convs: int = 1,
                 side: int = 64, batch: int = 8) -> Problem:
    """A small U-Net training step with long skip connections: per level `convs` convs and an
    average pool on the way down, `convs` bottleneck convs, per level an upsample, a
    concatenation with the skip (the level's last conv) and `convs` convs on the way up, a 1x1
    head and an MSE loss. Channels double and sides halve with depth (channel counts jittered
    by `seed`). (3 * levels + 1) * convs + 2 * levels + 2 forward ops: (1, convs=1 or 2) and
    (2, convs=1) are small enough for `rich_brute_force`."""
    rng = random.Random(seed)
    net = _ConvNet(batch)
    g = net.g

    def block(name, x, c_in, c_out, side):
        outs = []
        for k in range(convs):
            x = net.conv(f"{name}.conv{k}", x, c_in, c_out, side)
            outs.append(x)
            c_in = c_out
        return outs

    x, c, s, downs, skips = None, 3, side, [], []
    for lv in range(levels):
        c_out = _jitter(rng, width << lv)
        downs.append(block(f"down{lv}", x, c, c_out, s))
        skips.append(downs[-1][-1])
        x, c, s = net.pool(f"down{lv}.pool", skips[-1]), c_out, s // 2
    c_out = _jitter(rng, width << levels)
    mid = block("mid", x, c, c_out, s)
    x, c = mid[-1], c_out
    ups = []
    for lv in reversed(range(levels)):
        up = net.upsample(f"up{lv}.upsample", x)
        cat = net.cat(f"up{lv}.cat", up, skips[lv])
        c_out = _jitter(rng, width << lv)
        outs = block(f"up{lv}", cat, net.shape[cat][0], c_out, s * 2)
        x, c, s = outs[-1], c_out, s * 2
        ups.append((lv, up, cat, outs))
    head = net.conv("head", x, c, 3, s, kernel=1)
    loss = net.loss(head)
    g.backward()
    grad = g.add("loss.bwd", [loss, head], g.ops[head].size, module="loss")
    grad = _conv_backward(net, head, grad)
    skip_grads = {}
    for lv, up, cat, outs in reversed(ups):
        for conv in reversed(outs):
            grad = _conv_backward(net, conv, grad)
        d_up = g.add(f"up{lv}.cat.bwd_up", [grad], kind=Kind.VIEW, module=f"up{lv}.cat")
        skip_grads[lv] = g.add(f"up{lv}.cat.bwd_skip", [grad], kind=Kind.VIEW,
                               module=f"up{lv}.cat")
        grad = g.add(f"up{lv}.upsample.bwd", [d_up], g.ops[g.ops[up].inputs[0]].size,
                     module=f"up{lv}.upsample")
    for conv in reversed(mid):
        grad = _conv_backward(net, conv, grad)
    for lv in reversed(range(levels)):
        conv = skips[lv]
        d_pool = g.add(f"down{lv}.pool.bwd", [grad, conv], g.ops[conv].size,
                       module=f"down{lv}.pool")
        grad = g.add(f"down{lv}.skip_add", [d_pool, skip_grads[lv]], g.ops[conv].size,
                     module=f"down{lv}")
        for conv in reversed(downs[lv]):
            grad = _conv_backward(net, conv, grad)
    return g.problem(f"unet_l{levels}_c{convs}_w{width}_s{seed}", generator="unet_problem",
                     levels=levels, convs=convs, width=width, seed=seed, side=side,
                     batch=batch)


def skip_chain_problem(stages: int = 3, convs: int = 2, width: int = 16, seed: int = 0, *,
                       side: int = 64, batch: int = 8) -> Problem:
    """A VGG-like chain with long skips (hypercolumns): `stages` stages of `convs` convs, an
    average pool after every stage but the last; then each earlier stage's first conv output,
    pooled down to the last side (the long skip: computed where the head needs it, so the
    early activation stays alive across the chain, and its pool's backward reads it early in
    the backward while its own conv's backward reads it late), is concatenated with the last
    features; a 1x1 head and an MSE loss. Channels double and sides halve per stage (jittered
    by `seed`). stages * (convs + 2) + 1 forward ops: (3, 2) is small enough for
    `rich_brute_force`."""
    rng = random.Random(seed)
    net = _ConvNet(batch)
    g = net.g
    x, c, s = None, 3, side
    chain, skips, pool_of = [], [], {}
    for stage in range(stages):
        c_out = _jitter(rng, width << stage)
        for k in range(convs):
            x, c = net.conv(f"s{stage}.conv{k}", x, c, c_out, s), c_out
            chain.append(x)
            if k == 0 and stage < stages - 1:
                skips.append(x)
        if stage < stages - 1:
            pool_of[x] = x = net.pool(f"s{stage}.pool", x)
            s //= 2
    hyper = x
    pooled = {}
    for src in skips:
        pooled[src] = net.g.add(f"{g.ops[src].name}.skip_pool", [src],
                                net.nbytes(net.shape[src][0], s), module="skip",
                                target="aten.avg_pool2d")
        net.shape[pooled[src]] = (net.shape[src][0], s)
        hyper = net.cat(f"{g.ops[src].name}.skip_cat", hyper, pooled[src])
    head = net.conv("head", hyper, net.shape[hyper][0], 3, s, kernel=1)
    loss = net.loss(head)
    g.backward()
    grad = g.add("loss.bwd", [loss, head], g.ops[head].size, module="loss")
    d_hyper = _conv_backward(net, head, grad)
    skip_grads = {}
    for src in reversed(skips):  # each concatenation's gradient: views of its gradient
        name = g.ops[src].name
        d_pooled = g.add(f"{name}.skip_cat.bwd_skip", [d_hyper], kind=Kind.VIEW, module="skip")
        d_hyper = g.add(f"{name}.skip_cat.bwd_main", [d_hyper], kind=Kind.VIEW, module="skip")
        skip_grads[src] = g.add(f"{name}.skip_pool.bwd", [d_pooled, src], g.ops[src].size,
                                module="skip")
    grad = d_hyper
    for out in reversed(chain):
        name = g.ops[out].name
        if out in pool_of:
            grad = g.add(f"{g.ops[pool_of[out]].name}.bwd", [grad, out], g.ops[out].size,
                         module=name)
        if out in skip_grads:
            grad = g.add(f"{name}.skip_add", [grad, skip_grads[out]], g.ops[out].size,
                         module=name)
        grad = _conv_backward(net, out, grad)
    return g.problem(f"skipchain_s{stages}_c{convs}_w{width}_s{seed}",
                     generator="skip_chain_problem", stages=stages, convs=convs, width=width,
                     seed=seed, side=side, batch=batch)
