"""Regional compilation (`FP8Tuning(compile_decoder_layers=True)`): decoder layers compiled in place keep their names and, with
AOTAutograd alone (no Inductor fusion), eager's bits; the layers share their graphs; the trainer option reaches it."""

import collections
import functools

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import trl_fp8.trainer.mixin as trainer_mixin
from trl_fp8 import FP8LinearConfig, FP8Tuning, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.trainer.regional_compile import compile_decoder_layers


def _loss_and_grads(model, length):
    ids = torch.randint(0, 200, (2, length), generator=torch.Generator().manual_seed(length))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_compiled_layers_keep_names_and_eager_bits_and_share_graphs():
    torch._dynamo.reset()
    counters.clear()
    results = {}
    for compiled in (False, True):
        model = tiny_qwen3(dtype=torch.bfloat16, num_hidden_layers=2)
        convert_to_fp8(model, config=FP8LinearConfig(backend="emulated"))
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        names = [n for n, _ in model.named_parameters()]
        if compiled:
            assert compile_decoder_layers(model, backend="aot_eager") == 2
            assert [n for n, _ in model.named_parameters()] == names  # in place: no `_orig_mod.` in any name
            assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
        results[compiled] = [_loss_and_grads(model, length) for length in (128, 200)]
    for (loss, grads), (loss_c, grads_c) in zip(results[False], results[True], strict=True):
        assert torch.equal(loss, loss_c) and all(torch.equal(grads[n], grads_c[n]) for n in grads)
    # 2 layers x 2 lengths: one static graph, then one with a dynamic length, shared by every layer; no break.
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]


def test_a_model_without_repeated_layers_is_refused():
    with pytest.raises(ValueError, match=r"Drop FP8Tuning\(compile_decoder_layers=True\)"):
        compile_decoder_layers(nn.Sequential(nn.Linear(128, 128), nn.ReLU()))


def counting_backend(runs: collections.Counter):
    """AOTAutograd without Inductor, counting each run of a compiled graph by grad mode (training forwards run with
    grad enabled; generation and scoring without)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(graph, example_inputs):
        compiled = aot_eager(graph, example_inputs)

        def run(*args):
            runs["grad" if torch.is_grad_enabled() else "no_grad"] += 1
            return compiled(*args)

        return run

    return backend


def test_the_trainer_compiles_its_policy_layers_and_trains_with_them(monkeypatch, tmp_path):
    """Every training forward runs each decoder layer's compiled graph. Generation runs them eagerly: compiled, its
    token-by-token shapes would recompile the layers up to Dynamo's limit, after which training ran eagerly too."""
    from test_grpo_trainer import make_trainer

    from trl_fp8.demo.tiny_model import tiny_char_tokenizer

    runs, forwards = collections.Counter(), collections.Counter()
    monkeypatch.setattr(trainer_mixin, "compile_decoder_layers",
                        functools.partial(compile_decoder_layers, backend=counting_backend(runs)))  # fmt: skip
    torch._dynamo.reset()
    path = tmp_path / "model"
    tokenizer = tiny_char_tokenizer()
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer = make_trainer(str(path), tmp_path, max_steps=2, tuning=FP8Tuning(compile_decoder_layers=True))
    assert trainer.compiled_decoder_layers == 4
    trainer.model.register_forward_pre_hook(
        lambda module, args: forwards.update(["grad" if torch.is_grad_enabled() else "no_grad"])
    )
    trainer.train()
    assert forwards["grad"] == 2 and forwards["no_grad"] > 0  # one training forward per step; generation's
    assert runs == {"grad": 4 * forwards["grad"]}  # every layer of every training forward, compiled; nothing else
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in trainer.state.log_history if "loss" in log)
