"""`use_liger_kernel=None` (FP8GRPOConfig's default): Liger's layer kernels are chosen at start-up from the model type,
the device, liger-kernel's presence and `FP8Tuning.compile_decoder_layers`, and put on the model through TRL's own option."""

import types
import warnings

import pytest
import torch
from transformers import HfArgumentParser

from trl_fp8 import FP8GRPOConfig, FP8Tuning
from trl_fp8.plan import Choice
from trl_fp8.plan.choices import choose_liger_kernels

from fake_vllm import tiny_trainer


def options(**overrides):
    return types.SimpleNamespace(**{"use_liger_kernel": None, "fp8_recipe": "blockwise", **overrides})


@pytest.fixture
def liger_installed(monkeypatch):
    monkeypatch.setattr("transformers.utils.is_liger_kernel_available", lambda: True)


@pytest.mark.parametrize(
    "model_type, cuda, overrides, tuning, on, said",
    [
        ("qwen3", True, {}, {}, True, "use_liger_kernel=False turns them off"),
        ("llama", True, {}, {"fuse_swiglu": True}, True, "SwiGLU left to FP8Tuning(fuse_swiglu=True)"),
        ("qwen3", False, {}, {}, False, "no CUDA GPU"),
        ("qwen3_moe", True, {}, {}, False, "model type 'qwen3_moe' is not one of the dense decoders"),
        (None, True, {}, {}, False, "model type None"),
        ("qwen3", True, {}, {"compile_decoder_layers": True}, False, "compile_decoder_layers=True) compiles the"),
        ("qwen3", True, {"fp8_recipe": None}, {}, True, "use_liger_kernel=False turns them off"),  # BF16 training
        ("qwen3", True, {"fp8_recipe": "tensorwise"}, {}, False, "torchao's 'tensorwise' recipe is not measured"),
    ],
)
def test_the_automatic_choice_follows_model_device_and_compilation(
    liger_installed, model_type, cuda, overrides, tuning, on, said
):
    choice = choose_liger_kernels(model_type, options(**overrides), cuda=cuda, tuning=FP8Tuning(**tuning))
    assert (choice.on, choice.automatic) == (on, True) and said in choice.reason


def test_without_liger_kernel_installed_the_choice_is_off_and_names_the_extra(monkeypatch):
    monkeypatch.setattr("transformers.utils.is_liger_kernel_available", lambda: False)
    choice = choose_liger_kernels("qwen3", options(), cuda=True)
    assert not choice.on and "pip install 'trl-fp8[liger]'" in choice.reason


@pytest.mark.parametrize("value", [True, False])
def test_a_value_the_user_set_is_kept(value):
    choice = choose_liger_kernels("qwen3_moe", options(use_liger_kernel=value), cuda=False)
    assert (choice.on, choice.automatic) == (value, False)


def test_the_command_line_keeps_a_bare_flag_meaning_true():
    parser = HfArgumentParser(FP8GRPOConfig)
    for argv, expected in (([], None), (["--use_liger_kernel"], True), (["--use_liger_kernel", "false"], False)):
        namespace, _ = parser.parse_known_args(["--output_dir", "unused", *argv])
        assert namespace.use_liger_kernel is expected


def test_the_trainer_settles_the_option_before_trl_reads_it(fake_vllm, tmp_path):
    trainer = tiny_trainer(tmp_path)
    assert trainer.args.use_liger_kernel is False  # on CPU: off, and not left unset for transformers' train()
    assert trainer.plan.liger_kernels == Choice(False, "no CUDA GPU to train on (Liger's kernels are Triton kernels)")


def test_an_automatic_choice_goes_through_trls_option_without_its_deprecation_warning(
    fake_vllm, tmp_path, monkeypatch
):
    """On: TRL's own `use_liger_kernel` path (its `liger_kernel_config`, applied by transformers when training starts),
    with Liger's SwiGLU left out where `FP8Tuning(fuse_swiglu=True)` fuses it, and without TRL's warning to a user who set the
    deprecated option (the trainer chose it)."""
    monkeypatch.setattr("trl_fp8.plan.run_plan.choose_liger_kernels", lambda *a, **k: Choice(True, "chosen"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = tiny_trainer(tmp_path, tuning=FP8Tuning(fuse_swiglu=True))
    assert trainer.args.use_liger_kernel is True
    assert trainer.args.liger_kernel_config == {"swiglu": False, "fused_linear_cross_entropy": False}
    assert not [w for w in caught if "use_liger_kernel" in str(w.message)]


def test_after_train_the_modeling_module_is_transformers_own_again(fake_vllm, tmp_path, monkeypatch):
    """transformers puts Liger's kernels on the model in `train()`, and Liger also rebinds names of the modeling module
    (`modeling_qwen3.Qwen3RMSNorm`, `apply_rotary_pos_emb`): every Qwen3 built later in the process, a saved model
    reloaded on CPU for evaluation, would get Triton kernels. After `train()`, even one stopped by an error, the module
    holds its own names again."""
    from transformers.models.qwen3 import modeling_qwen3

    stock = dict(vars(modeling_qwen3))
    monkeypatch.setattr("trl_fp8.plan.run_plan.choose_liger_kernels", lambda *a, **k: Choice(True, "chosen"))
    trainer = tiny_trainer(tmp_path)
    patched = []

    def liger_like_patch(model, kernel_config):  # what liger's apply_liger_kernel_to_qwen3 does to the module
        monkeypatch.setattr(modeling_qwen3, "Qwen3RMSNorm", type("LigerRMSNorm", (torch.nn.Module,), {}))
        monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", lambda *args: args)
        modeling_qwen3.liger_rotary_pos_emb = lambda *args: args  # a new name (a stray one would be harmless)
        patched.append(model)
        raise RuntimeError("stopped after the patch")

    monkeypatch.setattr("transformers.trainer.apply_liger_kernel", liger_like_patch)
    with pytest.raises(RuntimeError, match="stopped after the patch"):
        trainer.train()
    assert patched == [trainer.model]
    now = vars(modeling_qwen3)
    assert now.keys() == stock.keys() and all(now[name] is value for name, value in stock.items())
