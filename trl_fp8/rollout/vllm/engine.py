"""The colocated engine's set-up and weights: the config-only folder it starts from, the settings and environment
it needs for the trainer's FP8 weights, and the tensors pushed into it at every sync."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from trl_fp8.checkpoint.save import (
    check_fused_groups,
    checkpoint_config,
    fp8_checkpoint_tensors,
    hf_name,
    linear_module_names,
    unwrap_model,
)
from trl_fp8.config import check_rollout_precision
from trl_fp8.recipe import BlockwiseRecipe
from trl_fp8.rollout.vllm._compat import engine_worker, online_fp8_quantization
from trl_fp8.rollout.vllm.attention import KVAttention
from trl_fp8.rollout.vllm.kernels import (
    FP8_KV_ATTENTION_BACKEND,
    RolloutKernel,
    forget_cached_deepgemm_decisions,
    rollout_kernel,
)
from trl_fp8.rollout.vllm.tuned_moe import tuned_moe_config_env

logger = logging.getLogger(__name__)

__all__ = [
    "ALLOCATOR_VARIABLES",
    "EXPANDABLE_SEGMENTS",
    "TRL_MAX_NUM_BATCHED_TOKENS",
    "allocator_expandable_segments",
    "allocator_settings",
    "apply_engine_env",
    "engine_env",
    "engine_overrides",
    "expandable_segments_on",
    "push_to_engine",
    "rollout_weight_tensors",
    "sleep_mode_allocator",
    "write_engine_config",
]

# TRL builds its colocated engine with max_num_batched_tokens=4096: the largest GEMM the engine runs has that many rows.
TRL_MAX_NUM_BATCHED_TOKENS = 4096


def rollout_weight_tensors(
    model: nn.Module,
    rollout_precision: str,
    *,
    fp8_modules: set[str] | None = None,
    power_of_two_scales: bool = False,
    attention_scales: dict[str, torch.Tensor] | None = None,
    skip_experts: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """`(name, tensor)` pairs pushed to vLLM at each sync, in transformers names, on the model's device.

    "fp8": the block-FP8 checkpoint tensors (FP8 layers as float8_e4m3fn weight + float32 `weight_scale_inv`, the
    trainer's own quantized weights; the rest in BF16). "bf16" and "fp8_online": BF16 tensors only. PEFT adapters are
    merged in by PEFT's own merge; a tied lm_head is left to vLLM's tying. `power_of_two_scales` rounds the scales of
    layers quantized here (a BF16-trained model's; FP8 layers keep their own setting), as the exporter does.
    `attention_scales` (FP8 KV cache) come last, after every layer's weights, because vLLM processes attention scales
    after the linear layers. `skip_experts`: experts layers written into the engine another way (`vllm_experts`).
    """
    check_rollout_precision(rollout_precision)
    yield from fp8_checkpoint_tensors(
        model,
        fp8_modules=fp8_modules if rollout_precision == "fp8" else set(),
        recipe=BlockwiseRecipe(power_of_two_scales=power_of_two_scales),
        check_finite=False,
        dtype=torch.bfloat16,
        skip_experts=skip_experts,
    )
    for name, scale in (attention_scales or {}).items():
        yield name, scale.reshape(()).float()


def write_engine_config(model: nn.Module, tokenizer, path: str | Path, fp8_modules: set[str]) -> Path:
    """Write the files vLLM builds an engine from, without weights: `config.json` (with the block-FP8
    `quantization_config` when `fp8_modules` is non-empty), `generation_config.json` and the tokenizer."""
    hf_model = unwrap_model(model)
    linear_names = linear_module_names(hf_model)
    clean = {hf_name(n) for n in fp8_modules}
    check_fused_groups(clean, linear_names)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = checkpoint_config(hf_model, clean, linear_names, torch.bfloat16)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(path)
    if tokenizer is not None:
        getattr(tokenizer, "tokenizer", tokenizer).save_pretrained(path)
    return path


def engine_overrides(
    engine_dir: str | Path,
    rollout_precision: str,
    fp8_kv_cache: bool,
    kernel: RolloutKernel | None = None,
    kv_attention: KVAttention | None = None,
) -> dict:
    """`LLM(...)` arguments that build a colocated engine from `write_engine_config`'s folder with dummy weights;
    for "fp8" rollouts, `kernel`'s linear backend; with an FP8 KV cache, the attention backend `kv_attention` chose
    (`rollout.vllm.attention`; None: FlashAttention-3, `vllm_kernels.FP8_KV_ATTENTION_BACKEND`), both of which take
    new q/k/v scales at every sync."""
    # disable_log_stats=False: vLLM computes per-step scheduler statistics, which `RolloutStats` collects.
    overrides = {"model": str(engine_dir), "load_format": "dummy", "disable_log_stats": False}
    if rollout_precision == "fp8_online":
        overrides["quantization"] = online_fp8_quantization()  # vLLM's own online FP8 of the BF16 weights
    if rollout_precision == "fp8" and kernel is not None:
        overrides.update(kernel.llm_kwargs)
    if fp8_kv_cache:
        backend = FP8_KV_ATTENTION_BACKEND if kv_attention is None else kv_attention.backend
        overrides.update(kv_cache_dtype="fp8", attention_backend=backend)
    return overrides


def engine_env(rollout_precision: str, kernel: RolloutKernel | None = None) -> dict[str, str]:
    """Environment variables a vLLM engine needs so that it runs `rollout_precision` on the pushed values as they are
    (for "fp8": `kernel`'s, resolved with `rollout_kernel("auto")` when None).

    Assign them (not `setdefault`: a site default such as `VLLM_USE_DEEP_GEMM_E8M0=1` must not win) before the engine
    is built; vLLM reads them when it creates its layers.
    """
    if check_rollout_precision(rollout_precision) != "fp8":
        return {}
    # the experts' Triton tiles trl-fp8 tuned for decode, where it ships them (`rollout.vllm.tuned_moe`)
    return {**(kernel or rollout_kernel("auto")).env, **tuned_moe_config_env()}


def apply_engine_env(rollout_precision: str, kernel: RolloutKernel | None = None) -> None:
    """Assign `engine_env` to this process's environment, and make vLLM forget what it decided from the old one."""
    os.environ.update(engine_env(rollout_precision, kernel))
    forget_cached_deepgemm_decisions()


def sleep_mode_allocator(args, environ=os.environ) -> tuple[int, str] | None:
    """For a colocated run in sleep mode, turn on PyTorch's expandable segments, and return `(log level, line)` to
    log (None: nothing to do). PyTorch's caching allocator otherwise keeps the training step's freed blocks in
    segments that a live tensor pins (optimizer states are born among them), `empty_cache` cannot return those, and
    vLLM then wakes its whole share beside them: gigabytes at an 8B model, which a lower share would have to leave
    (the documentation's "When FP8 pays" page has the sizes).

    Whichever variable the user set (`allocator_settings`), the allocator is asked whether it runs on them
    (`allocator_expandable_segments`), and what it runs on is recorded in `PYTORCH_CUDA_ALLOC_CONF`: the variable
    vLLM (>= 0.26) reads, in this spelling, to turn expandable segments off around its own sleep-mode pool, which
    cannot use them, and the one PyTorch reads first (a child process starts on the same settings). A user's
    explicit `expandable_segments:False`, in either variable, is kept, with a warning. `environ`: this process's
    environment (a test's dict)."""
    if not (args.use_vllm and args.vllm_mode == "colocate" and args.vllm_enable_sleep_mode):
        return None
    if not torch.cuda.is_available():
        return None
    settings = allocator_settings(environ)[1]
    on = allocator_expandable_segments()
    if on is None:  # a PyTorch that cannot say: as it reads the environment
        on = bool(_expandable_segments_setting(settings))
    if on:
        if EXPANDABLE_SEGMENTS in environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            return None
        environ["PYTORCH_CUDA_ALLOC_CONF"] = _with_expandable_segments(settings)
        return logging.INFO, (
            "vllm_enable_sleep_mode=True: PyTorch's expandable segments are on; recorded as PYTORCH_CUDA_ALLOC_CONF="
            f"{environ['PYTORCH_CUDA_ALLOC_CONF']}, the variable vLLM reads to turn them off around its sleep-mode "
            "pool."
        )
    said_off = [name for name in ALLOCATOR_VARIABLES if _expandable_segments_setting(environ.get(name, "")) is False]
    if said_off:
        return logging.WARNING, (
            f"vllm_enable_sleep_mode=True with {said_off[0]}=expandable_segments:False: PyTorch keeps freed "
            "training memory pinned while vLLM wakes into its share (gigabytes at an 8B model), so a run out of "
            "memory at wake-up needs a lower vllm_gpu_memory_utilization; expandable_segments:True avoids it."
        )
    combined = _with_expandable_segments(settings)
    try:
        # The whole string: the setter resets options it is not given (a user's max_split_size_mb...).
        set_allocator_settings(combined)
    except (AttributeError, RuntimeError) as exc:  # a PyTorch that cannot change it at run time: the user can
        return logging.WARNING, (
            f"vllm_enable_sleep_mode=True: could not turn on PyTorch's expandable segments ({exc}); set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the run starts, or freed training memory stays "
            "pinned while vLLM wakes into its share (gigabytes at an 8B model)."
        )
    environ["PYTORCH_CUDA_ALLOC_CONF"] = combined
    return logging.INFO, (
        f"vllm_enable_sleep_mode=True: turned on PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF="
        f"{combined}), so the memory a training step frees goes back before vLLM wakes into its share. Set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False to keep PyTorch's default."
    )


# What vLLM looks for in PYTORCH_CUDA_ALLOC_CONF (this exact spelling) before it builds its sleep-mode pool.
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# Where PyTorch (2.11, 2.13) takes its allocator settings from, in its order: the first variable set, even empty,
# read once, at the allocator's first use. PYTORCH_ALLOC_CONF is the current name but comes last.
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def allocator_settings(environ=os.environ) -> tuple[str | None, str]:
    """`(variable, settings)`: the allocator settings PyTorch takes from `environ`, and the variable that holds
    them (`ALLOCATOR_VARIABLES`' order; `(None, "")` where none is set)."""
    for name in ALLOCATOR_VARIABLES:
        if name in environ:
            return name, environ[name]
    return None, ""


def allocator_expandable_segments() -> bool | None:
    """Whether PyTorch's CUDA caching allocator runs on expandable segments now, as it says itself (its memory
    snapshot's settings: whatever variable or run-time call set them; asking starts no CUDA context); None where it
    cannot say (a PyTorch without CUDA, another allocator backend)."""
    try:
        return bool(torch.cuda.memory._snapshot()["allocator_settings"]["expandable_segments"])
    except (AttributeError, KeyError, RuntimeError):
        return None


def _is_expandable_segments(option: str) -> bool:
    return option.replace(" ", "").partition(":")[0] == "expandable_segments"


def _expandable_segments_setting(settings: str) -> bool | None:
    """What allocator `settings` say of expandable segments (the last mention wins, as PyTorch parses them); None:
    nothing."""
    said = [option.partition(":")[2] for option in settings.split(",") if _is_expandable_segments(option)]
    return said[-1].strip().lower() == "true" if said else None


def _with_expandable_segments(settings: str) -> str:
    """`settings` with expandable segments on, in the spelling vLLM looks for, their other options as they were."""
    others = [option for option in settings.split(",") if option.strip() and not _is_expandable_segments(option)]
    return ",".join([*others, EXPANDABLE_SEGMENTS])


def expandable_segments_on(environ=None) -> bool:
    """Whether PyTorch's allocator runs on expandable segments: as the allocator says where it can
    (`allocator_expandable_segments`), else as PyTorch reads this process's environment. With `environ` (a child
    process's, a test's), as PyTorch would read those settings (`allocator_settings`)."""
    if environ is None:
        if (said := allocator_expandable_segments()) is not None:
            return said
        environ = os.environ
    return bool(_expandable_segments_setting(allocator_settings(environ)[1]))


def set_allocator_settings(settings: str) -> None:
    """Change the CUDA caching allocator's settings at run time (as vLLM does around its sleep-mode pool)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(settings)


def push_to_engine(llm, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format `weights` into an in-process engine through vLLM's layerwise reload."""
    worker = engine_worker(llm)
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    llm.reset_prefix_cache()
