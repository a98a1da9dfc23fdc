"""Running a plan eagerly, as per-block selective checkpointing in the user's own loop (FSDP2,
DDP, Hugging Face): which ops of each block a policy may cache and the problem the eager
planner solves (`policy`), what eager PyTorch really dispatches in each block (`probe`), the
policies as picklable data (`block_policy`), and wrapping the blocks in place (`apply`).

Uses `tracing` and `lowering` below it, and `remat.solvers`."""
from remat.fx_passes.eager.apply import apply_eager
from remat.fx_passes.eager.block_policy import BlockPolicy, with_cache
from remat.fx_passes.eager.eager_bytes import eager_problem
from remat.fx_passes.eager.policy import block_paths, eager_blocks
from remat.fx_passes.eager.probe import probe

__all__ = ["apply_eager", "BlockPolicy", "with_cache", "block_paths", "eager_blocks",
           "eager_problem", "probe"]
