"""vLLM rollouts on the trainer's own FP8 weights and scales.

`FP8VLLMGeneration` is TRL's `VLLMGeneration` with three changes, and nothing else copied:

- colocate start-up: vLLM is built from a config-only folder (`config.json` with the block-FP8
  `quantization_config`, tokenizer, generation config) with `load_format="dummy"`; TRL syncs weights before the
  first generation, so the engine never samples from the dummy weights, and nothing is written to disk but configs;
- the tensors pushed at each sync (`_iter_named_params`): for `rollout_precision="fp8"`, every FP8 layer's
  `weight` (float8_e4m3fn) and `weight_scale_inv` (float32) exactly as the trainer's forward uses them, BF16 for the
  rest; plus, with an FP8 KV cache, the q/k/v scales measured on the trainer's forward (`kv_scales.py`);
- colocate sync: vLLM's layerwise `reload_weights` (the only refresh path that works on a running FP8 engine in
  vLLM 0.26; `model.load_weights`, which TRL calls, fails there). Server mode keeps TRL's own path (its client
  streams the same tensors through vLLM's NCCL weight-transfer engine, which also reloads layerwise).

Rollout precisions: "fp8" (our quantizer makes weights and scales: the unified flow), "bf16", and "fp8_online"
(BF16 weights pushed, vLLM quantizes them itself: the BF16-train / FP8-rollout baseline).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from trl.generation.vllm_generation import VLLMGeneration

from trl_fp8.checkpoint.save import (
    check_fused_groups,
    checkpoint_config,
    fp8_checkpoint_tensors,
    fp8_module_names,
    hf_name,
    linear_module_names,
    unwrap_model,
)
from trl_fp8.config import ROLLOUT_PRECISIONS, check_rollout_precision, check_vllm_version
from trl_fp8.nn.linear import release_fp8_weight_caches
from trl_fp8.rollout.kv_scales import AttentionScaleObserver
from trl_fp8.rollout.stats import RolloutStats, engine_kv_cache_tokens
from trl_fp8.rollout.vllm.deepgemm_warmup import PrecompileResult, precompile_engine_kernels
from trl_fp8.rollout.vllm.experts import NO_FP8_EXPERTS, EngineExperts, quiet_skipped_layers
from trl_fp8.rollout.vllm.kernels import (
    FP8_KV_ATTENTION_BACKEND,
    VLLM_LINEAR_BACKEND,
    RolloutKernel,
    check_fp8_kv_attention,
    forget_cached_deepgemm_decisions,
    rollout_kernel,
    server_command,
    server_kernel,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ROLLOUT_PRECISIONS",
    "FP8VLLMGeneration",
    "apply_engine_env",
    "check_served_quantization",
    "check_server_config",
    "check_server_kernel",
    "check_vllm_version",
    "engine_env",
    "engine_overrides",
    "push_to_engine",
    "rollout_weight_tensors",
    "write_engine_config",
]

# TRL builds its colocated engine with max_num_batched_tokens=4096: the largest GEMM the engine runs has that many rows.
TRL_MAX_NUM_BATCHED_TOKENS = 4096

# vLLM's own online FP8 (per-tensor weights, dynamic per-token activations): `vllm serve --quantization fp8`.
VLLM_ONLINE_FP8 = "fp8"


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
        power_of_two_scales=power_of_two_scales,
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
    engine_dir: str | Path, rollout_precision: str, fp8_kv_cache: bool, kernel: RolloutKernel | None = None
) -> dict:
    """`LLM(...)` arguments that build a colocated engine from `write_engine_config`'s folder with dummy weights;
    for "fp8" rollouts, `kernel`'s linear backend; with an FP8 KV cache, the attention backend that takes new q/k/v
    scales at every sync (`vllm_kernels.FP8_KV_ATTENTION_BACKEND`)."""
    # disable_log_stats=False: vLLM computes per-step scheduler statistics, which `RolloutStats` collects.
    overrides = {"model": str(engine_dir), "load_format": "dummy", "disable_log_stats": False}
    if rollout_precision == "fp8_online":
        overrides["quantization"] = VLLM_ONLINE_FP8
    if rollout_precision == "fp8" and kernel is not None:
        overrides.update(kernel.llm_kwargs)
    if fp8_kv_cache:
        overrides.update(kv_cache_dtype="fp8", attention_backend=FP8_KV_ATTENTION_BACKEND)
    return overrides


def engine_env(rollout_precision: str, kernel: RolloutKernel | None = None) -> dict[str, str]:
    """Environment variables a vLLM engine needs so that it runs `rollout_precision` on the pushed values as they are
    (for "fp8": `kernel`'s, resolved with `rollout_kernel("auto")` when None).

    Assign them (not `setdefault`: a site default such as `VLLM_USE_DEEP_GEMM_E8M0=1` must not win) before the engine
    is built; vLLM reads them when it creates its layers.
    """
    if check_rollout_precision(rollout_precision) != "fp8":
        return {}
    return dict((kernel or rollout_kernel("auto")).env)


def apply_engine_env(rollout_precision: str, kernel: RolloutKernel | None = None) -> None:
    """Assign `engine_env` to this process's environment, and make vLLM forget what it decided from the old one."""
    os.environ.update(engine_env(rollout_precision, kernel))
    forget_cached_deepgemm_decisions()


def sleep_mode_allocator_advice(args, environ=os.environ) -> str | None:
    """What to set before a colocated run in sleep mode, or None. PyTorch's caching allocator keeps the training
    step's freed blocks in segments that a live tensor pins (optimizer states are born among them), `empty_cache`
    cannot return those, and vLLM then wakes its whole share beside them: 10.0 GiB with BF16 training, about 14 with
    FP8, at the 8B shape; with expandable segments 0.8-1.1 GiB (benchmarks/README.md). vLLM >= 0.26 turns
    expandable segments off around its own sleep-mode pool, so the setting is safe there."""
    if not (args.use_vllm and args.vllm_mode == "colocate" and args.vllm_enable_sleep_mode):
        return None
    if "expandable_segments:true" in environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
        return None
    return (
        "vllm_enable_sleep_mode=True: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the run starts "
        "(examples/grpo_fp8.py does). Without it PyTorch keeps freed training memory pinned while vLLM wakes into "
        "its share (10-14 GiB at an 8B model), so a run out of memory at wake-up needs a lower "
        "vllm_gpu_memory_utilization; with it, 0.45 ran on an 80 GB H100 where 0.4 failed for FP8 training."
    )


def push_to_engine(llm, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-format `weights` into an in-process engine through vLLM's layerwise reload."""
    worker = llm.llm_engine.model_executor.driver_worker.worker
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    llm.reset_prefix_cache()


def _served_model_config(server_config: dict) -> dict | None:
    """The served model's `config.json`: read from its folder when that is readable here (one host, the usual two-GPU
    setup), or from the Hub when the server serves a Hub id (cached or downloaded). vLLM's `/server_info` reports
    neither the architecture nor the checkpoint's `quantization_config` itself. None when neither source answers."""
    model_config = server_config.get("model_config", {})
    path = model_config.get("model")
    if not path:
        return None
    config = Path(str(path)) / "config.json"
    if config.is_file():
        return json.loads(config.read_text())
    if Path(str(path)).is_absolute() or not re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        return None  # a folder on the server's host
    try:
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(str(path), "config.json", revision=model_config.get("revision"))
    except Exception as exc:  # offline, private, gated: say so in the caller's warning, never fail the run here
        logger.info("Could not read %s's config.json from the Hub: %s", path, exc)
        return None
    return json.loads(Path(local).read_text())


def _ignored_by(entries: list[str], name: str) -> bool:
    """Whether a `modules_to_not_convert` / `ignored_layers` list keeps linear layer `name` unquantized (exact names,
    parent modules, and vLLM's `re:` patterns)."""
    for entry in entries:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name):
                return True
        elif name == entry or name.startswith(entry + "."):
            return True
    return False


def check_served_quantization(
    served: dict | None, model: nn.Module, rollout_precision: str, fp8_modules: set[str], fix: str
) -> None:
    """Raise naming the fix when the served checkpoint's quantization is not what this trainer pushes.

    vLLM reports `quantization="fp8"` both for a block-FP8 checkpoint and for a BF16 model it quantizes itself
    (`--quantization fp8`), so the served model's own `quantization_config` decides: for "fp8" rollouts it must be
    a 128x128 block-FP8 checkpoint keeping exactly the trainer's high-precision layers (vLLM builds the layers' FP8
    or BF16 parameters from it, and a pushed tensor of the other kind would not fit); for "fp8_online" it must be a
    BF16 model. `served` None (a server on another host that does not report its config): warn that this could not
    be checked.
    """
    if rollout_precision == "bf16":
        return  # a BF16 server reports quantization=None, already checked
    if served is None:
        logger.warning(
            "The vLLM server's model config is not readable from here, so whether it serves a block-FP8 checkpoint "
            "with the trainer's high-precision layers (rollout_precision=%r) cannot be checked.",
            rollout_precision,
        )
        return
    config = served.get("quantization_config") or None
    if rollout_precision == "fp8_online":
        if config is not None:
            raise ValueError(
                f"rollout_precision='fp8_online' pushes BF16 weights for vLLM to quantize, but the server serves a "
                f"{config.get('quant_method')!r} checkpoint. Serve the BF16 model with `trl vllm-serve --model "
                "<bf16 model> --quantization fp8`, or use rollout_precision='fp8' with this checkpoint."
            )
        return
    if config is None:
        raise ValueError(
            "rollout_precision='fp8' pushes the trainer's block-FP8 weights and scales, but the server quantizes a "
            "BF16 checkpoint itself (vLLM's online FP8, `--quantization fp8`: other layers, other scales), so it "
            f"cannot take them. {fix}."
        )
    block = list(config.get("weight_block_size") or [])
    if config.get("quant_method") != "fp8" or block != [128, 128]:
        raise ValueError(
            f"The server's checkpoint is quant_method={config.get('quant_method')!r} with weight_block_size={block}, "
            f"not the 128x128 block FP8 the trainer pushes. {fix}."
        )
    ignored = list(config.get("modules_to_not_convert") or config.get("ignored_layers") or [])
    linear = {n for n in linear_module_names(model) if n.rsplit(".", 1)[-1] != "lm_head"}  # vLLM never quantizes it
    ours = {hf_name(n) for n in fp8_modules}
    theirs_only = sorted(n for n in linear if _ignored_by(ignored, n) and n in ours)
    ours_only = sorted(n for n in linear if not _ignored_by(ignored, n) and n not in ours)
    if theirs_only or ours_only:
        shown = "; ".join(
            f"{what}: {', '.join(names[:3])}{f' (+{len(names) - 3} more)' if len(names) > 3 else ''}"
            for what, names in (("FP8 in the trainer, BF16 on the server", theirs_only),
                                ("BF16 in the trainer, FP8 on the server", ours_only)) if names
        )  # fmt: skip
        raise ValueError(
            f"The server's checkpoint keeps other layers in high precision than the trainer ({shown}), so the pushed "
            f"weights would not fit its layers. {fix}, with the trainer's layer choices "
            "(--num_first_layers_in_bf16 / --num_last_layers_in_bf16 / --keep_in_bf16)."
        )


def check_server_kernel(server_config: dict, server_env: dict | None, fp8_backend: str = "auto") -> str | None:
    """Raise naming the fix when an FP8 server's kernel settings change the trainer's values (E8M0 on with DeepGEMM
    enabled); warn when its kernel is not the one `fp8_backend` asks for (same values, other speed). Returns the
    server's linear backend as vLLM reports it, or None when the server did not report its environment."""
    linear_backend = server_config.get("kernel_config", {}).get("linear_backend", "auto")
    if server_env is None:
        logger.warning(
            "The vLLM server did not report its environment, so its FP8 kernel settings cannot be checked; it must "
            "run with VLLM_USE_DEEP_GEMM_E8M0=0: `%s`.",
            server_command(),
        )
        return None

    def on(name: str, default: bool) -> bool:
        return str(server_env.get(name, default)).lower() in ("1", "true")

    if on("VLLM_USE_DEEP_GEMM", True) and on("VLLM_USE_DEEP_GEMM_E8M0", True):
        raise ValueError(
            "The vLLM server runs with VLLM_USE_DEEP_GEMM_E8M0=1: it rounds the pushed FP8 scales up to powers of two "
            "and requantizes the weights, so rollouts would not run the trainer's model. Restart it as "
            f"`{server_command()}`."
        )
    served = "deep_gemm" if linear_backend == "auto" and on("VLLM_USE_DEEP_GEMM", True) else linear_backend
    served = {vllm: ours for ours, vllm in VLLM_LINEAR_BACKEND.items()}.get(served, served)  # our backend names
    if fp8_backend != "auto" and served != fp8_backend:
        logger.warning(
            "vllm_fp8_backend=%r but the vLLM server runs %r (same FP8 values, other speed). For %r restart it as `%s`.",
            fp8_backend, served, fp8_backend, server_command(server_kernel(fp8_backend)),
        )  # fmt: skip
    return served


def check_server_config(
    server_config: dict,
    model: nn.Module,
    rollout_precision: str,
    fp8_kv_cache: bool,
    *,
    server_env: dict | None = None,
    fp8_backend: str = "auto",
    fp8_modules: set[str] | None = None,
) -> None:
    """Raise naming the fix when a `trl vllm-serve` server cannot take this trainer's weights.

    `server_config` is the server's `/server_info` VllmConfig tree (`VLLMClient.get_server_info()`) and `server_env`
    its `vllm_env` (the VLLM_* settings it runs with): its quantization, KV-cache dtype and, for FP8 rollouts, its
    block-FP8 kernel settings (`check_server_kernel`) are checked, and, when the served model's config is known
    (reported, or readable from here), its architecture, shapes and quantization config: a block-FP8 checkpoint
    with the same high-precision layers as `fp8_modules` (default: the model's FP8 layers) for "fp8" rollouts, a
    BF16 model for "fp8_online" (`check_served_quantization`).
    """
    hf_config = unwrap_model(model).config
    fix = (
        "Start the server on an FP8 checkpoint of this very policy: `trl-fp8 quantize <model> <fp8_dir>` then "
        f"`{server_command()}`"
    )
    quantization = server_config.get("model_config", {}).get("quantization")
    wanted = {"fp8": "fp8", "fp8_online": VLLM_ONLINE_FP8, "bf16": None}[rollout_precision]
    if quantization != wanted:
        if rollout_precision == "fp8":
            raise ValueError(
                f"rollout_precision='fp8' pushes FP8 weights and scales, but the vLLM server runs "
                f"quantization={quantization!r}. {fix}."
            )
        hint = "--quantization fp8" if wanted else "a BF16 checkpoint and no --quantization"
        raise ValueError(
            f"rollout_precision={rollout_precision!r} needs a server with quantization={wanted!r}, found "
            f"{quantization!r}. Restart `trl vllm-serve` with {hint}."
        )
    if rollout_precision == "fp8":
        check_server_kernel(server_config, server_env, fp8_backend)
    cache_dtype = server_config.get("cache_config", {}).get("cache_dtype")
    if fp8_kv_cache and not str(cache_dtype).startswith("fp8"):
        raise ValueError(
            f"fp8_kv_cache=True but the server's KV cache is {cache_dtype!r}. Restart it with "
            f"`trl vllm-serve ... --kv_cache_dtype fp8 --attention-backend {FP8_KV_ATTENTION_BACKEND}`, or set "
            "fp8_kv_cache=False."
        )
    attention = (server_config.get("attention_config") or {}).get("backend")  # None: vLLM's pick, FA3 on Hopper
    if fp8_kv_cache and attention is not None and str(attention).rsplit(".", 1)[-1] != FP8_KV_ATTENTION_BACKEND:
        raise ValueError(
            f"fp8_kv_cache=True but the server's attention backend is {attention!r}, which does not take the q/k/v "
            f"scales pushed at every step. Restart it with `--attention-backend {FP8_KV_ATTENTION_BACKEND}` (or no "
            "--attention-backend, which picks it on Hopper)."
        )
    served = _served_model_config(server_config)
    fp8_modules = fp8_module_names(model) if fp8_modules is None else fp8_modules
    check_served_quantization(served, model, rollout_precision, fp8_modules, fix)
    if served is None:
        return
    ours = list(getattr(hf_config, "architectures", None) or [type(unwrap_model(model)).__name__])
    if served.get("architectures") and list(served["architectures"]) != ours:
        raise ValueError(f"The vLLM server serves {served['architectures']}, the trainer trains {ours}. {fix}.")
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size", "intermediate_size"):
        if key in served and served[key] != getattr(hf_config, key, served[key]):
            raise ValueError(
                f"The vLLM server's model has {key}={served[key]}, the trainer's {getattr(hf_config, key)}: not the "
                f"same architecture. {fix}."
            )


class FP8VLLMGeneration(VLLMGeneration):
    """TRL's vLLM generation whose rollouts run on the trainer's own FP8 weights (see the module docstring).

    Extra keyword arguments on top of `VLLMGeneration`'s:

    Args:
        rollout_precision: "fp8", "bf16" or "fp8_online".
        fp8_modules: names of the layers served in FP8. Default: read from the model (`export.fp8_module_names`)
            at start-up and at every sync, so they follow PEFT wrapping.
        power_of_two_scales: round the scales of layers quantized for the sync (a BF16-trained model's) down to
            powers of two, as the exported checkpoint does.
        kv_observer: an `AttentionScaleObserver` on the policy; its scales are pushed with every sync and vLLM's KV
            cache is FP8. None: KV cache in the model dtype.
        fp8_backend: vLLM's kernel for the FP8 linear layers ("auto", "deepgemm", "cutlass", "triton"; see
            `vllm_kernels.rollout_kernel`). In server mode it only names what the server is expected to run.
        jit_cache_dir: DeepGEMM's compiled-kernel cache (default `vllm_kernels.default_jit_cache_dir()`).
        deepgemm_workers: processes compiling DeepGEMM's kernels before a colocated engine starts
            (`deepgemm_warmup.precompile_deepgemm`; None: one per CPU core, 0: none).
    """

    def __init__(
        self,
        *args,
        rollout_precision: str = "fp8",
        fp8_modules: set[str] | None = None,
        power_of_two_scales: bool = False,
        kv_observer: AttentionScaleObserver | None = None,
        fp8_backend: str = "auto",
        jit_cache_dir: str | None = None,
        deepgemm_workers: int | None = None,
        **kwargs,
    ):
        self.rollout_precision = check_rollout_precision(rollout_precision)
        self.fp8_backend = fp8_backend
        self.jit_cache_dir = jit_cache_dir
        self.deepgemm_workers = deepgemm_workers
        self.deepgemm_precompile: PrecompileResult | None = None  # what the parallel compilation did at start-up
        self.kernel: RolloutKernel | None = None  # resolved at colocated start-up
        self.engine_start_seconds: float | None = None
        self._fp8_modules = None if fp8_modules is None else set(fp8_modules)
        self.power_of_two_scales = power_of_two_scales
        self.kv_observer = kv_observer
        self.last_sync_seconds: float | None = None
        self.released_cache_bytes = 0  # FP8 weight copies let go for the last rollout (sleep mode)
        self.engine_dir: Path | None = None
        self.rollout_stats: RolloutStats | None = None  # colocate: what the engine did in each rollout
        self.kv_cache_tokens: int | None = None
        # colocate: writes FP8 experts in place (None until the first sync decides; False: the reload for all)
        self.engine_experts: EngineExperts | None | bool = None
        super().__init__(*args, **kwargs)

    @property
    def fp8_modules(self) -> set[str]:
        """Names of the layers vLLM runs in FP8 (empty unless rollout_precision is "fp8"); PEFT or plain, the engine
        config and the pushed tensors compare them as transformers names."""
        if self.rollout_precision != "fp8":
            return set()
        return fp8_module_names(self.model) if self._fp8_modules is None else self._fp8_modules

    # --- start-up ----------------------------------------------------------------------------------------------

    def _init_vllm(self):
        check_vllm_version()  # FSDP1 / ZeRO-3 launches were refused by the trainer before loading
        if self.mode != "colocate":
            if self.accelerator.is_main_process:
                self._check_server()  # before TRL joins the server's NCCL group, which cannot be undone
            super()._init_vllm()
            return
        self.engine_dir = Path(tempfile.mkdtemp(prefix="trl_fp8_vllm_engine_"))
        weakref.finalize(self, shutil.rmtree, str(self.engine_dir), True)
        write_engine_config(self.model, self.processing_class, self.engine_dir, self.fp8_modules)
        if self.kv_observer is not None:
            check_fp8_kv_attention(self.accelerator.device)

        # TRL builds `LLM(...)` itself with no knob for these settings: hand it an LLM that takes our overrides.
        import trl.generation.vllm_generation as trl_vllm

        llm_class = trl_vllm.LLM
        if self.rollout_precision == "fp8":
            self.kernel = rollout_kernel(
                self.fp8_backend, jit_cache_dir=self.jit_cache_dir, device=self.accelerator.device
            )
            log = logger.warning if self.fp8_backend == "auto" and self.kernel.backend != "deepgemm" else logger.info
            log("vLLM block-FP8 kernel for rollouts: %s (%s)", self.kernel.backend, self.kernel.reason)
        overrides = engine_overrides(
            self.engine_dir, self.rollout_precision, self.kv_observer is not None, self.kernel
        )
        apply_engine_env(self.rollout_precision, self.kernel)
        start = time.perf_counter()
        self._precompile_deepgemm()
        trl_vllm.LLM = lambda *a, **kw: llm_class(*a, **{**kw, **overrides})
        try:
            super()._init_vllm()
        finally:
            trl_vllm.LLM = llm_class
        # DeepGEMM's kernels are compiled above or in vLLM's warm-up when the JIT cache is cold.
        self.engine_start_seconds = time.perf_counter() - start
        self.rollout_stats = RolloutStats.attach(self.llm)
        self.kv_cache_tokens = engine_kv_cache_tokens(self.llm)
        logger.info(
            "vLLM engine started in %.0f s, KV cache %s tokens", self.engine_start_seconds, self.kv_cache_tokens
        )

    def _precompile_deepgemm(self) -> None:
        """Compile the engine's DeepGEMM kernels in parallel processes (local main process; the others wait and
        find them in the shared cache) before vLLM's warm-up, which would compile them one at a time."""
        if self.accelerator.is_local_main_process:
            self.deepgemm_precompile = precompile_engine_kernels(
                self.kernel, self.model, self.fp8_modules, TRL_MAX_NUM_BATCHED_TOKENS,
                workers=self.deepgemm_workers, device=self.accelerator.device.index,
            )  # fmt: skip
        self.accelerator.wait_for_everyone()

    def _check_server(self) -> None:
        import requests
        from trl.generation.vllm_client import VLLMClient

        base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
        try:
            client = VLLMClient(base_url=base_url, connection_timeout=self.server_timeout)
        except (ConnectionError, requests.exceptions.ConnectionError) as exc:  # TRL raises the latter
            raise ConnectionError(
                f"{exc} For FP8 rollouts the server must run an FP8 checkpoint of the initial policy: "
                f"`trl-fp8 quantize <model> <fp8_dir>` then `{server_command(server_kernel(self.fp8_backend))}`."
            ) from exc
        # TRL's get_server_info() returns the config only; the same endpoint also reports the server's VLLM_* settings.
        response = client.session.get(f"{client.base_url}/server_info", params={"config_format": "json"})
        info = response.json() if response.status_code == 200 else {"vllm_config": client.get_server_info()}
        check_server_config(
            info["vllm_config"], self.model, self.rollout_precision, self.kv_observer is not None,
            server_env=info.get("vllm_env"), fp8_backend=self.fp8_backend, fp8_modules=self.fp8_modules,
        )  # fmt: skip

    # --- weight sync -------------------------------------------------------------------------------------------

    def _attention_scales(self) -> dict[str, torch.Tensor] | None:
        if self.kv_observer is None:
            return None
        scales = self.kv_observer.scales()
        if torch.distributed.is_available() and torch.distributed.is_initialized() and scales:
            # One scale per layer for every engine: the max over the ranks' observations.
            stacked = torch.stack(list(scales.values())).to(self.accelerator.device)
            torch.distributed.all_reduce(stacked, op=torch.distributed.ReduceOp.MAX)
            scales = dict(zip(scales, stacked.unbind(), strict=True))
        return scales

    def _iter_named_params(self, skip_experts: frozenset[str] | set[str] = frozenset()):
        # DDP / ZeRO-1/2: every rank holds the whole model. FSDP2: each tensor is gathered as it is produced, and TRL
        # walks this on every rank in the same order (in server mode the others discard it). vLLM shards for TP.
        yield from rollout_weight_tensors(
            self.model,
            self.rollout_precision,
            fp8_modules=self.fp8_modules,
            power_of_two_scales=self.power_of_two_scales,
            attention_scales=self._attention_scales(),
            skip_experts=skip_experts,
        )

    def _push_colocated(self) -> None:
        """Everything through vLLM's layerwise reload, except FP8 experts once writing them in place is proven to
        give the engine the same bits (`vllm_experts`: the reload's per-expert path dominated MoE syncs)."""
        if self.engine_experts:
            with quiet_skipped_layers():
                push_to_engine(self.llm, self._iter_named_params(skip_experts=self.engine_experts.names))
            self.engine_experts.write()  # (no request ran since the reload reset the prefix cache)
            return
        push_to_engine(self.llm, self._iter_named_params())
        if self.engine_experts is None and self.rollout_precision == "fp8":
            experts, why = EngineExperts.verified(
                self.model, self.llm, self.fp8_modules, sleep_mode=bool(self.enable_sleep_mode)
            )
            self.engine_experts = experts or False
            if experts is not None:
                logger.info("FP8 experts sync: %s", why)
            elif why != NO_FP8_EXPERTS:
                logger.warning("FP8 experts sync: one tensor per expert through vLLM's reload (slower): %s", why)

    def sync_weights(self):
        start = time.perf_counter()
        if self.mode == "colocate":
            if self.enable_sleep_mode:
                torch.cuda.empty_cache()
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            self._push_colocated()
            if self.enable_sleep_mode:  # the KV cache wakes next: give it the trainer's FP8 copies while it generates
                self.released_cache_bytes = release_fp8_weight_caches(self.model)
                torch.cuda.empty_cache()
        else:
            super().sync_weights()  # streams _iter_named_params through TRL's client
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.last_sync_seconds = time.perf_counter() - start
