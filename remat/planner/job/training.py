"""What a training step holds whatever the activation plan is: the `Training` configuration and
the state it implies (weights, master copy, gradients, optimizer state) in bytes per parameter, as
`Precision` and `Optimizer` list them.

Torch-free: parameters are anything with a `.shape` (real, fake or meta tensors, or plain tuples
of ints), given as a module with `named_parameters()` or as (name, shape) pairs.
"""
from __future__ import annotations

import enum
import fnmatch
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from remat.planner.job.budget import parse_size

log = logging.getLogger(__name__)


class Precision(str, enum.Enum):
    """How weights, gradients and the master copy are stored, with their bytes per parameter."""

    FP32 = "fp32"
    """fp32 weights, fp32 gradients, no master copy: 4 + 4 bytes per parameter."""
    BF16_MIXED = "bf16-mixed"
    """bf16 weights for compute, an fp32 master copy, fp32 gradients: 2 + 4 + 4."""
    BF16 = "bf16"
    """bf16 weights and gradients, an fp32 master copy: 2 + 4 + 2."""
    FP16 = "fp16"
    """fp16 weights, fp32 gradients, no master copy counted: 2 + 4."""
    AUTOCAST = "autocast"
    """torch.autocast over fp32 weights: 4 + 4, and a bf16 copy of each weight (2) cached while
    the forward runs and held by the backward's saved tensors."""


class Optimizer(str, enum.Enum):
    ADAM = "adam"
    ADAMW = "adamw"
    SGD = "sgd"
    SGD_MOMENTUM = "sgd_momentum"
    LION = "lion"
    ADAFACTOR = "adafactor"
    ADAM8BIT = "adam8bit"


@dataclass(frozen=True)
class _Layout:
    weight: int  # bytes per parameter of the weights the matmuls read
    master: int  # fp32 master copy, 0 if none
    grad: int  # bytes per parameter of the gradients the optimizer reads
    cast_copy: int = 0  # autocast's low-precision weight copies
    compute_dtype: str = "bfloat16"  # whose peak FLOP/s of the device applies (torch's name)


_LAYOUTS = {
    Precision.FP32: _Layout(weight=4, master=0, grad=4, compute_dtype="float32"),
    Precision.BF16_MIXED: _Layout(weight=2, master=4, grad=4),
    Precision.BF16: _Layout(weight=2, master=4, grad=2),
    Precision.FP16: _Layout(weight=2, master=0, grad=4, compute_dtype="float16"),
    Precision.AUTOCAST: _Layout(weight=4, master=0, grad=4, cast_copy=2),
}

# bitsandbytes' blockwise 8-bit optimizers (Dettmers et al., 2022): two uint8 moments, one fp32
# absmax scale per block of 2048 values per moment, and tensors under 4096 values kept in fp32.
ADAM8BIT_BLOCK = 2048
ADAM8BIT_MIN_SIZE = 4096


@dataclass(frozen=True, kw_only=True)
class Training:
    """How the model is trained: everything besides the activations that decides the memory of a
    step. Strings are accepted for the enums ("adamw", "bf16-mixed") and sizes ("1GiB")."""

    precision: Precision = Precision.FP32
    """Storage of weights, gradients and the master copy; see `Precision`."""
    optimizer: Optimizer = Optimizer.ADAMW
    """The optimizer, which decides the state kept per trainable parameter."""
    data_parallel: int = 1
    """Number of data-parallel ranks that ZeRO shards state across."""
    zero_stage: int = 0
    """ZeRO stage: 0 shards nothing (with data_parallel > 1: DDP, whose gradient buckets are
    state, `StateMemory.buckets`); 1 the optimizer state and master copy; 2 also the
    gradients; 3 also the weights (FSDP). From 2 on, the step is planned with FSDP2's
    collectives (remat.fx_passes.lowering.sharding): each block's full gradients live until its
    reduce-scatter, and from 3 on its full parameters from its all-gather to its reshard;
    these count as activations, the shards as state."""
    prefetch: int = 1
    """ZeRO-3/FSDP: how many blocks ahead a block's parameters are all-gathered, in the forward
    and in the backward (1, as FSDP2 overlaps communication by default on a GPU)."""
    backward_prefetch: int | None = None
    """ZeRO-3/FSDP: the same in the backward, where it differs (None: `prefetch`). FSDP2 with
    no explicit prefetch and synchronous collectives (gloo on a CPU) gathers no block ahead in
    the forward and one in the backward (its implicit backward prefetch):
    ``prefetch=0, backward_prefetch=1``."""
    reshard_after_forward: bool = True
    """ZeRO-3/FSDP: whether a block's gathered parameters are freed after its forward and
    gathered again for its backward (FSDP2's `fully_shard(reshard_after_forward=...)`); False
    keeps them from the forward to the block's backward (FSDP2's ZeRO-2-like mode: weights
    sharded between steps, whole during it)."""
    frozen: frozenset[str] | Callable[[str], bool] = frozenset()
    """Parameters that are not trained (no gradients, no master copy, no optimizer state): names
    or fnmatch patterns ("model.embed_tokens.*"), or a predicate on the name. Parameters whose
    `requires_grad` is False are frozen too."""
    reserve: int = 2**30
    """Bytes the step cannot use: CUDA context, library workspaces (default 1 GiB)."""
    fragmentation: float = 0.10
    """Fraction of the budget left free for the allocator's fragmentation."""
    host_memory: int | str | None = None
    """Bytes of host memory per rank that offloaded activations may hold ("64GB"; pinned
    buffers, one per offloaded tensor, allocated ahead): a bound on what
    ``optimize(..., offload=True)`` moves to the host. None: no bound."""
    tensor_parallel: int | None = None
    """Tensor-parallel ranks the model is sharded over (DTensor, `parallelize_module`). The
    plan is per TP rank and the sharding is read from the parallelized model's placements,
    never guessed: a model with DTensor parameters must lie on a TP mesh of this size; with
    `tensor_parallel > 1`, a model without them is refused (parallelize it first, or on
    `remat.planner.parallel.tensor_parallel.fake_tensor_parallel(N)`). None: as the model is
    (remat.planner.job.tensor_layout). Such a model is planned in execution="eager" only."""
    sequence_parallel: bool | None = None
    """Whether the TP model runs sequence parallelism (SequenceParallel styles on its norms,
    the residual stream sharded along the sequence): checked against the styles found on the
    model (remat.planner.job.tensor_layout). None: as the model is."""

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("precision", _enum(Precision, self.precision, "precision"))
        set_("optimizer", _enum(Optimizer, self.optimizer, "optimizer"))
        set_("reserve", parse_size(self.reserve, allow_zero=True))
        if self.host_memory is not None:
            set_("host_memory", parse_size(self.host_memory, allow_zero=True))
        if not callable(self.frozen):
            names = [self.frozen] if isinstance(self.frozen, str) else self.frozen
            set_("frozen", frozenset(names))
        if isinstance(self.data_parallel, bool) or not isinstance(self.data_parallel, int) \
                or self.data_parallel < 1:
            raise ValueError(f"data_parallel must be an int >= 1, not {self.data_parallel!r}")
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, not {self.zero_stage!r}")
        for name in ("prefetch", "backward_prefetch"):
            value = getattr(self, name)
            if name == "backward_prefetch" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, not {value!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError("reshard_after_forward must be True or False, not "
                             f"{self.reshard_after_forward!r}")
        if self.tensor_parallel is not None and (
                isinstance(self.tensor_parallel, bool) or not isinstance(self.tensor_parallel, int)
                or self.tensor_parallel < 1):
            raise ValueError("tensor_parallel must be an int >= 1 (or None: as the model is "
                             f"parallelized), not {self.tensor_parallel!r}")
        if self.sequence_parallel not in (None, True, False):
            raise ValueError("sequence_parallel must be True, False or None (as the model is), "
                             f"not {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("sequence_parallel=True shards the sequence over the "
                             "tensor-parallel ranks: it needs tensor_parallel > 1")
        if not (isinstance(self.fragmentation, (int, float)) and 0 <= self.fragmentation < 1):
            raise ValueError(f"fragmentation must be a fraction in [0, 1), "
                             f"not {self.fragmentation!r}")

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter of the weights the step computes with."""
        return _LAYOUTS[self.precision].weight

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of the gradients the optimizer reads."""
        return _LAYOUTS[self.precision].grad

    @property
    def compute_dtype(self) -> str:
        """"bfloat16", "float16" or "float32": whose peak FLOP/s bound the step's matmuls."""
        return _LAYOUTS[self.precision].compute_dtype

    def is_frozen(self, name: str, param: Any = None) -> bool:
        if param is not None and getattr(param, "requires_grad", True) is False:
            return True
        if callable(self.frozen):
            return bool(self.frozen(name))
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.frozen)

    def margin(self, budget: int) -> int:
        """The fragmentation margin for a whole-step budget, rounded up (it is kept free)."""
        return math.ceil(self.fragmentation * budget)

    def to_dict(self) -> dict:
        return {"precision": self.precision.value, "optimizer": self.optimizer.value,
                "data_parallel": self.data_parallel, "zero_stage": self.zero_stage,
                "prefetch": self.prefetch, "backward_prefetch": self.backward_prefetch,
                "reshard_after_forward": self.reshard_after_forward,
                "frozen": "<predicate>" if callable(self.frozen) else sorted(self.frozen),
                "reserve": self.reserve, "fragmentation": self.fragmentation,
                "host_memory": self.host_memory, "tensor_parallel": self.tensor_parallel,
                "sequence_parallel": self.sequence_parallel}


def _enum(cls: type[enum.Enum], value: Any, what: str):
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown {what} {value!r}; choose one of: {known}") from None


@dataclass(frozen=True)
class StateMemory:
    """Bytes of the state a step holds whatever the plan is, per rank, by term.

    `gradients` is the gradient storage the configuration keeps (fp32 accumulation buffers for
    bf16-mixed and fp16): how it adds to the step's peak is decided in
    `remat.planner.job.accounting`, because the captured graph makes gradients of its own."""

    parameters: int
    """Number of parameters, trainable and frozen."""
    trainable: int
    """Number of trainable parameters."""
    weights: int
    cast_copies: int
    master: int
    gradients: int
    optimizer: int
    buckets: int = 0
    """DDP (data_parallel > 1, zero_stage 0): the reducer's flat buckets, one more copy of
    every trainable gradient, allocated when the model is wrapped and kept all along
    (`DistributedDataParallel`'s default, gradient_as_bucket_view=False)."""
    batch: int = 0
    """The micro-batch's tensors (inputs, labels) on the device all step: graph inputs, held
    whatever the plan, so not activations."""
    buffers: int = 0
    """The modules' buffers (BatchNorm statistics, rotary tables), likewise."""

    @property
    def total(self) -> int:
        return (self.weights + self.cast_copies + self.master + self.gradients + self.optimizer
                + self.buckets + self.batch + self.buffers)

    def to_dict(self) -> dict:
        return {"parameters": self.parameters, "trainable": self.trainable,
                "weights": self.weights, "cast_copies": self.cast_copies,
                "master": self.master, "gradients": self.gradients,
                "optimizer": self.optimizer, "buckets": self.buckets, "batch": self.batch,
                "buffers": self.buffers, "total": self.total}


def named_shapes(params: Any) -> list[tuple[str, tuple[int, ...], Any]]:
    """(name, shape, the parameter or None) for a module, (name, tensor) or (name, shape) pairs,
    or a bare list of shapes. A DTensor parameter (tensor parallel) counts as its local shard,
    what its placements leave this rank."""
    if hasattr(params, "named_parameters"):
        params = params.named_parameters()
    out = []
    for i, item in enumerate(params):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, p = item
        else:
            name, p = f"param{i}", item
        if hasattr(p, "to_local"):  # a DTensor (tensor parallel): this rank's shard
            p = p.to_local()
        shape = tuple(p.shape) if hasattr(p, "shape") else tuple(p)
        out.append((name, tuple(int(d) for d in shape), p if hasattr(p, "shape") else None))
    return out


def optimizer_state_bytes(optimizer: Optimizer, shape: tuple[int, ...]) -> int:
    """Bytes of optimizer state for one trainable parameter of `shape`."""
    n = math.prod(shape)
    if optimizer in (Optimizer.ADAM, Optimizer.ADAMW):
        return 8 * n  # two fp32 moments
    if optimizer is Optimizer.SGD:
        return 0
    if optimizer in (Optimizer.SGD_MOMENTUM, Optimizer.LION):
        return 4 * n  # one fp32 momentum
    if optimizer is Optimizer.ADAFACTOR:
        # Factored second moment over the last two dims (rows and columns), no first moment
        # (Adafactor's default beta1=None); vectors keep a full second moment.
        if len(shape) < 2:
            return 4 * n
        rows = math.prod(shape[:-1])
        cols = math.prod(shape[:-2]) * shape[-1]
        return 4 * (rows + cols)
    if optimizer is Optimizer.ADAM8BIT:
        if n < ADAM8BIT_MIN_SIZE:
            return 8 * n
        return 2 * n + 2 * 4 * math.ceil(n / ADAM8BIT_BLOCK)
    raise AssertionError(optimizer)


def state_memory(params: Any, training: Training = Training()) -> StateMemory:
    """The state of one rank: weights, autocast copies, master copy, gradients and optimizer
    state, from the parameters' shapes and the configuration. ZeRO divides the
    sharded terms by the data-parallel size, rounding up (a rank holds the larger shard)."""
    layout = _LAYOUTS[training.precision]
    total = trainable = opt = 0
    for name, shape, p in named_shapes(params):
        n = math.prod(shape)
        total += n
        if not training.is_frozen(name, p):
            trainable += n
            opt += optimizer_state_bytes(training.optimizer, shape)
    shard = lambda nbytes, stage: -(-nbytes // training.data_parallel) \
        if training.zero_stage >= stage else nbytes  # noqa: E731
    # ZeRO-1 partitions the optimizer's state, which includes the fp32 master copy (ZeRO paper,
    # Rajbhandari et al. 2020, "K = 12" for mixed-precision Adam).
    weights = shard(layout.weight * total, 3)
    if training.zero_stage == 3 and training.precision is Precision.BF16_MIXED:
        # FSDP2's MixedPrecisionPolicy keeps the fp32 shards (the master weights) and casts them
        # to bf16 as it all-gathers: no bf16 shard of its own. Frozen parameters keep theirs.
        weights = shard(layout.weight * (total - trainable), 3)
    return StateMemory(
        parameters=total, trainable=trainable,
        weights=weights,
        cast_copies=shard(layout.cast_copy * total, 3),
        master=shard(layout.master * trainable, 1),
        gradients=shard(layout.grad * trainable, 2),
        optimizer=shard(opt, 1),
        buckets=layout.grad * trainable if training.data_parallel > 1
        and training.zero_stage == 0 else 0,
    )
