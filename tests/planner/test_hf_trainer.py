"""Hugging Face's Trainer with `remat.for_trainer`: a tiny GPT-2 (built from a config, random
data, dropout on) trained for a few steps with an eval set, then `Trainer.evaluate()` and
`generate()`; every logged loss, the evaluation and the generated tokens equal the untouched
model's trained the same way, and the plan really recomputed."""
import copy
import inspect
import tempfile

import pytest
import torch

import remat
from remat.errors import RematError

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

VOCAB, SEQ, BATCH = 128, 16, 4


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        use_cache=False)  # dropout 0.1 by default
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def data(n: int):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(n)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def collated(rows):
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def train(model, *, remat_on: bool, steps: int = 3, **arguments):
    from transformers import Trainer, TrainingArguments

    rows = data(16)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
            max_steps=steps, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
            logging_steps=1, eval_strategy="steps", eval_steps=2, learning_rate=1e-2, seed=0,
            activation_checkpointing=remat_on, **arguments)
        trainer = Trainer(model=model, args=args, train_dataset=rows[:12],
                          eval_dataset=rows[12:])
        trainer.train()
        evaluated = trainer.evaluate()
    prompt = collated(rows[12:])["input_ids"][:, :4]
    tokens = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                            do_sample=False, pad_token_id=0)
    return trainer.state.log_history, evaluated, tokens


def test_the_trainer_trains_with_a_plan_as_without():
    example = collated(data(BATCH))  # one batch as the default collator makes it
    # Two thirds of the activations of caching everything: the plan must recompute.
    everything = remat.optimize(gpt2().train(), activation_budget=10**9, example_kwargs=example,
                                execution="eager", solver="checkpoint_blocks").activation_peak
    expected = train(gpt2(), remat_on=False)
    model = remat.for_trainer(gpt2(), activation_budget=2 * everything // 3,
                              example_kwargs=example, solver="checkpoint_blocks")
    assert model.activation_checkpointing_enable.plan is None  # planned when train() starts
    logged, evaluated, tokens = train(model, remat_on=True)
    plan = model.activation_checkpointing_enable.plan
    assert plan is not None and plan.recompute_flops > 0
    assert all(getattr(block, "_remat_policy", None) is not None
               for block in model.transformer.h)

    # losses (train and eval, every step), gradient norms: the same numbers
    assert numbers(logged) == numbers(expected[0])
    # evaluated at steps 2 and 3 while training, then by evaluate()
    assert sum("eval_loss" in entry for entry in logged) == 3
    assert evaluated["eval_loss"] == expected[1]["eval_loss"]
    assert torch.equal(tokens, expected[2])
    assert model.loss_type is None  # the model as the Trainer inspected it


def numbers(history):
    return [{k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k}
            for entry in history]


def test_the_trainer_s_mixed_precision_is_planned_for():
    """TrainingArguments(bf16=True): accelerate runs the forward under autocast; the plan is
    made under the same autocast, and trains as the untouched model does."""
    example = collated(data(BATCH))
    expected = train(gpt2(), remat_on=False, steps=2, bf16=True)
    model = remat.for_trainer(gpt2(), activation_budget=10**9, example_kwargs=example,
                              solver="checkpoint_blocks")
    logged, evaluated, tokens = train(model, remat_on=True, steps=2, bf16=True)
    plan = model.activation_checkpointing_enable.plan
    assert plan.prepared.call_spec.autocast == (("cpu", "bfloat16"),)
    assert numbers(logged) == numbers(expected[0])
    assert evaluated["eval_loss"] == expected[1]["eval_loss"]
    assert torch.equal(tokens, expected[2])


def evaluate(model) -> dict:
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], disable_tqdm=True,
                                 per_device_eval_batch_size=BATCH)
        return Trainer(model=model, args=args, eval_dataset=data(8)).evaluate()


def test_the_trainer_evaluates_a_compiled_plan_s_module():
    """The Trainer keeps the dataset columns that the model's forward names, and computes an
    evaluation loss where it names labels: plan.module's forward carries the model's
    signature (with (*args, **kwargs), every batch came out empty)."""
    model = gpt2().train()
    untouched = copy.deepcopy(model)
    plan = remat.optimize(model, activation_budget=10**9, example_kwargs=collated(data(BATCH)),
                          solver="checkpoint_blocks")
    assert inspect.signature(plan.module.forward) == inspect.signature(model.forward)
    assert type(plan.module).__name__ == "PlannedGPT2LMHeadModel"
    assert evaluate(plan.module)["eval_loss"] == evaluate(untouched)["eval_loss"]


def test_training_before_the_plan_is_made_is_refused():
    model = remat.for_trainer(gpt2().train(), activation_budget=10**9,
                              example_kwargs=collated(data(BATCH)))
    with torch.no_grad():
        model(**collated(data(BATCH)))  # evaluation is fine
    with pytest.raises(RematError, match=r"pass TrainingArguments\(activation_checkpointing="
                                         "True\\)"):
        model(**collated(data(BATCH)))
    with pytest.raises(RematError, match="have no meaning for its plan"):
        model.activation_checkpointing_enable(every_n_layers=2)
    with pytest.raises(RematError, match="already set up"):
        remat.for_trainer(model, activation_budget=10**9, example_kwargs={})
