"""vLLM rollout throughput, its distance to the hardware floor, engine start-up and weight-sync time, for BF16,
vLLM's online FP8 and trl_fp8's FP8 rollouts on each block-FP8 kernel (± FP8 KV cache).

    python -m benchmarks.bench_rollout                       # GPU host with vLLM; Qwen3-8B shape, random weights
    python -m benchmarks.bench_rollout --engines fp8_triton --points 64x1024 --append   # add rows to the same file

Each engine runs in its own child process, built the way `FP8GRPOTrainer` builds it (config-only folder, dummy
load, CUDA graphs on), next to a trainer-side model of the same shape on the same GPU:

- `bf16`: BF16 weights pushed each step (what TRL does today);
- `vllm_fp8`: BF16 weights pushed, vLLM quantizes them itself (`quantization="fp8"`, per-tensor weights);
- `fp8_<kernel>`: trl_fp8's block-FP8 weights and scales, quantized on the trainer's GPU and pushed (the unified
  flow), multiplied by vLLM's DeepGEMM, Cutlass or Triton block-FP8 kernel (`vllm_fp8_backend`);
- `fp8_deepgemm_kv`, `fp8_cutlass_kv`: the same on DeepGEMM or Cutlass plus an FP8 KV cache (FP8 attention) with
  q/k/v scales measured on the trainer's forward.

`--gpu_memory_utilization` gives every engine the same share of the GPU (matched memory: FP8 engines hold more KV
cache); `--max_num_seqs` caps every engine at the same number of sequences at once (matched concurrency). Each row
records vLLM's KV-cache tokens next to `trl_fp8.rollout.capacity`'s estimate, and each point the most sequences that ran at
once and the preemptions (vLLM's scheduler statistics).

`--profile_point SxN` runs one more rollout under the torch profiler and records its GPU kernel time by category
(attention, FP8 and BF16 GEMMs, ...) and its heaviest kernels: how far each part of a decode step is from its floor.

Per engine: engine start-up (with DeepGEMM, whether its JIT cache was cold), the weight sync of one step
(quantization included, median of 3), and for each `--points` entry `SxN` (S sequences of `--prompt_len` prompt
tokens, N new tokens each, ignore_eos, temperature 1) the output tokens per second and the floor for that point, a
lower bound on its time whatever order vLLM schedules the sequences in:

    floor time = prefill FLOPs / peak + max(memory time, compute time)
    memory time = (decode steps x weight bytes + KV reads x KV bytes per token) / HBM bandwidth
    KV reads = S x (N x prompt + N (N - 1) / 2)           (each new token reads its sequence's cache once)
    decode steps = max(N, KV reads / KV-cache tokens, S x N / max_num_seqs)

A decode step reads the linear weights (1 byte FP8, 2 BF16) and lm_head (BF16) once, and at most the whole KV cache:
so a rollout that does not fit needs at least KV reads / KV-cache tokens steps. Preemptions (recomputed prefills)
are not charged; peaks are the data sheet's dense BF16 / FP8 tensor-core rates. Until 2026-11-25 the floor assumed
waves of full-length sequences, which vLLM beat by running short sequences together; `--refloor FILE` recomputes a
results file's floors (the committed ones were). Writes `benchmarks/results/rollout_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import arg_parser, kernel_breakdown, metadata, previous_rows, results_path, run_all, write_json
from trl_fp8.rollout.vllm.sampling import TOKEN_IDS_ONLY

SHAPES = {  # Qwen3 configs: hidden, intermediate, layers, heads, kv heads, vocab
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=151936),
    # Larger than one GPU trains in BF16 beside its engine: FSDP2 over several GPUs (bench_grpo --num_processes).
    "14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=151936),
    "32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=151936),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=151936),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=4096),
    # Mixture of experts (Qwen3-MoE; every layer sparse): too large to hold a trainer-side copy beside the engine,
    # so these engines keep vLLM's random ("dummy") weights and nothing is pushed (`MOE_SHAPES`).
    "30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                    num_key_value_heads=4, vocab_size=151936, moe_intermediate_size=768, num_experts=128,
                    num_experts_per_tok=8),
    # 12 of its 48 layers: ~8B parameters, an FP8 or BF16 GRPO step beside its engine on one H200 (`bench_grpo.py`).
    "30b-a3b-12l": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=12, num_attention_heads=32,
                        num_key_value_heads=4, vocab_size=151936, moe_intermediate_size=768, num_experts=128,
                        num_experts_per_tok=8),
    "tiny-moe": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, vocab_size=4096, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2),
}  # fmt: skip
MOE_SHAPES = {name for name, shape in SHAPES.items() if "num_experts" in shape}
ENGINES = {  # engine: (trainer in FP8, rollout precision, FP8 KV cache, vLLM block-FP8 kernel)
    "bf16": (False, "bf16", False, None),
    "vllm_fp8": (False, "fp8_online", False, None),
    "fp8_cutlass": (True, "fp8", False, "cutlass"),
    "fp8_triton": (True, "fp8", False, "triton"),
    "fp8_deepgemm": (True, "fp8", False, "deepgemm"),
    "fp8_deepgemm_kv": (True, "fp8", True, "deepgemm"),
    "fp8_cutlass_kv": (True, "fp8", True, "cutlass"),  # no DeepGEMM JIT compile: a fresh host starts in a minute
    # Variants of the default DeepGEMM engines, each one setting changed (ENGINE_LLM_KWARGS), to find where a decode
    # step's time goes and what wins it back.
    "fp8_deepgemm_inductor_quant": (True, "fp8", False, "deepgemm"),
    "fp8_deepgemm_kv_inductor_quant": (True, "fp8", True, "deepgemm"),
    "fp8_deepgemm_kv_triton_attn": (True, "fp8", True, "deepgemm"),
    "fp8_deepgemm_kv_flashinfer": (True, "fp8", True, "deepgemm"),
    "fp8_deepgemm_kv_block64": (True, "fp8", True, "deepgemm"),
    # vLLM's fused SiLU-and-mul + FP8 quantization on trl-fp8's kernel, as the trainer's colocated engines run it
    "fp8_deepgemm_trl_act_quant": (True, "fp8", False, "deepgemm"),
    "fp8_deepgemm_kv_trl_act_quant": (True, "fp8", True, "deepgemm"),
    # Mixture-of-experts shapes: the dense layers on DeepGEMM, the experts on each of vLLM's block-FP8 MoE backends
    # (MOE_ENGINE_LLM_KWARGS); "fp8_deepgemm" is vLLM's own choice, Triton's fused MoE on Hopper at TP 1.
    "fp8_deepgemm_moe_deepgemm": (True, "fp8", False, "deepgemm"),
    "fp8_deepgemm_moe_flashinfer_cutlass": (True, "fp8", False, "deepgemm"),
    # With vLLM's prefix caching, as TRL's colocated engines keep it (vLLM's default; the other engines here turn it
    # off): its per-step bookkeeping in the scheduler, beside the same engine without it.
    "bf16_prefix_caching": (False, "bf16", False, None),
    "fp8_deepgemm_prefix_caching": (True, "fp8", False, "deepgemm"),
    # Built with every argument TRL's colocated engines get that the others lack: its executor for torchrun-style
    # launchers (`external_launcher`: this process is rank 0 of 1) and prefix caching on.
    "fp8_deepgemm_trl_engine": (True, "fp8", False, "deepgemm"),
}
# For block-FP8 weights vLLM turns its CUDA activation quantizer on (`+quant_fp8`) and then fuses it into the op
# before it: `rms_norm_per_block_quant` and `silu_and_mul_per_block_quant`. On one H200 at 256 sequences these ran at
# 10-30 us a call, 7-9x their bytes (results/rollout_capacity_mem0.3_NVIDIA_H200.json, the profiled row). With
# `-quant_fp8` the quantizer is vLLM's PyTorch one, which Inductor fuses with the norm or SiLU-mul itself.
INDUCTOR_QUANT = {
    "compilation_config": {
        "custom_ops": ["-quant_fp8"],
        "pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False},
    }
}
ENGINE_LLM_KWARGS = {
    "fp8_deepgemm_inductor_quant": INDUCTOR_QUANT,
    "fp8_deepgemm_kv_inductor_quant": INDUCTOR_QUANT,
    # Triton's unified attention reads the FP8 cache's q/k/v scales from the layer's tensors at every call, as FA3
    # does, so the scales of every sync reach it: a candidate for the trainer's engines.
    "fp8_deepgemm_kv_triton_attn": {"attention_backend": "TRITON_ATTN"},
    # FlashInfer copies the scales into Python floats at its first forward, so later syncs' scales would not reach it
    # (trl_fp8.rollout.vllm.kernels): a speed reference only, never a rollout engine of the trainer.
    "fp8_deepgemm_kv_flashinfer": {"attention_backend": "FLASHINFER"},
    # KV pages of 64 tokens instead of vLLM's 16 for FlashAttention: 4x longer contiguous reads per page of the
    # cache that decode attention streams (35% of its floor at 256 sequences, the profiled row above).
    "fp8_deepgemm_kv_block64": {"block_size": 64},
    "bf16_prefix_caching": {"enable_prefix_caching": True},
    "fp8_deepgemm_prefix_caching": {"enable_prefix_caching": True},
    "fp8_deepgemm_trl_engine": {"enable_prefix_caching": True, "distributed_executor_backend": "external_launcher"},
}
# `--sampling`: "bench" samples as this benchmark always has (a seed per request, no log-probs); "trainer" as
# FP8GRPOTrainer's colocated rollouts at GRPOConfig's defaults (TRL's fields, the sampled tokens' log-probs for
# importance sampling, trl-fp8's token-ids-only fields), both `ignore_eos` at each point's length.
SAMPLING = {
    "bench": {"temperature": 1.0, "detokenize": False, "seed": 0},
    "trainer": {"n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                "logprobs": 0, **TOKEN_IDS_ONLY},
}  # fmt: skip
# vLLM's `moe_backend` for the experts (its names); DeepGEMM's grouped GEMM also needs VLLM_MOE_USE_DEEP_GEMM=1, which
# the trainer leaves at 0 (trl_fp8.rollout.vllm.kernels.moe_kernel_env) and which also runs vLLM's grouped warm-up.
MOE_ENGINE_LLM_KWARGS = {
    "fp8_deepgemm_moe_deepgemm": {"moe_backend": "deep_gemm"},
    "fp8_deepgemm_moe_flashinfer_cutlass": {"moe_backend": "flashinfer_cutlass"},
}
ENGINE_ENV = {
    "fp8_deepgemm_moe_deepgemm": {"VLLM_MOE_USE_DEEP_GEMM": "1"},
    # what TRL sets before building its engine (torch.distributed's env:// rendezvous of one rank)
    "fp8_deepgemm_trl_engine": {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": "29657"},
}  # fmt: skip
# Engines whose `silu_and_mul_per_block_quant` runs on trl-fp8's kernel (`trl_fp8.rollout.vllm.act_quant`); the
# others keep vLLM's, so each pair differs in that kernel alone.
TRL_ACT_QUANT = {"fp8_deepgemm_trl_act_quant", "fp8_deepgemm_kv_trl_act_quant"}
DEFAULT_POINTS = ["64x1024", "256x1024", "1024x1024", "64x4096", "256x4096", "16x16384"]
HEAD_DIM = 128  # every SHAPES entry
# Data-sheet peaks (SXM): HBM bytes/s, dense BF16 and FP8 tensor-core FLOP/s.
HARDWARE = {
    "H200": {"hbm": 4.8e12, "bf16": 989e12, "fp8": 1979e12},
    "H100": {"hbm": 3.35e12, "bf16": 989e12, "fp8": 1979e12},
}


def hardware(device: str) -> dict | None:
    return next((v for k, v in HARDWARE.items() if k in device), None)


def hbm_bandwidth(device: str, tb_s: float | None = None) -> tuple[float, str]:
    """Bytes per second a floor divides by, and where it comes from: `tb_s` (`--hbm_tb_s`) if given, else the
    device's data sheet, else an H200's, said so."""
    if tb_s:
        return tb_s * 1e12, "--hbm_tb_s"
    hw = hardware(device)
    return (hw["hbm"], f"{device}'s data sheet") if hw else (4.8e12, "assumed: an H200's data sheet")


def model_bytes(shape: dict, fp8_linear: bool, fp8_kv: bool) -> dict:
    """Bytes a decode step reads once (linear weights, lm_head) and per cached token (KV), and FLOPs per token, of a
    `SHAPES` entry (Qwen3, head_dim 128, untied lm_head)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    q, kv = shape["num_attention_heads"] * HEAD_DIM, shape["num_key_value_heads"] * HEAD_DIM
    attention = layers * (h * q + 2 * h * kv + q * h)  # q, k, v, o
    if "num_experts" in shape:  # a decode step of many sequences reads every expert; a token runs its top-k
        mlp_read = layers * 3 * h * shape["moe_intermediate_size"] * shape["num_experts"]
        mlp_run = layers * 3 * h * shape["moe_intermediate_size"] * shape["num_experts_per_tok"]
    else:
        mlp_read = mlp_run = layers * 3 * h * shape["intermediate_size"]  # gate, up, down
    lm_head = shape["vocab_size"] * h
    return {
        "weights": (attention + mlp_read) * (1 if fp8_linear else 2) + lm_head * 2,
        "kv_per_token": layers * 2 * kv * (1 if fp8_kv else 2),
        "flops_per_token": 2 * (attention + mlp_run + lm_head),
        "attention_flops_per_token_per_ctx": 4 * layers * q,
    }


def floor_tokens_per_s(
    sizes: dict, hw: dict, fp8: bool, seqs: int, prompt: int, new: int, kv_tokens: int | None,
    max_num_seqs: int | None = None,
) -> dict:  # fmt: skip
    """The floor of one point: a lower bound on its time, whatever vLLM's scheduling (see the module docstring)."""
    peak = hw["fp8" if fp8 else "bf16"]
    kv_reads = seqs * (new * prompt + new * (new - 1) / 2)
    steps = max(new, kv_reads / kv_tokens if kv_tokens else 0, seqs * new / max_num_seqs if max_num_seqs else 0)
    memory_s = (steps * sizes["weights"] + kv_reads * sizes["kv_per_token"]) / hw["hbm"]
    compute_s = (seqs * new * sizes["flops_per_token"] + kv_reads * sizes["attention_flops_per_token_per_ctx"]) / peak
    prefill_s = seqs * prompt * sizes["flops_per_token"] / peak
    return {
        "floor_tokens_per_s": seqs * new / (prefill_s + max(memory_s, compute_s)),
        "floor_decode_steps": round(steps),
        "floor_mean_concurrency": seqs * new / steps,  # sequences per decode step at the floor
        "bound": "memory" if memory_s >= compute_s else "compute",
    }


def point_floor(result: dict, row: dict, point: dict) -> dict:
    """`floor_tokens_per_s` of a recorded point, from what its results file records."""
    hw = result.get("hardware_peaks") or hardware(result["device"])
    sizes = model_bytes(result["shape"], fp8_linear=row["rollout_precision"] != "bf16", fp8_kv=row["fp8_kv_cache"])
    floor = floor_tokens_per_s(
        sizes, hw, row["rollout_precision"] != "bf16", point["seqs"], result["prompt_len"], point["new_tokens"],
        row.get("kv_cache_tokens"), row.get("max_num_seqs"),
    )  # fmt: skip
    return {**floor, "of_floor": point["tokens_per_s"] / floor["floor_tokens_per_s"]}


def refloor(path: Path) -> None:
    """Recompute the floors of a results file in place (the measurements are not touched)."""
    result = json.loads(path.read_text())
    for row in result["results"]:
        for point in row.get("points", []):
            for key in ("floor_tokens_per_s", "concurrency", "bound", "of_floor"):
                point.pop(key, None)
            point.update(point_floor(result, row, point))
    write_json(path, result)
    print(summary(result["results"]))


def cache_files(path: str | None) -> int:
    return sum(1 for p in Path(path).rglob("*") if p.is_file()) if path and Path(path).is_dir() else 0


def shape_model(shape: str, device: str, max_position_embeddings: int, **config_kwargs):
    """A random BF16 model of a `SHAPES` entry, built on `device` (no FP32 copy for the allocator to keep cached):
    Qwen3, or Qwen3-MoE for the shapes with experts. Seeded, so every run of a shape gets the same weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = shape in MOE_SHAPES
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    config = config_cls(**SHAPES[shape], head_dim=128, max_position_embeddings=max_position_embeddings,
                        tie_word_embeddings=False, **config_kwargs)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return model_cls._from_config(config, dtype=torch.bfloat16)


def build_trainer_model(shape: str):
    """The trainer-side model of a `SHAPES` entry: on the GPU, or for a mixture of experts on the meta device (its
    config and module names build the engine; vLLM's dummy weights stay)."""
    return shape_model(shape, "meta" if shape in MOE_SHAPES else "cuda", 40960).eval()


def timed_generate(llm, prompts, max_tokens, sampling: str = "bench"):
    """One rollout: its tokens and time, and its engine steps' host time by call (`host_timers.HostTimers`, a clock
    around each call: about a microsecond a call)."""
    from vllm import SamplingParams

    from benchmarks.host_timers import HostTimers

    params = SamplingParams(**SAMPLING[sampling], max_tokens=max_tokens, ignore_eos=True)
    with HostTimers(llm) as timers:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "host": timers.summary()}


def parse_point(point: str) -> tuple[int, int]:
    """The `--points` notation: SxN -> (S sequences, N new tokens each)."""
    seqs, new = point.split("x")
    return int(seqs), int(new)


def run_engine(args):
    import os

    import torch

    from benchmarks.vllm_engine import engine_kernels, start_engine, sync
    from trl_fp8 import convert_to_fp8
    from trl_fp8.nn.linear import FP8Linear, invalidate_fp8_weights
    from trl_fp8.rollout.capacity import ModelShape, rollout_capacity
    from trl_fp8.rollout.kv_scales import AttentionScaleObserver
    from trl_fp8.rollout.stats import RolloutStats
    from trl_fp8.rollout.vllm.engine import TRL_MAX_NUM_BATCHED_TOKENS
    from trl_fp8.rollout.vllm.kernels import rollout_kernel

    train_fp8, precision, fp8_kv, backend = ENGINES[args.engine]
    if args.engine in MOE_ENGINE_LLM_KWARGS and args.shape not in MOE_SHAPES:
        raise SystemExit(f"{args.engine} picks a mixture-of-experts kernel: use a MoE --shape ({sorted(MOE_SHAPES)})")
    os.environ.update(ENGINE_ENV.get(args.engine, {}))  # before the engine's settings are applied (a child per engine)
    llm_kwargs = {**ENGINE_LLM_KWARGS, **MOE_ENGINE_LLM_KWARGS}.get(args.engine, {})
    model = build_trainer_model(args.shape)
    if train_fp8:
        convert_to_fp8(model)
    row = {
        "engine": args.engine,
        "rollout_precision": precision,
        "fp8_kv_cache": fp8_kv,
        "backend": backend,
        "sampling": args.sampling,
    }

    scales = None
    pushed = args.shape not in MOE_SHAPES  # MoE shapes keep vLLM's dummy weights (see SHAPES)
    row["weights"] = "trainer's, pushed" if pushed else "vLLM's dummy weights (random), nothing pushed"
    if fp8_kv and pushed:
        ids = torch.randint(0, model.config.vocab_size, (4, 2048), device="cuda")

        def forward_ms(reps=5):
            with torch.no_grad():
                model(ids)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(reps):
                    model(ids)
                torch.cuda.synchronize()
            return 1e3 * (time.perf_counter() - start) / reps

        plain = forward_ms()
        observer = AttentionScaleObserver(model)
        observed = forward_ms()
        row["trainer_forward_ms"] = {"without_kv_observer": plain, "with_kv_observer": observed, "tokens": ids.numel()}
        scales = observer.scales()

    if backend == "deepgemm":
        cache = rollout_kernel("deepgemm").env["DG_JIT_CACHE_DIR"]
        row["jit_cache"] = {"dir": cache, "files_before": cache_files(cache)}
    torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free at start-up
    start = time.perf_counter()
    points = [parse_point(p) for p in args.points]
    sized = points + ([parse_point(args.profile_point)] if args.profile_point else [])  # the engine must hold all
    max_len = args.prompt_len + max(n for _, n in sized) + 16
    # --max_num_seqs: matched concurrency (every engine decodes at most that many); else every point's S at once.
    max_num_seqs = args.max_num_seqs or max(s for s, _ in sized)
    if args.engine in TRL_ACT_QUANT:
        from trl_fp8.rollout.vllm.act_quant import install_for_model

        choice = install_for_model(model, torch.device("cuda", torch.cuda.current_device()))
        row["act_quant"] = vars(choice)
        print(f"[{args.engine}] SiLU-and-mul + FP8 quantization: {choice.reason}", flush=True)
    llm = start_engine(
        model, precision, Path(args.workdir), fp8_kv_cache=fp8_kv, backend=backend or "auto",
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_len,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=TRL_MAX_NUM_BATCHED_TOKENS,  # TRL's colocate setting
        deepgemm_workers=args.deepgemm_workers,
        **llm_kwargs,
    )  # fmt: skip
    stats = RolloutStats.attach(llm)
    if llm_kwargs:
        row["llm_kwargs"] = llm_kwargs
    if args.engine in ENGINE_ENV:
        row["env"] = ENGINE_ENV[args.engine]
    row["engine_start_s"] = time.perf_counter() - start  # the DeepGEMM pre-compilation included
    if llm.trl_fp8_precompile is not None:
        row["deepgemm_precompile"] = vars(llm.trl_fp8_precompile)
    row.update(engine_kernels(llm))
    # The planner's estimate beside vLLM's own figure (trl_fp8.rollout.capacity; its goal: within 10%).
    total = torch.cuda.mem_get_info()[1]
    shape = ModelShape.from_config(model.config)
    planned = rollout_capacity(shape, total, args.gpu_memory_utilization, fp8_weights=precision != "bf16",
                               fp8_kv=fp8_kv, seq_len=max_len, max_num_seqs=max_num_seqs).kv_tokens  # fmt: skip
    row.update(gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max_num_seqs, gpu_total_bytes=total,
               planner_kv_tokens=planned, planner_error=planned / row["kv_cache_tokens"] - 1 if row["kv_cache_tokens"]
               else None)  # fmt: skip
    if backend == "deepgemm":
        row["jit_cache"]["files_after"] = cache_files(row["jit_cache"]["dir"])
        row["jit_cache"]["state"] = "warm" if row["jit_cache"]["files_before"] else "cold"
        row["deep_gemm_warmup"] = os.environ.get("VLLM_DEEP_GEMM_WARMUP")

    syncs, quantize = [], []
    for _ in range(3 if pushed else 0):
        invalidate_fp8_weights(model)  # a new optimizer step: the FP8 weights must be quantized again
        if train_fp8:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for m in model.modules():
                if isinstance(m, FP8Linear):
                    m.quantized_weight()
            torch.cuda.synchronize()
            quantize.append(time.perf_counter() - t0)
            invalidate_fp8_weights(model)  # the sync below quantizes again: its time includes quantization
        syncs.append(sync(llm, model, precision, scales))
    if syncs:
        row["weight_sync_ms"] = 1e3 * statistics.median(syncs)
    if quantize:
        row["quantize_ms"] = 1e3 * statistics.median(quantize)

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def prompts(n):
        return [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(n)]

    sizes = model_bytes(SHAPES[args.shape], fp8_linear=precision != "bf16", fp8_kv=fp8_kv)
    hw = hardware(torch.cuda.get_device_name())
    measured = {"device": torch.cuda.get_device_name(), "shape": SHAPES[args.shape], "prompt_len": args.prompt_len}
    timed_generate(llm, prompts(8), 16)  # warm-up
    row["points"] = []
    for seqs, new in points:
        if stats:
            stats.read()
        point = {"seqs": seqs, "new_tokens": new, **timed_generate(llm, prompts(seqs), new, args.sampling)}
        if stats:  # how many decoded at once, and how often the KV cache ran out (preempted, recomputed)
            took = stats.read()
            point.update(running_peak=int(took["running_peak"]), preemptions=int(took["preemptions"]))
        if hw:
            point.update(point_floor(measured, row, point))
        for other in args.compare_sampling or ():  # the same point with other sampling fields, this engine
            point.setdefault("sampling_compared", {})[other] = timed_generate(llm, prompts(seqs), new, other)
        if args.host_stacks:  # once more, untimed: where the host thread spends the rollout's steps
            from benchmarks.host_sampling import StackSampler

            with StackSampler() as sampler:
                timed_generate(llm, prompts(seqs), new, args.sampling)
            point["host_stacks"] = sampler.summary(top=15)
        row["points"].append(point)
        print(f"# {args.engine} {seqs}x{new}: {point['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
    if args.profile_point:  # where a decode step's time goes: attention against the GEMMs and the rest
        from torch.profiler import ProfilerActivity, profile

        seqs, new = parse_point(args.profile_point)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            timed = timed_generate(llm, prompts(seqs), new, args.sampling)
        row["profile"] = {"seqs": seqs, "new_tokens": new, "profiled_seconds": timed["seconds"],
                          **kernel_breakdown(prof)}  # fmt: skip
        if hw:  # the attention kernels' own floor: every decode step reads each sequence's cache once
            kv_read = seqs * (new * args.prompt_len + new * (new - 1) / 2) * sizes["kv_per_token"]
            row["profile"]["attention_kv_floor_ms"] = 1e3 * kv_read / hw["hbm"]
    print(json.dumps(row), flush=True)


def host_line(host: dict, seconds: float) -> str:
    """A rollout's milliseconds per engine step: in all, then each timed host call (`HostTimers.summary`): the step's,
    the model runner's inside the executor's, and every wait on a CUDA event."""
    wall = 1e3 * seconds / host["steps"]

    def listed(ms_per_step: dict) -> str:
        return ", ".join(f"{name} {ms:.2f}" for name, ms in ms_per_step.items())

    line = f"{wall:.2f} ms a step; " + listed(host["ms_per_step"])
    if inside := host.get("in_executor_ms_per_step"):
        line += "; inside the executor: " + listed(inside)
    if anywhere := host.get("anywhere_ms_per_step"):
        line += "; " + listed(anywhere)
    return line


def summary(rows: list[dict]) -> str:
    """One line per engine and point: tok/s, ratio to BF16 at the same point, share of the floor."""
    base = {(p["seqs"], p["new_tokens"]): p for r in rows if r["engine"] == "bf16" for p in r["points"]}
    lines = [
        f"{'engine':<17}{'kernel':<34}{'start s':>8}{'sync ms':>8}{'KV tokens':>10}{'point':>11}{'at once':>8}"
        f"{'preempt':>8}{'tok/s':>9}{'vs bf16':>9}{'of floor':>9}"
    ]
    for r in rows:
        for p in r["points"]:
            ref = base.get((p["seqs"], p["new_tokens"]))
            ratio = f"{p['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
            floor = f"{p['of_floor']:.0%}" if "of_floor" in p else "-"
            lines.append(
                f"{r['engine']:<17}{r['linear_kernel'][:33]:<34}{r['engine_start_s']:>8.0f}{r.get('weight_sync_ms', 0):>8.0f}"
                f"{r.get('kv_cache_tokens', 0):>10}{str(p['seqs']) + 'x' + str(p['new_tokens']):>11}"
                f"{p.get('running_peak', '-'):>8}{p.get('preemptions', '-'):>8}{p['tokens_per_s']:>9.0f}{ratio:>9}"
                f"{floor:>9}"
            )
    for r in rows:  # each rollout's host time per engine step, by call (benchmarks.host_timers)
        for p in r["points"]:
            runs = {r.get("sampling", "bench"): p, **p.get("sampling_compared", {})}
            for sampling, run in runs.items():
                if "host" in run:
                    lines.append(f"{r['engine']} {p['seqs']}x{p['new_tokens']} {sampling} sampling: "
                                 + host_line(run["host"], run["seconds"]))  # fmt: skip
    for r in rows:  # --profile_point: kernel time by category, attention against its floor
        if "profile" in r:
            prof = r["profile"]
            parts = ", ".join(f"{c} {ms:.0f}" for c, ms in prof["kernel_ms_by_category"].items())
            floor = prof.get("attention_kv_floor_ms")
            kv_floor = f" (attention's KV floor {floor:.0f})" if floor else ""
            timeline = prof.get("timeline")  # no kernel running: the GPU waiting on the host (scheduling, sampling)
            idle = f"; GPU idle {timeline['idle_ms']:.0f} of {timeline['span_ms']:.0f} ms" if timeline else ""
            lines.append(f"{r['engine']} {prof['seqs']}x{prof['new_tokens']} kernel ms: {parts}{kv_floor}{idle}")
    return "\n".join(lines)


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/rollout_<device>.json", append=True,
                        workdir="/tmp/trl_fp8_rollout")  # fmt: skip
    parser.add_argument("--engine", choices=list(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--shape", choices=list(SHAPES), default="8b")
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="SxN: S sequences, N new tokens each")
    parser.add_argument("--prompt_len", type=int, default=256)
    parser.add_argument(
        "--sampling",
        choices=list(SAMPLING),
        default="bench",
        help="the SamplingParams fields of every rollout (SAMPLING): this benchmark's, or the trainer's",
    )
    parser.add_argument(
        "--compare_sampling",
        nargs="+",
        choices=list(SAMPLING),
        default=None,
        help="each point once more with each of these sampling fields, on the same engine (sampling_compared)",
    )
    parser.add_argument(
        "--profile_point",
        default=None,
        help="SxN: one more rollout under the torch profiler, its kernel time by category",
    )
    parser.add_argument(
        "--host_stacks",
        action="store_true",
        help="each point once more with the host thread's stack sampled (host_sampling.StackSampler)",
    )
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.6)
    parser.add_argument(
        "--max_num_seqs",
        type=int,
        default=None,
        help="vLLM's max_num_seqs for every engine (matched concurrency); default: each point's S",
    )
    parser.add_argument(
        "--deepgemm_workers",
        type=int,
        default=None,
        help="processes compiling DeepGEMM's kernels before the engine starts, as the trainer does (0: vLLM's warm-up)",
    )
    parser.add_argument("--refloor", default=None, help="a results file: recompute its floors in place, then exit")
    args = parser.parse_args()
    if args.refloor:
        return refloor(Path(args.refloor))
    if args.engine:
        return run_engine(args)

    import torch

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    out = results_path(args.out, "rollout", device)
    result = {
        "benchmark": "vLLM rollout throughput, floor, start-up and weight-sync time",
        **metadata(device),
        "shape": {"name": args.shape, **SHAPES[args.shape]},
        "prompt_len": args.prompt_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        **({"sampling": args.sampling} if args.sampling != "bench" else {}),  # files before --sampling: "bench"
        "hardware_peaks": hardware(device),
        "results": [],
    }
    if args.append:
        same = ("shape", "prompt_len", "gpu_memory_utilization", "max_num_seqs", "sampling")
        result["results"] = previous_rows(out, result, same, "engine", args.engines)
    failed = run_all(__spec__.name, "--engine", args.engines, sys.argv[1:], result, out, "engine", list(ENGINES))
    if failed:  # kept as rows: at a small memory share an engine that cannot start is a result (its log says why)
        result["results"] += [{"engine": name, "started": False} for name in failed]
        write_json(out, result)
    print(summary([row for row in result["results"] if row.get("started", True)]))
    print(f"wrote {out}")
    if failed:
        raise SystemExit(f"failed engines: {failed}")


if __name__ == "__main__":
    main()
