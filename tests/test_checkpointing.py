"""Gradient checkpointing under GRPO keeps one input-grad hook on the embeddings, however often it is re-enabled
(TRL re-enables it after every no-grad pass, the trainer once more for `every_n_layers`)."""

import torch
from test_grpo_trainer import make_trainer
from transformers import TrainerCallback

from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.trainer.layer_checkpointing import drop_stale_input_grad_hooks


def embedding_hooks(model) -> int:
    return len(model.get_input_embeddings()._forward_hooks)


def test_reenabling_checkpointing_leaves_one_input_grad_hook():
    model = tiny_qwen3(num_hidden_layers=2)
    for _ in range(3):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert embedding_hooks(model) == 3  # transformers forgets the earlier hooks without removing them
    assert drop_stale_input_grad_hooks(model) == 2 and embedding_hooks(model) == 1
    model.train()
    out = model.get_input_embeddings()(torch.tensor([[1, 2]]))
    assert out.requires_grad  # the hook kept is the one that works
    model.gradient_checkpointing_disable()
    assert drop_stale_input_grad_hooks(model) == 0


def test_partial_checkpointing_adds_no_hook_per_step(model_dir, tmp_path):  # noqa: F811
    trainer = make_trainer(model_dir, tmp_path, max_steps=3, beta=0.04, gradient_checkpointing=True,
                           gradient_checkpointing_kwargs={"every_n_layers": 2})  # fmt: skip
    seen = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            seen.append((embedding_hooks(model), [layer.gradient_checkpointing for layer in model.model.layers]))

    trainer.add_callback(Record())
    trainer.train()
    assert seen == [(1, [True, False, True, False])] * 3
