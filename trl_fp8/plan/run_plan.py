"""`FP8RunPlan`: every decision of one run in one frozen object, made once at start-up from the run's settings, the
model's config and the machine, before anything is converted or built.

The trainer reads its choices from the plan and never writes them into the user's `args`: what TRL and accelerate
must read resolved (`use_liger_kernel`, `liger_kernel_config`, `sync_each_batch`) goes into the trainer's own copy of
the args (`FP8RunPlan.trainer_args`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from trl_fp8.config import BLOCKWISE, LayerSelection
from trl_fp8.plan.choice import Choice, say_start_up
from trl_fp8.plan.choices import (
    choose_fp8_kv_cache,
    choose_fp8_weight_cache,
    choose_fsdp2_gradient_sync,
    choose_liger_kernels,
    choose_scoring,
    choose_token_tis,
)
from trl_fp8.plan.micro_batch import dense_hidden_size, small_micro_batch_note
from trl_fp8.rollout.settings import RolloutSettings
from trl_fp8.tuning import FP8Tuning

__all__ = ["FP8RunPlan"]


@dataclass(frozen=True)
class FP8RunPlan:
    """One run's decisions: the layers kept in BF16 (`layers`), the rollout engine's settings (`rollout`), and each
    automatic choice with its reason (`trl_fp8.plan.choices`). `fp8_weight_cache` is None without FP8 training,
    `fsdp2_gradient_sync` None where there is nothing to choose; `micro_batch_note` is the start-up note where FP8
    training would wait for the host (`plan.micro_batch`). `cuda`: whether the run trains on a CUDA GPU. `tuning`: the
    run's `FP8Tuning`, the one place the trainer reads it from. GRPO's rollout corrections, None for a config without
    them (RLOO's): `token_tis`, token-level TIS (a `TokenTIS` where it corrects the rollouts, None where not), and
    `scoring_in_training_forward`, whether the micro-batches' own forwards give the trainer's log-probs of the
    rollouts."""

    layers: LayerSelection
    rollout: RolloutSettings
    liger_kernels: Choice
    fp8_kv_cache: Choice
    fp8_weight_cache: Choice | None
    fsdp2_gradient_sync: Choice | None
    micro_batch_note: str | None
    cuda: bool
    tuning: FP8Tuning = FP8Tuning()
    token_tis: Choice | None = None
    scoring_in_training_forward: Choice | None = None

    @classmethod
    def build(
        cls,
        args,
        model_config,
        *,
        lora: bool = False,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        tuning: FP8Tuning | None = None,
        total_bytes: int | None = None,
        capability: tuple[int, int] | None = None,
        rollout_func: bool = False,
    ) -> FP8RunPlan:
        """The plan of a run with these settings (`args`, read only) for a model of `model_config`, on `args.device`
        and `args.world_size` processes. `lora`: only adapters train (`peft_config`). `total_bytes` and
        `capability`: the GPU's memory and compute capability (read from `args.device` when None). `tuning`: the run's
        `FP8Tuning` (None: its defaults). `rollout_func`: whether the trainer was given one (rollouts that bring
        their own log-probs)."""
        tuning = FP8Tuning.of(tuning)
        gpu = {"total_bytes": total_bytes}
        cuda = torch.device(args.device).type == "cuda"
        layers = LayerSelection(
            num_first_layers_in_bf16=args.num_first_layers_in_bf16,
            num_last_layers_in_bf16=args.num_last_layers_in_bf16,
            module_filter_fn=module_filter_fn,
            keep_experts_in_bf16=args.fp8_keep_experts_in_bf16,
        )
        weight_cache = None
        if args.fp8_recipe is not None:
            weight_cache = choose_fp8_weight_cache(model_config, args, lora=lora, tuning=tuning, **gpu)
        note = small_micro_batch_note(dense_hidden_size(model_config), args) if cuda else None
        token_tis = choose_token_tis(args, rollout_func=rollout_func)  # None: no TIS in this config (RLOO's)
        return cls(
            layers=layers,
            rollout=RolloutSettings.from_args(args, tuning),
            liger_kernels=choose_liger_kernels(
                getattr(model_config, "model_type", None), args, cuda=cuda, tuning=tuning
            ),
            fp8_kv_cache=choose_fp8_kv_cache(model_config, args, capability=capability, **gpu),
            fp8_weight_cache=weight_cache,
            fsdp2_gradient_sync=choose_fsdp2_gradient_sync(model_config, args, **gpu),
            micro_batch_note=note,
            cuda=cuda,
            tuning=tuning,
            token_tis=token_tis,
            scoring_in_training_forward=None if token_tis is None else choose_scoring(args, token_tis),
        )

    def replace(self, **changes) -> FP8RunPlan:
        """This plan with `changes` (what start-up learns from the model itself: its FP8 layers, the KV observer)."""
        return dataclasses.replace(self, **changes)

    def start_up_lines(self, args) -> list[str]:
        """The start-up lines of the choices the user did not make, in the order the trainer says them."""
        lines = []

        def choice(what: str, made: Choice | None, said: bool) -> None:
            if made is not None and made.automatic and said:
                lines.append(f"{what} {'on' if made.on else 'off'}: {made.reason}")

        choice("Liger's kernels", self.liger_kernels, self.cuda)
        if self.micro_batch_note is not None:
            lines.append(self.micro_batch_note)
        choice("FSDP2 gradient reduction at every micro-batch", self.fsdp2_gradient_sync, True)
        choice("FP8 weight cache", self.fp8_weight_cache, args.fp8_recipe == BLOCKWISE and self.cuda)
        choice("FP8 KV cache", self.fp8_kv_cache, args.use_vllm)
        choice("token-level truncated importance sampling", self.token_tis, True)
        choice("scoring the rollouts in the training forward", self.scoring_in_training_forward, True)
        return lines

    def say_start_up(self, args) -> None:
        """Say the start-up lines once (by the first process)."""
        for line in self.start_up_lines(args):
            say_start_up(args, line)

    def trainer_args(self, args):
        """The trainer's own copy of `args` with the plan's resolved values where TRL, transformers and accelerate read
        them (`use_liger_kernel`, `liger_kernel_config`, accelerate's `gradient_accumulation_kwargs`,
        `fp8_kv_cache`); the user's object is left as it was given. Containers are copied too, so what TRL adds to
        them stays in the trainer's copy, in one deep copy: two names that hold one object (transformers'
        `gradient_checkpointing_kwargs` and `activation_checkpointing_kwargs`; `hf_deepspeed_config` and
        `deepspeed_plugin.hf_ds_config`) still hold one object, the copy."""
        resolved = copy.copy(args)
        containers = {name: value for name, value in vars(args).items()
                      if isinstance(value, (dict, list, set)) or dataclasses.is_dataclass(value)}  # fmt: skip
        memo: dict[int, object] = {}
        for name, value in copy.deepcopy(containers, memo).items():
            setattr(resolved, name, value)
        for name, value in vars(args).items():  # an attribute that is an object inside a copied container
            if id(value) in memo and name not in containers:
                setattr(resolved, name, memo[id(value)])
        liger = self.liger_kernels
        resolved.use_liger_kernel = liger.on
        if liger.automatic and liger.on and self.tuning.fuse_swiglu:  # both replace the MLP's forward: ours stays
            resolved.liger_kernel_config = {**(args.liger_kernel_config or {}), "swiglu": False}
        sync = self.fsdp2_gradient_sync
        if sync is not None and sync.automatic and sync.on:
            kwargs = resolved.accelerator_config.gradient_accumulation_kwargs or {}
            resolved.accelerator_config.gradient_accumulation_kwargs = {**kwargs, "sync_each_batch": True}
        resolved.fp8_kv_cache = self.fp8_kv_cache.on
        return resolved
