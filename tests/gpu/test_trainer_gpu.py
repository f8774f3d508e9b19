"""FP8GRPOTrainer on an SM90 GPU with the real FP8 kernels (no vLLM): trains, learns, exports, and agrees with the
exact emulation. Run on the GPU host: `python -m pytest -m gpu tests/gpu -s`."""

import json

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Linear
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
from trl_fp8.ops import select_ops

from conftest import rel_err

pytestmark = pytest.mark.gpu


def letter_task_trainer(tmp_path, **config) -> FP8GRPOTrainer:
    """The demo's task on a tiny Qwen3, 40 GRPO steps in BF16 with gradient checkpointing, plus `config`."""
    tokenizer = tiny_char_tokenizer()
    model_dir = tmp_path / "model"
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    args = FP8GRPOConfig(
        **{**GRPO_SETTINGS, "gradient_checkpointing": True},
        output_dir=str(tmp_path / "out"), max_steps=40, logging_steps=1, bf16=True, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"}, **config,
    )  # fmt: skip
    return FP8GRPOTrainer(str(model_dir), say_letter_reward, args, train_dataset=say_letter_dataset(2048))


def reward_gain(trainer, label: str) -> tuple[float, float]:
    """Mean reward of the first 5 and the last 10 logged steps."""
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    early, late = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    print(f"{label} reward: steps 1-5 {early:.3f}, steps 31-40 {late:.3f}")
    return early, late


def test_grpo_end_to_end_with_real_fp8_kernels(tmp_path):
    trainer = letter_task_trainer(tmp_path)
    layer = trainer.model.model.layers[0].mlp.up_proj
    assert isinstance(layer, FP8Linear) and layer.weight.is_cuda and layer.weight.dtype == torch.bfloat16
    from trl_fp8.ops import scaled_mm  # imports Triton: GPU hosts only

    assert select_ops(layer.fp8_config, layer.weight.device) is scaled_mm  # the real kernels, not the emulation
    trainer.train()
    early, late = reward_gain(trainer, "GPU FP8 GRPO")
    assert late > early + 0.08

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
    the FP8 layers stay FP8 and compute what they compute without Liger (loss and every gradient within bf16 noise of
    the FP8 model without Liger); with the sibling GEMMs, Liger's SwiGLU gets the gate/up columns of the one GEMM.
    Then a short FP8GRPOTrainer run with it learns. Liger's kernels do not run in Triton's CPU interpreter."""
    pytest.importorskip("liger_kernel", reason="pip install liger-kernel (the `liger` extra)")
    import copy

    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    from trl_fp8 import FP8LinearConfig, convert_to_fp8

    base = tiny_qwen3(dtype=torch.bfloat16, vocab_size=512).cuda()
    ids = torch.randint(0, 512, (4, 256), device="cuda")
    runs = {}
    for name, options, liger in [("fp8", {}, False), ("fp8_liger", {}, True),
                                 ("siblings_liger", {"fuse_sibling_gemms": True}, True)]:  # fmt: skip
        model = copy.deepcopy(base)
        convert_to_fp8(model, config=FP8LinearConfig(**options))
        if liger:
            _apply_liger_kernel_to_instance(model=model, fused_linear_cross_entropy=False)
        assert isinstance(model.model.layers[0].mlp.up_proj, FP8Linear)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs[name] = (loss.item(), {n: p.grad.float() for n, p in model.named_parameters()})
    ref_loss, ref_grads = runs["fp8"]
    for name in ("fp8_liger", "siblings_liger"):
        loss, grads = runs[name]
        worst = max(rel_err(grads[n], ref_grads[n]) for n in ref_grads)
        print(f"{name}: loss {loss:.5f} vs {ref_loss:.5f}, worst gradient rel diff {worst:.2e}")
        assert abs(loss - ref_loss) < 1e-2 * abs(ref_loss)
        assert worst < 5e-2  # Liger's fp32 norm/activation vs eager's bf16 steps, through FP8 re-quantization


@pytest.mark.parametrize("fuse", [False, True])
def test_grpo_learns_with_liger_kernels(tmp_path, fuse):
    pytest.importorskip("liger_kernel", reason="pip install liger-kernel (the `liger` extra)")
    trainer = letter_task_trainer(tmp_path, use_liger_kernel=True, fp8_fuse_sibling_gemms=fuse)
    trainer.train()
    mlp = trainer.model.model.layers[0].mlp
    assert isinstance(mlp.up_proj, FP8Linear)
    assert "Liger" in mlp.forward.__qualname__ and "Liger" in trainer.model.model.norm.forward.__qualname__
    early, late = reward_gain(trainer, f"GPU FP8 GRPO + Liger (siblings fused: {fuse})")
    assert late > early + 0.08
