"""End-to-end GRPO step time, BF16 TRL against the FP8 flows, each run back to back on the same GPU.

    python -m benchmarks.bench_grpo --shape 8b --optim adamw_bnb_8bit --runs trl_bf16 fp8_rollout unified unified_fp8kv
    python -m benchmarks.bench_grpo       # Qwen3-4B shape, stock AdamW (no bitsandbytes needed)

    python -m benchmarks.bench_grpo --shape 8b --num_processes 2 --launch_config fsdp2 --runs trl_bf16 unified
                          # several GPUs: each run under `accelerate launch` with one of TRL's configs

The first command is the committed run (`results/grpo_speed_NVIDIA_H200.json`, via `run_report.sh`); random
weights, GPU host with vLLM.

Runs (one child process each, vLLM colocated, same model, prompts, batch and 1k-token rollouts):

- `trl_bf16`: TRL's plain `GRPOTrainer` (BF16 training, BF16 vLLM rollouts): what a user runs today;
- `fp8_rollout`: `FP8GRPOTrainer`, BF16 training, rollouts on block-FP8 weights quantized by the trainer;
- `unified`: `FP8GRPOTrainer`, blockwise FP8 training and rollouts on the same FP8 weights (Jet-RL's flow);
- `unified_fp8kv` (with `--runs ... unified_fp8kv`): the same plus an FP8 KV cache;
- `unified_deepgemm`: `unified` with FProp and DGrad on DeepGEMM (`fp8_backend="deepgemm"`);
- `unified_nocache`: `unified` quantizing each weight at every forward instead of caching its FP8 copy (the
  memory that copy costs, against the time it saves);
- `bf16_compiled`, `unified_compiled`, `unified_fp8kv_compiled`: BF16 training (FP8GRPOTrainer without FP8 layers,
  BF16 rollouts) and the unified flows with every decoder layer compiled (`FP8Tuning(compile_decoder_layers=True)`);
  `unified_fp8kv_compiled_liger` puts Liger's RMSNorm, RoPE and SwiGLU kernels inside the compiled layers;
- `unified_fused`: `unified` with q/k/v and gate/up as one FP8 GEMM per pass and SiLU·mul fused into
  `down_proj`'s input quantization (`FP8Tuning(fuse_sibling_gemms=True, fuse_swiglu=True)`);
- `fp8_defaults`: `FP8GRPOConfig` left to its defaults (what a user who sets nothing gets: Liger's kernels where
  installed, the FP8 weight cache and the FP8 KV cache as the planner chooses them, the rollouts scored in the
  micro-batches' own forwards); every other run sets `use_liger_kernel` and `fp8_kv_cache` itself;
  `fp8_defaults_scoring_pass` keeps TRL's scoring pass before the micro-batches (`score_in_training_forward=False`),
  `fp8_defaults_vllm_act_quant` keeps vLLM's own fused SiLU-and-mul + FP8 quantization kernel
  (`FP8Tuning(vllm_act_quant_kernel="vllm")`), `fp8_defaults_vllm_text` vLLM's text and per-token log-prob dicts
  (`vllm_token_ids_only=False`), `fp8_defaults_fused_siblings` runs q/k/v (and a dense MLP's gate/up) as one FP8 GEMM
  per pass (`FP8Tuning(fuse_sibling_gemms=True)`); `trl_bf16_token_ids` is TRL BF16 with the `SamplingParams` fields that
  `vllm_token_ids_only` adds, passed through TRL's `generation_kwargs`; `fp8_defaults_compiled` and its twin
  `bf16_defaults_compiled` compile every decoder layer (`FP8Tuning(compile_decoder_layers=True)`, so the planner
  leaves Liger's kernels off), `fp8_defaults_deepgemm` runs FProp and DGrad on DeepGEMM (`fp8_backend="deepgemm"`);
- `fp8_exact`: the defaults in exact on-policy mode (`exact_on_policy=True`: vLLM in batch-invariant mode, a BF16 KV
  cache, every log-prob scored with the engine's kernels); its row keeps each step's largest |dlogp| and k3 KL
  (`mismatch_by_step`), which exact mode makes 0, and its cost shows against `fp8_defaults`.

Peak allocated memory is recorded per phase (rollout: sync + generate; training: the rest, split into scoring and
micro-batches), with the size of the FP8 weight cache at the end.

Each step is split into rollout (vLLM generate), weight sync, and training (everything else: scoring log-probs,
rewards, forward/backward, optimizer). Medians are reported over the steps after the first `--warmup` and before
the first profiled one (`--profile_step`: a step's training phase; `--profile_rollout_step`: a step's rollout). All
runs use token-level IS correction so they do the same work.
Writes `benchmarks/results/grpo_speed_<device>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from benchmarks.bench_rollout import (
    SAMPLING,
    SHAPES,
    floor_tokens_per_s,
    hardware,
    host_line,
    model_bytes,
    shape_model,
)
from benchmarks.common import (
    arg_parser,
    kernel_breakdown,
    metadata,
    previous_rows,
    results_path,
    run_all,
    segment_end,
    untraced_span,
    write_json,
)
from benchmarks.host_sampling import GcPauses, StackSampler
from benchmarks.host_timers import HostTimers

RUNS = {  # run: (trainer, fp8_recipe, rollout_precision, fp8 KV cache, training GEMM backend, FP8 weight cache)
    "trl_bf16": ("trl", None, "bf16", False, None, None),
    "fp8_rollout": ("trl_fp8", "none", "fp8", False, "auto", None),
    "unified": ("trl_fp8", "blockwise", "fp8", False, "auto", None),
    "unified_fp8kv": ("trl_fp8", "blockwise", "fp8", True, "auto", None),
    "unified_fp8kv_liger": ("trl_fp8", "blockwise", "fp8", True, "auto", None),  # the fastest flow at the 8B shape
    "unified_deepgemm": ("trl_fp8", "blockwise", "fp8", False, "deepgemm", None),  # FProp/DGrad on DeepGEMM (opt-in)
    "unified_nocache": ("trl_fp8", "blockwise", "fp8", False, "auto", False),  # weights quantized at every forward
    "unified_fused": ("trl_fp8", "blockwise", "fp8", False, "auto", None),  # + RUN_TUNING below
    "trl_bf16_liger": ("trl", None, "bf16", False, None, None),
    "unified_liger": ("trl_fp8", "blockwise", "fp8", False, "auto", None),
    "unified_fused_liger": ("trl_fp8", "blockwise", "fp8", False, "auto", None),
    # FP8Tuning(compile_decoder_layers=True): each decoder layer compiled in place (regional compilation), BF16 and FP8 alike
    "bf16_compiled": ("trl_fp8", "none", "bf16", False, "auto", None),
    "unified_compiled": ("trl_fp8", "blockwise", "fp8", False, "auto", None),
    "unified_fp8kv_compiled": ("trl_fp8", "blockwise", "fp8", True, "auto", None),
    "unified_fp8kv_compiled_liger": ("trl_fp8", "blockwise", "fp8", True, "auto", None),
    # partial checkpointing (transformers' every_n_layers; TRL 1.16's own trainer fails with it, ours keeps it)
    "bf16_ckpt2": ("trl_fp8", "none", "bf16", False, "auto", None),
    "unified_ckpt2": ("trl_fp8", "blockwise", "fp8", False, "auto", None),
    "unified_ckpt4": ("trl_fp8", "blockwise", "fp8", False, "auto", None),
    "unified_liger_nocache": ("trl_fp8", "blockwise", "fp8", False, "auto", False),  # Liger, BF16's peak memory
    # the FP8 weight cache kept through the micro-batches too (the default holds it for scoring and the sync only)
    "unified_fp8kv_liger_cache": ("trl_fp8", "blockwise", "fp8", True, "auto", True),
    # MoE: every sync takes vLLM's layerwise reload for the experts too (the in-place expert write off), to compare
    "unified_experts_reload": ("trl_fp8", "blockwise", "fp8", False, "auto", None),
    "fp8_defaults": ("trl_fp8", "blockwise", "fp8", None, "auto", None),  # + use_liger_kernel left unset
    # fp8_defaults' BF16 twin: the same trainer and defaults (Liger, scoring in the training forward, token ids only,
    # token TIS) with nothing in FP8, so that FP8's own share of a speed-up is told apart from the trainer's
    "bf16_defaults": ("trl_fp8", "none", "bf16", False, "auto", None),
    "fp8_defaults_scoring_pass": ("trl_fp8", "blockwise", "fp8", None, "auto", None),
    "fp8_defaults_vllm_act_quant": ("trl_fp8", "blockwise", "fp8", None, "auto", None),
    "fp8_defaults_vllm_text": ("trl_fp8", "blockwise", "fp8", None, "auto", None),
    "fp8_defaults_fused_siblings": ("trl_fp8", "blockwise", "fp8", None, "auto", None),
    "trl_bf16_token_ids": ("trl", None, "bf16", False, None, None),
    # the defaults with every decoder layer compiled (the host's work per FP8 layer cut; Liger's layer kernels then
    # off), and their BF16 twin; the defaults with FProp and DGrad on DeepGEMM
    "fp8_defaults_compiled": ("trl_fp8", "blockwise", "fp8", None, "auto", None),
    "bf16_defaults_compiled": ("trl_fp8", "none", "bf16", False, "auto", None),
    "fp8_defaults_deepgemm": ("trl_fp8", "blockwise", "fp8", None, "deepgemm", None),
    "fp8_exact": ("trl_fp8", "blockwise", "fp8", False, "auto", None),  # exact mode needs a BF16 KV cache
    # FSDP2's all-gathers and the host: gathered two layers ahead, old log-probs scored 16 sequences a forward, and
    # both with q/k/v and gate/up as one GEMM each (fewer launches per layer where the host bounds the step)
    "unified_fp8kv_liger_prefetch2": ("trl_fp8", "blockwise", "fp8", True, "auto", None),
    "unified_fp8kv_liger_logprob16": ("trl_fp8", "blockwise", "fp8", True, "auto", None),
    "unified_fp8kv_liger_fsdp2": ("trl_fp8", "blockwise", "fp8", True, "auto", None),
}
EXPERTS_BY_RELOAD = {"unified_experts_reload"}
LIGER = {
    "use_liger_kernel": True
}  # Liger's RMSNorm, SwiGLU and RoPE kernels (TRL already fuses the LM head's logprobs)
RUN_OPTIONS = {  # further (FP8)GRPOConfig fields of a run
    "trl_bf16_liger": LIGER,
    "unified_liger": LIGER,
    "unified_fp8kv_liger": LIGER,
    "unified_fused_liger": LIGER,  # Liger's SwiGLU in place of ours
    # Liger's kernels traced inside the compiled layers, against Inductor fusing the same ops itself
    "unified_fp8kv_compiled_liger": LIGER,
    "bf16_ckpt2": {"gradient_checkpointing_kwargs": {"every_n_layers": 2}},
    "unified_ckpt2": {"gradient_checkpointing_kwargs": {"every_n_layers": 2}},
    "unified_ckpt4": {"gradient_checkpointing_kwargs": {"every_n_layers": 4}},
    "unified_liger_nocache": LIGER,
    "unified_fp8kv_liger_cache": LIGER,
    "fp8_defaults": {"use_liger_kernel": None},  # FP8GRPOTrainer's own start-up choice
    "bf16_defaults": {"use_liger_kernel": None},
    # the defaults, with TRL's scoring pass of every rollout before the micro-batches kept (what skipping it gains)
    "fp8_defaults_scoring_pass": {"use_liger_kernel": None, "score_in_training_forward": False},
    # the defaults with vLLM's own fused SiLU-and-mul + FP8 quantization kernel (what trl-fp8's kernel gains)
    "fp8_defaults_vllm_act_quant": {"use_liger_kernel": None},
    # the defaults with vLLM's text and per-token log-prob dicts kept (what `vllm_token_ids_only` gains), and TRL
    # BF16 given the same SamplingParams fields through its generation_kwargs (the part of it that is not FP8's)
    "fp8_defaults_vllm_text": {"use_liger_kernel": None, "vllm_token_ids_only": False},
    "trl_bf16_token_ids": {"generation_kwargs": {"detokenize": False, "flat_logprobs": True}},
    # the defaults with q/k/v (and a dense MLP's gate/up) as one FP8 GEMM per pass: fewer launches where the host
    # bounds the micro-batches
    "fp8_defaults_fused_siblings": {"use_liger_kernel": None},
    "fp8_defaults_compiled": {"use_liger_kernel": None},
    "bf16_defaults_compiled": {"use_liger_kernel": None},
    "fp8_defaults_deepgemm": {"use_liger_kernel": None},
    "fp8_exact": {"use_liger_kernel": None, "exact_on_policy": True},
    "unified_fp8kv_liger_prefetch2": LIGER,
    "unified_fp8kv_liger_logprob16": {"logprob_batch_size": 16, **LIGER},
    "unified_fp8kv_liger_fsdp2": {"logprob_batch_size": 16, **LIGER},
}
RUN_TUNING = {  # the `FP8Tuning` of a run of FP8GRPOTrainer (its fields; the others: FP8Tuning's defaults)
    "unified_fused": {"fuse_sibling_gemms": True, "fuse_swiglu": True},
    "unified_fused_liger": {"fuse_sibling_gemms": True},
    "bf16_compiled": {"compile_decoder_layers": True},
    "unified_compiled": {"compile_decoder_layers": True},
    "unified_fp8kv_compiled": {"compile_decoder_layers": True},
    "unified_fp8kv_compiled_liger": {"compile_decoder_layers": True},
    "fp8_defaults_vllm_act_quant": {"vllm_act_quant_kernel": "vllm"},
    "fp8_defaults_fused_siblings": {"fuse_sibling_gemms": True},
    "fp8_defaults_compiled": {"compile_decoder_layers": True},
    "bf16_defaults_compiled": {"compile_decoder_layers": True},
    "unified_fp8kv_liger_prefetch2": {"fsdp2_prefetch_layers": 2},
    "unified_fp8kv_liger_fsdp2": {"fsdp2_prefetch_layers": 2, "fuse_sibling_gemms": True},
}


def vocab_tokenizer(vocab_size: int):
    """A word-level tokenizer covering the whole model vocabulary ("t<i>"), so random rollouts decode."""
    from trl_fp8.demo.tiny_model import word_tokenizer

    return word_tokenizer(["<pad>", "<eos>", *(f"t{i}" for i in range(2, vocab_size))], pad="<pad>", eos="<eos>",
                          unk="<pad>")  # fmt: skip


def model_positions(prompt_len: int, completion_len: int) -> int:
    """The model's (and so vLLM's) context: prompt plus completion, rounded up to a power of two, at least 4096."""
    return max(4096, 1 << (prompt_len + completion_len - 1).bit_length())


def make_model_dir(path: Path, shape: str, positions: int) -> None:
    """A random model of `shape` saved with a tokenizer: Qwen3, or Qwen3-MoE for the shapes with experts."""
    model = shape_model(shape, "cuda", positions, eos_token_id=1, pad_token_id=0)
    model.save_pretrained(path)
    vocab_tokenizer(model.config.vocab_size).save_pretrained(path)


def length_reward(completions, **kwargs) -> list[float]:
    """Any reward with spread will do for timing: a hash of the text."""
    return [(hash(c) % 1000) / 1000 for c in completions]


def allocator_segments(snapshot: list[dict]) -> dict[str, int]:
    """What PyTorch's caching allocator holds, split by where its free bytes sit (from `torch.cuda.memory_snapshot()`):
    free bytes in segments with no live block (`empty_cache` returns them), free bytes pinned in segments that still
    hold a live block (fragmentation: `empty_cache` cannot return them), and the bytes of private pools (vLLM's
    sleep-mode pool is one); says why reserved minus allocated stays high beside vLLM."""
    account = dict.fromkeys(("segments", "free_releasable", "free_pinned", "private_pool_reserved"), 0)
    for seg in snapshot:
        free = seg["total_size"] - seg["allocated_size"]
        account["segments"] += 1
        account["free_pinned" if seg["allocated_size"] else "free_releasable"] += free
        if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0):
            account["private_pool_reserved"] += seg["total_size"]
    return account


class DeviceMemorySampler:
    """The GPU's used memory (total - free, as `nvidia-smi` counts it) sampled every `interval` s in a thread;
    `take_peak()` returns the highest since the last call."""

    def __init__(self, interval: float = 0.02):
        import threading

        import torch

        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self.device = torch.cuda.current_device()  # this process's GPU (each rank's own)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import torch

        torch.cuda.set_device(self.device)  # a new thread starts on GPU 0: it would read (and hold a context on) GPU 0
        while not self._stop.wait(self.interval):
            free, total = torch.cuda.mem_get_info(self.device)
            self.peak = max(self.peak, total - free)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def take_peak(self) -> int:
        peak, self.peak = self.peak, 0
        return peak


def model_dir(args) -> Path:
    """One random model per shape and context length under `--workdir`, shared by the runs (and by later calls)."""
    return Path(args.workdir) / f"model_{args.shape}_{model_positions(args.prompt_len, args.completion_len)}"


def choice_record(choice, key: str) -> dict | None:
    """A plan's `Choice` as the results record it: its value under `key` ("on", "cache", "sync_each_batch"), its
    reason and whether the trainer made it; the weight cache adds `with_grad`. None for no choice."""
    if choice is None:
        return None
    value = choice.value
    record = {key: bool(value), "reason": choice.reason, "automatic": choice.automatic}
    if hasattr(value, "with_grad"):
        record["with_grad"] = value.with_grad
    return record


def fp8_cache_with_grad(model) -> bool | None:
    """Whether the model's FP8 layers keep their weight cache through the micro-batches (False: held for scoring and
    the sync only; None: no blockwise FP8 layer)."""
    configs = [m.fp8_config for m in model.modules() if hasattr(getattr(m, "fp8_config", None), "cache_with_grad")]
    return configs[0].cache_with_grad if configs else None


def run_one(args) -> None:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Tuning
    from trl_fp8.nn.linear import fp8_weight_cache_bytes
    from trl_fp8.trainer.memory import memory_breakdown

    trainer_kind, recipe, precision, fp8_kv, gemm_backend, cache_weights = RUNS[args.run]
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [" ".join(f"t{i}" for i in torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist())
               for _ in range(args.steps * args.generation_batch)]  # fmt: skip
    common = dict(
        output_dir=str(Path(args.workdir) / args.run), max_steps=args.steps, learning_rate=1e-6, logging_steps=1,
        per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.generation_batch // args.micro_batch,
        num_generations=args.num_generations, max_completion_length=args.completion_len,
        temperature=1.0, beta=0.0, bf16=True, gradient_checkpointing=True, save_strategy="no", report_to="none",
        seed=0, optim=args.optim, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory,
        generation_kwargs={"ignore_eos": True}, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
        model_init_kwargs={"dtype": "bfloat16"}, disable_tqdm=True, vllm_enable_sleep_mode=args.sleep_mode,
    )  # fmt: skip
    if args.vllm_tensor_parallel_size > 1:
        common["vllm_tensor_parallel_size"] = args.vllm_tensor_parallel_size
    if args.sync_each_batch:
        common["accelerator_config"] = {"gradient_accumulation_kwargs": {"sync_each_batch": True}}
    if trainer_kind == "trl":
        options = dict(RUN_OPTIONS.get(args.run, {}))
        options["generation_kwargs"] = {**common["generation_kwargs"], **options.get("generation_kwargs", {})}
        trainer_cls, config = GRPOTrainer, GRPOConfig(**{**common, **options})
        tuning = {}
    else:
        trainer_cls = FP8GRPOTrainer
        tuning = {"tuning": FP8Tuning(**RUN_TUNING.get(args.run, {}))}
        # Liger's kernels only in the runs named for them (FP8GRPOTrainer would otherwise choose them on a GPU)
        options = {"use_liger_kernel": False, **RUN_OPTIONS.get(args.run, {})}
        if precision == "fp8" and args.vllm_fp8_moe_backend != "auto":  # the experts' kernel in FP8 rollouts only
            options.setdefault("vllm_fp8_moe_backend", args.vllm_fp8_moe_backend)
        config = FP8GRPOConfig(**common, fp8_recipe=recipe, rollout_precision=precision, fp8_kv_cache=fp8_kv,
                               fp8_backend=gemm_backend, fp8_cache_weights=cache_weights,
                               save_fp8_checkpoint=False, **options)  # fmt: skip

    timings = {"rollout": [], "sync": [], "step": [], "score": [], "optimizer": []}
    # Peak allocated bytes by phase: "rollout" covers sync + generate, "training" the rest of the step, split into
    # "scoring" (rewards, old and reference log-probs) and "micro_batches" (forward/backward, optimizer): which of them
    # sets a flow's peak, and by how much. The allocator's peak is read and reset at each boundary.
    peaks = {"rollout": 0, "training": 0, "scoring": 0, "micro_batches": 0}

    # The allocator's figure counts what vLLM's sleep mode has unmapped (its pool's tensors stay allocated while their
    # memory is released), so it can exceed the GPU. The device's own use (total - free, sampled every 20 ms: this
    # process, vLLM's engine and CUDA contexts) is what must fit.
    device_peaks = {"rollout": 0, "training": 0, "scoring": 0, "micro_batches": 0}
    sampler = DeviceMemorySampler()

    def close_phase(phase: str) -> None:
        """`phase`: "rollout", "scoring" or "micro_batches" (the last two also count as "training")."""
        allocated, device = torch.cuda.max_memory_allocated(), sampler.take_peak()
        torch.cuda.reset_peak_memory_stats()
        for name in (phase, "training") if phase != "rollout" else (phase,):
            peaks[name] = max(peaks[name], allocated)
            device_peaks[name] = max(device_peaks[name], device)

    class StepTimer(TrainerCallback):
        """Optimizer-step wall times: the time between consecutive step ends (step begin fires per micro-step)."""

        def on_train_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            now = time.perf_counter()
            timings["step"].append(now - self.last)
            self.last = now
            close_phase("micro_batches")

        def on_pre_optimizer_step(self, args, state, control, **k):
            torch.cuda.synchronize()
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **k):
            torch.cuda.synchronize()
            timings["optimizer"].append((state.global_step, time.perf_counter() - self.optimizer_start))

    import trl.generation.vllm_generation as trl_vllm

    from trl_fp8.rollout.stats import engine_kv_cache_tokens
    from trl_fp8.rollout.vllm.partitions import tensor_parallel_overrides

    # Every engine collects vLLM's scheduler statistics (TRL's own builds it without). An engine over several GPUs
    # gets this host's tensor-parallel settings whichever trainer runs (FP8GRPOTrainer sets them itself): without
    # them TRL's own engine cannot start here either (no NVLink multicast; expandable segments in sleep mode).
    host = {name: value for name, (value, _) in tensor_parallel_overrides(args.vllm_tensor_parallel_size).items()}
    llm_class = trl_vllm.LLM
    trl_vllm.LLM = benchmark_llm(llm_class, host, json.loads(args.engine_kwargs) if args.engine_kwargs else {})
    start = time.perf_counter()
    trainer = trainer_cls(
        str(model_dir(args)), length_reward, config,
        train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[StepTimer()], **tuning,
    )  # fmt: skip
    startup_s = time.perf_counter() - start  # model load and engine start (DeepGEMM's warm-up included)
    sampler.start()
    generation = trainer.vllm_generation
    if args.run in EXPERTS_BY_RELOAD:
        generation.engine_experts = False  # FP8VLLMGeneration: False = never write experts in place
    report = getattr(generation, "report", None)  # what FP8VLLMGeneration settled and did (TRL's has no report)
    stats = engine_stats(generation)
    rollout_stats = []

    def with_stats(fn):
        def wrapper(*a, **k):
            stats.read()
            try:
                return fn(*a, **k)
            finally:
                rollout_stats.append(stats.read(reset=False))  # FP8GRPOTrainer reads (and resets) them after

        return wrapper

    if stats is not None:
        generation.generate = with_stats(generation.generate)

    def timed(fn, key):
        def wrapper(*a, **k):
            torch.cuda.synchronize()
            if key == "sync":  # the sync opens the rollout phase
                close_phase("micro_batches")
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                torch.cuda.synchronize()
                timings[key].append((trainer.state.global_step, time.perf_counter() - start))
                if key == "rollout":
                    close_phase("rollout")
                elif key == "score":
                    close_phase("scoring")
                    segment_end("scoring")  # a profile that covers the scoring splits there

        return wrapper

    # The step's scoring (rewards, old and reference log-probs, the mismatch metrics), around the rollout and sync
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "score")

    memory_at_generation = []  # the first two rollouts (warm-up and first measured), as vLLM starts generating
    llm_generate = generation.llm.generate

    def accounted(*a, **k):
        if len(memory_at_generation) < 2:
            account = memory_breakdown(trainer.model, trainer.optimizer, trainer.model_wrapped)
            segments = allocator_segments(torch.cuda.memory_snapshot())
            account.update((key, b) for key, b in segments.items() if key != "segments")
            memory_at_generation.append({key: b / 2**30 for key, b in account.items()})
            memory_at_generation[-1]["segments"] = segments["segments"]
        return llm_generate(*a, **k)

    generation.llm.generate = accounted
    generation.generate = timed(generation.generate, "rollout")
    generation.sync_weights = timed(generation.sync_weights, "sync")
    rollout_profile = {}
    if args.profile_rollout_step is not None:  # the engine's kernels during that step's rollout, in-process
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        timed_generate = generation.generate

        window = rollout_profile_window(args.completion_len, args.profile_engine_steps)

        def profiled_rollout(*a, **k):
            if trainer.state.global_step != args.profile_rollout_step or rollout_profile:
                return timed_generate(*a, **k)
            torch.cuda.synchronize()
            engine, engine_step = generation.llm.llm_engine, generation.llm.llm_engine.step
            with (
                torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=window) as prof,
                StackSampler() as stacks,
                GcPauses() as pauses,
                named_model_runner_calls(generation.llm),
            ):
                if window is not None:  # the profiler's steps are the engine's: it records the window's alone

                    def stepped(*sa, **sk):
                        out = engine_step(*sa, **sk)
                        prof.step()
                        return out

                    engine.step = stepped
                try:
                    out = timed_generate(*a, **k)
                    torch.cuda.synchronize()
                finally:
                    engine.__dict__.pop("step", None)
            rollout_profile["prof"] = prof  # its events are read after training
            # where the host thread was meanwhile (the engine steps on it), and the collector's pauses on it
            rollout_profile["host"] = {"stacks": stacks.summary(), "gc": pauses.record()}
            return out

        generation.generate = profiled_rollout
    profile, state = {}, {}
    if args.profile_step is not None:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]

        def untraced(fn):  # the rollout and the sync are measured above; the profile covers the training phase
            def wrapper(*a, **k):
                with untraced_span(state.get("prof"), activities):
                    return fn(*a, **k)

            return wrapper

        generation.generate = untraced(generation.generate)
        generation.sync_weights = untraced(generation.sync_weights)

        def start():
            state["prof"] = torch_profile(activities=activities)
            state["prof"].__enter__()

        def stop():
            torch.cuda.synchronize()
            state["prof"].__exit__(None, None, None)  # stops collecting; the events are read after training
            state["prof"], state["done"] = None, state["prof"]

        profiler = StepProfiler(args.profile_step, args.profile_micro_batches, start, stop, args.profile_scoring)
        trainer.add_callback(profiler)
    try:
        trainer.train()
    except torch.OutOfMemoryError:
        # What held the memory when it ran out, on every rank (the traceback says only where).
        breakdown = memory_breakdown(trainer.model, trainer.optimizer, trainer.model_wrapped)
        gib = {key: b / 2**30 for key, b in breakdown.items()}
        print(json.dumps({"out_of_memory_gib": {"rank": trainer.accelerator.process_index, **gib}}), flush=True)
        raise
    if "done" in state:
        profile.update(step=args.profile_step, **kernel_breakdown(state["done"], rest="micro_batches"))
        if args.profile_micro_batches is not None:
            profile["micro_batches"] = profiler.profiled  # from the step's second micro-batch on
            profile["scoring"] = args.profile_scoring  # then the first micro-batch is in `micro_batches` too

    def per_step(key):  # seconds per optimizer step, by the step during which they ran
        totals = [0.0] * args.steps
        for step, seconds in timings[key]:
            totals[step] += seconds
        return totals

    close_phase("micro_batches")
    sampler.stop()
    rollout_s, sync_s = per_step("rollout"), per_step("sync")
    per_step_s = {"step_s": timings["step"], "rollout_s": rollout_s, "weight_sync_s": sync_s,
                  # what _generate_and_score_completions spends beyond the rollout and the sync inside it
                  "scoring_s": [t - r - w for t, r, w in zip(per_step("score"), rollout_s, sync_s, strict=True)],
                  "optimizer_s": per_step("optimizer")}  # fmt: skip
    keep = median_steps(args.steps, args.warmup, first_profiled_step(args))
    plan = getattr(trainer, "plan", None)  # FP8 trainers' start-up decisions (TRL's own trainers have none)
    from benchmarks.vllm_engine import engine_kernels

    row = {
        "name": args.run,
        "trainer": trainer_kind,
        "fp8_recipe": recipe,
        "rollout_precision": precision,
        # as the trainer settled it where the run leaves it unset (fp8_defaults)
        "fp8_kv_cache": bool(trainer.args.fp8_kv_cache) if fp8_kv is None else fp8_kv,
        "fp8_backend": gemm_backend,
        "fp8_cache_weights": cache_weights,
        # the trainer's choice where fp8_cache_weights is None (FP8GRPOTrainer.plan.fp8_weight_cache)
        "fp8_weight_cache": choice_record(plan and plan.fp8_weight_cache, "cache"),
        # FSDP2 with gradient accumulation: whether every micro-batch reduce-scattered, and why (the trainer's choice)
        "fsdp2_gradient_sync": choice_record(plan and plan.fsdp2_gradient_sync, "sync_each_batch"),
        "fp8_options": RUN_OPTIONS.get(args.run, {}),
        **({"engine_kwargs": json.loads(args.engine_kwargs)} if args.engine_kwargs else {}),
        "tuning": RUN_TUNING.get(args.run, {}),  # the run's FP8Tuning, its fields other than the defaults
        # Liger's kernels as the trainer settled them (FP8GRPOTrainer.plan.liger_kernels; TRL's runs: their option)
        "liger_kernels": choice_record(plan.liger_kernels, "on")
        if plan
        else {"on": bool(trainer.args.use_liger_kernel), "automatic": False},
        "step_time": step_medians(per_step_s, keep),  # over measured.median_steps
        "per_step": per_step_s,
        "measured": measurement(args),
        "peak_memory_gib": max(peaks.values()) / 2**30,
        "peak_memory_by_phase_gib": {phase: b / 2**30 for phase, b in peaks.items()},
        "peak_device_memory_by_phase_gib": {phase: b / 2**30 for phase, b in device_peaks.items()},
        "gpu_memory_gib": torch.cuda.mem_get_info()[1] / 2**30,
        "fp8_weight_cache_gib": fp8_weight_cache_bytes(trainer.model) / 2**30,
        # whether the FP8 layers kept their cache through the micro-batches (False: held for scoring and the sync)
        "fp8_cache_with_grad": fp8_cache_with_grad(trainer.model),
        # sleep mode: the FP8 weight copies let go while the last rollout generated (vllm_sync)
        "fp8_cache_released_gib": (report.released_cache_bytes if report else 0) / 2**30,
        "memory_at_generation_gib": memory_at_generation,  # trainer tensors, allocator and device as vLLM generates
        "startup_s": startup_s,
        "time_to_first_step_s": startup_s + per_step_s["step_s"][0],
        "kv_cache_tokens": engine_kv_cache_tokens(generation.llm),
        # what vLLM runs, read from the engine (linear kernel, experts, attention implementation, cache dtype), and the
        # trainer's choice of decode kernel for an FP8 KV cache with its reason
        "engine_kernels": engine_kernels(generation.llm),
        "kv_attention": dataclasses.asdict(report.kv_attention) if report and report.kv_attention else None,
        "deepgemm_precompile": vars(report.deepgemm_precompile) if report and report.deepgemm_precompile else None,
        "act_quant": vars(report.act_quant_choice) if report and report.act_quant_choice else None,
        "norm_quant": vars(report.norm_quant_choice) if report and report.norm_quant_choice else None,
        "rollout_stats": rollout_stats,  # per rollout: most sequences at once, preemptions, peak KV-cache use
        "mismatch": mismatch_medians(trainer.state.log_history, keep),  # trainer vs rollout, TIS clipping
        "mismatch_by_step": mismatch_by_step(trainer.state.log_history),  # every step's, warm-up included
        **engine_experts_state(generation),
    }
    settings = {k: getattr(args, k) for k in REGIME} | {"vllm_tensor_parallel_size": args.vllm_tensor_parallel_size}
    row["rollout_floor"] = rollout_floor(row, settings, torch.cuda.get_device_name())
    row["planner"] = planned_kv_tokens(row, settings)
    world = trainer.accelerator.num_processes
    if world > 1:  # each rank's own phases: a straggler's longer rollout shows beside the others' longer scoring
        row["by_rank"] = ranks_phases(row, world)
    if args.profile_step is not None and world > 1:  # every rank profiled the same step: how each one spent it
        profile["by_rank"] = ranks_profiles(profile, world)
    if profile:
        row["training_profile"] = profile
    if "prof" in rollout_profile:
        row["rollout_profile"] = {
            "step": args.profile_rollout_step,
            "engine_steps": profile_window_steps(args.completion_len, args.profile_engine_steps),
            **kernel_breakdown(rollout_profile.pop("prof")),
            "host": rollout_profile["host"],
        }
    if args.engine_probe:
        row["engine_probe"] = engine_probe(generation, args.generation_batch, args.prompt_len, args.completion_len)
    row["processes"] = world
    row["completions_per_step"] = args.generation_batch * world
    row["completions_per_s"] = row["completions_per_step"] / row["step_time"]["step_s"]
    if trainer.accelerator.is_main_process:
        print(json.dumps(row), flush=True)


def probe_sampling(generation) -> dict[str, dict]:
    """`SamplingParams` fields of each `--engine_probe` rollout: the trainer's as TRL builds them for a colocated
    rollout (its log-probs, `generation_kwargs` with trl-fp8's token-ids-only fields), the same without log-probs,
    and `bench_rollout`'s (no log-probs, a seed per request), which measured the same engine alone faster."""
    trainer = {"n": 1, "repetition_penalty": generation.repetition_penalty, "temperature": generation.temperature,
               "top_p": generation.top_p, "top_k": generation.top_k,
               "min_p": 0.0 if generation.min_p is None else generation.min_p, "logprobs": generation.logprobs,
               **generation.generation_kwargs}  # fmt: skip
    return {"trainer": trainer, "trainer_no_logprobs": {**trainer, "logprobs": None},
            "bench_rollout": dict(SAMPLING["bench"])}  # fmt: skip


def benchmark_llm(llm_class, host: dict, extra: dict):
    """`LLM` as every run's engine is built: vLLM's statistics collected (TRL's own engine is built without), this
    host's tensor-parallel settings, then the trainer's arguments, then `extra` (`--engine_kwargs`) over all of them:
    one engine setting's cost inside the trainer, measured."""
    return lambda *a, **kw: llm_class(*a, **{"disable_log_stats": False, **host, **kw, **extra})


def process_facts() -> dict:
    """What about this process could slow a host thread that bench_rollout's does not have: tracing or profiling
    hooks, the collector's load, other threads, the CPU cores it may run on, PyTorch's global modes and threads."""
    import threading

    import torch

    return {
        "trace_hook": repr(sys.gettrace()), "profile_hook": repr(sys.getprofile()),
        "gc_objects": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count(), "gc_thresholds": gc.get_threshold(),
        "gc_counts": gc.get_count(), "threads": sorted(t.name for t in threading.enumerate()),
        "cpu_affinity": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(), "anomaly_mode": torch.is_anomaly_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "TORCH", "PYTORCH", "CUDA_", "OMP_"))},
    }  # fmt: skip


def engine_probe(generation, seqs: int, prompt_len: int, new_tokens: int) -> dict:
    """The trainer's own engine, after training, on `seqs` random prompts of `prompt_len` tokens, `new_tokens` each
    (ignore_eos), once per `probe_sampling` entry, then the trainer's again with `DeviceMemorySampler`'s thread
    running as it does during the timed steps and with the garbage collector off: milliseconds per decode step
    (prefill included) of each. Set beside
    the timed rollouts and `bench_rollout`'s engine alone, it says whether a slower decode step in the trainer comes
    from the sampling fields, the engine's settings (prefix caching: on in TRL's engines, off in bench_rollout's)
    or the process around the engine; each rollout's host time by call (`HostTimers`) says which of the engine's
    steps take it. The prefix cache is emptied before each, so that every one prefills its prompts."""
    import random

    import torch
    from vllm import SamplingParams

    llm = generation.llm
    if getattr(generation, "enable_sleep_mode", False):  # TRL put the engine to sleep after the last rollout, its
        generation.sync_weights()  # weights let go (level 2): wake it as a rollout does, weights pushed again
        llm.wake_up(tags=["kv_cache"])
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(seqs)]

    hosts = {}

    def ms_per_step(fields: dict, name: str) -> float:
        params = SamplingParams(**{**fields, "max_tokens": new_tokens, "ignore_eos": True})  # the fields may hold one
        llm.reset_prefix_cache()  # every variant prefills its prompts: none finds them cached by the one before
        torch.cuda.synchronize()
        with HostTimers(llm) as timers:
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        hosts[name] = timers.summary()
        return 1e3 * seconds / new_tokens

    variants = probe_sampling(generation)
    probe = {name: ms_per_step(fields, name) for name, fields in variants.items()}
    sampler = DeviceMemorySampler()
    sampler.start()
    try:
        probe["trainer_with_memory_sampler"] = ms_per_step(variants["trainer"], "trainer_with_memory_sampler")
    finally:
        sampler.stop()
    gc.collect()
    gc.disable()  # the collector's share: a trainer's process holds far more Python objects than bench_rollout's
    try:
        probe["trainer_gc_off"] = ms_per_step(variants["trainer"], "trainer_gc_off")
    finally:
        gc.enable()
    from trl_fp8.rollout.vllm._compat import engine_cache_config

    return {
        "ms_per_decode_step": probe,
        "process": process_facts(),
        "seqs": seqs,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "prefix_caching": bool(engine_cache_config(llm).enable_prefix_caching),
        "sampling": variants,
        "host": hosts,
    }


@contextlib.contextmanager
def named_model_runner_calls(llm, names=("execute_model", "sample_tokens")):
    """Each call of the in-process engine's model runner `names` inside a profiler scope `model_runner: <name>` while
    active, so the profile's host steps show the runner's own host time (vLLM names its scheduler's and engine's
    steps, not those of its V2 model runner). Nothing where the engine has no in-process runner."""
    import torch

    from trl_fp8.rollout.vllm._compat import engine_worker

    try:
        runner = engine_worker(llm).model_runner
    except AttributeError:
        yield
        return
    wrapped = []
    for name in names:
        call = getattr(runner, name, None)
        if call is None:
            continue

        def scoped(*a, _call=call, _scope=f"model_runner: {name}", **k):
            with torch.profiler.record_function(_scope):
                return _call(*a, **k)

        setattr(runner, name, scoped)
        wrapped.append(name)
    try:
        yield
    finally:
        for name in wrapped:
            runner.__dict__.pop(name, None)


def profile_window_steps(completion_len: int, engine_steps: int | None) -> list[int] | None:
    """The engine steps `[first, end)` a rollout profile of `engine_steps` records: those around the middle of the
    rollout's decode steps (a context of average length), or None for the whole rollout."""
    if engine_steps is None:
        return None
    first = max(completion_len // 2 - engine_steps // 2, 0)
    return [first, first + engine_steps]


def rollout_profile_window(completion_len: int, engine_steps: int | None):
    """The torch profiler schedule that records `profile_window_steps`' engine steps (the profiler steps once per engine
    step), or None for the whole rollout. A long rollout's every kernel is a million events at 8B: too many to read."""
    steps = profile_window_steps(completion_len, engine_steps)
    if steps is None:
        return None
    from torch.profiler import schedule

    return schedule(wait=max(steps[0] - 1, 0), warmup=min(steps[0], 1), active=engine_steps, repeat=1)


def print_host_account(name: str, phase: str, profile: dict, frames: int = 8) -> None:
    """A profiled phase's idle gaps by length, vLLM's host steps and where the host thread was (the heaviest
    frames on its stack) and the collector's pauses, where the profile has them."""
    if gaps := profile.get("idle_gaps"):
        print(f"{name} {phase} idle gaps: " + ", ".join(
            f"{label} {b['count']} ({b['ms']:.0f} ms)" for label, b in gaps["buckets"].items() if b["count"]))  # fmt: skip
    if scopes := profile.get("host_scopes"):
        print(f"{name} {phase} host steps (ms): " + ", ".join(f"{s['scope']} {s['ms']:.0f}" for s in scopes[:10]))
    host = profile.get("host") or {}
    if stacks := host.get("stacks"):
        print(f"{name} {phase} host thread ({stacks['samples']} samples), most often on its stack: " + ", ".join(
            f"{f['frame']} {f['share']:.0%}" for f in stacks["inclusive"][:frames]))  # fmt: skip
        print(f"{name} {phase} host thread, at the top of its stack: " + ", ".join(
            f"{f['frame']} {f['share']:.0%}" for f in stacks["leaf"][:frames]))  # fmt: skip
        if others := stacks.get("other_threads"):
            print(f"{name} {phase} other threads: " + ", ".join(
                f"{o['thread']} in {o['frame']} {o['ms']:.0f} ms" for o in others[:frames]))  # fmt: skip
    if gc_pauses := host.get("gc"):
        print(
            f"{name} {phase} garbage collector: {gc_pauses['collections']} collections, {gc_pauses['seconds']:.2f} s"
        )


def ranks_phases(row: dict, world: int) -> list[dict]:
    """Each rank's seconds per phase and step and its device peaks (a collective: every rank calls it). The step's
    rollout is each rank's own engine; the ranks wait for each other afterwards, in the scoring's gathers."""
    import torch.distributed as dist

    mine = {"per_step": row["per_step"], "peak_device_memory_by_phase_gib": row["peak_device_memory_by_phase_gib"]}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered


def ranks_profiles(profile: dict, world: int) -> list[dict]:
    """Each rank's timeline, launch lag and NCCL kernel spread of the profiled phase (a collective: every rank
    calls it). A rank that waits on another shows it as NCCL time or idle time the others do not have."""
    import torch.distributed as dist

    mine = {key: profile.get(key) for key in ("timeline", "timeline_parts", "launch_lag")}
    mine["nccl_kernels"] = {k: v for k, v in (profile.get("nccl_kernels") or {}).items() if k != "longest"}
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    return gathered


def engine_experts_state(generation) -> dict:
    """MoE models: the vLLM MoE layers' FP8 backend, and how the last sync reached the experts."""
    from trl_fp8.rollout.vllm.experts import engine_model

    try:
        layers = [m for m in engine_model(generation.llm).modules() if hasattr(m, "w13_weight")]
    except Exception as exc:  # a record, not a reason to lose the run's row
        return {"vllm_moe_backends": f"unknown ({type(exc).__name__}: {exc})"}
    if not layers:
        return {}
    backends = sorted({str(getattr(getattr(m, "quant_method", None), "fp8_backend", None)) for m in layers})
    written = getattr(generation, "engine_experts", None)
    return {"vllm_moe_backends": backends, "experts_sync": "in place" if written else "reload"}


def rollout_floor(row: dict, settings: dict, device: str) -> dict | None:
    """The rollout phase's floor (`bench_rollout.floor_tokens_per_s`: one engine's generation batch, every
    completion at full length, the engine's KV cache) and the share of it the measured median reached. An engine over
    `tp` GPUs decodes its `tp` ranks' sequences, each GPU reading and computing `1/tp` of every weight and cached
    token (heads, columns and the vocabulary split); its all-reduces are not counted."""
    hw, kv_tokens = hardware(device), row.get("kv_cache_tokens")
    if hw is None or not kv_tokens:
        return None
    fp8 = row["rollout_precision"] != "bf16"
    tp = settings.get("vllm_tensor_parallel_size", 1)
    sizes = model_bytes(SHAPES[settings["shape"]], fp8_linear=fp8, fp8_kv=row["fp8_kv_cache"])
    sizes = {key: value / tp for key, value in sizes.items()}
    seqs = settings["generation_batch"] * tp
    floor = floor_tokens_per_s(sizes, hw, fp8, seqs, settings["prompt_len"], settings["completion_len"], kv_tokens)
    seconds = seqs * settings["completion_len"] / floor["floor_tokens_per_s"]
    return {**floor, "floor_s": seconds, "of_floor": seconds / row["step_time"]["rollout_s"]}


def planned_kv_tokens(row: dict, settings: dict) -> dict | None:
    """`trl-fp8 plan`'s KV-token estimate for the run's engine (its goal: within 10% of vLLM's own figure)."""
    from trl_fp8.rollout.capacity import ModelShape, rollout_capacity

    if not row.get("kv_cache_tokens") or not row.get("gpu_memory_gib"):
        return None
    shape = ModelShape.from_config(dict(SHAPES[settings["shape"]], head_dim=128, tie_word_embeddings=False))
    tp = settings.get("vllm_tensor_parallel_size", 1)  # an engine over tp GPUs decodes its tp ranks' sequences
    planned = rollout_capacity(
        shape, int(row["gpu_memory_gib"] * 2**30), settings["vllm_memory"],
        fp8_weights=row["rollout_precision"] != "bf16", fp8_kv=row["fp8_kv_cache"],
        seq_len=settings["prompt_len"] + settings["completion_len"], max_num_seqs=settings["generation_batch"] * tp,
        tensor_parallel_size=tp,
    ).kv_tokens  # fmt: skip
    return {"kv_tokens": planned, "error": planned / row["kv_cache_tokens"] - 1}


class StepProfiler(TrainerCallback):
    """Calls `start()` and `stop()` around optimizer step `step`'s training phase; with `micro_batches`, around that
    many micro-batches after the step's first (which also scores the rollout and computes old log-probs): a smaller
    trace of the steady part, read in seconds; with `scoring` too, from the step's start (its scoring and first
    micro-batch, then the `micro_batches` after it). `profiled`: the micro-batches after the first it covered."""

    def __init__(self, step: int, micro_batches: int | None, start, stop, scoring: bool = False):
        self.step, self.micro_batches, self.start, self.stop = step, micro_batches, start, stop
        self.scoring = scoring
        self.running, self.done, self.profiled, self._ended = False, False, 0, 0

    def _start(self):
        self.running = True
        self.start()

    def _stop(self):
        self.running, self.done = False, True
        self.stop()

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and (self.micro_batches is None or self.scoring) and not self.done:
            self._start()

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or self.micro_batches is None or self.done:
            return
        self._ended += 1  # micro-batches of the step ended so far
        if self._ended == 1:
            if not self.running:  # (with `scoring` it runs from the step's start)
                self._start()
        elif self.running:
            self.profiled += 1
            if self.profiled == self.micro_batches:
                self._stop()

    def on_step_end(self, args, state, control, **kwargs):
        if self.running:  # the whole step, or fewer micro-batches than asked for (the step's last ends it)
            if self.micro_batches is not None:
                self.profiled += 1
            self._stop()


def engine_stats(generation):
    """The engine statistics of a run's rollouts: FP8VLLMGeneration's own (`report.rollout_stats`, which its trainer
    logs as `vllm/*`; attaching a second reader would take the engine's stat loggers from it), else ours, attached to
    the engine of TRL's generation."""
    from trl_fp8.rollout.stats import RolloutStats

    report = getattr(generation, "report", None)
    return (report.rollout_stats if report is not None else None) or RolloutStats.attach(generation.llm)


def first_profiled_step(args) -> int | None:
    """The first step a profiler records (`--profile_step`, `--profile_rollout_step`); the medians stop before it."""
    steps = [s for s in (args.profile_step, getattr(args, "profile_rollout_step", None)) if s is not None]
    return min(steps) if steps else None


def median_steps(steps: int, warmup: int, profile_step: int | None) -> list[int]:
    """The steps whose medians are reported: after the warm-up, before the profiled step. The profiler slows the
    step it records, and reading its events (tens of seconds) and freeing them disturb the steps that follow."""
    if profile_step is not None and not 0 <= profile_step < steps:
        raise ValueError(f"--profile_step {profile_step} is not one of the {steps} steps (0-{steps - 1})")
    end = steps if profile_step is None else profile_step
    if end - warmup < 1:
        raise ValueError(f"no step left to time: --warmup {warmup}, --profile_step {profile_step}, --steps {steps}")
    return list(range(warmup, end))


def step_medians(per_step: dict[str, list[float]], keep: list[int]) -> dict[str, float]:
    """Median seconds per phase over the steps `keep`; training is what the step spends outside rollout and sync.
    Where recorded, training splits into scoring (rewards, old log-probs), the optimizer step, and the rest: the
    micro-batches' forward and backward (`micro_batches_s`)."""
    training = [s - r - w for s, r, w in zip(per_step["step_s"], per_step["rollout_s"], per_step["weight_sync_s"],
                                             strict=True)]  # fmt: skip
    phases = {**per_step, "training_s": training}
    keys = ["step_s", "rollout_s", "weight_sync_s", "training_s"]
    if per_step.get("scoring_s") and per_step.get("optimizer_s"):
        phases["micro_batches_s"] = [t - c - o for t, c, o in zip(training, per_step["scoring_s"],
                                                                  per_step["optimizer_s"], strict=True)]  # fmt: skip
        keys += ["scoring_s", "optimizer_s", "micro_batches_s"]
    return {key: statistics.median(phases[key][i] for i in keep) for key in keys}


def mismatch_medians(log_history: list[dict], keep: list[int]) -> dict[str, float]:
    """Medians over the steps `keep` of the trainer-vs-rollout metrics the run logged: TRL's `sampling/*` (every
    trainer that corrects vLLM rollouts) and `FP8GRPOTrainer`'s `fp8/mismatch/*` (k3 KL, |dlogp|, the share of tokens
    TIS clipped). A log entry's `step` counts optimizer steps from 1; `keep` counts them from 0."""
    values: dict[str, list[float]] = {}
    for entry in log_history:
        if entry.get("step", 0) - 1 not in keep:
            continue
        for key, value in entry.items():
            if key.startswith(("sampling/", "fp8/mismatch/")) and isinstance(value, (int, float)):
                values.setdefault(key, []).append(float(value))
    return {key: statistics.median(v) for key, v in sorted(values.items())}


def mismatch_by_step(log_history: list[dict]) -> list[dict[str, float]]:
    """`FP8GRPOTrainer`'s `fp8/mismatch/*` of every logged step, the warm-up's too: where exactness is the claim, the
    largest |dlogp| of every step is the figure, not a median."""
    return [
        {"step": entry["step"]} | {k: float(v) for k, v in sorted(entry.items()) if k.startswith("fp8/mismatch/")}
        for entry in log_history
        if any(k.startswith("fp8/mismatch/") for k in entry)
    ]


# What a run measures, shared by the rows of one results file (`--append` refuses a file of another regime) ...
REGIME = ("shape", "optim", "generation_batch", "micro_batch", "num_generations", "prompt_len", "completion_len",
          "vllm_memory", "sleep_mode", "num_processes", "launch_config")  # fmt: skip


def measurement(args) -> dict:
    """... and how a row was measured, kept per row: rows appended by separate calls may have timed other steps."""
    return {"steps": args.steps, "warmup": args.warmup, "profile_step": args.profile_step,
            "profile_micro_batches": getattr(args, "profile_micro_batches", None),
            "profile_scoring": getattr(args, "profile_scoring", False),
            "profile_rollout_step": getattr(args, "profile_rollout_step", None),
            "profile_engine_steps": getattr(args, "profile_engine_steps", None),
            "median_steps": median_steps(args.steps, args.warmup, first_profiled_step(args)),
            "deep_gemm_warmup": os.environ.get("VLLM_DEEP_GEMM_WARMUP", "full"),
            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "sync_each_batch": getattr(args, "sync_each_batch", False),
            "cpu_affinity": getattr(args, "cpu_affinity", False),
            "vllm_tensor_parallel_size": getattr(args, "vllm_tensor_parallel_size", 1),
            "vllm_fp8_moe_backend": getattr(args, "vllm_fp8_moe_backend", "auto")}  # fmt: skip


def resummarize(path: Path, keep: list[int]) -> None:
    """Recompute a results file's medians from its per-step times over the steps `keep` (for a run whose
    profiled step was not the last: its medians took in the steps the profiler disturbed), and its rollout floors."""
    result = json.loads(path.read_text())
    for row in result["results"]:
        row["step_time"] = step_medians(row["per_step"], keep)
        row.setdefault("measured", {})["median_steps"] = keep
        row["rollout_floor"] = rollout_floor(row, result["settings"], result.get("device", ""))
        row["planner"] = planned_kv_tokens(row, result["settings"])
    result["settings"]["median_steps"] = keep
    write_json(path, result)
    print_summary(result)
    print(f"rewrote the medians and rollout floors of {path} over steps {keep}")


def print_summary(result: dict) -> None:
    """One line per run: phase times, speed-ups over `trl_bf16`, start-up, memory, the rollout's floor."""
    base = {r["name"]: r for r in result["results"]}.get("trl_bf16")
    print(f"{'run':<17}{'step s':>9}{'rollout s':>11}{'training s':>12}{'sync s':>9}{'speedup e2e/rollout/train':>28}"
          f"{'compl/s':>9}{'start/1st step s':>18}{'peak GiB roll/train':>21}{'on GPU':>13}"
          f"{'rollout of floor':>18}")  # fmt: skip
    for r in result["results"]:
        t = r["step_time"]
        speed = "-"
        if base:
            b = base["step_time"]
            speed = (f"{b['step_s'] / t['step_s']:.2f}x/{b['rollout_s'] / t['rollout_s']:.2f}x/"
                     f"{b['training_s'] / t['training_s']:.2f}x")  # fmt: skip
        peak = r.get("peak_memory_by_phase_gib", {})
        peak = (
            f"{peak['rollout']:.1f}/{peak['training']:.1f}"
            if peak
            else f"{r.get('peak_memory_gib', float('nan')):.1f}"
        )
        used = r.get("peak_device_memory_by_phase_gib")
        used = f"{used['rollout']:.1f}/{used['training']:.1f}" if used else "-"
        first = f"{r.get('startup_s', float('nan')):.0f}/{r.get('time_to_first_step_s', float('nan')):.0f}"
        floor = r.get("rollout_floor")
        floor = f"{floor['of_floor']:.0%} of {floor['floor_s']:.1f} s" if floor else "-"
        print(f"{r['name']:<17}{t['step_s']:>9.2f}{t['rollout_s']:>11.2f}{t['training_s']:>12.2f}"
              f"{t['weight_sync_s']:>9.2f}{speed:>28}{r.get('completions_per_s', float('nan')):>9.1f}"
              f"{first:>18}{peak:>21}{used:>13}{floor:>18}")  # fmt: skip
    for r in result["results"]:
        if "micro_batches_s" in r["step_time"]:
            t = r["step_time"]
            print(f"{r['name']} training phase: scoring {t['scoring_s']:.2f} s, micro-batches {t['micro_batches_s']:.2f} s, "
                  f"optimizer {t['optimizer_s']:.2f} s")  # fmt: skip
        for key, phase in (("training_profile", "training-phase"), ("rollout_profile", "rollout")):
            if key in r:
                cats = r[key]["kernel_ms_by_category"]
                if window := r[key].get("engine_steps"):
                    phase = f"{phase} (engine steps {window[0]}-{window[1] - 1})"
                print(f"{r['name']} {phase} kernels (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in cats.items()))
                if timeline := r[key].get("timeline"):
                    print(f"{r['name']} {phase} timeline (ms): "
                          + ", ".join(f"{k[:-3]} {v:.0f}" for k, v in timeline.items()))  # fmt: skip
                print_host_account(r["name"], phase, r[key])
    for r in result["results"]:
        if kernels := r.get("engine_kernels"):  # read from the engine: what ran, not what was asked for
            print(f"{r['name']} engine: " + ", ".join(f"{k} {v}" for k, v in kernels.items()))
        m = r.get("mismatch") or {}
        if "fp8/mismatch/kl_k3" in m:
            print(f"{r['name']} trainer vs rollout: k3 KL {m['fp8/mismatch/kl_k3']:.2e}, mean |dlogp| "
                  f"{m['fp8/mismatch/abs_logp_diff_mean']:.4f}, TIS clipped "
                  f"{m.get('fp8/mismatch/is_ratio_clipped_frac', float('nan')):.3%} of tokens")  # fmt: skip
        elif "sampling/sampling_logp_difference/mean" in m:
            print(f"{r['name']} trainer vs rollout: mean |dlogp| {m['sampling/sampling_logp_difference/mean']:.4f}")
        if r.get("fp8_options", {}).get("exact_on_policy"):  # exactness: every step's largest difference
            worst = [s.get("fp8/mismatch/abs_logp_diff_max") for s in r.get("mismatch_by_step", [])]
            print(f"{r['name']} largest |dlogp| of each step (every completion token): {worst}")
    for r in result["results"]:
        if probe := r.get("engine_probe"):
            timed = 1e3 * r["step_time"]["rollout_s"] / probe["new_tokens"]
            print(f"{r['name']} engine probe, ms per decode step ({probe['seqs']} x {probe['new_tokens']}, prefix "
                  f"caching {'on' if probe['prefix_caching'] else 'off'}): timed rollouts {timed:.2f}, "
                  + ", ".join(f"{k} {v:.2f}" for k, v in probe["ms_per_decode_step"].items()))  # fmt: skip
            if facts := probe.get("process"):
                print(f"{r['name']} engine probe, process: {facts['gc_objects']:,} objects ({facts['gc_frozen']:,} "
                      f"frozen), threads {facts['threads']}, {facts['cpu_affinity']} of {facts['cpu_count']} cores, "
                      f"trace {facts['trace_hook']}, profile {facts['profile_hook']}")  # fmt: skip
            for name, host in probe.get("host", {}).items():
                seconds = probe["ms_per_decode_step"][name] * probe["new_tokens"] / 1e3
                print(f"{r['name']} engine probe, {name}: {host_line(host, seconds)}")


def launcher(num_processes: int, config: str, port: int, cpu_affinity: bool = False) -> list[str] | None:
    """`accelerate launch` with TRL's shipped config `config` (multi_gpu, fsdp2, ...) for several processes;
    `cpu_affinity`: accelerate's `--enable_cpu_affinity` (each rank on the CPU cores of its GPU's NUMA node)."""
    if num_processes == 1:
        return None
    import trl

    config_file = Path(trl.__file__).parent / "accelerate_configs" / f"{config}.yaml"
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file),
            "--num_processes", str(num_processes), "--main_process_port", str(port),
            *(["--enable_cpu_affinity"] if cpu_affinity else [])]  # fmt: skip


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/grpo_speed_<device>.json", append=True,
                        workdir="/tmp/trl_fp8_bench_grpo")  # fmt: skip
    parser.add_argument("--run", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--runs", nargs="+", default=["trl_bf16", "fp8_rollout", "unified"], choices=list(RUNS))
    parser.add_argument("--shape", choices=list(SHAPES), default="4b")
    parser.add_argument("--optim", default="adamw_torch_fused")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--generation_batch", type=int, default=64, help="completions per optimizer step")
    parser.add_argument("--micro_batch", type=int, default=8)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--completion_len", type=int, default=1024)
    parser.add_argument("--vllm_memory", type=float, default=0.3)
    parser.add_argument("--sleep_mode", action="store_true", help="vllm_enable_sleep_mode for every run")
    parser.add_argument("--num_processes", type=int, default=1, help="GPUs, one training process and engine each")
    parser.add_argument("--launch_config", default="multi_gpu", help="TRL accelerate config with --num_processes > 1")
    parser.add_argument("--vllm_tensor_parallel_size", type=int, default=1,
                        help="GPUs per colocated vLLM engine (TRL's vllm_tensor_parallel_size; divides "
                        "--num_processes)")  # fmt: skip
    parser.add_argument("--cpu_affinity", action="store_true",
                        help="with --num_processes > 1: accelerate's --enable_cpu_affinity, each rank on the cores of "
                        "its GPU's NUMA node (the rollout engines' scheduling runs on the host)")  # fmt: skip
    parser.add_argument("--vllm_fp8_moe_backend", default="auto",
                        help="vLLM's kernel for the FP8 experts in the runs with FP8 rollouts (FP8GRPOConfig's "
                        "vllm_fp8_moe_backend; 'auto': vLLM's choice)")  # fmt: skip
    parser.add_argument("--sync_each_batch", action="store_true",
                        help="accelerate's sync_each_batch: every micro-batch reduces its gradients (under FSDP2 they "
                        "then stay sharded instead of whole between micro-batches)")  # fmt: skip
    parser.add_argument(
        "--profile_step",
        type=int,
        default=None,
        help="profile this optimizer step's training phase (rollout and sync left out): GPU kernel time by category",
    )
    parser.add_argument(
        "--profile_rollout_step",
        type=int,
        default=None,
        help="profile this optimizer step's rollout (the colocated engine's kernels, in-process): GPU kernel time by "
        "category and the time the GPU waited; a step other than --profile_step's",
    )
    parser.add_argument(
        "--profile_engine_steps",
        type=int,
        default=None,
        help="with --profile_rollout_step: record the kernels of only this many engine steps, around the middle of "
        "the rollout (default: the whole rollout; the host thread's stack is sampled over all of it)",
    )
    parser.add_argument(
        "--engine_kwargs",
        default=None,
        help="JSON of vLLM LLM(...) arguments over the trainer's own, e.g. '{\"enable_prefix_caching\": false}'",
    )
    parser.add_argument(
        "--engine_probe",
        action="store_true",
        help="after the timed steps, time the trainer's engine on a rollout of the same size with the trainer's "
        "sampling fields, without log-probs and with bench_rollout's: ms per decode step of each (engine_probe)",
    )
    parser.add_argument(
        "--profile_micro_batches",
        type=int,
        default=None,
        help="with --profile_step: profile only this many micro-batches, after the step's first (default: all)",
    )
    parser.add_argument(
        "--profile_scoring",
        action="store_true",
        help="with --profile_micro_batches: start at the step's start, so the profile also covers the scoring (old "
        "log-probs) and the first micro-batch; the timeline splits at the scoring's end",
    )
    parser.add_argument(
        "--resummarize",
        metavar="RESULTS_JSON",
        default=None,
        help="only recompute that file's medians from its per-step times, over --median_steps",
    )
    parser.add_argument("--median_steps", type=int, nargs="+", default=None, help="with --resummarize")
    args = parser.parse_args()
    if args.profile_engine_steps is not None and (args.profile_rollout_step is None or args.profile_engine_steps < 1):
        parser.error("--profile_engine_steps needs --profile_rollout_step and a positive count")
    if args.profile_rollout_step is not None and args.profile_rollout_step == args.profile_step:
        parser.error("--profile_rollout_step and --profile_step must be different steps (one profiler at a time)")
    if args.profile_rollout_step is not None and not 0 <= args.profile_rollout_step < args.steps:
        parser.error(f"--profile_rollout_step {args.profile_rollout_step} is not one of the {args.steps} steps")
    if args.num_processes % args.vllm_tensor_parallel_size:
        parser.error(
            "--vllm_tensor_parallel_size must divide --num_processes (TRL groups consecutive ranks into engines)"
        )
    if args.resummarize:
        return resummarize(Path(args.resummarize), args.median_steps or median_steps(args.steps, args.warmup, None))
    if args.run:
        return run_one(args)

    import torch

    from trl_fp8.trainer.config import check_optimizer_installed

    check_optimizer_installed(args.optim)  # every run's child would load the model and start vLLM first
    model = model_dir(args)
    if not (model / "config.json").exists():
        make_model_dir(model, args.shape, model_positions(args.prompt_len, args.completion_len))
        torch.cuda.empty_cache()
    if args.sleep_mode:  # FP8GRPOTrainer turns them on in sleep mode; TRL's BF16 runs get the same allocator
        from trl_fp8.rollout.vllm.engine import EXPANDABLE_SEGMENTS

        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE_SEGMENTS)
    if args.profile_rollout_step is not None:  # vLLM's engine and model-runner steps named in the rollout's profile
        os.environ.setdefault("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "1")
    device = torch.cuda.get_device_name()
    gpus = f"_{args.num_processes}x{args.launch_config}" if args.num_processes > 1 else ""
    out = results_path(args.out, "grpo_speed", device + gpus)
    settings = {k: getattr(args, k) for k in REGIME} | measurement(args)
    result = {"benchmark": "GRPO step time, vLLM colocated", **metadata(device), "settings": settings, "results": []}
    if args.append:
        result["results"] = previous_rows(out, result, tuple(f"settings.{k}" for k in REGIME), "name", args.runs)
    port = int(os.environ.get("MASTER_PORT", "29610"))
    failed = run_all(__spec__.name, "--run", args.runs, sys.argv[1:], result, out, "name", list(RUNS),
                     launcher(args.num_processes, args.launch_config, port, args.cpu_affinity))  # fmt: skip
    print_summary(result)
    print(f"wrote {out}")
    if failed:
        raise SystemExit(f"failed runs: {failed}")


if __name__ == "__main__":
    main()
