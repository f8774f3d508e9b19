"""Every access to vLLM internals that no public API offers, in one place (written against vLLM 0.26 and 0.31).

When a vLLM release moves one of these, this file is what changes; each function says what it reaches and why no
public path does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# The logger of vLLM's layerwise reload, which warns for each layer that gets no tensor in a sync.
LAYERWISE_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def engine_worker(llm):
    """The worker of an in-process `vllm.LLM` (colocated, one rank): its `reload_weights` is the only refresh path
    that works on a running FP8 engine (`model.load_weights` fails once FP8 layers have been processed)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def engine_model(llm) -> nn.Module:
    """The model inside an in-process `vllm.LLM`: the in-place expert write and the identity checks read it."""
    return engine_worker(llm).model_runner.model


def engine_rotary_table(llm) -> torch.Tensor:
    """A copy of the engine's rotary table (`cos_sin_cache [max_position, rotary_dim]`: cosines then sines; one per
    model, shared by its attention layers) in the dtype its forward casts it to (the activations', the model's
    dtype), read once: a sleeping engine's buffers are gone."""
    dtype = llm.llm_engine.model_config.dtype
    for module in engine_model(llm).modules():
        table = getattr(module, "cos_sin_cache", None)
        if isinstance(table, torch.Tensor):
            return table.detach().to(dtype=dtype, copy=True)
    raise RuntimeError("The vLLM engine's model has no rotary table (`cos_sin_cache`): exact mode needs RoPE.")


def _engine_attention_layers(llm) -> list[nn.Module]:
    """vLLM's attention layers of the engine's model (those holding the FP8 KV cache's `_k_scale`), in layer order
    (the first number in each one's name: `model.layers.{i}.self_attn.attn`)."""
    layers = []
    for name, module in engine_model(llm).named_modules():
        if isinstance(getattr(module, "_k_scale", None), torch.Tensor) and hasattr(module, "kv_cache_dtype"):
            index = next((int(part) for part in name.split(".") if part.isdigit()), None)
            if index is None:
                raise RuntimeError(f"The vLLM engine's attention layer {name!r} has no layer number in its name.")
            layers.append((index, module))
    return [module for _, module in sorted(layers, key=lambda pair: pair[0])]


def engine_attention_scales(llm) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Copies of each attention layer's `(_q_scale, _k_scale, _v_scale)` (float32) in layer order, as the engine's
    FP8 KV cache uses them now (after a sync: the scales the next rollout runs with), copied because a sleeping
    engine's tensors are gone. No public API reads them; exact mode's trainer quantizes with them."""
    return [
        tuple(getattr(layer, name).detach().float().clone() for name in ("_q_scale", "_k_scale", "_v_scale"))
        for layer in _engine_attention_layers(llm)
    ]


def engine_query_quant(llm) -> Callable | None:
    """The engine's quantizer of the attention query (`Attention.query_quant`: vLLM's static per-tensor `QuantFP8`,
    its kernel chosen when the engine built it), which an FP8 KV cache on FlashAttention feeds FP8 queries; None
    where the engine attends with a BF16 query. Exact mode's trainer calls it to get the engine's bits."""
    layers = _engine_attention_layers(llm)
    if not layers:
        raise RuntimeError("The vLLM engine's model has no attention layers with KV-cache scales.")
    return getattr(layers[0], "query_quant", None)


def engine_stat_logger_manager(llm):
    """The engine's stat-logger manager (None if it has none): rollout statistics replace its loggers."""
    return getattr(getattr(llm, "llm_engine", None), "logger_manager", None)


def engine_cache_config(llm):
    """The cache config vLLM settled on at start-up (`num_gpu_blocks` x `block_size` KV tokens)."""
    return llm.llm_engine.vllm_config.cache_config


def shutdown_engine(llm) -> None:
    """Shut an in-process `vllm.LLM` down now: its engine core frees its GPU memory and tears down vLLM's distributed
    state (one per process). vLLM 0.31's in-process client also does this when it is collected, and that can be in
    the middle of a later engine's start-up: vLLM freezes its start-up heap (`gc.freeze`), so an earlier engine's
    garbage waits for a later `gc.unfreeze`. The client's own `shutdown` detaches that finalizer. No public API
    shuts an `LLM` down."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None:
        client.shutdown()


def moe_kernel_format_converter() -> Callable:
    """vLLM's own conversion of stacked FP8 experts into its MoE kernel's layout (what its post-load runs)."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import convert_to_fp8_moe_kernel_format

    return convert_to_fp8_moe_kernel_format


def moe_kernel_scales(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The block scales vLLM's MoE kernel reads at call time (its quant config's `w1_scale`/`w2_scale`), under the
    layer's names for them (`w13_weight_scale_inv`...); `{}` where the layer has no such config. A layerwise reload
    builds that config from the tensors it processed and then copies their values into the layer's own (the storage
    CUDA graphs captured), so after a reload the config can hold other storage than the layer: a forward outside the
    graphs (a long prefill, eager mode) reads the config's."""
    config = getattr(getattr(layer, "quant_method", None), "moe_quant_config", None)
    if config is None:
        return {}
    name = getattr(layer.quant_method, "weight_scale_name", "weight_scale_inv")
    return {f"w13_{name}": config.w1_scale, f"w2_{name}": config.w2_scale}


def installed_vllm_release() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM, read from its metadata (no import), or None."""
    from trl_fp8.stack import installed_versions, release

    found = installed_versions(("vllm",)).get("vllm")
    try:
        return tuple(int(part) for part in release(found).split(".")) if found else None  # type: ignore[return-value]
    except ValueError:  # a version string that is no number
        return None


def online_fp8_quantization() -> str:
    """vLLM's `quantization` name for its own online FP8 of a BF16 model (per-tensor weight scales): `"fp8"` up to
    0.30; 0.31 deprecates that for `"fp8_per_tensor"`, which it maps `"fp8"` to."""
    release = installed_vllm_release()
    return "fp8_per_tensor" if release is not None and release >= (0, 31) else "fp8"


# Names a server doing that online FP8 reports as its quantization (the older and the newer spelling).
ONLINE_FP8_NAMES = ("fp8", "fp8_per_tensor")


def vllm_package_dirs() -> list[Path]:
    """The installed vLLM's package folders, found without importing it (its settings are read at import), or []."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return [Path(root) for root in (spec.submodule_search_locations or [])] if spec is not None else []


def bundled_deepgemm_dir() -> Path | None:
    """The DeepGEMM bundled in vLLM (`vllm/third_party/deep_gemm`), found without importing vLLM (whose settings must
    be assigned before it loads), or None."""
    for root in vllm_package_dirs():
        if (folder := root / "third_party" / "deep_gemm").is_dir():
            return folder
    return None


def bundled_deepgemm_version() -> tuple[int, ...] | None:
    """The version of the bundled DeepGEMM, read from its `__init__.py` without importing it (importing it
    initialises its compiled library), or None."""
    import re

    folder = bundled_deepgemm_dir()
    if folder is None or not (init := folder / "__init__.py").is_file():
        return None
    found = re.search(r"__version__\s*=\s*['\"]([\d.]+)", init.read_text())
    return tuple(int(part) for part in found.group(1).split(".") if part) if found else None


def deepgemm_min_nvcc() -> tuple[int, int]:
    """The oldest nvcc the bundled DeepGEMM compiles its kernels with: 12.9 from DeepGEMM 2.8 (vLLM 0.31), 12.3
    before."""
    bundled = bundled_deepgemm_version()
    return (12, 9) if bundled is not None and bundled >= (2, 8) else (12, 3)


def deepgemm_warmup_token_counts(max_tokens: int, n: int, device: torch.device) -> list[int]:
    """The token counts vLLM's DeepGEMM warm-up runs for a layer of `n` outputs (its 'relax' mode)."""
    from vllm.model_executor.warmup.deep_gemm_warmup import _generate_optimal_warmup_m_values

    return _generate_optimal_warmup_m_values(max_tokens, n, device)


# vLLM's fused SiLU-and-mul + 1x128-group FP8 quantization op (`csrc/quantization/fused_kernels/`), which its compile
# pass `fuse_act_quant` and its Triton fused MoE call; `rollout.vllm.act_quant` re-registers its CUDA kernel.
SILU_MUL_QUANT_OP = ("_C", "silu_and_mul_per_block_quant")
# Its schema in vLLM 0.26 (`csrc/torch_bindings.cpp`; the GPU suite checks the loaded op's arguments against it). The
# CPU tests define an op with it, to call our kernel the way the dispatcher calls vLLM's.
SILU_MUL_QUANT_SCHEMA = (
    "(Tensor! out, Tensor input, Tensor! scales, int group_size, Tensor? scale_ub=None, "
    "bool is_scale_transposed=False) -> ()"
)


def silu_mul_quant_op():
    """The op's overload (`torch.ops._C.silu_and_mul_per_block_quant.default`), or None where vLLM's compiled ops
    are not here. No public API replaces an op's kernel; `torch.library` does it from its namespace and name."""
    return _loaded_op(SILU_MUL_QUANT_OP)


# vLLM's fused RMSNorm (with or without the residual add) + 1x128-group FP8 quantization op, which its compile pass
# `fuse_norm_quant` puts before every block-FP8 linear fed by an RMSNorm; `rollout.vllm.norm_quant` re-registers its
# CUDA kernel.
NORM_QUANT_OP = ("_C", "rms_norm_per_block_quant")
# Its schema in vLLM 0.31 (`csrc/libtorch_stable/torch_bindings.cpp`: no defaults, so the dispatcher hands a kernel
# every argument; the GPU suite checks the loaded op's arguments against it). The CPU tests define an op with it.
NORM_QUANT_SCHEMA = (
    "(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, Tensor? scale_ub, "
    "Tensor!? residual, int group_size, bool is_scale_transposed) -> ()"
)


def norm_quant_op():
    """The op's overload (`torch.ops._C.rms_norm_per_block_quant.default`), or None where vLLM's compiled ops are
    not here (as `silu_mul_quant_op`)."""
    return _loaded_op(NORM_QUANT_OP)


def _loaded_op(op: tuple[str, str]):
    try:
        import vllm._custom_ops  # noqa: F401 (loads vllm's compiled library, which registers the op)
    except ImportError:
        return None
    namespace, name = op
    packet = getattr(getattr(torch.ops, namespace), name, None)
    return None if packet is None else packet.default


# --- attention on the FP8 KV cache (`rollout.vllm.attention`, `rollout.vllm.xqa_backend`) -------------------------

# `FlashInferDecodeKernel.XQA.value`: the decode kernel vLLM's FlashInfer builder settles on (0.26 and 0.31)
XQA_DECODE_KERNEL = "xqa"
LIVE_SCALE_BACKEND = "trl_fp8.rollout.vllm.xqa_backend.LiveScaleFlashInferBackend"


def flashinfer_xqa_decode() -> Callable | None:
    """FlashInfer's batched XQA decode, `flashinfer.decode.xqa_batch_decode_with_kv_cache` (what vLLM 0.31's
    FlashInfer backend calls, and 0.26's reaches through `trtllm_batch_decode_with_kv_cache(backend="xqa")`; same
    arguments in FlashInfer 0.6.14 and 0.7), or None where FlashInfer or the function is missing."""
    try:
        from flashinfer.decode import xqa_batch_decode_with_kv_cache
    except ImportError:
        return None
    return xqa_batch_decode_with_kv_cache


# The keywords of `flashinfer.xqa.xqa` the direct call passes (FlashInfer 0.6.14 and 0.7 both take them).
XQA_KERNEL_ARGS = ("sinks", "q_scale", "kv_scale", "sliding_win_size", "kv_layout", "sm_count", "enable_pdl",
                   "rcp_out_scale", "q_seq_len")  # fmt: skip
# FlashInfer's wrappers reserve the workspace's first 8 MiB for XQA's semaphores, the rest is its scratch.
XQA_SEMAPHORE_BYTES = 8 * 1024 * 1024


def flashinfer_xqa_kernel_missing() -> str | None:
    """What the direct XQA call (`xqa_decode_with_scales`) needs from this FlashInfer and does not find, or None."""
    import inspect

    try:
        from flashinfer.utils import device_support_pdl, get_device_sm_count  # noqa: F401
        from flashinfer.xqa import xqa
    except ImportError as exc:
        return f"this FlashInfer has no flashinfer.xqa.xqa to call with precomputed scales ({exc})"
    missing = set(XQA_KERNEL_ARGS) - set(inspect.signature(xqa).parameters)
    return f"this FlashInfer's flashinfer.xqa.xqa takes no {sorted(missing)}" if missing else None


def xqa_decode_with_scales(
    query: torch.Tensor,
    kv_cache,
    workspace_buffer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    q_scale: torch.Tensor | float,
    kv_scale: torch.Tensor | float,
    window_left: int = -1,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    kv_layout: str = "NHD",
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """One query token per sequence through `flashinfer.xqa.xqa`, given XQA's own `q_scale` and `kv_scale`: what
    `flashinfer.decode.xqa_batch_decode_with_kv_cache` does for `q_len_per_req=1`, no mask, no `kv_cache_sf` and
    `o_scale=1` (FlashInfer 0.6.14 and 0.7), less its scale arithmetic, which on tensors would run as kernels inside
    every captured decode. Returns `out`."""
    from flashinfer.utils import device_support_pdl, get_device_sm_count
    from flashinfer.xqa import xqa

    if isinstance(kv_cache, tuple):
        k_cache, v_cache = kv_cache
    elif kv_cache.shape[1] == 1:
        k_cache, v_cache = kv_cache, kv_cache
    else:
        k_cache, v_cache = kv_cache.unbind(dim=1)  # [num_pages, 2, ...]
    if kv_layout == "NHD":  # [num_pages, page_size, kv_heads, head_dim]
        page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    else:  # HND: [num_pages, kv_heads, page_size, head_dim]
        num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    workspace = workspace_buffer.view(torch.uint8)
    if out is None:
        out = torch.empty_like(query)
    xqa(
        query.unsqueeze(1), k_cache, v_cache, block_tables, seq_lens.unsqueeze(1), out.unsqueeze(1),
        workspace[XQA_SEMAPHORE_BYTES:], workspace[:XQA_SEMAPHORE_BYTES], num_kv_heads, page_size,
        sinks=sinks.reshape(num_kv_heads, -1) if sinks is not None else None, q_scale=q_scale, kv_scale=kv_scale,
        sliding_win_size=window_left + 1 if window_left >= 0 else 0, kv_layout=kv_layout,
        sm_count=get_device_sm_count(query.device),
        enable_pdl=device_support_pdl(query.device) if enable_pdl is None else enable_pdl, rcp_out_scale=1.0,
        q_seq_len=1,
    )  # fmt: skip
    return out


# The name vLLM's FlashInfer backend calls XQA decode by, in `vllm.v1.attention.backends.flashinfer`, with the
# defaults of the FlashInfer function behind it: 0.31 (`xqa_batch_decode_with_kv_cache`), then 0.26
# (`trtllm_batch_decode_with_kv_cache`, given `backend="xqa"`).
XQA_DECODE_NAMES = (
    ("flashinfer_xqa_batch_decode_with_kv_cache", {"kv_layout": "NHD", "backend": "xqa"}),
    ("trtllm_batch_decode_with_kv_cache", {"kv_layout": "HND", "backend": "auto"}),
)
# Both functions' leading arguments, in their order (vLLM passes them by keyword).
_DECODE_POSITIONAL = ("query", "kv_cache", "workspace_buffer", "block_tables", "seq_lens", "max_seq_len",
                      "bmm1_scale", "bmm2_scale", "window_left", "out")  # fmt: skip
# The arguments `xqa_decode_with_scales` takes (or, `max_seq_len`, that FlashInfer's XQA wrapper ignores) ...
_DIRECT_ARGS = frozenset(_DECODE_POSITIONAL + ("sinks", "kv_layout", "enable_pdl", "backend"))
# ... and the values it assumes for the others: a call giving any other value, or any other argument, goes to
# FlashInfer's wrapper (speculative decode, masks, NVFP4, FP8 output, LSE).
_DIRECT_DEFAULTS = {
    "q_len_per_req": 1, "o_scale": 1.0, "mask": None, "kv_cache_sf": None, "q_cu_seq_lens": None, "out_dtype": None,
    "o_sf_scale": None, "o_sf_vec_size": None, "max_q_len": None, "cum_seq_lens_q": None,
    "skip_softmax_threshold_scale_factor": None, "uses_shared_paged_kv_idx": True, "lse": None, "return_lse": False,
}  # fmt: skip


def _takes_direct_path(kwargs: dict, scales, defaults: dict) -> bool:
    if kwargs.get("bmm2_scale") is not scales.kv_scale:  # vLLM folded something else into it (an output scale)
        return False
    if kwargs.get("backend", defaults["backend"]) != "xqa":
        return False
    out = kwargs.get("out")
    if out is not None and not isinstance(out, torch.Tensor):  # an FP4 output
        return False
    for name, value in kwargs.items():
        if name in _DIRECT_ARGS:
            continue
        if name not in _DIRECT_DEFAULTS:
            return False
        default = _DIRECT_DEFAULTS[name]
        if default is None:
            if value is not None:
                return False
        elif isinstance(value, torch.Tensor) or value != default:
            return False
    return True


def route_xqa_scales(original: Callable, *, kv_layout: str = "NHD", backend: str = "xqa") -> Callable:
    """`original` (FlashInfer's XQA decode as vLLM calls it), taking an `xqa_scales.XQAScales` as `bmm1_scale`: a
    plain single-token decode goes straight to `flashinfer.xqa.xqa` with its precomputed tensors; any other call
    (floats from another backend, speculative decode, a mask) goes to `original` with the fused values.
    `kv_layout` and `backend`: `original`'s defaults."""
    from trl_fp8.rollout.vllm.xqa_scales import XQAScales

    defaults = {"kv_layout": kv_layout, "backend": backend}

    @functools.wraps(original)
    def decode(*args, **kwargs):
        if len(args) <= len(_DECODE_POSITIONAL):
            kwargs.update(zip(_DECODE_POSITIONAL, args, strict=False))
            args = ()
        scales = kwargs.get("bmm1_scale")
        if not isinstance(scales, XQAScales):
            return original(*args, **kwargs)
        if _takes_direct_path(kwargs, scales, defaults):
            return xqa_decode_with_scales(
                kwargs["query"], kwargs["kv_cache"], kwargs["workspace_buffer"], kwargs["block_tables"],
                kwargs["seq_lens"], q_scale=scales.q_scale, kv_scale=scales.kv_scale,
                window_left=kwargs.get("window_left", -1), out=kwargs.get("out"), sinks=kwargs.get("sinks"),
                kv_layout=kwargs.get("kv_layout", defaults["kv_layout"]), enable_pdl=kwargs.get("enable_pdl"),
            )  # fmt: skip
        kwargs["bmm1_scale"] = scales.bmm1_scale()
        return original(*args, **kwargs)

    decode.trl_fp8_routes_xqa_scales = original
    return decode


def route_xqa_scales_in_vllm() -> str:
    """Wrap, once per process, the function vLLM's FlashInfer backend calls for XQA decode (a module-level name of
    `vllm.v1.attention.backends.flashinfer`, see `XQA_DECODE_NAMES`) with `route_xqa_scales`, so the precomputed
    scales `xqa_backend` hands its forward reach XQA as they are. Other backends' calls pass through unchanged.
    Returns the name wrapped. No public API lets a backend pass XQA its own scales without copying vLLM's forward."""
    from vllm.v1.attention.backends import flashinfer as flashinfer_backend

    for name, defaults in XQA_DECODE_NAMES:
        current = getattr(flashinfer_backend, name, None)
        if current is None:
            continue
        if not hasattr(current, "trl_fp8_routes_xqa_scales"):
            setattr(flashinfer_backend, name, route_xqa_scales(current, **defaults))
        return name
    raise RuntimeError(f"vLLM's FlashInfer backend calls XQA by none of {[n for n, _ in XQA_DECODE_NAMES]}")


def live_scale_backend_missing() -> str | None:
    """What `xqa_backend` needs from this vLLM and does not find, or None: the FlashInfer backend's classes, the
    XQA scale hook of its implementation (`get_xqa_bmm1_scale`, its cached `bmm2_scale`), the name its forward
    calls XQA decode by and the registry's CUSTOM backend. No public API lets a backend pass XQA its scales another
    way."""
    try:
        from vllm.v1.attention.backends import flashinfer as flashinfer_backend
        from vllm.v1.attention.backends.flashinfer import FlashInferImpl, FlashInferMetadataBuilder  # noqa: F401
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend  # noqa: F401
    except ImportError as exc:
        return f"this vLLM has no FlashInfer attention backend to build on ({exc})"
    if not hasattr(FlashInferImpl, "get_xqa_bmm1_scale") or "CUSTOM" not in AttentionBackendEnum.__members__:
        return "this vLLM's FlashInfer backend has no XQA scale hook or no CUSTOM backend (tested: vLLM 0.26, 0.31)"
    if not any(hasattr(flashinfer_backend, name) for name, _ in XQA_DECODE_NAMES):
        return f"this vLLM's FlashInfer backend calls XQA by none of {[n for n, _ in XQA_DECODE_NAMES]}"
    return None


def forget_flashinfer_availability() -> None:
    """Make vLLM re-read whether FlashInfer's precompiled kernels are there (`VLLM_HAS_FLASHINFER_CUBIN`): it caches
    the answer, and whether TRT-LLM attention (XQA on Hopper) can run, on first read (`functools.cache`)."""
    from vllm.utils import flashinfer as vllm_flashinfer

    for name in ("has_flashinfer_cubin", "has_nvidia_artifactory", "supports_trtllm_attention", "has_flashinfer"):
        cache_clear = getattr(getattr(vllm_flashinfer, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()


def register_custom_attention(class_path: str = LIVE_SCALE_BACKEND) -> str | None:
    """Register `class_path` as vLLM's CUSTOM attention backend (`register_backend`, vLLM's API for out-of-tree
    backends). Returns the class path another package registered there, which is kept, or None."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    try:
        current = AttentionBackendEnum.CUSTOM.get_path()
    except ValueError:  # nothing registered yet
        current = None
    if current not in (None, class_path):
        return current
    register_backend(AttentionBackendEnum.CUSTOM, class_path)
    return None
