"""FP8GRPOTrainer end to end on a tiny Qwen3 (CPU, exact FP8 emulation), with the config, TIS, LoRA and export."""

import json
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from transformers import TrainerCallback

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Linear, FP8Tuning, dequantize_blocks, quantize_blocks
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3, tiny_qwen3_config
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
from trl_fp8.plan import FP8RunPlan
from trl_fp8.trainer.importance_sampling import token_tis_ratio
from trl_fp8.trainer.model_card import fp8_model_card_section

from conftest import HANG_GUARD_S, assert_fp8_equal, layer_names, rel_err

ROOT = Path(__file__).resolve().parents[1]


def make_args(tmp_path, **kw):
    defaults = dict(
        GRPO_SETTINGS,
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=16,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    return FP8GRPOConfig(**{**defaults, **kw})


def make_trainer(model_dir, tmp_path, model=None, **kw):
    trainer_kwargs = {
        k: kw.pop(k) for k in ("peft_config", "rollout_func", "fp8_module_filter_fn", "tuning") if k in kw
    }
    return FP8GRPOTrainer(
        model=model or model_dir,
        reward_funcs=say_letter_reward,
        args=make_args(tmp_path, **kw),
        train_dataset=say_letter_dataset(256),
        **trainer_kwargs,
    )


def rewards(trainer):
    return [log["reward"] for log in trainer.state.log_history if "reward" in log]


@pytest.mark.parametrize("fuse", [False, True], ids=["each_layer", "fused_siblings"])
def test_trains_with_fp8_layers(model_dir, tmp_path, fuse):
    trainer = make_trainer(model_dir, tmp_path, max_steps=3, tuning=FP8Tuning(fuse_sibling_gemms=fuse))
    layers = trainer.model.model.layers
    assert (layers[0].self_attn.k_proj._fp8_group is not None) == fuse
    assert all(isinstance(getattr(layer.self_attn, p), FP8Linear) for layer in layers for p in ("q_proj", "o_proj"))
    assert type(trainer.model.lm_head) is torch.nn.Linear
    assert trainer.fp8_report.num_fp8_layers == 28
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = trainer.state.log_history
    assert all(torch.isfinite(torch.tensor(log["loss"])) for log in logs if "loss" in log)
    assert [log["fp8/num_fp8_layers"] for log in logs if "fp8/num_fp8_layers" in log] == [28.0] * 3
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert "model.layers.0.mlp.down_proj.weight" in changed and "lm_head.weight" in changed
    # After the default (fused AdamW) steps, every FP8 layer multiplies the FP8 copy of its *current* weight.
    assert trainer.args.optim == "adamw_torch_fused"
    for module in trainer.model.modules():
        if isinstance(module, FP8Linear):
            q, s = module.quantized_weight()
            q_ref, s_ref = quantize_blocks(module.weight.detach())
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_grpo_learns_the_task_greedy_accuracy_of_the_saved_checkpoint_rises(tmp_path):
    """The demo's recipe and seed: warm start, FP8 GRPO, save, reload the FP8 checkpoint and ask every letter greedily.

    Measured with 2 and 8 threads on one CPU: 25% -> 100%, mean reward 0.60 -> 0.99 (`DEMO_MEASURED`). Another CPU may
    round sums differently and sampling amplifies that (over seeds 0-4 the gain was 25-75 points), so the bound is
    three letters more than before, and the reward gain."""
    from transformers import AutoModelForCausalLM

    from trl_fp8.demo.toy_task import DEMO_GRPO_SETTINGS, DEMO_MAX_STEPS, greedy_accuracy, warm_start

    seed = DEMO_GRPO_SETTINGS["seed"]
    tokenizer = tiny_char_tokenizer()
    model = tiny_qwen3(seed=seed, vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    warm_start(model, tokenizer, seed=seed)
    before, _ = greedy_accuracy(model, tokenizer)
    model.save_pretrained(tmp_path / "init")  # by path: TRL loads the reference model (beta > 0) from it
    args = FP8GRPOConfig(**DEMO_GRPO_SETTINGS, output_dir=str(tmp_path / "out"), max_steps=DEMO_MAX_STEPS,
                         logging_steps=1, use_cpu=True, bf16=False, disable_tqdm=True)  # fmt: skip
    trainer = FP8GRPOTrainer(str(tmp_path / "init"), say_letter_reward, args,
                             train_dataset=say_letter_dataset(seed=seed), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    trainer.save_model(str(tmp_path / "fp8"))
    after, answers = greedy_accuracy(AutoModelForCausalLM.from_pretrained(tmp_path / "fp8"), tokenizer)
    r = rewards(trainer)
    early, late = sum(r[:5]) / 5, sum(r[-10:]) / 10
    print(f"greedy accuracy {before:.3f} -> {after:.3f} {answers}; reward {early:.3f} -> {late:.3f}")
    assert after >= before + 0.375, (before, after, answers)
    assert late > early + 0.25, (early, late)


def test_bf16_and_fp8_runs_stay_close_early(model_dir, tmp_path):
    """Same seed, same data: the first update of the FP8 run points where the BF16 run's does.

    Measured: cosine 0.90 between the two first-step parameter updates; step-1 entropies equal to 1e-4.
    """
    runs = {}
    for recipe in ("blockwise", None):
        trainer = make_trainer(model_dir, tmp_path / str(recipe), max_steps=1, fp8_recipe=recipe)
        init = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
        trainer.train()
        final = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        entropy = next(log["entropy"] for log in trainer.state.log_history if "entropy" in log)
        runs[recipe] = (final - init, entropy)
    (d_fp8, h_fp8), (d_bf16, h_bf16) = runs["blockwise"], runs[None]
    cosine = torch.nn.functional.cosine_similarity(d_fp8, d_bf16, dim=0).item()
    assert cosine > 0.6, cosine
    assert abs(h_fp8 - h_bf16) / h_bf16 < 0.02


def test_bf16_baseline_has_no_fp8_layers(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, fp8_recipe="none")
    assert trainer.fp8_report.num_fp8_layers == 0
    assert not any(isinstance(m, FP8Linear) for m in trainer.model.modules())


@pytest.mark.parametrize("fuse", [False, True], ids=["each_layer", "fused"])
def test_reference_model_is_converted_too(model_dir, tmp_path, fuse):
    tuning = FP8Tuning(fuse_sibling_gemms=fuse, fuse_swiglu=fuse)
    trainer = make_trainer(model_dir, tmp_path, beta=0.04, max_steps=1, tuning=tuning)
    assert isinstance(trainer.ref_model.model.layers[0].mlp.up_proj, FP8Linear)
    assert ("forward" in trainer.ref_model.model.layers[0].mlp.__dict__) == fuse  # with the policy's fusions
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())  # frozen: quantized once
    trainer.train()
    assert any("kl" in log for log in trainer.state.log_history)


def test_fused_kernels_with_lora_a_reference_model_and_checkpointing(model_dir, tmp_path):
    """Both opt-in fusions under what GRPO runs around them: LoRA adapters (the base layers grouped and fused
    underneath), the KL term (with LoRA, TRL's reference is the base with the adapters off), gradient
    checkpointing's recomputation. The adapters train, the saved checkpoint holds the FP8 of the merged weights."""
    from peft import LoraConfig

    trainer = make_trainer(
        model_dir, tmp_path, beta=0.04, gradient_checkpointing=True, learning_rate=1e-2,
        tuning=FP8Tuning(fuse_sibling_gemms=True, fuse_swiglu=True),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
    )  # fmt: skip
    layer = trainer.model.base_model.model.model.layers[0]
    assert layer.self_attn.k_proj._fp8_group[0].members[0] is layer.self_attn.q_proj.base_layer
    assert "forward" in layer.mlp.__dict__ and trainer.ref_model is None
    lora_before = layer.self_attn.q_proj.lora_B["default"].weight.detach().clone()
    trainer.train()
    logs = trainer.state.log_history
    assert any("kl" in log for log in logs) and all(math.isfinite(log["loss"]) for log in logs if "loss" in log)
    assert not torch.equal(layer.self_attn.q_proj.lora_B["default"].weight, lora_before)
    out = tmp_path / "fused_lora"
    trainer.save_model(str(out))
    with safe_open(out / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv")
    q_proj = layer.self_attn.q_proj
    assert_fp8_equal(q, s, q_proj.base_layer.weight + q_proj.get_delta_weight("default"))


def test_partial_checkpointing_survives_grpo_scoring(model_dir, tmp_path):
    """transformers' `every_n_layers` under GRPO: TRL turns checkpointing off around its no-grad scoring and back on
    with the raw kwargs, which `torch.utils.checkpoint` refuses ("Unexpected keyword arguments: every_n_layers", TRL
    1.16); the trainer keeps transformers' selection instead, and the user's config is left as given."""
    from trl_fp8.trainer.layer_checkpointing import split_checkpointing_kwargs

    assert split_checkpointing_kwargs({"every_n_layers": 2, "use_reentrant": False, "offload": True}) == (
        {"use_reentrant": False}, {"every_n_layers": 2, "offload": True})  # fmt: skip
    assert split_checkpointing_kwargs(None) == (None, {})
    kwargs = {"every_n_layers": 2}
    trainer = make_trainer(model_dir, tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    seen = []  # which layers checkpoint at each step's end: as its training forward saw them (after the scoring)

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            seen.append([layer.gradient_checkpointing for layer in trainer.model.model.layers])

    trainer.add_callback(Record())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert seen == [[True, False, True, False]] * 2
    # transformers 5.24 renamed gradient_checkpointing* to activation_checkpointing*: no warning about the old names'
    # calls, ours or TRL's (the user's own `gradient_checkpointing_kwargs` field is theirs to rename)
    renamed = [str(w.message) for w in caught if re.search(r"`\w*gradient_checkpointing(_enable|_disable)?` is dep",
                                                           str(w.message))]  # fmt: skip
    assert renamed == [], renamed
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)
    assert trainer.args.gradient_checkpointing_kwargs == {"every_n_layers": 2}


@pytest.mark.parametrize("names", [("gradient_checkpointing_kwargs",), ("activation_checkpointing_kwargs",),
                                   ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")],
                         ids=["old_name", "new_name", "both_as_copies"])  # fmt: skip
def test_layer_options_are_kept_under_either_name_of_the_checkpointing_kwargs(names):
    """transformers 5.24 renames `gradient_checkpointing_kwargs` to `activation_checkpointing_kwargs` (the old name
    warns, and goes in v6); a copy of the args may hold each as its own dict. Whichever the args carry, TRL's no-grad
    scoring sees them without transformers' layer options, and the layers keep `every_n_layers` after it."""
    from trl_fp8.trainer.layer_checkpointing import enable_checkpointing, keep_layer_options

    model = tiny_qwen3(vocab_size=128)
    enable_checkpointing(model, None, {"every_n_layers": 2})
    args = SimpleNamespace(**{name: {"every_n_layers": 2, "use_reentrant": False} for name in names})
    with keep_layer_options(model, args):
        assert all(getattr(args, name) == {"use_reentrant": False} for name in names)
        model.activation_checkpointing_disable()  # TRL's no-grad scoring, then its re-enable with those kwargs
        enable_checkpointing(model, getattr(args, names[0]), {})
    assert all(getattr(args, name) == {"every_n_layers": 2, "use_reentrant": False} for name in names)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True, False]


def test_synced_reference_model_serves_its_blended_weights(model_dir, tmp_path):
    """TRL's sync_ref_model blends the policy into the frozen reference through `.data`; its FP8 copies must follow."""
    trainer = make_trainer(model_dir, tmp_path, beta=0.04, max_steps=2, sync_ref_model=True, ref_model_sync_steps=1,
                           ref_model_mixup_alpha=0.5)  # fmt: skip
    up = trainer.ref_model.model.layers[0].mlp.up_proj
    initial = up.weight.detach().clone()
    trainer.train()
    assert not torch.equal(up.weight, initial)  # TRL did blend
    assert_fp8_equal(*up.quantized_weight(), up.weight)


def test_first_last_layers_and_filter(model_dir, tmp_path):
    trainer = make_trainer(
        model_dir,
        tmp_path,
        num_first_layers_in_bf16=1,
        num_last_layers_in_bf16=1,
        fp8_module_filter_fn=lambda mod, fqn: "down_proj" not in fqn,
    )
    layers = trainer.model.model.layers
    assert type(layers[0].self_attn.q_proj) is torch.nn.Linear and type(layers[3].mlp.up_proj) is torch.nn.Linear
    assert isinstance(layers[1].self_attn.q_proj, FP8Linear) and type(layers[1].mlp.down_proj) is torch.nn.Linear
    assert trainer.fp8_report.num_fp8_layers == 12


def test_lora_base_in_fp8_adapters_in_bf16(model_dir, tmp_path):
    from peft import LoraConfig

    trainer = make_trainer(
        model_dir,
        tmp_path,
        learning_rate=1e-2,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    q_proj = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, FP8Linear) and not q_proj.base_layer.weight.requires_grad
    assert type(q_proj.lora_A["default"]) is torch.nn.Linear
    lora_before = q_proj.lora_B["default"].weight.detach().clone()
    base_before = q_proj.base_layer.weight.detach().clone()
    trainer.train()
    assert not torch.equal(q_proj.lora_B["default"].weight, lora_before)
    assert torch.equal(q_proj.base_layer.weight, base_before)
    out = tmp_path / "lora_fp8"
    trainer.save_model(str(out))
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "model.layers.0.self_attn.q_proj.weight" in f.keys()
        assert not any("lora" in k or "base_layer" in k for k in f.keys())
        q, s = (
            f.get_tensor("model.layers.0.self_attn.q_proj.weight"),
            f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv"),
        )
    assert_fp8_equal(q, s, base_before + q_proj.get_delta_weight("default"))  # FP8 of W + BA, bit for bit


def test_save_model_writes_a_block_fp8_checkpoint_transformers_loads(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, max_steps=1, save_bf16_master_weights=True)
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    }
    assert config["architectures"] == ["Qwen3ForCausalLM"]  # vLLM picks the model class from it
    assert (out / "tokenizer.json").exists() and (out / "bf16_master" / "model.safetensors").exists()
    model = trainer.model
    with safe_open(out / "model.safetensors", "pt") as f:
        for name, module in model.named_modules():
            if isinstance(module, FP8Linear):  # the FP8 block quantization of the trained weight, bit for bit
                assert_fp8_equal(
                    f.get_tensor(name + ".weight"), f.get_tensor(name + ".weight_scale_inv"), module.weight
                )
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16

    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out).float()  # CPU: transformers dequantizes to bf16
    q, s = model.model.layers[2].mlp.gate_proj.quantized_weight()
    assert rel_err(reloaded.model.layers[2].mlp.gate_proj.weight, dequantize_blocks(q, s)) < 4e-3  # bf16 rounding
    ids = torch.randint(0, 84, (2, 24))
    with torch.no_grad():
        fp8_logits = model(ids).logits
        err = rel_err(reloaded(ids).logits, fp8_logits)
    # Reloaded = same FP8 weights, but unquantized activations and bf16 norms/head: measured 0.038-0.046.
    assert err < 0.12, err


def test_a_save_waits_for_an_upload_in_flight_before_swapping(model_dir, tmp_path, monkeypatch):
    import trl_fp8.checkpoint.folder as checkpoint_folder

    trainer = make_trainer(model_dir, tmp_path)
    events = []

    class UploadInFlight:  # transformers' PushInProgress of a Hub push started at a training checkpoint
        def is_done(self):
            return "upload done" in events

        def wait_until_done(self):
            events.append("upload done")

    real_swap = checkpoint_folder._swap_in
    monkeypatch.setattr(checkpoint_folder, "_swap_in", lambda *a: (events.append("swap"), real_swap(*a))[1])
    trainer.push_in_progress = UploadInFlight()
    trainer.save_model()
    assert events == ["upload done", "swap"]


class FakeHub:
    """`hf_api()` for Trainer: records what each upload would send (the top-level names and the config)."""

    def __init__(self):
        self.uploads = []

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), run_as_future=False, **kwargs):
        import fnmatch
        from concurrent.futures import Future

        names = sorted(p.name for p in Path(folder_path).iterdir()
                       if not any(fnmatch.fnmatch(p.name, pat) for pat in ignore_patterns))  # fmt: skip
        config = json.loads((Path(folder_path) / "config.json").read_text())
        self.uploads.append((names, config.get("quantization_config", {}).get("quant_method")))
        done = Future()
        done.set_result(None)
        return done if run_as_future else None


def test_hub_pushes_upload_one_model_never_a_mix(model_dir, tmp_path, monkeypatch):
    """`hub_strategy="every_save"` copies each BF16 training checkpoint over the output folder and uploads it; an
    earlier FP8 save there (sharded, with adapter files and BF16 masters beside) must not be uploaded with it."""
    import transformers.trainer as hf_trainer

    from trl_fp8 import convert_to_fp8, save_fp8_checkpoint

    out = tmp_path / "out"
    earlier = tiny_qwen3(vocab_size=128)
    convert_to_fp8(earlier)
    save_fp8_checkpoint(earlier, out, progress=False, max_shard_size=2**20)  # model-0000i-of-0000n + index
    (out / "adapter_config.json").write_text("{}")
    (out / "adapter_model.safetensors").write_bytes(b"stale")
    (out / "bf16_master").mkdir()
    hub = FakeHub()
    monkeypatch.setattr(hf_trainer, "hf_api", lambda: hub)
    trainer = make_trainer(model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=1, push_to_hub=True,
                           hub_model_id="someone/tiny-fp8", hub_strategy="every_save")  # fmt: skip
    trainer.train()
    trainer.push_to_hub()
    model_files = {"config.json", "generation_config.json", "model.safetensors"}
    assert len(hub.uploads) == 3
    for names, method in hub.uploads[:2]:  # training checkpoints: BF16 masters, nothing of the earlier save
        assert model_files <= set(names) and method is None, names
        assert not [n for n in names if n.startswith(("model-", "adapter_", "bf16_master", "model.safetensors."))]
    names, method = hub.uploads[2]  # the final push: the FP8 checkpoint
    assert model_files | {"README.md"} <= set(names) and method == "fp8", names
    assert not [n for n in names if n.startswith(("model-", "adapter_", "bf16_master", ".")) or "tmp" in n]


def test_a_failed_push_leaves_the_fp8_checkpoint_and_says_where(model_dir, tmp_path, monkeypatch):
    """Offline (no Hub): transformers creates the repository before it saves, so the upload failed with no FP8
    checkpoint written. The checkpoint is written first, saved once, and the error names the folder."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = make_trainer(model_dir, tmp_path, max_steps=1)
    trainer.train()
    import trl_fp8.trainer.mixin as mixin

    writes = []
    real_write = mixin.save_fp8_checkpoint
    monkeypatch.setattr(mixin, "save_fp8_checkpoint", lambda *a, **k: writes.append(a[1]) or real_write(*a, **k))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match=rf"The FP8 checkpoint is saved in {out}, but pushing it to the Hugging "
                                           r"Face Hub failed .*hf upload <org/name> "):  # fmt: skip
        trainer.push_to_hub()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn
    assert writes == [str(out)] and not trainer._checkpoint_saved_for_push
    trainer.save_model()  # later saves write as before
    assert writes == [str(out)] * 2


def test_training_checkpoints_keep_bf16_masters(model_dir, tmp_path):
    trainer = make_trainer(model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    config = json.loads((ckpt / "config.json").read_text())
    assert "quantization_config" not in config  # resumable: full-precision master weights
    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float32


def test_push_to_hub_pushes_the_fp8_checkpoint_with_a_model_card(model_dir, tmp_path, monkeypatch):
    import transformers.trainer as hf_trainer

    pushed = {}

    class FakeApi:
        def upload_folder(self, repo_id, folder_path, **kwargs):
            pushed["repo"] = repo_id
            pushed["config"] = json.loads(open(f"{folder_path}/config.json").read())
            pushed["card"] = open(f"{folder_path}/README.md").read()

    monkeypatch.setattr(hf_trainer, "hf_api", lambda: FakeApi())
    trainer = make_trainer(model_dir, tmp_path, num_last_layers_in_bf16=1)
    trainer.hub_model_id = "someone/tiny-fp8"
    trainer.push_to_hub()
    assert pushed["repo"] == "someone/tiny-fp8"
    assert pushed["config"]["quantization_config"]["quant_method"] == "fp8"
    assert "model.layers.3.mlp.down_proj" in pushed["config"]["quantization_config"]["modules_to_not_convert"]
    assert (
        "## FP8" in pushed["card"] and "`model.layers.3.mlp.down_proj` (first/last layers in bf16)" in pushed["card"]
    )


def bf16_twin_rollout_func(model_dir):
    """A `rollout_func` sampling from a BF16 copy of the model (it differs from the FP8 policy), returning the sampled
    tokens' log-probs: off-policy rollouts without vLLM."""
    from transformers import AutoModelForCausalLM

    from fake_vllm import sampling_rollout_func

    rollout_model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sampling_rollout_func(tiny_char_tokenizer(), lambda trainer: rollout_model)


@pytest.mark.parametrize("in_training_forward", [False, True])
def test_token_tis_applies_to_rollouts_with_their_own_logprobs(model_dir, tmp_path, in_training_forward):
    """A rollout_func sampling from a BF16 copy (vLLM-less off-policy rollouts): mismatch is logged, and TRL's loss
    is weighted by our token ratio. With `score_in_training_forward` (the default here) no forward scores the rollout
    before the micro-batches: the loss's own forward gives the ratio, the one the scoring pass gives."""
    trainer = make_trainer(model_dir, tmp_path, tis="token", tis_cap=2.0, rollout_func=bf16_twin_rollout_func(model_dir),
                           score_in_training_forward=None if in_training_forward else False)  # fmt: skip
    plan = trainer.plan
    assert plan.token_tis.value.by_trainer and plan.scoring_in_training_forward.on is in_training_forward
    trainer.model.train()
    scoring = []  # grad mode of each forward that computes the policy's log-probs
    real = trainer._get_per_token_logps_and_entropies
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: scoring.append(torch.is_grad_enabled()) or real(
        *a, **k)  # fmt: skip
    batch = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in (0, 1) for _ in range(8)])
    assert scoring == ([] if in_training_forward else [False])
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); we call the loss directly
    batch["advantages"] = torch.linspace(-1.0, 2.0, len(batch["advantages"]))  # group-centred ones sum to 0
    if in_training_forward:
        assert "importance_sampling_ratio" not in batch
        trainer._compute_loss(trainer.model, batch)  # the one forward, with gradients, puts the ratio in the batch
        assert scoring == [True]
        with torch.no_grad():  # what a scoring pass gives: the same ratio
            logps = real(trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                         torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1),
                         batch["completion_ids"].size(1))[0]  # fmt: skip
        expected = token_tis_ratio(logps, batch["sampling_per_token_logps"], batch["completion_mask"], 2.0)
        torch.testing.assert_close(batch["importance_sampling_ratio"], expected, rtol=1e-5, atol=1e-6)
        assert trainer._metrics["train"]["sampling/importance_sampling_ratio/max"][-1] <= 2.0
    ratio = batch["importance_sampling_ratio"]
    assert ratio.shape == batch["completion_ids"].shape and (ratio <= 2.0).all() and (ratio != 1).any()
    stats = trainer._metrics["train"]
    assert stats["fp8/mismatch/abs_logp_diff_mean"][-1] > 1e-3  # FP8 policy vs BF16 sampler do differ

    # TRL's own loss code applies the ratio: halving it halves the (KL-free) loss.
    half = dict(batch, importance_sampling_ratio=torch.full_like(ratio, 0.5))
    ones = dict(batch, importance_sampling_ratio=torch.ones_like(ratio))
    loss_half = trainer._compute_loss(trainer.model, half)
    loss_ones = trainer._compute_loss(trainer.model, ones)
    assert torch.allclose(loss_half, 0.5 * loss_ones, rtol=1e-4, atol=1e-7) and loss_ones.abs() > 0
    assert trainer.use_vllm is False  # restored after the loss


def test_training_scores_off_policy_rollouts_in_its_micro_batches(model_dir, tmp_path):
    """Two optimizer steps of four micro-batches each, every rollout scored by its micro-batches' own forwards (TRL's
    buffering and shuffling of the batch around them): each step logs the ratio and the mismatch, and trains."""
    trainer = make_trainer(model_dir, tmp_path, tis="token", rollout_func=bf16_twin_rollout_func(model_dir),
                           per_device_train_batch_size=4, gradient_accumulation_steps=4)  # fmt: skip
    assert trainer.plan.scoring_in_training_forward.on
    before = trainer.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2
    for log in logs:
        assert 0 < log["sampling/importance_sampling_ratio/mean"] <= 2.0 and log["fp8/mismatch/kl_k3"] > 0
        assert math.isfinite(log["loss"])
    assert not torch.equal(before, trainer.model.model.layers[0].mlp.up_proj.weight)


def test_rollouts_trained_on_after_an_update_are_scored_before_the_micro_batches(model_dir, tmp_path):
    """Two optimizer steps per rollout (steps_per_generation=2, no gradient accumulation): the second micro-batch
    runs on updated weights, so its training forward is not the rollout's log-probs. Asked for, that is an error; by
    default the trainer keeps TRL's scoring pass and says why."""
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=1 must be a multiple of steps_per_generation "
                                         r"x num_iterations = 2 x 1"):  # fmt: skip
        make_args(tmp_path, tis="token", score_in_training_forward=True, steps_per_generation=2)
    trainer = make_trainer(model_dir, tmp_path, tis="token", steps_per_generation=2,
                           rollout_func=lambda prompts, trainer: None)  # fmt: skip
    choice = trainer.plan.scoring_in_training_forward
    assert not choice.on and choice.automatic and "updated weights" in choice.reason


def test_config_round_trips_through_trl_parser(tmp_path):
    from trl import TrlParser

    parser = TrlParser(FP8GRPOConfig)
    (args,) = parser.parse_args_and_config(
        ["--output_dir", str(tmp_path), "--fp8_recipe", "rowwise", "--num_last_layers_in_bf16", "2", "--tis", "token",
         "--tis_cap", "3.0", "--save_fp8_checkpoint", "false", "--use_cpu", "true", "--bf16", "false"]
    )  # fmt: skip
    assert (args.fp8_recipe, args.num_last_layers_in_bf16, args.tis, args.save_fp8_checkpoint) == (
        "rowwise", 2, "token", False)  # fmt: skip
    assert args.vllm_importance_sampling_mode == "token_truncate" and args.vllm_importance_sampling_clip_max == 3.0

    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text(
        f"output_dir: {tmp_path}\nfp8_recipe: none\nfp8_power_of_two_scales: false\nnum_first_layers_in_bf16: 1\n"
        "save_fp8_checkpoint: true\ntis: 'off'\nuse_cpu: true\nbf16: false\n"
    )
    (args,) = parser.parse_args_and_config(["--config", str(yaml_path)])
    assert args.fp8_recipe is None and args.num_first_layers_in_bf16 == 1
    assert args.tis == "off" and args.vllm_importance_sampling_correction is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fp8_recipe": "mxfp8"}, "fp8_recipe='mxfp8' is unknown"),
        ({"num_first_layers_in_bf16": -1}, "num_first_layers_in_bf16 must be >= 0"),
        (
            {"fp8_recipe": "tensorwise", "fp8_power_of_two_scales": True},
            "fp8_power_of_two_scales applies to the blockwise recipe only",
        ),
        ({"tis": "sequence"}, "tis='sequence' is unknown"),
        ({"tis": "token", "tis_cap": 1.0}, "tis_cap must be > 1"),
        ({"fp8_backend": "cuda"}, "fp8_backend='cuda' is unknown"),
        ({"rollout_precision": "int8"}, "rollout_precision='int8' is unknown"),
        ({"fp8_recipe": "tensorwise", "rollout_precision": "fp8"}, "Use fp8_recipe='blockwise'"),
        ({"fp8_kv_cache": True}, "it needs use_vllm=True"),
        # settings that would be ignored without a word
        ({"rollout_precision": "fp8"}, "rollout_precision='fp8' sets up vLLM rollouts, but use_vllm=False"),
        ({"vllm_fp8_backend": "cutlass"}, "vllm_fp8_backend='cutlass' sets up vLLM rollouts, but use_vllm=False"),
        ({"vllm_jit_cache_dir": "/tmp/dg"}, "vllm_jit_cache_dir='/tmp/dg' sets up vLLM rollouts"),
        ({"fp8_recipe": "rowwise", "fp8_backend": "deepgemm"}, "torchao's 'rowwise' recipe runs its own"),
        ({"fp8_recipe": None, "fp8_backend": "scaled_mm"}, "fp8_backend='scaled_mm' sets up FP8 training"),
        ({"fp8_recipe": None, "fp8_cache_weights": False}, "fp8_cache_weights=False sets up FP8 training"),
        ({"fp8_recipe": None, "num_first_layers_in_bf16": 1}, "num_first_layers_in_bf16=1 chooses how layers"),
        ({"fp8_recipe": None, "fp8_power_of_two_scales": True}, "fp8_power_of_two_scales=True chooses how layers"),
        ({"fp8_recipe": None, "fp8_keep_experts_in_bf16": True}, "fp8_keep_experts_in_bf16=True chooses how layers"),
        ({"tis": "token", "vllm_importance_sampling_correction": False}, "Drop one of them (tis='off'"),
        ({"tis": "token", "vllm_importance_sampling_mode": "sequence_truncate"}, "vllm_importance_sampling_mode="),
        ({"tis": "token", "vllm_importance_sampling_clip_max": 5.0}, "Set tis_cap=5.0 instead"),
    ],
)
def test_bad_configs_name_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_args(tmp_path, **kwargs)


def test_token_tis_is_the_default_unless_trls_own_fields_say_otherwise(tmp_path):
    """`tis="auto"` (the default): token TIS, as every measured FP8 run used, mapped onto TRL's fields; TRL's own
    importance-sampling settings, where a user set them, stand instead of being refused as with `tis="token"`."""
    args = make_args(tmp_path)
    assert args.tis == "auto" and args.tis_asks_for_token() and args.vllm_importance_sampling_mode == "token_truncate"
    assert args.vllm_importance_sampling_clip_max == 2.0 and args.vllm_importance_sampling_correction
    assert make_args(tmp_path, tis_cap=3.0).vllm_importance_sampling_clip_max == 3.0
    theirs = make_args(tmp_path, vllm_importance_sampling_mode="sequence_truncate")
    assert not theirs.tis_asks_for_token() and theirs.vllm_importance_sampling_mode == "sequence_truncate"
    assert theirs.trl_is_fields_set() == ["vllm_importance_sampling_mode='sequence_truncate'"]
    assert not make_args(tmp_path, vllm_importance_sampling_correction=False).tis_asks_for_token()
    trls = make_args(tmp_path, tis=None)
    assert not trls.tis_asks_for_token() and trls.vllm_importance_sampling_mode == "sequence_mask"  # TRL's default
    again = make_args(tmp_path, **{k: getattr(args, k) for k in ("tis", "vllm_importance_sampling_mode",
                                                                 "vllm_importance_sampling_clip_max")})  # fmt: skip
    assert again.tis_asks_for_token()  # a saved config of a run reads back to the same choice


def test_automatic_tis_is_said_at_start_up_and_asks_nothing_without_rollouts_to_correct(model_dir, tmp_path, capsys):
    trainer = make_trainer(model_dir, tmp_path)  # no vLLM, no rollout_func: nothing to correct, no error
    assert trainer.args.tis_asks_for_token() and trainer.plan.token_tis.value is None
    assert not trainer.plan.scoring_in_training_forward.on and "importance sampling" not in capsys.readouterr().out
    trainer = make_trainer(model_dir, tmp_path, rollout_func=lambda prompts, trainer: None)
    assert trainer.plan.token_tis.value.by_trainer
    assert "token-level truncated importance sampling on: " in capsys.readouterr().out
    with pytest.raises(ValueError, match="tis='token' corrects rollouts sampled by another engine"):
        make_trainer(model_dir, tmp_path, tis="token")  # asked for, with nothing to correct: refused


def test_a_tis_cap_with_nothing_to_correct_warns_naming_the_fix(model_dir, tmp_path):
    """tis="auto" with use_vllm=False and no rollout_func: token TIS corrects nothing, so a cap set is said to do
    nothing (at start-up: only the trainer knows whether a rollout_func comes); with a rollout_func it applies."""
    with pytest.warns(UserWarning, match=r"tis_cap=3.0 has no effect without token TIS, which has nothing to "
                                         r"correct here.* Set use_vllm=True \(or pass a rollout_func"):  # fmt: skip
        make_trainer(model_dir, tmp_path, tis_cap=3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(model_dir, tmp_path, tis_cap=3.0, rollout_func=lambda prompts, trainer: None)
    assert not [w for w in caught if "tis_cap" in str(w.message)] and trainer.plan.token_tis.value.cap == 3.0


def test_the_model_card_states_the_rollout_correction_that_ran(model_dir, tmp_path):
    """The default tis="auto" corrects nothing where the policy samples its own rollouts: the card names no TIS there,
    and token TIS with its cap where it corrected rollouts of another engine."""
    own = make_trainer(model_dir, tmp_path / "own")
    own.create_model_card()
    card = (tmp_path / "own" / "out" / "README.md").read_text()
    assert "Trained with trl-fp8's `FP8GRPOTrainer` with FP8 recipe `blockwise`" in card and "TIS" not in card
    other = make_trainer(model_dir, tmp_path / "other", tis_cap=3.0, rollout_func=lambda prompts, trainer: None)
    other.create_model_card()
    card = (tmp_path / "other" / "out" / "README.md").read_text()
    assert "(28 linear layers in FP8), token TIS capped at 3.0." in card


@pytest.mark.parametrize("backend", ["scaled_mm", "deepgemm"])
def test_a_gpu_backend_where_it_cannot_run_is_refused_before_the_model_loads(tmp_path, monkeypatch, backend):
    """Refused by the config, naming fp8_backend and the fix, instead of `backend=` in the first training step: on
    this CPU, and on a CUDA GPU other than SM90 (faked); accepted on SM90 (faked)."""
    message = rf"fp8_backend='{backend}' runs blockwise FP8 GEMMs on a CUDA SM90 GPU \(H100/H200\), but this run "
    fix = r"Use fp8_backend='auto' .* or fp8_backend='emulated'"
    with pytest.raises(ValueError, match=message + r"trains on cpu\. " + fix):
        make_args(tmp_path, fp8_backend=backend)
    gpu = property(lambda self: self._setup_devices and torch.device("cuda", 0))  # (the process state set up first)
    monkeypatch.setattr(FP8GRPOConfig, "device", gpu)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=message + r"trains on NVIDIA A100-SXM4-80GB \(sm_80\)"):
        make_args(tmp_path, fp8_backend=backend)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert make_args(tmp_path, fp8_backend=backend).fp8_backend == backend


def test_harmless_settings_without_effect_warn(tmp_path):
    with pytest.warns(UserWarning, match="tis_cap=3.0 has no effect without token TIS"):
        make_args(tmp_path, tis="off", tis_cap=3.0)
    with pytest.warns(UserWarning, match="tis_cap=3.0 has no effect without token TIS"):
        make_args(tmp_path, tis="auto", tis_cap=3.0, vllm_importance_sampling_mode="sequence_truncate")
    with pytest.warns(UserWarning, match="save_bf16_master_weights=True has no effect"):
        make_args(tmp_path, fp8_recipe=None, save_bf16_master_weights=True)


def test_a_bitsandbytes_optimizer_without_bitsandbytes_is_refused_at_config_time(tmp_path, monkeypatch):
    """Before the model loads and vLLM starts: transformers alone finds out when training begins."""
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_bitsandbytes_available", lambda: False)
    with pytest.raises(ImportError, match=r"optim='adamw_bnb_8bit' is a bitsandbytes optimizer.*trl-fp8\[bnb\]"):
        make_args(tmp_path, optim="adamw_bnb_8bit")
    monkeypatch.setattr(transformers.utils, "is_bitsandbytes_available", lambda: True)
    assert make_args(tmp_path, optim="adamw_bnb_8bit").optim == "adamw_bnb_8bit"
    monkeypatch.setattr(transformers.utils, "is_bitsandbytes_available", lambda: False)
    assert make_args(tmp_path, optim="adamw_torch").optim == "adamw_torch"  # other optimizers need nothing


def test_a_model_path_that_is_not_there_is_refused_naming_the_fix(tmp_path):
    """As the CLI says it, at once: not the Hub's repo-id validation error after asking the Hub for a typo."""
    with pytest.raises(ValueError, match=r"no model folder at \./no-such-model, and it is not a Hub id"):
        FP8GRPOTrainer("./no-such-model", say_letter_reward, make_args(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is a folder without config.json"):
        FP8GRPOTrainer(str(tmp_path / "empty"), say_letter_reward, make_args(tmp_path))


def test_model_init_kwargs_applied_by_the_trainer_are_not_said_to_be_ignored(model_dir, tmp_path, caplog):
    """trl-fp8 loads a model named by path itself (to convert it before TRL wraps it), with `model_init_kwargs`;
    TRL, handed the loaded model, would warn that they are ignored."""
    import logging

    with caplog.at_level(logging.WARNING):
        trainer = make_trainer(model_dir, tmp_path, model_init_kwargs={"attn_implementation": "eager"})
    assert trainer.model.config._attn_implementation == "eager"  # applied
    assert not [r for r in caplog.records if "model_init_kwargs" in r.getMessage()], caplog.text
    with caplog.at_level(logging.WARNING):  # a model the user built: TRL's warning stands
        FP8GRPOTrainer(tiny_qwen3(vocab_size=128), say_letter_reward, make_args(tmp_path, model_init_kwargs={}),
                       train_dataset=say_letter_dataset(32), processing_class=tiny_char_tokenizer())  # fmt: skip
    assert [r for r in caplog.records if "model_init_kwargs" in r.getMessage()]


def test_plain_grpo_config_is_refused_with_the_fix(model_dir, tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="needs an FP8GRPOConfig"):
        FP8GRPOTrainer(model_dir, say_letter_reward, GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False))


def test_quantize_cli_matches_the_training_quantizer(model_dir, tmp_path):
    from trl_fp8 import convert_to_fp8
    from trl_fp8.cli.quantize import main

    out = tmp_path / "q"
    assert main([model_dir, str(out), "--num_first_layers_in_bf16", "1", "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "model.layers.0.self_attn.q_proj" in config["quantization_config"]["modules_to_not_convert"]
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(model_dir)
    fp8 = AutoModelForCausalLM.from_pretrained(model_dir)
    convert_to_fp8(fp8)
    q_train, _ = fp8.model.layers[1].mlp.up_proj.quantized_weight()
    with safe_open(out / "model.safetensors", "pt") as f:
        up = "model.layers.1.mlp.up_proj"
        assert_fp8_equal(f.get_tensor(f"{up}.weight"), f.get_tensor(f"{up}.weight_scale_inv"),
                         original.get_submodule(up).weight)  # fmt: skip
        assert torch.equal(f.get_tensor(f"{up}.weight").view(torch.uint8), q_train.view(torch.uint8))  # = training
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float32
    assert main([str(out), str(tmp_path / "again")]) == 2  # already FP8: refused


# --- fail early, never silently ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, name",
    [
        ({"ACCELERATE_USE_FSDP": "true"}, "FSDP1"),  # accelerate's default FSDP version
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}, "DeepSpeed ZeRO-3"),
    ],
)
def test_sharded_launches_are_refused_before_loading_the_model(tmp_path, monkeypatch, env, name):
    from trl_fp8.distributed import check_no_weight_sharding

    args, bf16_args = make_args(tmp_path), make_args(tmp_path, fp8_recipe=None)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    loads = []
    monkeypatch.setattr(FP8GRPOTrainer, "_load_model", staticmethod(lambda *a: loads.append(1)))
    with pytest.raises(NotImplementedError, match=f"do not support {name}.*multi_gpu.yaml"):
        FP8GRPOTrainer("some/model", say_letter_reward, args, train_dataset=say_letter_dataset(16))
    assert loads == []
    check_no_weight_sharding(bf16_args)  # plain BF16 GRPO: TRL's business


def test_fsdp2_launches_are_accepted_and_keep_no_fp8_weight_cache(tmp_path, monkeypatch):
    """FSDP2 hands each layer the whole weight inside forward/backward, and the sync/export gather per tensor
    (tests/test_multiprocess.py runs them sharded); a cached FP8 copy of every layer would undo the sharding."""
    from trl_fp8.distributed import check_no_weight_sharding, weight_sharding

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    args = make_args(tmp_path)
    assert weight_sharding(args) == "FSDP2"
    check_no_weight_sharding(args)
    converted = []
    monkeypatch.setattr("trl_fp8.trainer.mixin.convert_to_fp8", lambda model, **kw: converted.append(kw["config"]))
    model = SimpleNamespace(config=tiny_qwen3_config())
    plan = FP8RunPlan.build(args, model.config)
    FP8GRPOTrainer._convert(model, args, plan)
    assert plan.fp8_weight_cache.reason.startswith("FSDP2 shards the weights")
    asked = make_args(tmp_path, fp8_cache_weights=True)
    FP8GRPOTrainer._convert(model, asked, FP8RunPlan.build(asked, model.config))
    assert [c.cache_quantized_weight for c in converted] == [False, True]  # the default under FSDP2; asked for
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert weight_sharding(make_args(tmp_path, fsdp=True)) == "FSDP2"  # transformers' default version


def test_sync_each_batch_as_trl_fp8_plan_names_it_reaches_the_trainers_accelerator(model_dir, tmp_path):
    """`trl-fp8 plan` tells an FSDP2 user whose whole BF16 gradients do not fit to reduce them at every micro-batch
    with accelerate's own option; the setting it prints reaches the accelerator that transformers' Trainer asks."""
    kwargs = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    trainer = make_trainer(model_dir, tmp_path, accelerator_config=kwargs, gradient_accumulation_steps=2)
    assert trainer.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch") is True
    assert not make_trainer(model_dir, tmp_path).accelerator.gradient_state.plugin_kwargs.get("sync_each_batch")


def _qwen3(hidden, intermediate, layers, heads):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, head_dim=128,
                       num_attention_heads=heads, num_key_value_heads=8, vocab_size=151936)  # fmt: skip


def test_fsdp2_reduces_gradients_at_every_micro_batch_where_whole_ones_would_not_fit(tmp_path, monkeypatch):
    """Under FSDP2 with gradient accumulation every GPU keeps the whole model's BF16 gradients between micro-batches
    (accelerate's no_sync). At 14B on 4 x 80 GB GPUs (27.5 GiB of them) the trainer turns on accelerate's
    sync_each_batch; at 8B (15.3 GiB) accelerate's default stays; a user's own setting wins; nothing is chosen
    without FSDP2, with one process or with one micro-batch a step."""
    from trl_fp8.plan import Choice
    from trl_fp8.plan.choices import choose_fsdp2_gradient_sync
    from trl_fp8.rollout.capacity import GPU_MEMORY_BYTES

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    common = dict(gradient_accumulation_steps=32, steps_per_generation=32, per_device_train_batch_size=4,
                  max_completion_length=1024, optim="adamw_torch_fused", gradient_checkpointing=True)  # fmt: skip
    qwen14b, qwen8b = _qwen3(5120, 17408, 40, 40), _qwen3(4096, 12288, 36, 32)

    def choose(config, **kw):
        n = kw.pop("num_processes", 4)
        args = make_args(tmp_path, **{**common, **kw})
        # a colocated engine asleep while the trainer trains (set after the config: no vLLM on this machine)
        args.use_vllm, args.vllm_mode, args.vllm_enable_sleep_mode = True, "colocate", True
        return choose_fsdp2_gradient_sync(config, args, num_processes=n, total_bytes=GPU_MEMORY_BYTES["H100"])

    big = choose(qwen14b)
    assert big.value and big.automatic and "(27.5 GiB a GPU)" in big.reason and "above 90%" in big.reason
    small = choose(qwen8b)
    assert not small.value and "(15.3 GiB a GPU)" in small.reason and "would keep them sharded" in small.reason
    user = {"gradient_accumulation_kwargs": {"sync_each_batch": False}}
    assert choose(qwen14b, accelerator_config=user) == Choice(False, "set in accelerator_config", False)
    assert choose(qwen14b, gradient_accumulation_steps=1) is None and choose(qwen14b, num_processes=1) is None
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert choose(qwen14b) is None  # DDP: no shards to keep


def test_the_trainer_sets_sync_each_batch_in_its_own_args_before_trl_builds_the_accelerator_and_says_why(
    tmp_path, monkeypatch, capsys
):
    """The automatic choice reaches accelerate's gradient-accumulation options of the trainer's own copy of the args
    (the next test of the Trainer's own plumbing shows they reach its accelerator), the user's args untouched, and is
    said once at start-up; a choice left off changes nothing."""
    from trl_fp8.plan import Choice

    args, config = make_args(tmp_path), tiny_qwen3_config()
    monkeypatch.setattr(
        "trl_fp8.plan.run_plan.choose_fsdp2_gradient_sync", lambda config, a, **gpu: Choice(False, "they fit")
    )
    plan = FP8RunPlan.build(args, config)
    plan.say_start_up(args)
    assert plan.trainer_args(args).accelerator_config.gradient_accumulation_kwargs is None
    monkeypatch.setattr("trl_fp8.plan.run_plan.choose_fsdp2_gradient_sync",
                        lambda config, a, **gpu: Choice(True, "they do not fit"))  # fmt: skip
    plan = FP8RunPlan.build(args, config)
    plan.say_start_up(args)
    assert plan.fsdp2_gradient_sync.on
    assert plan.trainer_args(args).accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
    assert args.accelerator_config.gradient_accumulation_kwargs is None
    out = capsys.readouterr().out
    assert "[trl-fp8] FSDP2 gradient reduction at every micro-batch off: they fit." in out
    assert "[trl-fp8] FSDP2 gradient reduction at every micro-batch on: they do not fit." in out


def test_the_trainer_settles_fp8_kv_cache_with_an_observer_where_on_and_says_why(tmp_path, monkeypatch, capsys):
    """`fp8_kv_cache=None` becomes the planner's choice before TRL builds the engine: on, with the observer that
    measures the K/V scales; off, with none; on for a model whose scales cannot be measured, off with that reason,
    where a user's own True raises."""
    from trl_fp8.plan import Choice

    model = tiny_qwen3()
    for on in (True, False):
        args = make_args(tmp_path)
        args.use_vllm = True  # (after the config: no vLLM on this machine)
        monkeypatch.setattr("trl_fp8.plan.run_plan.choose_fp8_kv_cache",
                            lambda config, a, on=on, **gpu: Choice(on, "because"))  # fmt: skip
        plan = FP8RunPlan.build(args, model.config)
        observer, choice = FP8GRPOTrainer._fp8_kv_observer(model, plan.fp8_kv_cache)
        assert (observer is not None) is on and choice.on is on and plan.trainer_args(args).fp8_kv_cache is on
        plan.replace(fp8_kv_cache=choice).say_start_up(args)
        assert f"[trl-fp8] FP8 KV cache {'on' if on else 'off'}: because." in capsys.readouterr().out
    no_attention = torch.nn.Sequential(torch.nn.Linear(128, 128))
    observer, choice = FP8GRPOTrainer._fp8_kv_observer(no_attention, Choice(True, "because"))
    assert observer is None and not choice.on
    assert choice.reason.startswith("kept BF16, as its K/V scales cannot be measured")
    with pytest.raises(ValueError, match="found no attention layers"):
        FP8GRPOTrainer._fp8_kv_observer(no_attention, Choice(True, "set by fp8_kv_cache", automatic=False))


def test_fsdp2_prefetch_layers_needs_an_fsdp2_launch_and_a_lead_of_one_or_more(tmp_path, monkeypatch):
    """A lead that sets nothing is refused at once, naming the launch it needs (tests/test_multiprocess.py runs it
    sharded)."""
    with pytest.raises(ValueError, match="does not shard with FSDP2.*fsdp2.yaml"):
        FP8Tuning(fsdp2_prefetch_layers=2).check(make_args(tmp_path))
    with pytest.raises(ValueError, match="does not shard with FSDP2"):  # the trainer checks before loading the model
        make_trainer("no-such-model", tmp_path, tuning=FP8Tuning(fsdp2_prefetch_layers=2))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match=re.escape("FP8Tuning(fsdp2_prefetch_layers=0): give 1 or more")):
        FP8Tuning(fsdp2_prefetch_layers=0)
    FP8Tuning(fsdp2_prefetch_layers=2).check(make_args(tmp_path))
    from trl_fp8.trainer.callbacks import PrefetchFSDP2Units

    with pytest.warns(UserWarning, match="has no effect: the model has no FSDP2 units"):  # e.g. accelerate on CPU
        PrefetchFSDP2Units(2).on_train_begin(None, SimpleNamespace(is_world_process_zero=True), None,
                                              model=torch.nn.Linear(2, 2))  # fmt: skip


def test_logprob_batch_size_scores_without_gradients_in_its_own_batches(model_dir, tmp_path, monkeypatch):
    """`logprob_batch_size`: the old log-probs (num_iterations=2: scored once per generation, without gradients) go
    through TRL's scoring loop that many sequences at a time; the training forward keeps TRL's micro-batch."""
    from trl import GRPOTrainer

    calls = []
    trl_scoring = GRPOTrainer._get_per_token_logps_and_entropies

    def recorded(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, *args, **kwargs):
        calls.append((torch.is_grad_enabled(), input_ids.size(0), batch_size))
        return trl_scoring(self, model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs)

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", recorded)
    with pytest.raises(ValueError, match="logprob_batch_size=0: give 1 or more"):
        make_args(tmp_path, logprob_batch_size=0)
    trainer = make_trainer(model_dir, tmp_path, max_steps=1, num_iterations=2, logprob_batch_size=4)
    trainer.train()
    scoring = [c for c in calls if not c[0]]
    training = [c for c in calls if c[0]]
    assert scoring and all(batch == 4 for _, _, batch in scoring)
    assert training and all(batch is None for _, _, batch in training)  # TRL's: its whole micro-batch at once


def test_peft_under_fsdp2_is_refused_before_loading_the_model(tmp_path, monkeypatch):
    """The sync and the export merge each adapter into its whole base weight, which FSDP2 shards: refused at start-up
    (before the model loads and the engine starts), with DDP named as the launch that works."""
    from peft import LoraConfig

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    loads = []
    monkeypatch.setattr(FP8GRPOTrainer, "_load_model", staticmethod(lambda *a: loads.append(1)))
    with pytest.raises(NotImplementedError, match="PEFT adapters with FSDP2.*multi_gpu.yaml"):
        FP8GRPOTrainer("some/model", say_letter_reward, make_args(tmp_path), train_dataset=say_letter_dataset(16),
                       peft_config=LoraConfig(target_modules=["q_proj"]))  # fmt: skip
    assert loads == []


def test_bitsandbytes_optimizers_under_fsdp2_are_refused_before_loading_the_model(tmp_path, monkeypatch):
    """bitsandbytes' update ops take plain tensors, not FSDP2's DTensor shards (8-bit AdamW raises at the first
    optimizer step on two gloo ranks): refused at start-up, naming the optimizer that works and DDP."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    args = make_args(tmp_path)
    args.optim = "adamw_bnb_8bit"  # (set after the config's own check, which wants bitsandbytes installed)
    loads = []
    monkeypatch.setattr(FP8GRPOTrainer, "_load_model", staticmethod(lambda *a: loads.append(1)))
    with pytest.raises(NotImplementedError, match="under FSDP2.*adamw_torch_fused.*multi_gpu.yaml"):
        FP8GRPOTrainer("some/model", say_letter_reward, args, train_dataset=say_letter_dataset(16))
    assert loads == []
    monkeypatch.delenv("ACCELERATE_USE_FSDP")  # DDP: 8-bit AdamW is fine
    from trl_fp8.distributed import check_sharding_supports

    check_sharding_supports(args)


def test_a_run_without_fp8_layers_is_an_error_not_a_silent_bf16_run(model_dir, tmp_path):
    with pytest.raises(ValueError, match="keeps all 4 decoder layers in BF16"):
        make_trainer(model_dir, tmp_path, num_first_layers_in_bf16=2, num_last_layers_in_bf16=2)
    with pytest.raises(ValueError, match=r"(?s)No linear layer of Qwen3ForCausalLM can run in FP8.*fp8_recipe=None"):
        make_trainer(model_dir, tmp_path, fp8_module_filter_fn=lambda mod, fqn: False)
    with pytest.raises(ValueError, match="No linear layer"):  # dims that are not multiples of 128
        make_trainer(model_dir, tmp_path, model=tiny_qwen3(hidden_size=192, intermediate_size=320, head_dim=64))


def test_the_baseline_without_fp8_saves_a_plain_model_and_says_the_precision_it_trains_in(model_dir, tmp_path):
    """On a CPU the tiny model trains (and saves) in float32, its dtype: the summary says so, not "BF16"."""
    trainer = make_trainer(model_dir, tmp_path, fp8_recipe=None, max_steps=1)
    assert trainer.args.save_fp8_checkpoint is False
    assert trainer.fp8_report.summary() == (
        "No FP8 (fp8_recipe=None): every layer trains in high precision, float32 (the model's dtype)."
    )
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}  # what it says is what trains
    trainer.save_model(str(tmp_path / "bf16"))
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert make_args(tmp_path).save_fp8_checkpoint is True  # FP8 runs export FP8 by default


def test_the_fp8_summary_names_the_master_weights_precision(model_dir, tmp_path):
    from trl_fp8.trainer.start_up import training_precision

    summary = make_trainer(model_dir, tmp_path, max_steps=1).fp8_report.summary()
    assert "master weights and high-precision layers: float32 (the model's dtype)" in summary, summary
    model = tiny_qwen3(vocab_size=128)
    mixed = SimpleNamespace(bf16=True, fp16=False)
    assert training_precision(model, mixed) == "float32 (the model's dtype) with bfloat16 autocast (bf16=True)"
    assert training_precision(model.to(torch.bfloat16), mixed) == "bfloat16 (the model's dtype)"


def test_bf16_training_with_fp8_export_honours_the_layer_choices(model_dir, tmp_path):
    """BF16 training, FP8 checkpoint: the layers kept in BF16 are the run's choices, not the converter's defaults."""
    trainer = make_trainer(model_dir, tmp_path, fp8_recipe=None, save_fp8_checkpoint=True, max_steps=1,
                           num_first_layers_in_bf16=1, fp8_module_filter_fn=lambda mod, fqn: "down_proj" not in fqn,
                           fp8_power_of_two_scales=True)  # fmt: skip
    assert trainer.fp8_report.num_fp8_layers == 0 and trainer.fp8_export_report.num_fp8_layers == 18
    trainer.train()
    trainer.save_model(str(tmp_path / "fp8"))
    kept = set(
        json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    )
    assert kept == {"lm_head", *layer_names(0), *(f"model.layers.{i}.mlp.down_proj" for i in range(4))}
    with safe_open(tmp_path / "fp8" / "model.safetensors", "pt") as f:
        scales = f.get_tensor("model.layers.1.mlp.up_proj.weight_scale_inv")
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # power-of-two scales, as asked
    card = fp8_model_card_section(trainer.fp8_report, trainer.args, trainer.fp8_export_report,
                                  trainer_name="FP8GRPOTrainer")  # fmt: skip
    assert "without FP8 (`fp8_recipe=None`: every layer in high precision)" in card
    assert "18 linear layers in FP8" in card
    assert "`model.layers.0.self_attn.q_proj` (first/last layers in bf16)" in card


def test_layer_choices_that_nothing_uses_are_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="fp8_module_filter_fn chooses FP8 layers, but nothing is FP8 here"):
        make_trainer(model_dir, tmp_path, fp8_recipe=None, fp8_module_filter_fn=lambda mod, fqn: True)


def test_auto_backend_on_a_gpu_without_blockwise_fp8_warns_once(monkeypatch):
    import trl_fp8.ops as ops
    from trl_fp8 import FP8LinearConfig

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    monkeypatch.setattr(ops, "_warned_emulation", set())
    ops.select_ops.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"NVIDIA L40S \(sm_89\).*EMULATES.*fp8_recipe='tensorwise'"):
            assert ops.select_ops(FP8LinearConfig(), torch.device("cuda", 0)) is ops.emulated
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ops.select_ops(FP8LinearConfig(power_of_two_scales=True), torch.device("cuda", 0))  # once per GPU
            ops.select_ops(FP8LinearConfig(backend="emulated"), torch.device("cuda", 1))  # asked for: no warning
    finally:
        ops.select_ops.cache_clear()


def test_torchao_recipes_decide_emulation_from_the_training_device():
    from trl_fp8 import convert_to_fp8

    model = tiny_qwen3()  # loaded on the CPU, as under a multi-process launch
    convert_to_fp8(model, recipe="tensorwise", device="cuda")
    assert model.model.layers[0].mlp.up_proj.config.emulate is False
    cpu_model = tiny_qwen3()
    convert_to_fp8(cpu_model, recipe="tensorwise")
    assert cpu_model.model.layers[0].mlp.up_proj.config.emulate is True


def test_quantize_cli_refuses_missing_paths_in_one_line(tmp_path, capsys):
    from trl_fp8.cli.quantize import main

    for missing in ("/no/such/dir", "not_a_folder", str(tmp_path / "gone")):
        start = time.perf_counter()
        assert main([missing, str(tmp_path / "out")]) == 2
        assert time.perf_counter() - start < 5  # no wait for an unreachable Hub
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: no model folder at")
    assert not (tmp_path / "out").exists()


def test_demo_without_vllm_stops_before_writing_anything(tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_fp8.py"), "--use_vllm", "--output_dir", str(out)],
        capture_output=True, text=True, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert proc.returncode != 0 and "use_vllm=True needs vLLM: pip install 'trl-fp8[vllm]'" in proc.stderr
    assert not out.exists()


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_output_dir_that_is_the_models_folder_is_refused_before_anything_loads(tmp_path, monkeypatch):
    """The model's own folder, spelt otherwise, through a symbolic link, or a folder inside it: refused with the fix
    before the model loads, and every file of the model folder stays byte-identical."""
    import trl_fp8.trainer.mixin as grpo_trainer

    model = tmp_path / "my-model"
    tiny_qwen3(vocab_size=128).save_pretrained(model)
    tiny_char_tokenizer().save_pretrained(model)
    (tmp_path / "link").symlink_to(model)
    before = _file_bytes(model)
    monkeypatch.setattr(grpo_trainer, "create_model_from_path", lambda *a, **k: pytest.fail("loaded the model"))
    for output_dir in (model, f"{model}/", tmp_path / "link", model / "run", tmp_path / "link" / "sub" / ".."):
        with pytest.raises(ValueError, match=r"input model's folder|input model's own folder") as err:
            FP8GRPOTrainer(str(model), say_letter_reward, make_args(tmp_path, output_dir=str(output_dir)),
                           train_dataset=say_letter_dataset(16))  # fmt: skip
        assert "FP8GRPOConfig(output_dir=...)" in str(err.value)
    assert _file_bytes(model) == before


def test_save_model_into_the_models_folder_is_refused_and_writes_nothing(model_dir, tmp_path):
    """A model passed as an object: its `name_or_path` folder is protected at start-up and at every save."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    before = _file_bytes(Path(model_dir))
    with pytest.raises(ValueError, match="input model's own folder"):
        make_trainer(model_dir, tmp_path, model=model, output_dir=model_dir)
    trainer = make_trainer(model_dir, tmp_path, model=model, max_steps=1)
    with pytest.raises(ValueError, match="input model's own folder"):
        trainer.save_model(model_dir)
    assert _file_bytes(Path(model_dir)) == before


def test_start_up_refuses_what_cannot_work_before_loading(tmp_path, monkeypatch):
    """TIS with nothing to correct, TRL's math rewards without math-verify, Liger's kernels without liger-kernel:
    each refused with the fix, before a model loads (a missing model folder would fail later)."""
    import importlib

    import transformers.utils
    from trl.rewards import accuracy_reward

    missing = str(tmp_path / "not-loaded")
    with pytest.raises(ValueError, match="tis='token' corrects rollouts sampled by another engine.*use_vllm=True"):
        FP8GRPOTrainer(missing, say_letter_reward, make_args(tmp_path, tis="token"))
    monkeypatch.setattr(importlib.import_module("trl.import_utils"), "is_math_verify_available", lambda: False)
    with pytest.raises(ImportError, match=r"accuracy_reward .*math-verify.*trl-fp8\[math\]"):
        FP8GRPOTrainer(missing, [say_letter_reward, accuracy_reward], make_args(tmp_path))
    monkeypatch.setattr(transformers.utils, "is_liger_kernel_available", lambda: False)
    with pytest.raises(ImportError, match=r"liger-kernel is not installed: pip install 'trl-fp8\[liger\]'"):
        make_args(tmp_path, use_liger_kernel=True)


def test_the_config_itself_warns_nothing_the_user_cannot_fix(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_args(tmp_path)


def test_example_resolves_reward_funcs_as_trl_and_runs_a_step(model_dir, tmp_path):
    """`--reward_funcs pkg.module.fn` (TRL's dotted-path convention) and a local model and dataset folder: one step,
    the checkpoint saved, the demo's initial model nowhere."""
    pkg = tmp_path / "work" / "my_rewards"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "letters.py").write_text(
        "def says_a(completions, **kwargs):\n    return [float(c.strip().startswith('a')) for c in completions]\n"
    )
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"say {c}:"}) + "\n" for c in "abcdefgh" * 4))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_fp8.py"), "--model_name_or_path", model_dir,
         "--dataset_name", str(data), "--reward_funcs", "my_rewards.letters.says_a", "--output_dir", str(out),
         "--max_steps", "1", "--per_device_train_batch_size", "8", "--num_generations", "4",
         "--max_completion_length", "4", "--use_cpu", "true", "--bf16", "false", "--report_to", "none",
         "--disable_tqdm", "true"],
        capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=tmp_path / "work",
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rewards/says_a/mean" in proc.stdout + proc.stderr
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr  # a quiet start-up
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_fp8.py"), "--model_name_or_path", model_dir,
         "--dataset_name", str(data), "--reward_funcs", "no_such_reward", "--output_dir", str(tmp_path / "x"),
         "--use_cpu", "true", "--bf16", "false"],
        capture_output=True, text=True, timeout=HANG_GUARD_S, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 2 and "neither one of TRL's rewards" in proc.stderr
    # its one line ends the output: no argparse usage of every flag before it (235 lines)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: --reward_funcs 'no_such_reward' is neither"), proc.stderr[-3000:]
    assert "usage:" not in proc.stderr and len(lines) < 10, proc.stderr[-3000:]
    assert not (tmp_path / "x").exists()
