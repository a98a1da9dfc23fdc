"""Random eager structures over random steps (`synthetic.random_problem`), for the tests of the
exact eager model against brute force: blocks of consecutive forward ops, backward ops owned by
the block they read, and each of `EagerBlocks`' finer facts (packers, node ends, positions made
after another op, forward lifetimes, multi-output groups, the generator's state, backward ops
written in Python, tensors the blocks are called with but never read, Python numbers an
autograd node keeps, tensors eager makes that no op reads) drawn at random, as the torch
side may report them. Half the structures are one module run several times (ALBERT's shared
layer): the torch side makes a block per call, named for the module and the call, and an
unread input is then held across the calls."""
from __future__ import annotations

import random

from remat.solvers.timeline.eager_blocks import EagerBlocks
from remat.solvers.core.problem import Kind, Problem, recompute_blocker, tuple_of
from tests.synthetic.problems import random_problem


def random_eager(seed: int, *, max_forward: int = 9, max_backward: int = 7,
                 max_cacheable: int = 10, decisions: bool = False
                 ) -> tuple[Problem, EagerBlocks]:
    """`decisions`: the blocks' tensors that may not be recomputed are cacheable too, as the
    torch side makes routing decisions (top-k), which every policy caches (`always_cached`);
    drawing nothing more, the structure is otherwise the same as without."""
    rng = random.Random(seed)
    problem = random_problem(rng, max_forward=max_forward, max_backward=max_backward)
    while problem.num_forward < max_forward // 2 or len(problem.backward) < max_backward // 2:
        problem = random_problem(rng, max_forward=max_forward, max_backward=max_backward)
    ops, nf = problem.ops, problem.num_forward
    # Blocks: one to three runs of consecutive forward ops, the loss outside (a model's head).
    cuts = sorted({rng.randint(0, 1), nf - 1, *rng.sample(range(nf), min(nf, rng.randint(0, 2)))})
    blocks: dict[str, tuple[int, ...]] = {}
    for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
        members = tuple(range(a + rng.randint(0, 1), b))
        if members:
            blocks[f"b{k}"] = members
    if not blocks:
        blocks["b0"] = tuple(range(max(nf - 1, 1)))
    several_runs = len(blocks) > 1 and rng.random() < 0.5
    if several_runs:  # one module's calls, in order
        blocks = {f"layer#{k}": members for k, members in enumerate(blocks.values())}
    block_of = {v: name for name, members in blocks.items() for v in members}
    owner: dict[int, str] = {}
    packer: dict[int, int] = {}
    node_end: dict[int, int] = {}
    for b in problem.backward:
        read = [block_of[s] for s in problem.storage_inputs[b] if s in block_of]
        if read and rng.random() < 0.85:
            owner[b] = rng.choice(read)
        elif rng.random() < 0.15:
            owner[b] = rng.choice(sorted(blocks))
        if b in owner and rng.random() < 0.3:
            packer[b] = rng.choice(blocks[owner[b]])
    # Autograd nodes: runs of consecutive backward ops (a formula of several kernels); a
    # node written in Python frees its temporaries as it goes.
    nodes: list[list[int]] = []
    for b in problem.backward:
        if nodes and rng.random() < 0.35:
            nodes[-1].append(b)
        else:
            nodes.append([b])
    python = rng.random() < 0.5
    python_backward = set()
    for node in nodes:
        node_end.update((b, node[-1]) for b in node[:-1])
        if python and rng.random() < 0.5:
            python_backward.update(node)
    cacheable = [v for v in block_of if ops[v].kind is Kind.TENSOR
                 and recompute_blocker(problem, v) is None and rng.random() < 0.7]
    rng.shuffle(cacheable)
    cacheable = frozenset(cacheable[:max_cacheable])
    if decisions:
        cacheable |= {v for v in block_of if ops[v].kind is Kind.TENSOR
                      and recompute_blocker(problem, v) is not None}
    groups = []
    for t in block_of:
        getitems = [g for g in problem.users[t] if tuple_of(problem, g) == t]
        if ops[t].kind is Kind.TUPLE and cacheable.intersection(getitems) and rng.random() < 0.5:
            groups.append(tuple(getitems))
    position = {v: v + rng.choice((-1.5, -0.5, 0.5, 1.5)) for v in block_of
                if rng.random() < 0.15}
    forward_life = {v: min(nf - 1, v + rng.randint(0, 3)) for v in range(nf)
                    if rng.random() < 0.3}
    state = rng.choice((0, 0, rng.randint(1, 20)))
    names = sorted(blocks)
    unread = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        callers = names if several_runs and rng.random() < 0.7 else rng.sample(
            names, rng.randint(1, len(names)))
        unread.append((rng.randint(1, 30), tuple(callers)))
    kept_numbers = tuple((8, rng.randrange(nf), rng.choice(problem.backward))
                         for _ in range(rng.choice((0, 0, 1, 2))))
    unused = []
    for _ in range(rng.choice((0, 0, 1, 2))):
        first = rng.randrange(nf)
        unused.append((rng.randint(1, 30), first, rng.randint(first, nf - 1),
                       first in block_of and rng.random() < 0.7))
    return problem, EagerBlocks(ops=blocks, owner=owner, packer=packer, cacheable=cacheable,
                                node_end=node_end, position=position,
                                forward_life=forward_life, state_bytes=state,
                                groups=tuple(groups), python_backward=frozenset(python_backward),
                                unread_inputs=tuple(unread), kept_numbers=kept_numbers,
                                unused_tensors=tuple(unused))
