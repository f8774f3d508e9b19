"""Frozen configuration for FP8 linear layers: what to quantize and how, which layers, no logic beyond validation."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

BLOCK = 128
"""Edge of the FP8 weight blocks (128x128) and length of the activation and gradient groups (1x128): the block of
vLLM / DeepSeek-V3 block-FP8 checkpoints, and the only one cuBLAS's and DeepGEMM's blockwise GEMMs take."""

# FP8 training recipes: ours, and torchao's two (training only; rollouts still get block-FP8 weights).
BLOCKWISE = "blockwise"
TENSORWISE = "tensorwise"
ROWWISE = "rowwise"
RECIPES = (BLOCKWISE, TENSORWISE, ROWWISE)
BACKENDS = ("auto", "scaled_mm", "deepgemm", "emulated")
# vLLM rollout weights: ours in FP8 (unified), BF16, or BF16 quantized by vLLM itself.
ROLLOUT_PRECISIONS = ("fp8", "bf16", "fp8_online")
# vLLM kernels for the rollout engine's block-FP8 linear layers ("auto": DeepGEMM on Hopper when it can run).
VLLM_FP8_BACKENDS = ("auto", "deepgemm", "cutlass", "triton")
# vLLM kernels for the rollout engine's block-FP8 experts ("auto": vLLM's own choice, Triton's fused MoE on Hopper at
# tensor parallel 1), by our names; `rollout.vllm.kernels.VLLM_MOE_BACKEND` maps them to vLLM's `moe_backend`.
VLLM_FP8_MOE_BACKENDS = ("auto", "triton", "deepgemm", "flashinfer_cutlass")
# vLLM MoE kernels that vLLM will not run on block-FP8 experts, and why.
UNAVAILABLE_VLLM_FP8_MOE_BACKENDS = {
    "cutlass": "vLLM 0.26 turns its CUTLASS FP8 MoE kernel off for block-FP8 models (its `Fp8MoEMethod` passes "
    "`allow_vllm_cutlass=False`), and the engine would stop at start-up ('vLLM CUTLASS FP8 MoE backend is disabled "
    "for this configuration')",
}
# Kernel of the engine's fused SiLU-and-mul + FP8 quantization ("auto": trl-fp8's where it gives vLLM's bits faster;
# "trl_fp8": trl-fp8's wherever it gives vLLM's bits; "vllm": vLLM's).
VLLM_ACT_QUANT_KERNELS = ("auto", "trl_fp8", "vllm")
VLLM_FP8_KV_ATTENTIONS = ("auto", "xqa", "flash_attn")  # `rollout.vllm.attention`
# Kernel of the engine's fused RMSNorm (+ residual add) + FP8 quantization, the same choices.
VLLM_NORM_QUANT_KERNELS = VLLM_ACT_QUANT_KERNELS
# Kernels of the mixture-of-experts FProp and DGrad ("auto": DeepGEMM's grouped GEMM on Hopper when it can run).
EXPERTS_GEMMS = ("auto", "deepgemm", "triton")


# vLLM whose workers can reload weights layer by layer into a running FP8 engine.
MIN_VLLM_VERSION = (0, 26)


def check_vllm_fp8_moe_backend(name: str) -> str:
    """`name` if it is one of `VLLM_FP8_MOE_BACKENDS`; else raise naming the fix."""
    if name in UNAVAILABLE_VLLM_FP8_MOE_BACKENDS:
        raise ValueError(
            f"vllm_fp8_moe_backend={name!r}: {UNAVAILABLE_VLLM_FP8_MOE_BACKENDS[name]}. Use 'auto' (vLLM's choice, its "
            "Triton fused MoE on Hopper) or 'deepgemm'."
        )
    if name not in VLLM_FP8_MOE_BACKENDS:
        raise ValueError(f"vllm_fp8_moe_backend={name!r} is unknown; use one of {VLLM_FP8_MOE_BACKENDS}.")
    return name


def check_vllm_version() -> str:
    """Raise naming the fix unless a vLLM with layerwise `reload_weights` (0.26+) is installed; return its version.

    Reads the installed metadata instead of importing vLLM, so it is cheap enough for config validation and leaves
    vLLM's import-time settings to whoever builds the engine.
    """
    import importlib.metadata
    import importlib.util

    from packaging.version import Version

    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        spec = importlib.util.find_spec("vllm")
        version = getattr(__import__("vllm"), "__version__", None) if spec is not None else None
    if version is None:
        raise ImportError(
            "use_vllm=True needs vLLM: pip install 'trl-fp8[vllm]' (vLLM >= 0.26 with layerwise weight reload)."
        )
    if Version(version).release[:2] < MIN_VLLM_VERSION:
        raise ImportError(
            f"vLLM {version} cannot refresh the weights of a running FP8 engine (layerwise reload_weights "
            "arrived in 0.26). Upgrade: pip install 'trl-fp8[vllm]'."
        )
    return version


def check_rollout_precision(rollout_precision: str) -> str:
    if rollout_precision not in ROLLOUT_PRECISIONS:
        raise ValueError(f"rollout_precision={rollout_precision!r} is unknown; use one of {ROLLOUT_PRECISIONS}.")
    return rollout_precision


# `FP8LinearConfig`'s fields as the trainers' configs call them (`FP8GRPOConfig`, `FP8RLOOConfig`).
# (`FP8LinearConfig`'s fuse_sibling_gemms, fuse_swiglu and experts_gemm are `FP8Tuning`'s, `trl_fp8.tuning`.)
LAYER_OPTION_FIELDS = {"recipe": "fp8_recipe", "backend": "fp8_backend", "power_of_two_scales": "fp8_power_of_two_scales",
                       "cache_quantized_weight": "fp8_cache_weights"}  # fmt: skip


def check_layer_options(options, name: Callable[[str], str] = str) -> None:
    """The rules of the FP8 layers' options, written once: `options` has `FP8LinearConfig`'s fields (the config, or
    the trainer config's view of its own fields under those names); each error names an option `name(field)`, so the
    trainer's config says `fp8_backend` where `FP8LinearConfig` says `backend`."""
    recipe, backend, experts_gemm = options.recipe, options.backend, options.experts_gemm
    for field_name, value, known in (("recipe", recipe, RECIPES), ("backend", backend, BACKENDS),
                                     ("experts_gemm", experts_gemm, EXPERTS_GEMMS)):  # fmt: skip
        if value not in known:
            raise ValueError(f"{name(field_name)}={value!r} is unknown; use one of {known}.")
    if recipe == BLOCKWISE and options.block_size != BLOCK:
        raise ValueError(
            f"block_size={options.block_size} is not supported: cuBLAS blockwise FP8 GEMMs and vLLM block-FP8 "
            f"checkpoints use {BLOCK}. Set block_size={BLOCK}."
        )
    if backend == "emulated" and experts_gemm != "auto":
        raise ValueError(
            f"{name('experts_gemm')}={experts_gemm!r} picks a GPU kernel of the FP8 experts, but "
            f"{name('backend')}='emulated' runs them one expert at a time in the emulation. Drop "
            f"{name('experts_gemm')}, or use {name('backend')}='auto' or 'scaled_mm'."
        )
    if not options.cache_with_grad and not options.cache_quantized_weight:
        raise ValueError(
            "cache_with_grad=False limits the FP8 weight cache to forwards without gradients, but "
            f"{name('cache_quantized_weight')}=False keeps no cache at all. Drop cache_with_grad."
        )
    if recipe == BLOCKWISE:
        return
    use_blockwise = f"use {name('recipe')}='blockwise'"
    if backend in ("scaled_mm", "deepgemm"):
        raise ValueError(
            f"{name('backend')}={backend!r} picks the kernels of the blockwise recipe; torchao's {recipe!r} recipe "
            f"runs its own. Use {name('backend')}='auto' (or 'emulated'), or {use_blockwise}."
        )
    for fusion in ("fuse_sibling_gemms", "fuse_swiglu"):
        if getattr(options, fusion):
            raise ValueError(
                f"{name(fusion)} applies to the blockwise recipe only; torchao's {recipe!r} recipe runs each layer "
                f"on its own. Drop {name(fusion)}, or {use_blockwise}."
            )
    if options.power_of_two_scales:
        raise ValueError(
            f"{name('power_of_two_scales')} applies to the blockwise recipe only; torchao's rowwise recipe already "
            f"rounds its scales to powers of two. Drop {name('power_of_two_scales')}, or {use_blockwise}."
        )
    if experts_gemm != "auto":
        raise ValueError(
            f"{name('experts_gemm')}={experts_gemm!r} picks the kernel of the blockwise recipe's FP8 experts; "
            f"torchao's {recipe!r} recipe has none (mixture-of-experts layers stay in BF16). Drop "
            f"{name('experts_gemm')}, or {use_blockwise}."
        )
    if not options.cache_quantized_weight:
        raise ValueError(
            f"{name('cache_quantized_weight')}=False turns off the blockwise layers' FP8 weight cache; torchao's "
            f"{recipe!r} layers keep no such cache. Drop {name('cache_quantized_weight')}, or {use_blockwise}."
        )


@dataclass(frozen=True)
class FP8LinearConfig:
    """How an FP8 linear layer quantizes its GEMM operands.

    Frozen (hashable) so it can be shared by every converted layer and traced by `torch.compile`.

    Args:
        recipe: `"blockwise"` (ours: 128x128 weight blocks, 1x128 activation and gradient groups, all three GEMMs
            in FP8 e4m3, the Jet-RL/DeepSeek-V3 recipe that vLLM block-FP8 checkpoints use), or torchao's own
            `"tensorwise"` / `"rowwise"` recipes (training only; rollouts still get block-FP8 weights).
        block_size: edge of weight blocks and length of activation groups. vLLM and cuBLAS only support 128.
        power_of_two_scales: round each scale down to a power of two (DeepSeek/NeMo style) so scaling is exact in
            binary; costs up to one bit of range per block.
        backend: `"scaled_mm"` runs real FP8 GEMMs (`torch.nn.functional.scaled_mm`, Hopper/SM90 for blockwise),
            `"emulated"` quantizes, dequantizes and multiplies in fp32 (exact emulation; any device), `"auto"`
            picks `scaled_mm` on SM90 CUDA tensors and `emulated` elsewhere. `"deepgemm"` (SM90, needs vLLM's
            bundled DeepGEMM) runs FProp and DGrad on DeepGEMM and WGrad as `scaled_mm`: opt-in, faster per layer
            at the cost of just-in-time compiles in the first step (`ops/deep_gemm.py`;
            docs/contributing/benchmark-details.md).
        cache_quantized_weight: keep the FP8 copy of each weight between calls until the weight changes
            (optimizer step), so micro-batches, log-prob passes and the vLLM weight sync quantize once per step.
            Costs one byte per parameter.
        cache_with_grad: with the cache on, keep it through forwards that record gradients for a trainable weight.
            `False`: such a forward lets go of the layer's cached copy and quantizes the weight for itself, so the
            memory peak of a training step (gradients, activations) holds no FP8 copies, while the forwards without
            gradients (scoring rollouts, evaluation) and the vLLM sync still share one quantization per optimizer
            step. Frozen weights (a LoRA base) stay cached either way.
        fuse_sibling_gemms: run layers that read one input and that vLLM fuses (q/k/v, gate/up) as one FP8 GEMM
            per pass on their stacked weight blocks (`trl_fp8.nn.sibling_gemms`): a third of the kernel launches for
            q/k/v, the same values per layer up to fp32 summation order, the same FP8 bytes synced and exported.
        fuse_swiglu: in gated MLPs with SiLU (`down_proj(silu(gate_proj(x)) * up_proj(x))`), form the product and
            quantize it for `down_proj` in one kernel, never writing it in BF16, and recompute `silu(gate)` in
            backward instead of keeping it (`trl_fp8.nn.fused_swiglu`): the unfused FP8 path's values.
        experts_gemm: the grouped kernel of mixture-of-experts FProp and DGrad on the GPU: `"deepgemm"` (vLLM's
            bundled DeepGEMM m-grouped GEMM, SM90), `"triton"` (ours, `trl_fp8.kernels.grouped_gemm`), or `"auto"`
            (DeepGEMM where it can run, else Triton). Same FP8 operands either way; WGrad is always ours.
        fuse_wgrad_accumulation: FP8 experts add their weight gradient into the weight's existing `.grad` in the
            WGrad kernel (reading and writing it once) instead of returning it for autograd to add (written, then
            both read and the sum written): the micro-batches after the first of a gradient accumulation. Only where
            nothing else watches a parameter's gradient: one process, no DDP, FSDP or DeepSpeed, whose hooks would not
            fire (`FP8GRPOTrainer` turns it on there). A weight whose `.grad` is missing or hooked gets its
            gradient returned as usual.
    """

    recipe: str = BLOCKWISE
    block_size: int = BLOCK
    power_of_two_scales: bool = False
    backend: str = "auto"
    cache_quantized_weight: bool = True
    cache_with_grad: bool = True
    fuse_sibling_gemms: bool = False
    fuse_swiglu: bool = False
    experts_gemm: str = "auto"
    fuse_wgrad_accumulation: bool = False

    def __post_init__(self):
        check_layer_options(self)

    @property
    def dim_multiple(self) -> int:
        """Linear dims must be multiples of this for the recipe to apply."""
        return self.block_size if self.recipe == BLOCKWISE else 16


@dataclass(frozen=True)
class LayerSelection:
    """Which layers a conversion keeps in high precision on purpose (`convert_to_fp8(model, selection=...)`).

    Frozen, so one object can stand for a run's layer choices wherever they are applied (training, rollouts, export).

    Args:
        num_first_layers_in_bf16: decoder layers kept in BF16 at the input end (counted from the `layers.<i>.` index
            in module names).
        num_last_layers_in_bf16: decoder layers kept in BF16 at the output end.
        module_filter_fn: `fn(module, fqn)` returning False for a linear or expert layer to keep in high precision.
        keep_experts_in_bf16: keep every mixture-of-experts expert layer in BF16 (also for layouts FP8 experts do not
            handle, which otherwise raise).
    """

    num_first_layers_in_bf16: int = 0
    num_last_layers_in_bf16: int = 0
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None
    keep_experts_in_bf16: bool = False

    def __post_init__(self):
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int >= 0, got {value!r}.")
            if value < 0:
                raise ValueError(f"{name}={value} keeps a negative number of layers in BF16: it must be >= 0.")
        if self.module_filter_fn is not None and not callable(self.module_filter_fn):
            raise TypeError(
                f"module_filter_fn must be a callable fn(module, fqn) -> bool, got {self.module_filter_fn!r}."
            )

    @classmethod
    def of(cls, selection: LayerSelection | None = None, **options) -> LayerSelection:
        """`selection`, or one made of `options` (its fields by keyword, the older spelling); not both at once."""
        loose = cls(**options)
        if selection is None:
            return loose
        if not isinstance(selection, LayerSelection):
            raise TypeError(f"selection must be a LayerSelection, got {type(selection).__name__}.")
        defaults = cls()
        if given := [name for name, value in options.items() if value != getattr(defaults, name)]:
            raise ValueError(f"Layer options given twice, in `selection` and as {', '.join(given)}: pass one of them.")
        return selection
