"""A `trl vllm-serve` server checked before the trainer joins it: the served checkpoint's quantization and layers,
its kernel and KV cache, against what the trainer will push."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from torch import nn

from trl_fp8.checkpoint.save import (
    fp8_module_names,
    hf_name,
    linear_module_names,
    unwrap_model,
)
from trl_fp8.config import BLOCK
from trl_fp8.rollout.vllm._compat import ONLINE_FP8_NAMES, online_fp8_quantization
from trl_fp8.rollout.vllm.attention import VLLM_ATTENTION_BACKEND
from trl_fp8.rollout.vllm.kernels import (
    FP8_KV_ATTENTION_BACKEND,
    VLLM_LINEAR_BACKEND,
    server_command,
    server_kernel,
)

logger = logging.getLogger(__name__)

__all__ = ["check_served_quantization", "check_server_config", "check_server_kernel"]


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
    if config.get("quant_method") != "fp8" or block != [BLOCK, BLOCK]:
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
    wanted = {"fp8": ("fp8",), "fp8_online": ONLINE_FP8_NAMES, "bf16": (None,)}[rollout_precision]
    if quantization not in wanted:
        if rollout_precision == "fp8":
            raise ValueError(
                f"rollout_precision='fp8' pushes FP8 weights and scales, but the vLLM server runs "
                f"quantization={quantization!r}. {fix}."
            )
        name = online_fp8_quantization() if rollout_precision == "fp8_online" else None
        hint = f"--quantization {name}" if name else "a BF16 checkpoint and no --quantization"
        raise ValueError(
            f"rollout_precision={rollout_precision!r} needs a server with quantization={name!r}, found "
            f"{quantization!r}. Restart `trl vllm-serve` with {hint}."
        )
    if rollout_precision == "fp8":
        check_server_kernel(server_config, server_env, fp8_backend)
    cache_dtype = server_config.get("cache_config", {}).get("cache_dtype")
    if fp8_kv_cache and not str(cache_dtype).startswith("fp8"):
        raise ValueError(
            f"fp8_kv_cache=True but the server's KV cache is {cache_dtype!r}. Restart it with "
            "`trl vllm-serve ... --kv_cache_dtype fp8 --attention-backend CUSTOM` (trl-fp8's XQA backend, Hopper; "
            f"or {FP8_KV_ATTENTION_BACKEND}), or set fp8_kv_cache=False."
        )
    if not fp8_kv_cache and str(cache_dtype).startswith("fp8"):
        raise ValueError(
            f"The vLLM server keeps its KV cache in {cache_dtype!r}, but fp8_kv_cache is off, so the trainer would "
            "not push the K/V scales measured on its forward and the server would scale keys and values by 1.0. Set "
            "fp8_kv_cache=True, or restart the server without --kv_cache_dtype."
        )
    attention = (server_config.get("attention_config") or {}).get("backend")  # None: vLLM's pick, FA3 on Hopper
    if (
        fp8_kv_cache
        and attention is not None
        and str(attention).rsplit(".", 1)[-1] not in VLLM_ATTENTION_BACKEND.values()
    ):
        raise ValueError(
            f"fp8_kv_cache=True but the server's attention backend is {attention!r}, which does not take the q/k/v "
            "scales pushed at every step. Restart it with `--attention-backend CUSTOM` (trl-fp8's XQA backend, the "
            f"faster) or `--attention-backend {FP8_KV_ATTENTION_BACKEND}` (also vLLM's pick on Hopper when none is "
            "given)."
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
