"""FP8GRPOTrainer on an SM90 GPU with the real FP8 kernels (no vLLM): trains, learns, exports, and agrees with the
exact emulation. Run on the GPU host: `python -m pytest -m gpu tests/gpu -s`."""

import json

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Linear, FP8Tuning
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.demo.toy_task import (
    GRPO_SETTINGS,
    sampled_reward,
    say_letter_dataset,
    say_letter_reward,
)
from trl_fp8.ops import select_ops

from conftest import rel_err

pytestmark = pytest.mark.gpu


def letter_task_trainer(tmp_path, tuning=None, **config) -> FP8GRPOTrainer:
    """The demo's task on a tiny Qwen3, 40 GRPO steps in BF16 with gradient checkpointing, plus `config` (and an
    `FP8Tuning`)."""
    tokenizer = tiny_char_tokenizer()
    model_dir = tmp_path / "model"
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    args = FP8GRPOConfig(
        **{**GRPO_SETTINGS, "gradient_checkpointing": True},
        output_dir=str(tmp_path / "out"), max_steps=40, logging_steps=1, bf16=True, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"}, **config,
    )  # fmt: skip
    return FP8GRPOTrainer(
        str(model_dir), say_letter_reward, args, train_dataset=say_letter_dataset(2048), tuning=tuning
    )


def assert_learned(trainer, before: float, label: str) -> None:
    """The policy's expected reward (`sampled_reward`: 512 sampled answers, fixed seed) rose from `before` by more
    than its sampling noise. The logged reward windows (32 completions a step) are too noisy to judge by: on one H100
    the last 10 steps' mean was +0.05 to +0.12 above the first 5's in three runs of the same setting, and in one CPU
    run +0.07, where this estimate went from 0.006 to 0.114 (three seeds after training: 0.110-0.116)."""
    after = sampled_reward(trainer.model, trainer.processing_class)
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    print(f"{label}: expected reward {before:.3f} -> {after:.3f} (logged: steps 1-5 {sum(rewards[:5]) / 5:.3f}, "
          f"last 10 {sum(rewards[-10:]) / 10:.3f})")  # fmt: skip
    assert after > before + 0.04  # (seeds of the estimate differ by under 0.01)


def test_grpo_end_to_end_with_real_fp8_kernels(tmp_path):
    trainer = letter_task_trainer(tmp_path)
    layer = trainer.model.model.layers[0].mlp.up_proj
    assert isinstance(layer, FP8Linear) and layer.weight.is_cuda and layer.weight.dtype == torch.bfloat16
    from trl_fp8.ops import scaled_mm  # imports Triton: GPU hosts only

    assert select_ops(layer.fp8_config, layer.weight.device) is scaled_mm  # the real kernels, not the emulation
    from transformers.utils import is_liger_kernel_available

    # The default on a GPU: Liger's layer kernels wherever liger-kernel is installed (a dense Qwen3)
    liger = trainer.plan.liger_kernels
    assert liger.automatic and liger.on is is_liger_kernel_available()
    before = sampled_reward(trainer.model, trainer.processing_class)
    trainer.train()
    assert_learned(trainer, before, f"GPU FP8 GRPO (Liger's kernels: {liger.on})")
    liger_norm = "Liger" in trainer.model.model.norm.forward.__qualname__
    assert liger_norm is liger.on and isinstance(trainer.model.model.layers[0].mlp.up_proj, FP8Linear)

    # The trained model under the real kernels vs the exact emulation of the same FP8 math.
    ids = torch.randint(0, 84, (4, 64), device="cuda")
    with torch.no_grad():
        real = trainer.model(ids).logits.float()
        for module in trainer.model.modules():
            if isinstance(module, FP8Linear):
                module.fp8_config = type(module.fp8_config)(backend="emulated")
                module.invalidate()
        emulated = trainer.model(ids).logits.float()
    print(f"logits, scaled_mm vs emulated: rel diff {rel_err(real, emulated):.2e}")
    assert rel_err(real, emulated) < 1e-2  # bf16 activations between layers, fp32 accumulation order

    out = tmp_path / "fp8"
    trainer.save_model(str(out))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_liger_kernels_with_fp8_layers():
    """TRL's `use_liger_kernel=True` (Liger's RMSNorm, RoPE and SwiGLU put on the model after the FP8 conversion):
    the FP8 layers stay FP8, and the model's gradients are as close to the high-precision model's as the FP8 model's
    without Liger (Liger's fp32 norm and activation feed the FP8 quantizers values a bf16 step apart from eager's, so
    roundings differ: not the same bits, the same accuracy). With the sibling GEMMs, Liger's SwiGLU gets the gate/up
    columns of the one GEMM. Liger's kernels do not run in Triton's CPU interpreter."""
    pytest.importorskip("liger_kernel", reason="pip install liger-kernel (the `liger` extra)")
    import copy

    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    from trl_fp8 import FP8LinearConfig, convert_to_fp8

    base = tiny_qwen3(dtype=torch.bfloat16, vocab_size=512).cuda()
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    reference = copy.deepcopy(base).float()  # the same weights, every op in fp32
    reference(input_ids=ids, labels=ids).loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    errors = {}
    for name, options, liger in [("fp8", {}, False), ("fp8_liger", {}, True),
                                 ("siblings_liger", {"fuse_sibling_gemms": True}, True)]:  # fmt: skip
        model = copy.deepcopy(base)
        convert_to_fp8(model, config=FP8LinearConfig(**options))
        if liger:
            _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False)
        assert isinstance(model.model.layers[0].mlp.up_proj, FP8Linear)
        model(input_ids=ids, labels=ids).loss.backward()
        errors[name] = sorted(rel_err(p.grad.float(), ref_grads[n]) for n, p in model.named_parameters())
    median = {name: e[len(e) // 2] for name, e in errors.items()}
    print("gradient error against fp32, median / worst parameter: "
          + ", ".join(f"{name} {median[name]:.3f} / {e[-1]:.3f}" for name, e in errors.items()))  # fmt: skip
    for name in ("fp8_liger", "siblings_liger"):
        assert median[name] < 1.5 * median["fp8"] and errors[name][-1] < 1.5 * errors["fp8"][-1]


@pytest.mark.parametrize("fuse", [False, True])
def test_grpo_learns_with_liger_kernels(tmp_path, fuse):
    pytest.importorskip("liger_kernel", reason="pip install liger-kernel (the `liger` extra)")
    trainer = letter_task_trainer(tmp_path, FP8Tuning(fuse_sibling_gemms=fuse), use_liger_kernel=True)
    before = sampled_reward(trainer.model, trainer.processing_class)
    trainer.train()
    mlp = trainer.model.model.layers[0].mlp
    assert isinstance(mlp.up_proj, FP8Linear)
    assert "Liger" in mlp.forward.__qualname__ and "Liger" in trainer.model.model.norm.forward.__qualname__
    assert_learned(trainer, before, f"GPU FP8 GRPO + Liger (siblings fused: {fuse})")
