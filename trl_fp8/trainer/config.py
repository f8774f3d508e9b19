"""The trainers' configs: `FP8TrainingArguments` (the FP8 fields every trainer shares) on top of TRL's `GRPOConfig`
(`FP8GRPOConfig`, with TIS) and `RLOOConfig` (`FP8RLOOConfig`)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field, fields

from trl import GRPOConfig, RLOOConfig

from trl_fp8 import config as fp8_config
from trl_fp8.config import (
    BACKENDS,
    BLOCKWISE,
    EXPERTS_GEMMS,
    RECIPES,
    VLLM_ACT_QUANT_KERNELS,
    VLLM_FP8_BACKENDS,
    FP8LinearConfig,
    check_rollout_precision,
)
from trl_fp8.trainer.requirements import check_liger_installed, check_optimizer_installed

TIS_MODES = ("auto", "token", "off")
# TRL's importance-sampling fields, which tis="token" sets and tis="auto" leaves to a user who set them
TRL_IS_FIELDS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                 "vllm_importance_sampling_cap")  # fmt: skip


@dataclass
class FP8TrainingArguments:
    r"""The FP8 fields that `FP8GRPOConfig` and `FP8RLOOConfig` add to TRL's configs: the precision flow, vLLM
    rollouts on the trainer's FP8 weights, and saving.

    **The FP8 precision flow.** Which layers train in FP8, with which recipe and kernels.

    Args:
        fp8_recipe (str | None): `"blockwise"` (128x128 weights, 1x128 activations and gradients, all three GEMMs in
            FP8: the Jet-RL unified flow that rollouts share), torchao's `"tensorwise"` or `"rowwise"`, or `None` to
            train in BF16 (the same script then runs the BF16 baseline).
        num_first_layers_in_bf16 (int): Decoder layers at the input end kept in BF16.
        num_last_layers_in_bf16 (int): Decoder layers at the output end kept in BF16.
        fp8_keep_experts_in_bf16 (bool): Mixture-of-experts models: keep the expert layers in BF16 (attention stays
            FP8). Needed for an expert layout trl-fp8 cannot run in FP8, which otherwise raises naming it.
        fp8_power_of_two_scales (bool): Round blockwise scales down to powers of two (DeepSeek / NeMo RL style).
        fp8_backend (str): `"scaled_mm"` (real FP8 kernels, SM90), `"emulated"` (exact emulation, any device) or
            `"auto"` (`scaled_mm` on SM90, emulated elsewhere). `"deepgemm"` (SM90 with vLLM's DeepGEMM: FProp and
            DGrad on DeepGEMM) is opt-in: a slightly faster training phase, for just-in-time compiles of the
            training GEMMs' shapes in the first step.
        fp8_cache_weights (bool | None): Keep each layer's FP8 weight between forwards until the optimizer changes
            it (one byte per parameter), so micro-batches, scoring passes and the vLLM sync quantize once per step.
            `False` quantizes at every forward instead (one read of the weights per forward). `None` (default): kept
            for the forwards without gradients (scoring the rollouts) and the vLLM sync, let go as the training
            micro-batches start, which quantize at every forward: the training peak then holds no FP8 copy, for a
            peak no higher than BF16's (`FP8LinearConfig.cache_with_grad=False`). Off under FSDP2, whose point is
            not to hold whole weights, and where the memory planner puts one GPU's training peak with the cache above
            90% of the GPU; kept through the micro-batches off a GPU, which has no GPU memory to spare. `True`
            keeps it through the training micro-batches too.
        fp8_fuse_sibling_gemms (bool): Run q/k/v and gate/up, which read one input, as one FP8 GEMM per pass on their
            stacked weight blocks (fewer, larger kernels; the same FP8 bytes synced and exported). Off by default:
            it pays where separate small layers are host-bound, not yet in a whole training step.
        fp8_fuse_swiglu (bool): In gated SiLU MLPs, form `silu(gate) * up` and quantize it for `down_proj` in one
            kernel, never writing it in BF16 nor keeping `silu(gate)` for backward (the unfused path's values).
            Off by default, like `fp8_fuse_sibling_gemms`; it cannot be combined with Liger's SwiGLU.
        fp8_experts_gemm (str): Grouped kernel of the mixture-of-experts FProp and DGrad: `"deepgemm"` (vLLM's
            bundled DeepGEMM, Hopper), `"triton"` (ours) or `"auto"` (DeepGEMM where it can run). Same FP8 operands
            either way.
        compile_decoder_layers (bool): Compile each decoder layer in place with `torch.compile` (regional
            compilation: one graph shared by the layers; names, sync and export unchanged). The FP8 ops enter the
            graph whole, so the host no longer issues each quantizer and GEMM: use it where the training phase is
            host-bound. The first steps trace and compile the layer: once for one sequence length, once more with
            the length dynamic.
        fsdp2_prefetch_layers (int | None): Under FSDP2, all-gather each decoder layer's weights this many layers
            before it runs, in forward and in backward (FSDP2's `set_modules_to_forward_prefetch` and
            `set_modules_to_backward_prefetch`). `None`: FSDP2's own, one layer ahead once the host reaches it. FP8
            layers compute faster than BF16 ones, which leaves more of each gather exposed; every layer of lead
            holds one more layer's gathered weights.
        logprob_batch_size (int | None): Sequences per forward when the trainer scores rollouts without gradients (old
            and reference log-probs, the mismatch metrics), as NeMo RL's `logprob_batch_size` and veRL's
            `log_prob_micro_batch_size_per_gpu`. `None`: TRL's `per_device_train_batch_size`. Nothing is kept for
            backward and TRL's log-prob head never holds whole logits, so a larger batch costs little memory; it runs
            fewer, larger GEMMs and, under FSDP2, gathers every weight fewer times. (Where GRPO's
            `score_in_training_forward` leaves the old log-probs and the metrics to the micro-batches, only the
            reference model scores this way.)
        ddp_gradient_as_bucket_view (bool): Under DDP, let each gradient live in DDP's all-reduce bucket instead of
            beside a copy of it (PyTorch's `gradient_as_bucket_view`): two bytes per BF16 parameter given back, 16 GB
            at 8B, the same gradients.
        use_liger_kernel (bool | None): Liger's fused RMSNorm, RoPE and SwiGLU kernels on the model (transformers' and
            TRL's option). `None`: decided at start-up, on for a dense Llama, Mistral, Qwen2 or Qwen3 model trained on a
            CUDA GPU with liger-kernel installed, in blockwise FP8 or BF16, `compile_decoder_layers` off (they take the
            BF16 part of the training phase beside the FP8 GEMMs; the speeds with and without them: the documentation's
            "Benchmarks" page, "GRPO with Liger's kernels, compiled layers and the fusions"); the start-up log says
            which, and why.

    **vLLM rollouts** (with `use_vllm=True`).

    Args:
        rollout_precision (str | None): `"fp8"`: vLLM runs the trainer's own block-FP8 weights and scales, pushed at
            every sync (the unified flow; the default with the blockwise recipe). `"bf16"`: BF16 weights (the
            default otherwise). `"fp8_online"`: BF16 weights pushed and quantized by vLLM itself
            (`--quantization fp8`), the BF16-train / FP8-rollout baseline.
        vllm_fp8_backend (str): vLLM kernel for the FP8 linear layers of `rollout_precision="fp8"` rollouts:
            `"deepgemm"` (fastest on Hopper; compiles its kernels with nvcc, once per machine thanks to
            `vllm_jit_cache_dir`), `"cutlass"` or `"triton"`. `"auto"`: DeepGEMM on an SM90 GPU with nvcc, else
            Cutlass, with the reason logged. All keep the trainer's weights and scales bit for bit (vLLM's E8M0
            rounding is switched off). In server mode, start the server with the same kernel (the trainer checks it
            and prints the command).
        vllm_fp8_moe_backend (str): vLLM kernel for the FP8 experts of a mixture of experts in a colocated engine
            (vLLM's `moe_backend`): `"triton"` (vLLM's fused MoE), `"deepgemm"` (DeepGEMM's grouped GEMM; needs the
            linear layers on DeepGEMM too; its warm-up compiles many kernels on a cold cache) or
            `"flashinfer_cutlass"`. `"auto"`: vLLM's own choice (Triton on Hopper at tensor parallel 1), the fastest
            measured (the documentation's "Mixture of experts" page, "Which MoE kernel vLLM runs"). vLLM 0.26 runs no
            CUTLASS MoE kernel on block-FP8 experts (`"cutlass"` is refused). Only Triton is GPU-tested with the
            trainer's experts; the sync checks every engine's expert tensors against the trainer's either way. A
            `trl vllm-serve` server chooses its own.
        vllm_act_quant_kernel (str): Which kernel runs a colocated FP8 engine's fused SiLU-and-mul + FP8 activation
            quantization (`down_proj`'s input, dense and expert MLPs): `"auto"` runs trl-fp8's Triton kernel where,
            checked on the GPU at engine start, it writes vLLM's own kernel's bits and takes less time (the start-up
            log says which, with both times), else vLLM's; `"trl_fp8"` runs trl-fp8's wherever it writes vLLM's bits,
            faster or not; `"vllm"` always keeps vLLM's. The values are the same either way. A `trl vllm-serve`
            server runs vLLM's.
        vllm_jit_cache_dir (str | None): Where DeepGEMM keeps its compiled kernels across runs. `None`:
            `DG_JIT_CACHE_DIR`, else vLLM's `~/.cache/vllm/deep_gemm`.
        vllm_deepgemm_workers (int | None): Processes that compile DeepGEMM's kernels side by side before the
            colocated engine starts, into `vllm_jit_cache_dir` (vLLM's own warm-up compiles them one at a time:
            minutes for an 8B model on a cold cache). `None`: one per CPU core, at most 16; `0`: leave it all to
            vLLM's warm-up. A cache that already holds them is not compiled again.
        vllm_token_ids_only (bool): A colocated engine returns each sampled token's id and log-prob only, all that
            TRL reads: `detokenize=False` and `flat_logprobs=True` are added to `generation_kwargs` (which TRL passes
            to vLLM's `SamplingParams`), unless set there. vLLM's defaults also turn every token into text and keep
            a dict per token, on the engine's thread between decode steps (the host time it takes: the
            documentation's "vLLM rollouts on the trainer's FP8 weights" page, "Token ids and log-probs only"). The
            token ids and log-probs are the same either way. `stop` strings in `generation_kwargs` keep the text. A
            `trl vllm-serve` server answers in OpenAI's format, with text.
        fp8_kv_cache (bool | None): vLLM `kv_cache_dtype="fp8"`, with the q/k/v scales measured on the trainer's
            forward and pushed at every sync (Hopper only). `None`: on for a colocated engine on Hopper in the FP8 flow
            with importance sampling on, where a rollout's sequences would not all fit a BF16 KV cache at once by the
            memory planner's account (`trl-fp8 plan`); there it pays (about twice the sequences decode at once), for
            a larger trainer-vs-rollout mismatch, which TIS corrects. The start-up log says which, and why (the
            documentation's "When FP8 pays" page).

    **Saving.**

    Args:
        save_fp8_checkpoint (bool | None): `save_model()` (and so `push_to_hub()`) writes a block-FP8 checkpoint that
            vLLM and transformers load. Intermediate training checkpoints keep the BF16 master weights so training can
            resume from them. `None`: `True` when training in FP8, `False` for the BF16 baseline (`fp8_recipe=None`),
            which then saves as TRL does.
        save_bf16_master_weights (bool): Also write the high-precision master weights to `<output_dir>/bf16_master`.
    """

    fp8_recipe: str | None = field(
        default=BLOCKWISE,
        metadata={
            "help": "FP8 training recipe: 'blockwise' (128x128 weights, 1x128 activations and gradients, the unified "
            "flow rollouts share), torchao's 'tensorwise' or 'rowwise', or 'none' to train in BF16.",
        },
    )
    num_first_layers_in_bf16: int = field(
        default=0, metadata={"help": "Number of decoder layers at the input end kept in BF16."}
    )
    num_last_layers_in_bf16: int = field(
        default=0, metadata={"help": "Number of decoder layers at the output end kept in BF16."}
    )
    fp8_keep_experts_in_bf16: bool = field(
        default=False,
        metadata={
            "help": "Mixture-of-experts models: keep the expert layers in BF16 (needed for expert layouts "
            "trl-fp8 cannot run in FP8, which otherwise raise)."
        },  # fmt: skip
    )
    fp8_power_of_two_scales: bool = field(
        default=False, metadata={"help": "Round blockwise FP8 scales down to powers of two (DeepSeek/NeMo style)."}
    )
    fp8_backend: str = field(
        default="auto",
        metadata={
            "help": "FP8 GEMM backend: 'scaled_mm' (real FP8 kernels, needs an SM90 GPU), 'emulated' (exact "
            "emulation on any device), 'auto' (scaled_mm on SM90, emulated elsewhere), or 'deepgemm' (SM90 with "
            "vLLM's DeepGEMM for FProp and DGrad; opt-in: slightly faster training, for JIT compiles in the first "
            "step).",
        },
    )
    fp8_cache_weights: bool | None = field(
        default=None,
        metadata={
            "help": "Keep each layer's FP8 weight until the optimizer changes it (1 byte per parameter); False "
            "quantizes at every forward. Default: kept for scoring passes and the vLLM sync, let go during training "
            "micro-batches (a training peak no higher than BF16's); off under FSDP2 or where the memory planner puts "
            "the training peak with it above 90% of the GPU (the start-up log says which, and why). True keeps it "
            "through the micro-batches too.",
        },
    )
    fp8_fuse_sibling_gemms: bool = field(
        default=False,
        metadata={
            "help": "Run q/k/v and gate/up (layers reading one input) as one FP8 GEMM per pass on their stacked "
            "weight blocks: fewer, larger kernels, the same FP8 bytes synced and exported.",
        },
    )
    fp8_fuse_swiglu: bool = field(
        default=False,
        metadata={
            "help": "In gated SiLU MLPs, form silu(gate) * up and quantize it for down_proj in one kernel, without "
            "writing it in BF16 or keeping silu(gate) for backward.",
        },
    )
    fsdp2_prefetch_layers: int | None = field(
        default=None,
        metadata={
            "help": "Under FSDP2: all-gather each decoder layer's weights this many layers before it runs, in forward "
            "and backward. Unset: FSDP2's own prefetch (one layer ahead).",
        },
    )
    logprob_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Sequences per forward when scoring rollouts without gradients (old and reference log-probs). "
            "Unset: per_device_train_batch_size, as TRL does.",
        },
    )
    ddp_gradient_as_bucket_view: bool = field(
        default=True,
        metadata={
            "help": "Under DDP, gradients live in DDP's all-reduce buckets instead of beside a copy (PyTorch's "
            "gradient_as_bucket_view): 2 bytes per BF16 parameter given back, the same gradients.",
        },
    )
    fp8_experts_gemm: str = field(
        default="auto",
        metadata={
            "help": "Grouped kernel of mixture-of-experts FProp and DGrad: 'deepgemm' (vLLM's DeepGEMM, Hopper), "
            "'triton' (ours) or 'auto' (DeepGEMM where it can run).",
        },
    )
    use_liger_kernel: bool | None = field(
        default=None,
        metadata={
            "help": "Liger's RMSNorm, RoPE and SwiGLU kernels on the model. Unset: on for dense Llama, Mistral, "
            "Qwen2 and Qwen3 models trained on a CUDA GPU with liger-kernel installed (the start-up log says which, "
            "and why).",
            # argparse: a bare --use_liger_kernel still means True, as TRL's bool field had it
            "nargs": "?",
            "const": True,
        },
    )
    compile_decoder_layers: bool = field(
        default=False,
        metadata={
            "help": "Compile each decoder layer in place with torch.compile (one graph shared by the layers): the "
            "FP8 ops run inside the graph instead of being issued one by one from Python.",
        },
    )
    rollout_precision: str | None = field(
        default=None,
        metadata={
            "help": "vLLM rollout weights: 'fp8' (the trainer's own block-FP8 weights and scales; default with the "
            "blockwise recipe), 'bf16' (default otherwise) or 'fp8_online' (vLLM quantizes BF16 weights itself).",
        },
    )
    vllm_fp8_backend: str = field(
        default="auto",
        metadata={
            "help": "vLLM kernel for FP8 rollouts: 'deepgemm' (fastest on Hopper, JIT-compiled with nvcc), "
            "'cutlass', 'triton', or 'auto' (DeepGEMM on SM90 with nvcc, else Cutlass).",
        },
    )
    vllm_fp8_moe_backend: str = field(
        default="auto",
        metadata={
            "help": "vLLM kernel for the FP8 experts of a mixture of experts in a colocated engine: 'triton', "
            "'deepgemm', 'flashinfer_cutlass', or 'auto' (vLLM's own choice).",
        },
    )
    vllm_act_quant_kernel: str = field(
        default="auto",
        metadata={
            "help": "Kernel of a colocated FP8 engine's fused SiLU-and-mul + FP8 quantization: 'auto' (trl-fp8's "
            "Triton kernel where it gives vLLM's bits faster, checked at engine start), 'trl_fp8' (trl-fp8's wherever "
            "it gives vLLM's bits) or 'vllm' (vLLM's own).",
        },
    )
    vllm_jit_cache_dir: str | None = field(
        default=None,
        metadata={"help": "DeepGEMM's compiled-kernel cache. Unset: DG_JIT_CACHE_DIR, else ~/.cache/vllm/deep_gemm."},
    )
    vllm_deepgemm_workers: int | None = field(
        default=None,
        metadata={
            "help": "Processes compiling DeepGEMM's kernels in parallel before the colocated engine starts (a cold "
            "cache only). Unset: one per CPU core, at most 16; 0: vLLM's own one-at-a-time warm-up only.",
        },
    )
    vllm_token_ids_only: bool = field(
        default=True,
        metadata={
            "help": "A colocated engine returns token ids and log-probs only (detokenize=False, flat_logprobs=True "
            "in vLLM's SamplingParams, unless generation_kwargs sets them): the same tokens, less host work per "
            "decode step. False keeps vLLM's text and per-token dicts.",
        },
    )
    fp8_kv_cache: bool | None = field(
        default=None,
        metadata={
            "help": "FP8 KV cache in vLLM, with q/k/v scales measured on the trainer's forward every step. Unset: on "
            "for a colocated engine on Hopper in the FP8 flow with importance sampling, where a rollout's sequences "
            "would not all fit a BF16 KV cache at once (the start-up log says which, and why).",
            "nargs": "?",
            "const": True,
        },
    )
    save_fp8_checkpoint: bool | None = field(
        default=None,
        metadata={
            "help": "Make save_model()/push_to_hub() write a block-FP8 checkpoint that vLLM and transformers load. "
            "Unset: on when training in FP8, off for the BF16 baseline (fp8_recipe none).",
        },
    )
    save_bf16_master_weights: bool = field(
        default=False,
        metadata={"help": "Also write the high-precision master weights to <output_dir>/bf16_master."},
    )

    def _check_fp8_fields(self) -> None:
        """Validate and resolve the FP8 fields, before TRL's own `__post_init__` runs."""
        if isinstance(self.fp8_recipe, str) and self.fp8_recipe.lower() in ("none", "null", "bf16", ""):
            self.fp8_recipe = None  # the CLI and YAML pass strings
        if self.fp8_recipe is not None and self.fp8_recipe not in RECIPES:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r} is unknown; use one of {RECIPES} or None for BF16.")
        if self.fp8_backend not in BACKENDS:
            raise ValueError(f"fp8_backend={self.fp8_backend!r} is unknown; use one of {BACKENDS}.")
        if self.fp8_experts_gemm not in EXPERTS_GEMMS:
            raise ValueError(f"fp8_experts_gemm={self.fp8_experts_gemm!r} is unknown; use one of {EXPERTS_GEMMS}.")
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        if self.fp8_power_of_two_scales and self.fp8_recipe not in (BLOCKWISE, None):
            raise ValueError(
                "fp8_power_of_two_scales applies to fp8_recipe='blockwise' only (torchao's rowwise recipe already "
                "uses power-of-two scales). Drop fp8_power_of_two_scales or use the blockwise recipe."
            )
        if isinstance(self.rollout_precision, str) and self.rollout_precision.lower() in ("none", "null", ""):
            self.rollout_precision = None
        if self.rollout_precision is not None:
            check_rollout_precision(self.rollout_precision)
        if self.rollout_precision == "fp8" and self.fp8_recipe not in (BLOCKWISE, None):
            raise ValueError(
                f"rollout_precision='fp8' serves the trainer's block-FP8 weights, but fp8_recipe={self.fp8_recipe!r} "
                "trains with other scales. Use fp8_recipe='blockwise' (the unified flow), or rollout_precision="
                "'fp8_online' / 'bf16'."
            )
        if self.vllm_fp8_backend not in VLLM_FP8_BACKENDS:
            raise ValueError(f"vllm_fp8_backend={self.vllm_fp8_backend!r} is unknown; use one of {VLLM_FP8_BACKENDS}.")
        fp8_config.check_vllm_fp8_moe_backend(self.vllm_fp8_moe_backend)
        if self.vllm_act_quant_kernel not in VLLM_ACT_QUANT_KERNELS:
            raise ValueError(f"vllm_act_quant_kernel={self.vllm_act_quant_kernel!r} is unknown; use one of "
                             f"{VLLM_ACT_QUANT_KERNELS}.")  # fmt: skip
        if self.vllm_deepgemm_workers is not None and self.vllm_deepgemm_workers < 0:
            raise ValueError(
                f"vllm_deepgemm_workers={self.vllm_deepgemm_workers} must be >= 0 (0: no parallel compilation; "
                "unset: one process per CPU core)."
            )
        self._refuse_settings_without_effect()
        if self.logprob_batch_size is not None and self.logprob_batch_size < 1:
            raise ValueError(
                f"logprob_batch_size={self.logprob_batch_size}: give 1 or more sequences per scoring forward, or leave "
                "it unset for per_device_train_batch_size."
            )
        if self.fsdp2_prefetch_layers is not None:
            from trl_fp8.distributed import weight_sharding

            if self.fsdp2_prefetch_layers < 1:
                raise ValueError(
                    f"fsdp2_prefetch_layers={self.fsdp2_prefetch_layers}: give 1 or more layers, or leave it unset "
                    "for FSDP2's own prefetch."
                )
            if weight_sharding(self) != "FSDP2":
                raise ValueError(
                    "fsdp2_prefetch_layers sets FSDP2's all-gathers, but this launch does not shard with FSDP2 "
                    "(accelerate launch --config_file fsdp2.yaml, or fsdp_config={'version': 2}). Drop it."
                )
        if self.rollout_precision is None and self.use_vllm:
            self.rollout_precision = "fp8" if self.fp8_recipe == BLOCKWISE else "bf16"
        for name in ("vllm_fp8_backend", "vllm_fp8_moe_backend", "vllm_act_quant_kernel"):
            if getattr(self, name) != "auto" and self.rollout_precision != "fp8":
                raise ValueError(
                    f"{name}={getattr(self, name)!r} picks a kernel of rollout_precision='fp8' rollouts, but "
                    f"rollout_precision={self.rollout_precision!r}. Drop {name} or use rollout_precision='fp8'."
                )
        for name in ("vllm_fp8_moe_backend", "vllm_act_quant_kernel"):
            if getattr(self, name) != "auto" and self.use_vllm and self.vllm_mode == "server":
                raise ValueError(
                    f"{name}={getattr(self, name)!r} picks a kernel of a colocated engine; a `trl vllm-serve` server "
                    f"runs the kernels it was started with. Drop {name}, or use vllm_mode='colocate'."
                )
        if self.fp8_kv_cache and not self.use_vllm:
            raise ValueError("fp8_kv_cache sets vLLM's KV cache dtype; it needs use_vllm=True.")
        if self.use_vllm:
            fp8_config.check_vllm_version()  # now, before a script writes anything for a run that cannot start
        if self.save_fp8_checkpoint is None:
            self.save_fp8_checkpoint = self.fp8_recipe is not None
        self._refuse_layer_choices_without_effect()
        self.fp8_linear_config()  # validates the FP8 layers' options now, not when the model is converted

    def _finish_post_init(self) -> None:
        """TRL's `__post_init__` between the FP8 checks and the package checks; its deprecated-name warning is TRL's
        default, not the user's to fix."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
            super().__post_init__()
        check_optimizer_installed(self.optim)
        if self.use_liger_kernel:
            check_liger_installed()

    def fp8_linear_config(
        self, cache_weights: bool | None = None, cache_with_grad: bool | None = None
    ) -> FP8LinearConfig | None:
        """The FP8 layers' config of this run (None for BF16 training), validated by `FP8LinearConfig` itself; its
        errors name this config's fields (`fp8_backend`, not `backend`). `cache_weights` and `cache_with_grad`: the
        trainer's choice where `fp8_cache_weights` is None (`trl_fp8.trainer.memory.choose_fp8_weight_cache`; off a
        GPU the cache stays through the micro-batches)."""
        if self.fp8_recipe is None:
            return None
        from trl_fp8.distributed import weight_sharding

        # Under FSDP2 no FP8 copy of a whole weight is kept between steps (it would undo the sharding); torchao's
        # recipes keep none at all.
        cache = self.fp8_cache_weights
        if cache is None:
            cache = weight_sharding(self) != "FSDP2" if cache_weights is None else cache_weights
        cache = self.fp8_recipe != BLOCKWISE or cache
        if not cache or self.fp8_recipe != BLOCKWISE or self.fp8_cache_weights is not None:
            cache_with_grad = True  # nothing to limit (torchao's recipes keep their own), or kept on purpose
        elif cache_with_grad is None:
            cache_with_grad = False  # the default: held for scoring and the sync, let go in the micro-batches
        # One process with no DDP, FSDP or DeepSpeed (whose gradient hooks would not fire): FP8 experts add their
        # weight gradients into `.grad` in place (FP8LinearConfig.fuse_wgrad_accumulation).
        state = getattr(self, "distributed_state", None)
        one_process = state is not None and state.distributed_type == "NO"
        try:
            return FP8LinearConfig(
                recipe=self.fp8_recipe, power_of_two_scales=self.fp8_power_of_two_scales, backend=self.fp8_backend,
                fuse_sibling_gemms=self.fp8_fuse_sibling_gemms, fuse_swiglu=self.fp8_fuse_swiglu,
                experts_gemm=self.fp8_experts_gemm, cache_quantized_weight=cache, cache_with_grad=cache_with_grad,
                fuse_wgrad_accumulation=one_process and self.fp8_recipe == BLOCKWISE,
            )  # fmt: skip
        except ValueError as exc:
            message = re.sub(r"\b(recipe|backend|experts_gemm|power_of_two_scales|fuse_sibling_gemms|fuse_swiglu)=",
                             r"fp8_\1=", str(exc))  # fmt: skip
            raise ValueError(message.replace("cache_quantized_weight=", "fp8_cache_weights=")) from None

    @property
    def fp8_outside_training(self) -> bool:
        """Whether some weights are stored in FP8 outside training: FP8 rollouts or an FP8 checkpoint."""
        return bool(self.save_fp8_checkpoint) or (self.use_vllm and self.rollout_precision == "fp8")

    def _refuse_settings_without_effect(self) -> None:
        """Raise for a setting that this combination would silently ignore, naming the fix (warn where harmless)."""
        if not self.use_vllm:
            for name, default in (("rollout_precision", None), ("vllm_fp8_backend", "auto"), ("vllm_fp8_moe_backend", "auto"),
                                  ("vllm_act_quant_kernel", "auto"), ("vllm_jit_cache_dir", None), ("vllm_deepgemm_workers", None),
                                  ("vllm_token_ids_only", True)):  # fmt: skip
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} sets up vLLM rollouts, but use_vllm=False: the trainer "
                        f"generates with its own model. Set use_vllm=True, or drop {name}."
                    )
        if self.fp8_recipe is None:
            for name, default in (
                ("fp8_backend", "auto"),
                ("fp8_cache_weights", None),
                ("fp8_fuse_sibling_gemms", False),
                ("fp8_fuse_swiglu", False),
                ("fp8_experts_gemm", "auto"),
            ):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} sets up FP8 training, but fp8_recipe=None trains in BF16. "
                        f"Drop {name}, or train in FP8 with fp8_recipe='blockwise'."
                    )
        elif self.fp8_fuse_swiglu and self.use_liger_kernel and (self.liger_kernel_config or {}).get("swiglu", True):
            raise ValueError(
                "fp8_fuse_swiglu and use_liger_kernel=True both replace the gated MLP's forward, and Liger's, applied "
                "later, would win: the fused FP8 path would never run. Keep Liger's other kernels with "
                "liger_kernel_config={'swiglu': False}, or drop fp8_fuse_swiglu."
            )
        elif self.fp8_recipe != BLOCKWISE and (self.fp8_fuse_sibling_gemms or self.fp8_fuse_swiglu):
            raise ValueError(
                f"fp8_fuse_sibling_gemms and fp8_fuse_swiglu apply to the blockwise recipe; torchao's "
                f"{self.fp8_recipe!r} recipe runs each layer on its own. Drop them, or use fp8_recipe='blockwise'."
            )
        self._refuse_fp8_options_without_effect()

    def _refuse_fp8_options_without_effect(self) -> None:
        """Raise for an option of the blockwise FP8 layers that the recipe, backend or compilation would ignore."""
        if self.fp8_recipe not in (BLOCKWISE, None):
            for name, default, what in (("fp8_experts_gemm", "auto", "kernel of FP8 experts"),
                                        ("fp8_cache_weights", None, "cache of FP8 weights")):  # fmt: skip
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} sets the blockwise recipe's {what}; torchao's "
                        f"{self.fp8_recipe!r} recipe has none. Drop {name}, or use fp8_recipe='blockwise'."
                    )
        if self.fp8_experts_gemm != "auto" and (self.fp8_keep_experts_in_bf16 or self.fp8_backend == "emulated"):
            why = ("fp8_keep_experts_in_bf16=True keeps the experts in BF16" if self.fp8_keep_experts_in_bf16
                   else "fp8_backend='emulated' runs them one expert at a time in the emulation")  # fmt: skip
            raise ValueError(
                f"fp8_experts_gemm={self.fp8_experts_gemm!r} picks the GPU kernel of FP8 experts, but {why}. "
                "Drop fp8_experts_gemm."
            )
        fusions = [name for name in ("fp8_fuse_sibling_gemms", "fp8_fuse_swiglu") if getattr(self, name)]
        if self.compile_decoder_layers and fusions:
            raise ValueError(
                f"{' and '.join(fusions)} fuse eager FP8 layers, but compile_decoder_layers=True traces each decoder "
                "layer into one graph, where its FP8 layers run unfused: the fusion would never run. Drop "
                f"{' and '.join(fusions)}, or set compile_decoder_layers=False."
            )

    def _refuse_layer_choices_without_effect(self) -> None:
        if self.save_bf16_master_weights and not self.save_fp8_checkpoint:
            warnings.warn(
                "save_bf16_master_weights=True has no effect with save_fp8_checkpoint=False: save_model() writes the "
                "high-precision master weights already.",
                stacklevel=3,
            )
        if self.fp8_recipe is not None or self.fp8_outside_training:
            return
        chosen = [
            f"{name}={getattr(self, name)}"
            for name in (
                "num_first_layers_in_bf16",
                "num_last_layers_in_bf16",
                "fp8_power_of_two_scales",
                "fp8_keep_experts_in_bf16",
            )  # fmt: skip
            if getattr(self, name)
        ]
        if chosen:
            raise ValueError(
                f"{', '.join(chosen)} chooses how layers are stored in FP8, but nothing is FP8 here: fp8_recipe=None "
                "trains in BF16, save_fp8_checkpoint=False saves BF16 and the rollouts are not rollout_precision="
                "'fp8'. Drop it, or set save_fp8_checkpoint=True / rollout_precision='fp8' (BF16 training, FP8 "
                "export or rollouts)."
            )


@dataclass
class FP8GRPOConfig(FP8TrainingArguments, GRPOConfig):
    r"""Configuration for `FP8GRPOTrainer`: every field of TRL's `GRPOConfig`, the FP8 fields of
    `FP8TrainingArguments` (the precision flow, vLLM rollouts, saving), and the rollout corrections below.

    Args:
        log_rollout_mismatch (bool): With vLLM, always score the rollouts with the trainer (one extra forward when no
            importance sampling needs it) and log the trainer-vs-rollout mismatch (`fp8/mismatch/*`).
        tis (str | None): `"token"`: token-level TIS, `min(pi_train / pi_rollout, tis_cap)` per token (TRL's
            `token_truncate` mode with vLLM; applied by this trainer to any other rollout that returns its own
            log-probs). `"auto"` (default): token-level TIS, unless TRL's own `vllm_importance_sampling_*` fields are
            set to something else, which then stands; unlike `"token"`, never refused for having nothing to correct.
            `"off"`: no correction. `None`: TRL's `vllm_importance_sampling_*` fields as they are (TRL's default:
            `sequence_mask`). Every FP8 run measured for trl-fp8's accuracy and speed used token TIS, as Jet-RL, NeMo
            RL and veRL do for FP8 rollouts.
        tis_cap (float): Upper clip of the token ratio (veRL and NeMo RL use 2.0 for FP8 rollouts).
        score_in_training_forward (bool | None): Take the trainer's log-probs of the rollout tokens (for the
            importance-sampling ratio and the mismatch metrics) from each micro-batch's own training forward, detached,
            instead of a no-grad forward over the whole rollout before the micro-batches (TRL's scoring pass): one
            forward pass fewer per step, the same values where every rollout is trained on within one optimizer step
            (`gradient_accumulation_steps` a multiple of `steps_per_generation` x `num_iterations`, TRL's default),
            since the weights are then the same in both forwards. `None`: on there. The metrics are then logged per
            micro-batch and averaged, as TRL logs its loss-side metrics.
    """

    log_rollout_mismatch: bool = field(
        default=True,
        metadata={"help": "With vLLM, always log the trainer-vs-rollout log-prob mismatch (fp8/mismatch/*)."},
    )
    tis: str | None = field(
        default="auto",
        metadata={
            "help": "Truncated importance sampling: 'token' (per-token ratio clipped at tis_cap), 'auto' (token, "
            "unless TRL's vllm_importance_sampling_* fields are set otherwise), 'off', or none to keep TRL's "
            "vllm_importance_sampling_* settings.",
        },
    )
    tis_cap: float = field(
        default=2.0, metadata={"help": "Upper clip of the token-level importance ratio (veRL/NeMo RL use 2.0)."}
    )
    score_in_training_forward: bool | None = field(
        default=None,
        metadata={
            "help": "Take the trainer's log-probs of the rollout tokens (importance sampling, mismatch metrics) from "
            "each micro-batch's training forward instead of a separate scoring pass: one forward fewer per step. "
            "None: on where every rollout is trained on within one optimizer step.",
        },
    )

    def __post_init__(self):
        if isinstance(self.tis, str) and self.tis.lower() in ("none", "null", ""):
            self.tis = None
        if self.tis is not None and self.tis not in TIS_MODES:
            raise ValueError(f"tis={self.tis!r} is unknown; use 'auto' (the default), 'token', 'off' or None.")
        if not self.tis_cap > 1.0:
            raise ValueError(
                f"tis_cap must be > 1 (a cap at or below 1 down-weights every token), got {self.tis_cap}."
            )
        self._check_fp8_fields()
        self._refuse_tis_conflicts()
        # Map onto TRL's own fields before its __post_init__ validates them.
        if self.token_tis:
            self.vllm_importance_sampling_correction = True
            self.vllm_importance_sampling_mode = "token_truncate"
            self.vllm_importance_sampling_clip_max = self.tis_cap
        elif self.tis == "off":
            self.vllm_importance_sampling_correction = False
        self._finish_post_init()
        if self.score_in_training_forward and not self.rollouts_train_within_one_step():
            raise ValueError(
                "score_in_training_forward=True takes the trainer's log-probs of a rollout from the training forward, "
                "which equals a scoring pass before the micro-batches only if every rollout is trained on within one "
                f"optimizer step: gradient_accumulation_steps={self.gradient_accumulation_steps} must be a multiple "
                f"of steps_per_generation x num_iterations = {self.steps_per_generation} x {self.num_iterations}. "
                "Align them, or set score_in_training_forward=False (the scoring pass)."
            )

    @property
    def token_tis(self) -> bool:
        """Whether token-level TIS corrects the rollouts (`tis="token"`, or `"auto"` resolved to it; TRL's fields as
        token TIS sets them still count as unset, so the answer holds after the mapping)."""
        return self.tis == "token" or (self.tis == "auto" and not self.trl_is_fields_set())

    def trl_is_fields_set(self) -> list[str]:
        """TRL's importance-sampling fields set to something else than TRL's defaults or what token TIS sets them to
        (`name=value` each): where `tis="auto"` leaves the user's settings."""
        trl_defaults = {f.name: f.default for f in fields(GRPOConfig)}
        token = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
                 "vllm_importance_sampling_clip_max": self.tis_cap}  # fmt: skip
        unset = {name: (trl_defaults.get(name), token.get(name, trl_defaults.get(name))) for name in TRL_IS_FIELDS}
        return [f"{name}={getattr(self, name)!r}" for name in TRL_IS_FIELDS
                if hasattr(self, name) and getattr(self, name) not in unset[name]]  # fmt: skip

    def rollouts_train_within_one_step(self) -> bool:
        """Whether every rollout is trained on within one optimizer step (TRL's condition for not scoring old
        log-probs), so that the weights a rollout was sampled with are the weights of all its micro-batches."""
        return self.gradient_accumulation_steps % (self.steps_per_generation * self.num_iterations) == 0

    def _refuse_tis_conflicts(self) -> None:
        """Raise where TRL's own importance-sampling fields say otherwise than `tis`; warn on a cap nothing uses."""
        if self.tis == "token":
            trl_defaults = {f.name: f.default for f in fields(GRPOConfig)}
            if self.vllm_importance_sampling_correction is False:
                raise ValueError(
                    "tis='token' turns TRL's importance-sampling correction on, but "
                    "vllm_importance_sampling_correction=False turns it off. Drop one of them (tis='off' is the way "
                    "to say off)."
                )
            mode = self.vllm_importance_sampling_mode
            if mode not in (trl_defaults["vllm_importance_sampling_mode"], "token_truncate"):
                raise ValueError(
                    f"tis='token' is TRL's vllm_importance_sampling_mode='token_truncate', but "
                    f"vllm_importance_sampling_mode={mode!r} is set. Drop one of them."
                )
            for name in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap"):
                value = getattr(self, name, None)
                if value not in (trl_defaults.get(name), self.tis_cap):
                    raise ValueError(
                        f"tis='token' clips the ratio at tis_cap={self.tis_cap}, but {name}={value} is set. Set "
                        f"tis_cap={value} instead."
                    )
        elif self.tis_cap != 2.0 and not self.token_tis:
            warnings.warn(
                f"tis_cap={self.tis_cap} has no effect without token TIS (TRL's own correction, if on, clips at "
                "vllm_importance_sampling_clip_max).",
                stacklevel=3,
            )


@dataclass
class FP8RLOOConfig(FP8TrainingArguments, RLOOConfig):
    r"""Configuration for `FP8RLOOTrainer`: every field of TRL's `RLOOConfig` and the FP8 fields of
    `FP8TrainingArguments` (the precision flow, vLLM rollouts on the trainer's FP8 weights, saving).

    TRL's RLOO has no rollout correction (it scores every rollout with the trainer and discards the engine's
    log-probs), so the TIS and mismatch options of `FP8GRPOConfig` do not exist here.
    """

    def __post_init__(self):
        self._check_fp8_fields()
        self._finish_post_init()
