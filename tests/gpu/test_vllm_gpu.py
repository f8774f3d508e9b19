"""FP8GRPOTrainer with vLLM colocated on one SM90 GPU: rollouts run the trainer's own FP8 weights and scales.

Run on the GPU host (vLLM from ../shared/gpu): `python -m pytest -m gpu tests/gpu -s`.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from vllm_op_checks import cuda_kernel_names

from conftest import WORKERS, artifacts_dir, clean_subprocess_env, run_child

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _tiny_model_dir(tmp_path):
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3

    tokenizer = tiny_char_tokenizer()
    model_dir = tmp_path / "model"
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def save_warm_model(model_dir: Path) -> float:
    """Save a tiny Qwen3 after the demo's supervised warm start (`toy_task.warm_start`, on the GPU) and its tokenizer
    to `model_dir`; return its expected reward (`sampled_reward`). About a third of its sampled answers are right, so
    a 20-step run has a learning signal. From a random model's ~1% the sampler's seed decided whether the reward of
    20 steps rose (RLOO and the server push: they rose on vLLM 0.26 and fell on 0.31, same tests, same weights)."""
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
    from trl_fp8.demo.toy_task import sampled_reward, warm_start

    tokenizer = tiny_char_tokenizer()
    model = tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).cuda()
    warm_start(model, tokenizer)
    before = sampled_reward(model, tokenizer)
    model.cpu().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return before


KERNEL_CLASS_PREFIX = {"deepgemm": "DeepGemm", "cutlass": "Cutlass", "triton": "Triton"}


def fused_partition(ours, config, tp_rank: int, tp_size: int, kv: bool, deepgemm: bool):
    """The `(weight, weight_scale_inv)` that vLLM rank `tp_rank` of `tp_size` holds for a fused layer whose parts are
    `ours` (each part's `quantized_weight()`): each part's row shard in blocks of 128 rows (key/value heads are
    replicated when there are fewer of them than ranks), concatenated. DeepGEMM stores the scales in its own layout:
    then the expected scales are vLLM's DeepGEMM post-processing of ours (a layout change; with E8M0 off it changes
    no value)."""
    from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_fp8_weight_block

    shards = []
    for i, (q, s) in enumerate(ours):
        rows = q.shape[0]
        if kv and i > 0 and config.num_key_value_heads < tp_size:
            head = tp_rank * config.num_key_value_heads // tp_size
            start, size = head * config.head_dim, config.head_dim
        else:
            size = rows // tp_size
            start = tp_rank * size
        shards.append((q[start : start + size], s[start // 128 : (start + size) // 128]))
    weight = torch.cat([q for q, _ in shards])
    scale = torch.cat([s for _, s in shards])
    if deepgemm:
        _, scale = deepgemm_post_process_fp8_weight_block(weight.clone(), scale.clone(), (128, 128), use_e8m0=False)
    return weight, scale


def fused_parts(layer) -> dict[str, tuple[list, bool]]:
    """The trainer's layers behind each of vLLM's fused layers of a decoder layer: name -> (parts, holds k/v)."""
    attn, mlp = layer.self_attn, layer.mlp
    return {"self_attn.qkv_proj": ([attn.q_proj, attn.k_proj, attn.v_proj], True),
            "mlp.gate_up_proj": ([mlp.gate_proj, mlp.up_proj], False)}  # fmt: skip


def assert_engine_holds_trainer_fp8(trainer, layer_index=1, sync=True):
    """After a sync (`sync=False`: as the engine is now), vLLM's fused layers hold exactly the trainer's FP8 bits and
    scales (this engine rank's partition of them), on the kernel the trainer chose. Returns the vLLM layer."""
    from trl_fp8 import FP8Linear

    generation = trainer.vllm_generation
    if sync:
        generation.sync_weights()
    vmodel = generation.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    layer, vlayer = trainer.model.model.layers[layer_index], vmodel.model.layers[layer_index]
    backend = generation.report.kernel.backend
    for name, (parts, kv) in fused_parts(layer).items():
        fused = vlayer.get_submodule(name)
        kernel = type(fused.quant_method.fp8_linear).__name__
        assert kernel.startswith(KERNEL_CLASS_PREFIX[backend]), (backend, kernel)
        assert all(isinstance(p, FP8Linear) for p in parts)
        ours = [p.quantized_weight() for p in parts]  # FSDP2: gathered, by every rank in the same order
        tp_rank, tp_size = getattr(fused, "tp_rank", 0), getattr(fused, "tp_size", 1)
        weight, scale = fused_partition(ours, trainer.model.config, tp_rank, tp_size, kv, backend == "deepgemm")
        assert fused.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(fused.weight.view(torch.uint8), weight.view(torch.uint8))
        assert fused.weight_scale_inv.shape == scale.shape
        assert torch.equal(fused.weight_scale_inv.float(), scale.float())
    print(
        f"identity on {kernel} ({generation.report.kernel.reason}); engine start {generation.report.engine_start_seconds:.0f} s"
    )
    return vlayer


def test_colocate_fp8_rollouts_use_the_trainers_fp8_weights_and_kv_scales(tmp_path, monkeypatch):
    """30 GRPO steps on the trainer's FP8 weights and KV scales, the engine's SiLU-and-mul and RMSNorm quantizations
    on trl-fp8's kernels (their timing checks made to pass: at this tiny width either kernel may be faster; their bit
    checks run), and the engine asked for token ids and log-probs only (`vllm_token_ids_only`, the default)."""
    pytest.importorskip("vllm")
    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
    from trl_fp8.rollout.vllm import act_quant, norm_quant

    for module in (act_quant, norm_quant):
        timings = iter([2.0, 1.0])  # vLLM's kernel, then ours
        monkeypatch.setattr(module, "graph_time_us", lambda fn, reps=20, timings=timings: (fn(), next(timings))[1])

    args = FP8GRPOConfig(
        **GRPO_SETTINGS, output_dir=str(tmp_path / "out"), max_steps=30, logging_steps=1, bf16=True,
        disable_tqdm=True, model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25, tis="token", fp8_kv_cache=True,
    )  # fmt: skip
    assert args.rollout_precision == "fp8"
    try:
        trainer = FP8GRPOTrainer(
            str(_tiny_model_dir(tmp_path)), say_letter_reward, args, train_dataset=say_letter_dataset(2048)
        )
        llm, rollouts = trainer.vllm_generation.llm, []
        generate = llm.generate

        def recorded_generate(*a, **k):  # what TRL asked of the engine, and what it got back
            outputs = generate(*a, **k)
            rollouts.append((k.get("sampling_params"), outputs[0].outputs[0]))
            return outputs

        monkeypatch.setattr(llm, "generate", recorded_generate)
        trainer.train()
        params, completion = rollouts[0]
        assert params.detokenize is False and params.flat_logprobs is True and params.logprobs == 0
        assert completion.text == "" and type(completion.logprobs).__name__ == "FlatLogprobs"
        assert len(completion.logprobs) == len(completion.token_ids)
        report = trainer.vllm_generation.report
        # Hopper with nvcc: the FP8 cache's decode runs on XQA (checked at start-up), not FlashAttention-3.
        assert report.kv_attention.kernel == "xqa", report.kv_attention
        choice = report.act_quant_choice
        assert choice is not None and choice.installed and act_quant.installed() == choice, choice
        norm_choice = report.norm_quant_choice
        assert norm_choice is not None and norm_choice.installed and norm_quant.installed() == norm_choice, norm_choice
        kernels = _engine_kernel_names(trainer.vllm_generation.llm)
        assert any("_silu_mul_quant_kernel" in name for name in kernels)
        assert any("_rms_norm_quant_kernel" in name for name in kernels), sorted(kernels)  # (fuse_norm_quant's op)
    finally:
        act_quant.uninstall()  # the ops would stay ours for the rest of this process
        norm_quant.uninstall()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    rewards = [log["reward"] for log in logs]
    mismatch = [log["fp8/mismatch/abs_logp_diff_mean"] for log in logs]
    kl = [log["fp8/mismatch/kl_k3"] for log in logs]
    sync_ms = [log["fp8/weight_sync_ms"] for log in logs if "fp8/weight_sync_ms" in log]
    print(
        f"colocate fp8+fp8 KV: reward {sum(rewards[:5]) / 5:.3f} -> {sum(rewards[-5:]) / 5:.3f}; "
        f"mean|dlogp| first {mismatch[0]:.4f} median {sorted(mismatch)[len(mismatch) // 2]:.4f} max {max(mismatch):.4f}; "
        f"KL k3 median {sorted(kl)[len(kl) // 2]:.2e}; weight sync median {sorted(sync_ms)[len(sync_ms) // 2]:.1f} ms"
    )
    if artifacts := artifacts_dir():
        (artifacts / "colocate_log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    assert len(sync_ms) == len(logs)  # one sync per optimizer step, each logged
    assert all(0 <= m < 0.5 for m in mismatch)
    assert sum(rewards[-5:]) > sum(rewards[:5])
    # What the engine did in each rollout reaches the logs: the generation batch running at once (vLLM counts after
    # each step, so a completion that ended at its first token is not counted: 31 of 32 in 3 of 34 rollouts, H100).
    batch = args.per_device_train_batch_size * args.steps_per_generation
    peaks = [log["vllm/running_peak"] for log in logs]
    assert max(peaks) == batch and min(peaks) > batch // 2 and all(log["vllm/preemptions"] == 0 for log in logs)
    assert all(log["vllm/kv_cache_tokens"] > 16 * 64 for log in logs)

    vlayer = assert_engine_holds_trainer_fp8(trainer)
    assert_engine_uses_trainer_kv_scales(trainer, vlayer)

    out = tmp_path / "fp8"
    trainer.save_model(str(out))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def _engine_kernel_names(llm) -> set[str]:
    """The CUDA kernels a short generation of `llm` runs (its CUDA graphs' kernels included)."""
    from vllm import SamplingParams

    return cuda_kernel_names(
        lambda: llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}] * 4, SamplingParams(max_tokens=8), use_tqdm=False)
    )


def assert_engine_uses_trainer_kv_scales(trainer, vlayer, layer_index=1):
    """vLLM's attention layer uses the amax/448 the trainer measured, in FP8 attention."""
    observed = trainer.vllm_generation.settings.kv_observer.scales(reset=False)
    print(f"KV cache {vlayer.self_attn.attn.kv_cache_dtype}, attention {type(vlayer.self_attn.attn.impl).__name__}")
    attn = vlayer.self_attn.attn
    for leaf, name in (("k", "_k_scale"), ("v", "_v_scale"), ("q", "_q_scale")):
        ours = observed[f"model.layers.{layer_index}.self_attn.{leaf}_scale"].item()
        assert getattr(attn, name).item() == pytest.approx(ours, rel=1e-6), leaf
    assert attn.kv_cache_dtype.startswith("fp8")
    choice = trainer.vllm_generation.report.kv_attention
    if choice.kernel == "xqa":  # trl-fp8's backend: XQA decode reading the scale tensors at every replay
        assert type(attn.impl).__name__ == "LiveScaleFlashInferImpl", type(attn.impl)
        assert attn.impl.bmm2_scale is attn._v_scale  # the tensor every sync rewrites, not a float from the capture
        # XQA's q_scale, precomputed from the layer's scales after the reload (or at the last eager forward)
        xqa_scales = attn.impl.live_xqa_scales.scales
        q_scale = attn.impl.scale * attn.impl.head_size**0.5 * attn._k_scale.item() / attn._v_scale.item()
        assert xqa_scales.kv_scale is attn._v_scale and xqa_scales.q_scale.item() == pytest.approx(q_scale, rel=1e-6)
    else:  # FlashAttention-3's FP8 attention (queries quantized with our q scale), which reads the scales every call
        assert type(attn.impl).__name__ == "FlashAttentionImpl" and attn.impl.vllm_flash_attn_version == 3
        assert attn.query_quant is not None  # queries quantized to FP8 with the q scale the trainer measured


def test_sleep_mode_wakes_up_with_the_trainers_current_fp8_weights_and_kv_scales(tmp_path):
    """`vllm_enable_sleep_mode=True` (TRL sleeps the engine at level 2 after each rollout, discarding its weights):
    at every wake-up, right before generating, the engine holds the trainer's FP8 weights and KV scales of that
    step, bit for bit."""
    pytest.importorskip("vllm")
    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward

    args = FP8GRPOConfig(
        **GRPO_SETTINGS, output_dir=str(tmp_path / "out"), max_steps=4, logging_steps=1, bf16=True,
        disable_tqdm=True, model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25, vllm_enable_sleep_mode=True, tis="token", fp8_kv_cache=True,
    )  # fmt: skip
    trainer = FP8GRPOTrainer(
        str(_tiny_model_dir(tmp_path)), say_letter_reward, args, train_dataset=say_letter_dataset(256)
    )
    llm, checked = trainer.vllm_generation.llm, []
    generate = llm.generate

    def checked_generate(*a, **k):  # awake again, weights pushed: the engine must be this step's trainer
        vlayer = assert_engine_holds_trainer_fp8(trainer, sync=False)
        assert_engine_uses_trainer_kv_scales(trainer, vlayer)
        checked.append(trainer.state.global_step)
        return generate(*a, **k)

    llm.generate = checked_generate
    trainer.train()
    assert llm.llm_engine.is_sleeping()  # TRL put it back to sleep after the last rollout
    assert checked == [0, 1, 2, 3]


def test_power_of_two_scales_reach_the_default_kernel_unchanged(tmp_path):
    """fp8_power_of_two_scales=True on the default kernel (DeepGEMM on Hopper): the engine holds those scales as they
    are (vLLM's E8M0 rounding would also give powers of two, but rounded up from its own amax: not ours)."""
    pytest.importorskip("vllm")
    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward

    args = FP8GRPOConfig(
        **GRPO_SETTINGS, output_dir=str(tmp_path / "out"), max_steps=2, logging_steps=1, bf16=True,
        disable_tqdm=True, model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25, tis="token", fp8_power_of_two_scales=True,
    )  # fmt: skip
    trainer = FP8GRPOTrainer(
        str(_tiny_model_dir(tmp_path)), say_letter_reward, args, train_dataset=say_letter_dataset(256)
    )
    trainer.train()
    assert_engine_holds_trainer_fp8(trainer, layer_index=0)
    scale = trainer.model.model.layers[0].mlp.down_proj.quantized_weight()[1]
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # the trainer's scales are powers of two


@pytest.mark.parametrize("precision", ["bf16", "fp8_online"])
def test_colocate_other_rollout_precisions_run_grpo_steps(tmp_path, precision):
    pytest.importorskip("vllm")
    recipe = "none" if precision == "fp8_online" else "blockwise"  # fp8_online: the BF16-train baseline
    cmd = [
        sys.executable, str(ROOT / "examples" / "grpo_fp8.py"), "--output_dir", str(tmp_path), "--max_steps", "3",
        "--logging_steps", "1", "--use_vllm", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.25",
        "--rollout_precision", precision, "--fp8_recipe", recipe, "--tis", "token", "--save_fp8_checkpoint", "false",
    ]  # fmt: skip
    # A child of its own: no distributed-launch variables (an earlier in-process engine held MASTER_PORT). Three
    # steps take 2-5 minutes (engine start and compile included); on a machine whose other GPUs run tests too, longer.
    proc = run_child(cmd, timeout=720, env=clean_subprocess_env())
    tail = proc.stdout[-4000:]
    assert proc.returncode == 0, tail
    # The Trainer prints each step's logs as a dict: every step carries the mismatch and the sync time.
    logs = [line for line in proc.stdout.splitlines() if "fp8/mismatch/abs_logp_diff_mean" in line]
    print(f"{precision}: {logs[-1][:400] if logs else tail[-600:]}")
    assert len(logs) == 3 and all("fp8/weight_sync_ms" in line for line in logs)


def test_colocate_moe_rollouts_use_the_trainers_fp8_experts(tmp_path):
    """A Qwen3-MoE trained by FP8GRPOTrainer with colocated vLLM: after several steps, the engine's FusedMoE
    (block-FP8 `Fp8MoEMethod`) holds each expert's FP8 blocks and scales exactly as the trainer quantized them
    (`tests/workers/moe_colocate_worker.py`). In a process of its own: vLLM creates its expert-parallel group only
    with the first engine of a process, and the tests above started dense ones in this process."""
    pytest.importorskip("vllm")
    cmd = [sys.executable, str(WORKERS / "moe_colocate_worker.py"), str(tmp_path)]
    proc = run_child(cmd, timeout=480, env=clean_subprocess_env())
    out = proc.stdout
    print("\n".join(line for line in out.splitlines() if line.startswith("[moe]")))
    assert proc.returncode == 0, out[-6000:]
    assert "[moe] identity" in proc.stdout
