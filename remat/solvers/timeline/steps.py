"""The kinds of step a training step runs (`remat.solvers.timeline.simulate.step_order`), in a
module of their own so that both the simulator and the transfer timeline
(`remat.solvers.timeline.overlap`), which the simulator uses, can name them."""
from __future__ import annotations

import enum


class StepKind(str, enum.Enum):
    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    RELOAD = "reload"  # an offloaded value copied back from host memory
