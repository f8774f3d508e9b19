"""The trainer's vLLM generation (`trl_fp8.rollout.vllm.generation`): the engine TRL's code builds for each rollout
precision, what each sync pushes (dense, LoRA, DoRA, BF16 training with FP8 rollouts, sleep mode), the vLLM version
and server errors, and TRL's importance sampling left as the config set it. On CPU without vLLM (`fake_vllm` stands
in for its `LLM` and records what TRL's code hands it)."""

import json
import sys
import types

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Linear
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
from trl_fp8.rollout.settings import RolloutSettings
from trl_fp8.rollout.vllm.generation import FP8VLLMGeneration, check_vllm_version

from conftest import assert_fp8_equal, layer_names
from fake_vllm import fp8_model, tiny_trainer


def test_vllm_version_errors_name_the_fix(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.25.1")
    with pytest.raises(ImportError, match="arrived in 0.26"):
        check_vllm_version()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.26.0")
    assert check_vllm_version() == "0.26.0"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'trl-fp8\[vllm\]'"):
        check_vllm_version()
    # Refused by the config itself, before a script can write anything for a run that cannot start.
    with pytest.raises(ImportError, match="use_vllm=True needs vLLM"):
        FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False, use_vllm=True)


@pytest.mark.parametrize(
    "precision, kv, expected",
    [
        (
            "fp8",
            True,
            {
                "load_format": "dummy",
                "kv_cache_dtype": "fp8",
                "quantization": None,
                "linear_backend": "cutlass",
                "attention_backend": "FLASH_ATTN",
            },  # FA3: the FP8 attention that takes new q/k/v scales each sync
        ),
        (
            "fp8_online",
            False,
            {"load_format": "dummy", "quantization": "fp8", "linear_backend": None, "attention_backend": None},
        ),
        (
            "bf16",
            False,
            {"load_format": "dummy", "quantization": None, "linear_backend": None, "attention_backend": None},
        ),
    ],
)
def test_trainer_builds_vllm_from_a_config_folder_and_pushes_its_rollout_tensors(
    fake_vllm, tmp_path, monkeypatch, precision, kv, expected
):
    monkeypatch.setenv("VLLM_USE_DEEP_GEMM_E8M0", "1")  # vLLM 0.26's own default: the trainer must override it
    tokenizer = tiny_char_tokenizer()
    model = tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    args = FP8GRPOConfig(
        **{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path), use_cpu=True, bf16=False,
        use_vllm=True, vllm_mode="colocate", rollout_precision=precision, fp8_kv_cache=kv,
        fp8_recipe="none" if precision == "fp8_online" else "blockwise",
    )  # fmt: skip
    trainer = FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                             processing_class=tokenizer)  # fmt: skip
    generation = trainer.vllm_generation
    assert isinstance(generation, FP8VLLMGeneration) and generation.settings.rollout_precision == precision
    (llm,) = fake_vllm.instances
    for key, value in expected.items():
        assert llm.kwargs.get(key) == value, key
    assert llm.kwargs["model"] == str(generation.engine_dir)
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs"  # TRL's own settings pass through
    if precision == "fp8":  # no GPU here: "auto" falls back from DeepGEMM to Cutlass; E8M0 off in every case
        assert llm.env == {"VLLM_USE_DEEP_GEMM": "0", "VLLM_USE_DEEP_GEMM_E8M0": "0"}
        assert generation.report.kernel.backend == "cutlass" and "no CUDA GPU" in generation.report.kernel.reason
    config = json.loads((generation.engine_dir / "config.json").read_text())
    assert ("quantization_config" in config) == (precision == "fp8")

    if kv:  # before the first rollout the trainer measures the KV scales on the prompts
        trainer._calibrate_kv_scales([[1, 2, 3], [4, 5]])
    generation.sync_weights()
    pushed = dict(llm.pushed)
    assert generation.report.last_sync_seconds is not None and llm.reloads == 1
    hf_model = trainer.model
    if precision == "fp8":
        down = "model.layers.2.mlp.down_proj"
        assert_fp8_equal(
            pushed[f"{down}.weight"], pushed[f"{down}.weight_scale_inv"], hf_model.get_submodule(down).weight
        )
        assert pushed["model.layers.3.self_attn.k_scale"].item() > 0
    else:
        assert not any(t.dtype == torch.float8_e4m3fn for t in pushed.values())
        assert torch.equal(
            pushed["model.layers.2.mlp.down_proj.weight"],
            hf_model.model.layers[2].mlp.down_proj.weight.to(torch.bfloat16),
        )
    # TRL's own importance-sampling switch is left as the config set it.
    assert trainer.vllm_importance_sampling_correction is args.vllm_importance_sampling_correction


@pytest.mark.parametrize("sleep_mode", [True, False])
def test_sleep_mode_rollouts_let_go_of_the_fp8_weight_copies_and_training_requantizes_the_same_bits(
    fake_vllm, tmp_path, sleep_mode
):
    """In sleep mode vLLM's KV cache wakes after the sync: the trainer lets go of its cached FP8 weights (their bytes
    go to the cache), and the next forward quantizes the unchanged weights to the very bits the engine holds."""
    trainer = tiny_trainer(tmp_path, vllm_enable_sleep_mode=sleep_mode)
    generation, model = trainer.vllm_generation, trainer.model
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert all(m._fp8_weight_cache is not None for m in layers)
    generation.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    cached = [m._fp8_weight_cache is not None for m in layers]
    expected = sum(m.weight.numel() + 4 * m.weight.numel() // 128**2 for m in layers)
    assert generation.report.released_cache_bytes == (expected if sleep_mode else 0)
    assert not any(cached) if sleep_mode else all(cached)
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            q, scale_inv = module.quantized_weight()
            assert torch.equal(q.view(torch.uint8), pushed[f"{name}.weight"].view(torch.uint8))
            assert torch.equal(scale_inv, pushed[f"{name}.weight_scale_inv"])


def test_lora_fp8_rollouts_push_every_engine_fp8_layer_in_fp8(fake_vllm, tmp_path):
    """LoRA on q_proj only: the engine is configured with every projection in FP8, so q_proj (PEFT-wrapped, pushed
    as its merged weight) must arrive as FP8 with a scale like k_proj does, not as BF16."""
    from peft import LoraConfig

    trainer = tiny_trainer(
        tmp_path, peft_config=LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False), tis="token"
    )
    generation = trainer.vllm_generation
    config = json.loads((generation.engine_dir / "config.json").read_text())
    kept = set(config["quantization_config"]["modules_to_not_convert"])
    generation.sync_weights()
    (llm,) = fake_vllm.instances
    pushed = dict(llm.pushed)
    hf_model = trainer.model.get_base_model()
    engine_fp8 = {n for n, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    engine_fp8 = {n.removesuffix(".base_layer") for n in engine_fp8} - kept
    assert len(engine_fp8) == 28 and "model.layers.0.self_attn.q_proj" in engine_fp8
    for name in engine_fp8:
        module = hf_model.get_submodule(name)
        weight = module.base_layer.weight.detach() + module.get_delta_weight("default") if hasattr(
            module, "base_layer") else module.weight.detach()  # fmt: skip
        assert_fp8_equal(pushed[f"{name}.weight"], pushed[f"{name}.weight_scale_inv"], weight)
    assert not any("lora" in n or "base_layer" in n for n in pushed)


def test_bf16_training_fp8_rollouts_follow_the_runs_layer_choices(fake_vllm, tmp_path):
    """BF16 training, FP8 rollouts: the engine's FP8 layers and the pushed tensors follow num_first_layers_in_bf16
    and fp8_module_filter_fn (they used to be everything but lm_head), with power-of-two scales when asked."""
    tokenizer = tiny_char_tokenizer()
    args = FP8GRPOConfig(
        **{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path), use_cpu=True, bf16=False,
        use_vllm=True, vllm_mode="colocate", fp8_recipe=None, rollout_precision="fp8", num_last_layers_in_bf16=1,
        fp8_power_of_two_scales=True,
    )  # fmt: skip
    trainer = FP8GRPOTrainer(tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0),
                             say_letter_reward, args, train_dataset=say_letter_dataset(64), processing_class=tokenizer,
                             fp8_module_filter_fn=lambda mod, fqn: not fqn.endswith("o_proj"))  # fmt: skip
    generation = trainer.vllm_generation
    kept = set(json.loads((generation.engine_dir / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"])  # fmt: skip
    assert kept == {"lm_head", *layer_names(3), *(f"model.layers.{i}.self_attn.o_proj" for i in range(3))}
    generation.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    assert pushed["model.layers.3.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert pushed["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    scale = pushed["model.layers.1.mlp.up_proj.weight_scale_inv"]
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # what the exported checkpoint holds too


def test_dora_rollouts_push_the_weight_peft_merges(fake_vllm, tmp_path):
    import copy

    from peft import LoraConfig

    trainer = tiny_trainer(
        tmp_path,
        peft_config=LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], use_dora=True, init_lora_weights=False
        ),  # fmt: skip
    )
    trainer.vllm_generation.sync_weights()
    pushed = dict(fake_vllm.instances[0].pushed)
    merged = copy.deepcopy(trainer.model).merge_and_unload()
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.v_proj"):
        assert_fp8_equal(
            pushed[f"{name}.weight"], pushed[f"{name}.weight_scale_inv"], merged.get_submodule(name).weight
        )
    assert not any("lora" in n or "magnitude" in n for n in pushed)


def test_unreachable_server_says_how_to_start_one(monkeypatch):
    import trl.generation.vllm_client as trl_client

    if not trl_client.is_requests_available():
        pytest.skip("requests is not installed")
    monkeypatch.setattr(trl_client, "is_vllm_available", lambda *a, **k: True)
    generation = types.SimpleNamespace(
        server_base_url="http://127.0.0.1:9", server_timeout=0.0, model=fp8_model(), settings=RolloutSettings(),
    )  # fmt: skip
    with pytest.raises(
        ConnectionError,
        match="E8M0=0 VLLM_MOE_USE_DEEP_GEMM=0 trl vllm-serve --model <fp8_dir> --linear-backend deep_gemm",
    ):
        FP8VLLMGeneration._check_server(generation)


def test_no_tis_and_no_mismatch_logging_leave_trls_importance_sampling_off(fake_vllm, tmp_path, model_batch):
    """tis='off' + log_rollout_mismatch=False: TRL must never be told to score rollouts (an extra forward per step),
    not even after a loss computation."""
    trainer = tiny_trainer(tmp_path, tis="off", log_rollout_mismatch=False)
    assert trainer.vllm_importance_sampling_correction is False
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, model_batch)
    assert trainer.vllm_importance_sampling_correction is False


@pytest.mark.parametrize("tis", [None, "token"])
def test_vllm_rollouts_are_scored_in_the_training_forward(fake_vllm, tmp_path, model_batch, monkeypatch, tis):
    """TRL's importance sampling (its own default mode, or tis='token'), every rollout trained on within one optimizer
    step: TRL builds the batch with its correction switched off (so without its scoring pass), and the loss's own
    forward puts TRL's ratio of that mode in the batch before TRL's loss multiplies by it, and logs the metrics."""
    from trl import GRPOTrainer

    from trl_fp8.trainer.importance_sampling import importance_sampling_ratio

    trainer = tiny_trainer(tmp_path, tis=tis)
    assert trainer.plan.scoring_in_training_forward.on and trainer.vllm_importance_sampling_correction is True
    switch = []
    rollout_batch = {"prompt_ids": model_batch["prompt_ids"]}  # (what the micro-batches below score: all of it)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions",
                        lambda self, inputs: switch.append(self.vllm_importance_sampling_correction) or rollout_batch)  # fmt: skip
    trainer._generate_and_score_completions([])
    assert switch == [False] and trainer.vllm_importance_sampling_correction is True

    trainer.model.train()
    batch = dict(model_batch)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():  # what TRL's scoring pass would have given
        train = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, batch["completion_ids"].size(1))[
            0
        ]
    noise = 0.3 * torch.randn(train.shape, generator=torch.Generator().manual_seed(0))
    batch["sampling_per_token_logps"] = (train + noise).masked_fill(torch.rand(train.shape) < 0.05, float("nan"))
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, batch)
    expected = importance_sampling_ratio(train, batch["sampling_per_token_logps"], batch["completion_mask"],
                                         trainer.vllm_importance_sampling_mode,
                                         trainer.vllm_importance_sampling_clip_min,
                                         trainer.vllm_importance_sampling_clip_max)  # fmt: skip
    torch.testing.assert_close(batch["importance_sampling_ratio"], expected, rtol=1e-4, atol=1e-6)
    assert (expected != 1).any()
    metrics = trainer._metrics["train"]
    assert metrics["sampling/sampling_logp_difference/mean"][-1] > 0.1 and metrics["fp8/mismatch/kl_k3"][-1] > 0


@pytest.fixture
def model_batch(tmp_path):
    """A scored GRPO batch from a trainer without vLLM (the same model and tokenizer as `tiny_trainer`)."""
    tokenizer = tiny_char_tokenizer()
    args = FP8GRPOConfig(**{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=str(tmp_path / "plain"),
                         use_cpu=True, bf16=False)  # fmt: skip
    model = tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    trainer = FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                             processing_class=tokenizer)  # fmt: skip
    trainer.model.train()
    return trainer._generate_and_score_completions([trainer.train_dataset[i] for i in (0, 1) for _ in range(8)])


def test_an_earlier_trainers_engine_shuts_down_before_the_next_engine_starts(fake_vllm, tmp_path, monkeypatch):
    """vLLM keeps one distributed state per process and an engine's shutdown tears it down. An earlier trainer's
    engine, reachable or not, shuts down (once) before the next engine starts: left to the garbage collector, on
    vLLM 0.31 it shut down in the middle of the next engine's start-up, which then lost its world group. vLLM
    freezes its start-up heap, so a `gc.collect()` before the start does not reach it: the test freezes it too."""
    import gc

    events = []
    start = fake_vllm.__init__
    monkeypatch.setattr(
        fake_vllm, "__init__", lambda self, **kw: (events.append("engine started"), start(self, **kw))[1]
    )
    monkeypatch.setattr(fake_vllm, "_shutdown", lambda self: (events.append(f"engine {fake_vllm.instances.index(self)} shut down"), setattr(self, "shutdowns", self.shutdowns + 1)))  # fmt: skip
    tiny_trainer(tmp_path / "first")  # unreachable from here on, its engine with it
    gc.freeze()
    try:
        second = tiny_trainer(tmp_path / "second")
    finally:
        gc.unfreeze()
    assert events == ["engine started", "engine 0 shut down", "engine started"]
    first_engine, second_engine = fake_vllm.instances
    assert (first_engine.shutdowns, second_engine.shutdowns) == (1, 0)
    assert second.vllm_generation.llm is second_engine
    tiny_trainer(tmp_path / "third")  # the second trainer is still reachable: one engine a process all the same
    assert second_engine.shutdowns == 1 and fake_vllm.instances[2].shutdowns == 0
