"""`FP8TrainingArguments`, the FP8 fields every trainer's config shares, and `FP8RLOOConfig` (TRL's `RLOOConfig` with
them); `FP8GRPOConfig`, which adds TIS, is in `grpo_config.py`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from trl import RLOOConfig

from trl_fp8 import config as fp8_config
from trl_fp8.config import (
    BLOCKWISE,
    LAYER_OPTION_FIELDS,
    VLLM_FP8_BACKENDS,
    FP8LinearConfig,
    check_layer_options,
    check_rollout_precision,
)
from trl_fp8.field_docs import field_help
from trl_fp8.requirements import check_liger_installed, check_optimizer_installed
from trl_fp8.tuning import FP8Tuning

if TYPE_CHECKING:
    from trl_fp8.plan.choice import WeightCache


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
        logprob_batch_size (int | None): Sequences per forward when the trainer scores rollouts without gradients (old
            and reference log-probs, the mismatch metrics), as NeMo RL's `logprob_batch_size` and veRL's
            `log_prob_micro_batch_size_per_gpu`. `None`: TRL's `per_device_train_batch_size`. Nothing is kept for
            backward and TRL's log-prob head never holds whole logits, so a larger batch costs little memory; it runs
            fewer, larger GEMMs and, under FSDP2, gathers every weight fewer times. (Where GRPO's
            `score_in_training_forward` leaves the old log-probs and the metrics to the micro-batches, only the
            reference model scores this way.)
        use_liger_kernel (bool | None): Liger's fused RMSNorm, RoPE and SwiGLU kernels on the model (transformers' and
            TRL's option). `None`: decided at start-up, on for a dense Llama, Mistral, Qwen2 or Qwen3 model trained on a
            CUDA GPU with liger-kernel installed, in blockwise FP8 or BF16, decoder layers not compiled
            (`FP8Tuning.compile_decoder_layers`) (they take the BF16 part of the training phase beside the FP8 GEMMs;
            the speeds with and without them: the documentation's "Benchmarks" page, "GRPO with Liger's kernels,
            compiled layers and the fusions"); the start-up log says which, and why.

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
        vllm_jit_cache_dir (str | None): Where DeepGEMM keeps its compiled kernels across runs. `None`:
            `DG_JIT_CACHE_DIR`, else vLLM's `~/.cache/vllm/deep_gemm`.
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

    fp8_recipe: str | None = field(default=BLOCKWISE, metadata=field_help(__doc__, "fp8_recipe"))
    num_first_layers_in_bf16: int = field(default=0, metadata=field_help(__doc__, "num_first_layers_in_bf16"))
    num_last_layers_in_bf16: int = field(default=0, metadata=field_help(__doc__, "num_last_layers_in_bf16"))
    fp8_keep_experts_in_bf16: bool = field(default=False, metadata=field_help(__doc__, "fp8_keep_experts_in_bf16"))
    fp8_power_of_two_scales: bool = field(default=False, metadata=field_help(__doc__, "fp8_power_of_two_scales"))
    fp8_backend: str = field(default="auto", metadata=field_help(__doc__, "fp8_backend"))
    fp8_cache_weights: bool | None = field(default=None, metadata=field_help(__doc__, "fp8_cache_weights"))
    logprob_batch_size: int | None = field(default=None, metadata=field_help(__doc__, "logprob_batch_size"))
    # argparse: a bare --use_liger_kernel still means True, as TRL's bool field had it (and --fp8_kv_cache alike)
    use_liger_kernel: bool | None = field(
        default=None, metadata=field_help(__doc__, "use_liger_kernel", nargs="?", const=True)
    )
    rollout_precision: str | None = field(default=None, metadata=field_help(__doc__, "rollout_precision"))
    vllm_fp8_backend: str = field(default="auto", metadata=field_help(__doc__, "vllm_fp8_backend"))
    vllm_fp8_moe_backend: str = field(default="auto", metadata=field_help(__doc__, "vllm_fp8_moe_backend"))
    vllm_jit_cache_dir: str | None = field(default=None, metadata=field_help(__doc__, "vllm_jit_cache_dir"))
    vllm_token_ids_only: bool = field(default=True, metadata=field_help(__doc__, "vllm_token_ids_only"))
    fp8_kv_cache: bool | None = field(
        default=None, metadata=field_help(__doc__, "fp8_kv_cache", nargs="?", const=True)
    )
    save_fp8_checkpoint: bool | None = field(default=None, metadata=field_help(__doc__, "save_fp8_checkpoint"))
    save_bf16_master_weights: bool = field(default=False, metadata=field_help(__doc__, "save_bf16_master_weights"))

    def _check_fp8_fields(self) -> None:
        """Validate and resolve the FP8 fields, before TRL's own `__post_init__` runs."""
        if isinstance(self.fp8_recipe, str) and self.fp8_recipe.lower() in ("none", "null", "bf16", ""):
            self.fp8_recipe = None  # the CLI and YAML pass strings
        for name in ("num_first_layers_in_bf16", "num_last_layers_in_bf16"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        self._check_layer_options()
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
        self._refuse_settings_without_effect()
        if self.logprob_batch_size is not None and self.logprob_batch_size < 1:
            raise ValueError(
                f"logprob_batch_size={self.logprob_batch_size}: give 1 or more sequences per scoring forward, or leave "
                "it unset for per_device_train_batch_size."
            )
        if self.rollout_precision is None and self.use_vllm:
            self.rollout_precision = "fp8" if self.fp8_recipe == BLOCKWISE else "bf16"
        for name in ("vllm_fp8_backend", "vllm_fp8_moe_backend"):
            if getattr(self, name) != "auto" and self.rollout_precision != "fp8":
                raise ValueError(
                    f"{name}={getattr(self, name)!r} picks a kernel of rollout_precision='fp8' rollouts, but "
                    f"rollout_precision={self.rollout_precision!r}. Drop {name} or use rollout_precision='fp8'."
                )
        if self.vllm_fp8_moe_backend != "auto" and self.use_vllm and self.vllm_mode == "server":
            raise ValueError(
                f"vllm_fp8_moe_backend={self.vllm_fp8_moe_backend!r} picks a kernel of a colocated engine; a `trl "
                "vllm-serve` server runs the kernels it was started with. Drop vllm_fp8_moe_backend, or use "
                "vllm_mode='colocate'."
            )
        if self.fp8_kv_cache and not self.use_vllm:
            raise ValueError("fp8_kv_cache sets vLLM's KV cache dtype; it needs use_vllm=True.")
        if self.use_vllm:
            fp8_config.check_vllm_version()  # now, before a script writes anything for a run that cannot start
        if self.save_fp8_checkpoint is None:
            self.save_fp8_checkpoint = self.fp8_recipe is not None
        self._refuse_layer_choices_without_effect()

    def _finish_post_init(self) -> None:
        """TRL's `__post_init__` between the FP8 checks and the package checks; its deprecated-name warning is TRL's
        default, not the user's to fix."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "`gradient_checkpointing` is deprecated", FutureWarning)
            super().__post_init__()
        self._refuse_gpu_backend_off_sm90()  # now that transformers has set up the device
        check_optimizer_installed(self.optim)
        if self.use_liger_kernel:
            check_liger_installed()

    def fp8_linear_config(
        self, weight_cache: WeightCache, *, tuning: FP8Tuning | None = None
    ) -> FP8LinearConfig | None:
        """The FP8 layers' config of this run (None for BF16 training); `__post_init__` checked its options under this
        config's names (`_check_layer_options`), `FP8Tuning.check` the tuning's. `weight_cache`: the run plan's FP8
        weight cache (`FP8RunPlan.fp8_weight_cache`, the user's `fp8_cache_weights` or what
        `trl_fp8.plan.choices.choose_fp8_weight_cache` chose). `tuning`: the run's `FP8Tuning` (fuse_sibling_gemms,
        fuse_swiglu, experts_gemm; None: its defaults)."""
        tuning = FP8Tuning.of(tuning)
        if self.fp8_recipe is None:
            return None
        # torchao's recipes keep no cache of ours: the blockwise layers' cache options stay at their defaults there
        blockwise = self.fp8_recipe == BLOCKWISE
        cache = weight_cache.cache or not blockwise
        cache_with_grad = weight_cache.with_grad is not False or not blockwise  # False: held for scoring and the sync
        # One process with no DDP, FSDP or DeepSpeed (whose gradient hooks would not fire): FP8 experts add their
        # weight gradients into `.grad` in place (FP8LinearConfig.fuse_wgrad_accumulation).
        state = getattr(self, "distributed_state", None)
        one_process = state is not None and state.distributed_type == "NO"
        return FP8LinearConfig(
            recipe=self.fp8_recipe, power_of_two_scales=self.fp8_power_of_two_scales, backend=self.fp8_backend,
            fuse_sibling_gemms=tuning.fuse_sibling_gemms, fuse_swiglu=tuning.fuse_swiglu,
            experts_gemm=tuning.experts_gemm, cache_quantized_weight=cache, cache_with_grad=cache_with_grad,
            fuse_wgrad_accumulation=one_process and blockwise,
        )  # fmt: skip

    def _check_layer_options(self) -> None:
        """The FP8 layers' own rules (`trl_fp8.config.check_layer_options`, shared with `FP8LinearConfig`), on this
        config's fields and under their names, with `FP8Tuning`'s defaults for the options it holds (`FP8Tuning.check`
        runs the same rules with the run's tuning); BF16 training refuses the layer options separately."""
        if self.fp8_recipe is None:
            return
        check_layer_options(FP8Tuning().layer_options(self), name=lambda field: LAYER_OPTION_FIELDS.get(field, field))

    @property
    def fp8_outside_training(self) -> bool:
        """Whether some weights are stored in FP8 outside training: FP8 rollouts or an FP8 checkpoint."""
        return bool(self.save_fp8_checkpoint) or (self.use_vllm and self.rollout_precision == "fp8")

    def _refuse_gpu_backend_off_sm90(self) -> None:
        """Refuse, before any model loads, a blockwise GEMM backend chosen by name where it cannot run (the first
        training step would fail, naming `FP8LinearConfig`'s `backend`)."""
        from trl_fp8.ops import blockwise_scaled_mm_supported

        backend = self.fp8_backend
        if self.fp8_recipe != BLOCKWISE or backend in ("auto", "emulated"):
            return  # (torchao's recipes refuse these backends in `_check_layer_options`)
        if blockwise_scaled_mm_supported(self.device):
            return
        here = self.device.type
        if here == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            here = f"{torch.cuda.get_device_name(self.device)} (sm_{major}{minor})"
        raise ValueError(
            f"fp8_backend={backend!r} runs blockwise FP8 GEMMs on a CUDA SM90 GPU (H100/H200), but this run trains on "
            f"{here}. Use fp8_backend='auto' (real FP8 GEMMs on an SM90 GPU, the exact emulation elsewhere) or "
            "fp8_backend='emulated'."
        )

    def _refuse_settings_without_effect(self) -> None:
        """Raise for a setting that this combination would silently ignore, naming the fix (warn where harmless)."""
        if not self.use_vllm:
            for name, default in (("rollout_precision", None), ("vllm_fp8_backend", "auto"), ("vllm_fp8_moe_backend", "auto"),
                                  ("vllm_jit_cache_dir", None), ("vllm_token_ids_only", True)):  # fmt: skip
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} sets up vLLM rollouts, but use_vllm=False: the trainer "
                        f"generates with its own model. Set use_vllm=True, or drop {name}."
                    )
        if self.fp8_recipe is None:
            for name, default in (("fp8_backend", "auto"), ("fp8_cache_weights", None)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} sets up FP8 training, but fp8_recipe=None trains in BF16. "
                        f"Drop {name}, or train in FP8 with fp8_recipe='blockwise'."
                    )
        self._refuse_fp8_options_without_effect()

    def _refuse_fp8_options_without_effect(self) -> None:
        """Raise for an option of the blockwise FP8 layers that the recipe would ignore (`FP8Tuning.check`: the
        tuning's)."""
        if self.fp8_recipe not in (BLOCKWISE, None) and self.fp8_cache_weights:  # False: `_check_layer_options`
            raise ValueError(
                f"fp8_cache_weights=True sets the blockwise recipe's cache of FP8 weights; torchao's "
                f"{self.fp8_recipe!r} recipe has none. Drop fp8_cache_weights, or use fp8_recipe='blockwise'."
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
class FP8RLOOConfig(FP8TrainingArguments, RLOOConfig):
    r"""Configuration for `FP8RLOOTrainer`: every field of TRL's `RLOOConfig` and the FP8 fields of
    `FP8TrainingArguments` (the precision flow, vLLM rollouts on the trainer's FP8 weights, saving).

    TRL's RLOO has no rollout correction (it scores every rollout with the trainer and discards the engine's
    log-probs), so the TIS and mismatch options of `FP8GRPOConfig` do not exist here.
    """

    def __post_init__(self):
        self._check_fp8_fields()
        self._finish_post_init()
