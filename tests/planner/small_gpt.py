"""The small GPT the planner's report and error tests plan (4 layers, dropout off), and its
module-scoped fixtures: import `model_inputs` and `prepared` into a test module to use them."""
from __future__ import annotations

import pytest

from remat.planner.job.training import Training
from remat.planner.plans.prepare import prepare
from tests.models import GPTConfig, gpt

CONFIG = GPTConfig(block_size=64, vocab_size=256, n_layer=4, n_head=4, n_embd=64, dropout=0.0)
TRAINING = Training(optimizer="adamw", reserve=0, fragmentation=0.0)


@pytest.fixture(scope="module")
def model_inputs():
    return gpt(CONFIG, batch=8)


@pytest.fixture(scope="module")
def prepared(model_inputs):
    model, inputs = model_inputs
    return prepare(model, inputs, training=TRAINING)
