"""`FP8Tuning`: the kernel selectors and benchmark knobs of an FP8 run, kept out of the trainer's config
(`FP8GRPOTrainer(..., tuning=FP8Tuning(...))`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from trl_fp8.config import (
    BLOCK,
    EXPERTS_GEMMS,
    LAYER_OPTION_FIELDS,
    VLLM_ACT_QUANT_KERNELS,
    VLLM_FP8_KV_ATTENTIONS,
    VLLM_NORM_QUANT_KERNELS,
    check_layer_options,
)
from trl_fp8.field_docs import field_help

__all__ = ["FP8Tuning"]

# `FP8Tuning`'s fields that set up vLLM rollouts, with their defaults (a run without vLLM must leave them so).
VLLM_DEFAULTS = (
    ("vllm_act_quant_kernel", "auto"),
    ("vllm_norm_quant_kernel", "auto"),
    ("vllm_fp8_kv_attention", "auto"),
    ("vllm_deepgemm_workers", None),
)
# `FP8LinearConfig`'s fields that `FP8Tuning` holds (the others are the trainer config's), by `FP8LinearConfig`'s name.
TUNING_LAYER_OPTIONS = ("fuse_sibling_gemms", "fuse_swiglu", "experts_gemm")


@dataclass(frozen=True)
class FP8Tuning:
    r"""Options for benchmarks and experiments: which kernels and launch details an FP8 run uses where the results
    are the same either way. Their defaults are what the measurements chose (the documentation's "Benchmarks" page);
    a run that sets none of them gets those. Give them to the trainer, beside its config:
    `FP8GRPOTrainer(model, reward_funcs, args, tuning=FP8Tuning(fuse_swiglu=True))`.

    Frozen, so one object stands for a run's tuning wherever it is read (the run's plan keeps it: `plan.tuning`).
    Its own rules are checked when it is built; the rules that combine it with the run's config
    (`FP8Tuning.check(args)`) when the trainer starts, before the model loads.

    Args:
        fuse_sibling_gemms (bool): Run q/k/v and gate/up, which read one input, as one FP8 GEMM per pass on their
            stacked weight blocks (fewer, larger kernels; the same FP8 bytes synced and exported). Off by default:
            it pays where separate small layers are host-bound, not yet in a whole training step.
        fuse_swiglu (bool): In gated SiLU MLPs, form `silu(gate) * up` and quantize it for `down_proj` in one
            kernel, never writing it in BF16 nor keeping `silu(gate)` for backward (the unfused path's values).
            Off by default, like `fuse_sibling_gemms`; it cannot be combined with Liger's SwiGLU.
        experts_gemm (str): Grouped kernel of the mixture-of-experts FProp and DGrad: `"deepgemm"` (vLLM's
            bundled DeepGEMM, Hopper), `"triton"` (ours) or `"auto"` (DeepGEMM where it can run). Same FP8 operands
            either way.
        compile_decoder_layers (bool): Compile each decoder layer in place with `torch.compile` (regional
            compilation: one graph shared by the layers; names, sync and export unchanged). The FP8 ops enter the
            graph whole, so the host no longer issues each quantizer and GEMM: use it where the training phase is
            host-bound. The first steps trace and compile the layer: once for one sequence length, once more with
            the length dynamic. With it on, Liger's kernels are not chosen automatically.
        fsdp2_prefetch_layers (int | None): Under FSDP2, all-gather each decoder layer's weights this many layers
            before it runs, in forward and in backward (FSDP2's `set_modules_to_forward_prefetch` and
            `set_modules_to_backward_prefetch`). `None`: FSDP2's own, one layer ahead once the host reaches it. FP8
            layers compute faster than BF16 ones, which leaves more of each gather exposed; every layer of lead
            holds one more layer's gathered weights.
        ddp_gradient_as_bucket_view (bool): Under DDP, let each gradient live in DDP's all-reduce bucket instead of
            beside a copy of it (PyTorch's `gradient_as_bucket_view`): two bytes per BF16 parameter given back, 16 GB
            at 8B, the same gradients.
        vllm_act_quant_kernel (str): Which kernel runs a colocated FP8 engine's fused SiLU-and-mul + FP8 activation
            quantization (`down_proj`'s input, dense and expert MLPs): `"auto"` runs trl-fp8's Triton kernel where,
            checked on the GPU at engine start, it writes vLLM's own kernel's bits and takes less time (the start-up
            log says which, with both times), else vLLM's; `"trl_fp8"` runs trl-fp8's wherever it writes vLLM's bits,
            faster or not; `"vllm"` always keeps vLLM's. The values are the same either way. A `trl vllm-serve`
            server runs vLLM's.
        vllm_norm_quant_kernel (str): Which kernel runs a colocated FP8 engine's fused RMSNorm (with or without the
            residual add) + FP8 activation quantization (the input of q/k/v and gate/up after each layer's norms):
            `"auto"` runs trl-fp8's Triton kernel where, checked on the GPU at engine start, it writes vLLM's own
            kernel's bits (FP8 values, scales and the updated residual) and takes less time (the start-up log says
            which, with both times), else vLLM's; `"trl_fp8"` runs trl-fp8's wherever it writes vLLM's bits, faster
            or not; `"vllm"` always keeps vLLM's. The values are the same either way. A `trl vllm-serve` server runs
            vLLM's.
        vllm_fp8_kv_attention (str): Which kernel of a colocated engine attends over its FP8 KV cache
            (`fp8_kv_cache=True`) at decode: `"auto"` runs FlashInfer's XQA where it builds and, checked on the GPU at
            engine start, follows the scales of every sync (Hopper, with nvcc; the start-up log says which and why),
            else FlashAttention-3; `"xqa"` insists on XQA; `"flash_attn"` keeps FlashAttention-3. Both read the
            pushed scales; XQA takes about two thirds of FlashAttention-3's time on the FP8 cache at 1-2k tokens. A `trl
            vllm-serve` server runs the backend it was started with (`--attention-backend CUSTOM` for XQA).
        vllm_deepgemm_workers (int | None): Processes that compile DeepGEMM's kernels side by side before the
            colocated engine starts, into the config's `vllm_jit_cache_dir` (vLLM's own warm-up compiles them one at
            a time: minutes for an 8B model on a cold cache). `None`: one per CPU core, at most 16; `0`: leave it all
            to vLLM's warm-up. A cache that already holds them is not compiled again.
    """

    # (each field's `help`, for a script that parses it beside the config: examples/grpo_fp8.py)
    fuse_sibling_gemms: bool = field(default=False, metadata=field_help(__doc__, "fuse_sibling_gemms"))
    fuse_swiglu: bool = field(default=False, metadata=field_help(__doc__, "fuse_swiglu"))
    experts_gemm: str = field(default="auto", metadata=field_help(__doc__, "experts_gemm"))
    compile_decoder_layers: bool = field(default=False, metadata=field_help(__doc__, "compile_decoder_layers"))
    fsdp2_prefetch_layers: int | None = field(default=None, metadata=field_help(__doc__, "fsdp2_prefetch_layers"))
    ddp_gradient_as_bucket_view: bool = field(
        default=True, metadata=field_help(__doc__, "ddp_gradient_as_bucket_view")
    )
    vllm_act_quant_kernel: str = field(default="auto", metadata=field_help(__doc__, "vllm_act_quant_kernel"))
    vllm_norm_quant_kernel: str = field(default="auto", metadata=field_help(__doc__, "vllm_norm_quant_kernel"))
    vllm_fp8_kv_attention: str = field(default="auto", metadata=field_help(__doc__, "vllm_fp8_kv_attention"))
    vllm_deepgemm_workers: int | None = field(default=None, metadata=field_help(__doc__, "vllm_deepgemm_workers"))

    def __post_init__(self):
        if self.experts_gemm not in EXPERTS_GEMMS:
            raise ValueError(f"FP8Tuning(experts_gemm={self.experts_gemm!r}) is unknown; use one of {EXPERTS_GEMMS}.")
        for name, known in (("vllm_act_quant_kernel", VLLM_ACT_QUANT_KERNELS),
                            ("vllm_norm_quant_kernel", VLLM_NORM_QUANT_KERNELS),
                            ("vllm_fp8_kv_attention", VLLM_FP8_KV_ATTENTIONS)):  # fmt: skip
            if getattr(self, name) not in known:
                raise ValueError(f"FP8Tuning({name}={getattr(self, name)!r}) is unknown; use one of {known}.")
        if self.vllm_deepgemm_workers is not None and self.vllm_deepgemm_workers < 0:
            raise ValueError(
                f"FP8Tuning(vllm_deepgemm_workers={self.vllm_deepgemm_workers}) must be >= 0 (0: no parallel "
                "compilation; unset: one process per CPU core)."
            )
        if self.fsdp2_prefetch_layers is not None and self.fsdp2_prefetch_layers < 1:
            raise ValueError(
                f"FP8Tuning(fsdp2_prefetch_layers={self.fsdp2_prefetch_layers}): give 1 or more layers, or leave it "
                "unset for FSDP2's own prefetch."
            )
        fusions = [f"{name}=True" for name in ("fuse_sibling_gemms", "fuse_swiglu") if getattr(self, name)]
        if self.compile_decoder_layers and fusions:
            raise ValueError(
                f"FP8Tuning({', '.join(fusions)}) fuses eager FP8 layers, but compile_decoder_layers=True traces each "
                "decoder layer into one graph, where its FP8 layers run unfused: the fusion would never run. Drop "
                f"{' and '.join(fusions)}, or set compile_decoder_layers=False."
            )

    @classmethod
    def of(cls, tuning: FP8Tuning | None) -> FP8Tuning:
        """`tuning`, or the defaults where None; a TypeError for anything else."""
        if tuning is None:
            return cls()
        if not isinstance(tuning, FP8Tuning):
            raise TypeError(f"tuning must be a trl_fp8.FP8Tuning, got {type(tuning).__name__}.")
        return tuning

    def layer_options(self, args) -> SimpleNamespace:
        """The FP8 layers' options of a run (`FP8LinearConfig`'s fields): the config's (`args`) and this tuning's."""
        cache = args.fp8_cache_weights is not False
        return SimpleNamespace(recipe=args.fp8_recipe, backend=args.fp8_backend, block_size=BLOCK,
                               power_of_two_scales=args.fp8_power_of_two_scales, cache_quantized_weight=cache,
                               cache_with_grad=True, **{name: getattr(self, name) for name in TUNING_LAYER_OPTIONS})  # fmt: skip

    def check(self, args) -> None:
        """Refuse, naming the fix, a tuning option that the run's config `args` (an `FP8GRPOConfig` or
        `FP8RLOOConfig`, checked already) would ignore or cannot combine with it."""
        from trl_fp8.distributed import weight_sharding

        if not args.use_vllm:
            for name, default in VLLM_DEFAULTS:
                if getattr(self, name) != default:
                    raise ValueError(
                        f"FP8Tuning({name}={getattr(self, name)!r}) sets up vLLM rollouts, but use_vllm=False: the "
                        f"trainer generates with its own model. Set use_vllm=True, or drop {name}."
                    )
        if args.fp8_recipe is None:
            for name, default in (("fuse_sibling_gemms", False), ("fuse_swiglu", False), ("experts_gemm", "auto")):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"FP8Tuning({name}={getattr(self, name)!r}) sets up FP8 training, but fp8_recipe=None trains "
                        f"in BF16. Drop {name}, or train in FP8 with fp8_recipe='blockwise'."
                    )
        elif self.fuse_swiglu and args.use_liger_kernel and (args.liger_kernel_config or {}).get("swiglu", True):
            raise ValueError(
                "FP8Tuning(fuse_swiglu=True) and use_liger_kernel=True both replace the gated MLP's forward, and "
                "Liger's, applied later, would win: the fused FP8 path would never run. Keep Liger's other kernels "
                "with liger_kernel_config={'swiglu': False}, or drop fuse_swiglu."
            )
        if self.experts_gemm != "auto" and args.fp8_keep_experts_in_bf16:
            raise ValueError(
                f"FP8Tuning(experts_gemm={self.experts_gemm!r}) picks the GPU kernel of FP8 experts, but "
                "fp8_keep_experts_in_bf16=True keeps the experts in BF16. Drop experts_gemm."
            )
        if args.fp8_recipe is not None:  # the FP8 layers' own rules, written once (`trl_fp8.config`)
            names = {field: f"FP8Tuning.{field}" for field in TUNING_LAYER_OPTIONS}
            check_layer_options(self.layer_options(args),
                                name=lambda field: names.get(field) or LAYER_OPTION_FIELDS.get(field, field))  # fmt: skip
        if self.fsdp2_prefetch_layers is not None and weight_sharding(args) != "FSDP2":
            raise ValueError(
                f"FP8Tuning(fsdp2_prefetch_layers={self.fsdp2_prefetch_layers}) sets FSDP2's all-gathers, but this "
                "launch does not shard with FSDP2 (accelerate launch --config_file fsdp2.yaml, or "
                "fsdp_config={'version': 2}). Drop it."
            )
        if self.vllm_fp8_kv_attention != "auto" and args.use_vllm:
            if args.fp8_kv_cache is False:  # None: the run's plan decides, and the option holds where it is on
                raise ValueError(
                    f"FP8Tuning(vllm_fp8_kv_attention={self.vllm_fp8_kv_attention!r}) picks the attention kernel of "
                    "an FP8 KV cache, but fp8_kv_cache=False. Set fp8_kv_cache=True, or drop vllm_fp8_kv_attention."
                )
            if args.vllm_mode == "server":
                raise ValueError(
                    f"FP8Tuning(vllm_fp8_kv_attention={self.vllm_fp8_kv_attention!r}) picks a kernel of a colocated "
                    "engine; a `trl vllm-serve` server runs the attention backend it was started with "
                    "(--attention-backend CUSTOM: XQA; FLASH_ATTN: FlashAttention-3). Drop vllm_fp8_kv_attention."
                )
        for name in ("vllm_act_quant_kernel", "vllm_norm_quant_kernel"):
            kernel = getattr(self, name)
            if kernel == "auto" or not args.use_vllm:
                continue
            if args.rollout_precision != "fp8":
                raise ValueError(
                    f"FP8Tuning({name}={kernel!r}) picks a kernel of rollout_precision='fp8' rollouts, but "
                    f"rollout_precision={args.rollout_precision!r}. Drop {name} or use rollout_precision='fp8'."
                )
            if args.vllm_mode == "server":
                raise ValueError(
                    f"FP8Tuning({name}={kernel!r}) picks a kernel of a colocated engine; a `trl vllm-serve` server "
                    f"runs the kernels it was started with. Drop {name}, or use vllm_mode='colocate'."
                )
