"""`RolloutSettings`: what trl-fp8's rollout engine takes beside TRL's own arguments, one frozen object (the run's
plan makes it, `FP8VLLMGeneration` reads it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RolloutSettings"]


@dataclass(frozen=True)
class RolloutSettings:
    """What `FP8VLLMGeneration` takes beside TRL's own arguments: the rollout precision, the layers stored in FP8
    (`fp8_modules`, None: read from the model's FP8 layers at every sync), the scale format, the observer of the FP8
    KV cache's scales (None: a BF16 KV cache), and the colocated engine's kernel options (`FP8GRPOConfig`'s
    `vllm_*` fields of the same names; `act_quant_kernel`, `norm_quant_kernel` and `deepgemm_workers`: `FP8Tuning`'s
    `vllm_*` ones).

    Args:
        rollout_precision: "fp8", "bf16" or "fp8_online".
        fp8_modules: names of the layers served in FP8. Default: read from the model
            (`checkpoint.save.fp8_module_names`) at start-up and at every sync, so they follow PEFT wrapping.
        power_of_two_scales: round the scales of layers quantized for the sync (a BF16-trained model's) down to
            powers of two, as the exported checkpoint does.
        kv_observer: an `AttentionScaleObserver` on the policy; its scales are pushed with every sync and vLLM's KV
            cache is FP8. None: KV cache in the model dtype.
        fp8_backend: vLLM's kernel for the FP8 linear layers ("auto", "deepgemm", "cutlass", "triton"; see
            `rollout.vllm.kernels.rollout_kernel`). In server mode it only names what the server is expected to run.
        fp8_moe_backend: vLLM's kernel for FP8 experts in a colocated engine
            (`rollout.vllm.kernels.with_moe_backend`).
        act_quant_kernel: "auto" runs a colocated FP8 engine's fused SiLU-and-mul + FP8 quantization on trl-fp8's
            kernel where it gives vLLM's bits faster (`rollout.vllm.act_quant.install`); "trl_fp8" wherever it
            gives vLLM's bits; "vllm" keeps vLLM's.
        kv_attention: the kernel of a colocated engine's decode on the FP8 KV cache: "auto", "xqa" or "flash_attn"
            (`rollout.vllm.attention.choose_kv_attention`).
        norm_quant_kernel: the same choice for the engine's fused RMSNorm (+ residual add) + FP8 quantization
            (`rollout.vllm.norm_quant.install`).
        jit_cache_dir: DeepGEMM's compiled-kernel cache (default `rollout.vllm.kernels.default_jit_cache_dir()`).
        deepgemm_workers: processes compiling DeepGEMM's kernels before a colocated engine starts
            (`rollout.vllm.deepgemm_warmup.precompile_deepgemm`; None: one per CPU core, 0: none).
        token_ids_only: a colocated engine returns token ids and log-probs only, no text (`rollout.vllm.sampling`).
        exact: a colocated engine in exact mode (`rollout.vllm.exact`), whose kernels the trainer's forward calls;
            trl-fp8's own engine kernels then stay out (vLLM's are the ones the trainer calls).
    """

    rollout_precision: str = "fp8"
    fp8_modules: frozenset[str] | None = None
    power_of_two_scales: bool = False
    kv_observer: object | None = None  # an `AttentionScaleObserver`
    fp8_backend: str = "auto"
    fp8_moe_backend: str = "auto"
    act_quant_kernel: str = "auto"
    kv_attention: str = "auto"
    norm_quant_kernel: str = "auto"
    jit_cache_dir: str | None = None
    deepgemm_workers: int | None = None
    token_ids_only: bool = True
    exact: bool = False

    @classmethod
    def from_args(cls, args, tuning=None) -> RolloutSettings:
        """The settings of a run's config `args` and its `FP8Tuning` (None: its defaults)."""
        from trl_fp8.tuning import FP8Tuning

        tuning = FP8Tuning.of(tuning)
        return cls(
            rollout_precision=args.rollout_precision,
            power_of_two_scales=args.fp8_power_of_two_scales,
            fp8_backend=args.vllm_fp8_backend,
            fp8_moe_backend=args.vllm_fp8_moe_backend,
            act_quant_kernel=tuning.vllm_act_quant_kernel,
            kv_attention=tuning.vllm_fp8_kv_attention,
            norm_quant_kernel=tuning.vllm_norm_quant_kernel,
            jit_cache_dir=args.vllm_jit_cache_dir,
            deepgemm_workers=tuning.vllm_deepgemm_workers,
            token_ids_only=args.vllm_token_ids_only,
            exact=getattr(args, "exact_on_policy", False),
        )
