"""`FP8TrainerMixin`: what every FP8 trainer adds to a TRL trainer, whatever its loss.

Put before a TRL trainer class (`class FP8GRPOTrainer(FP8TrainerMixin, GRPOTrainer)`), it converts the policy (and
the reference model) before TRL wraps it, makes TRL build `FP8VLLMGeneration` (rollouts on the trainer's own FP8
weights), and overrides a few of TRL's hooks, never its long methods:

- `_generate_single_turn`: measures the FP8 KV-cache scales once before the very first rollout, and generates
  eagerly when decoder layers are compiled (the graphs stay for training);
- `_get_per_token_logps_and_entropies`: scoring without gradients takes `logprob_batch_size` sequences at a time,
  and every forward numbers each sequence's tokens from its first (`positions`), as the rollout engine did; in exact
  mode (`exact_on_policy`) the log-probs come from the exact forward on the engine's kernels (`trainer.exact`);
- `_generate_and_score_completions`: keeps transformers' partial gradient checkpointing (`every_n_layers`) across
  TRL's no-grad scoring, logs the FP8 layer count, the weight-sync time and what the engine did;
- `save_model` / `_save_checkpoint`: final saves are block-FP8 checkpoints, swapped into the output folder
  atomically (after any Hub upload of it in flight), training checkpoints keep BF16 masters;
- `_push_from_checkpoint`: clears model files a training checkpoint's files would not overwrite before transformers
  copies them into the output folder for a Hub push, so the upload is one model, not a mix;
- `create_model_card`: says which recipe and which layers stayed in high precision.

Every TRL and transformers name used here is listed in `tests/test_trl_contract.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers.trainer import TRAINING_ARGS_NAME
from trl.trainer.utils import create_model_from_path

from trl_fp8.checkpoint.folder import drop_checkpoint_entries, is_checkpoint_entry, output_overwrites_model
from trl_fp8.checkpoint.save import save_fp8_checkpoint, unwrap_model
from trl_fp8.config import LayerSelection
from trl_fp8.distributed import (
    check_no_weight_sharding,
    check_sharding_supports,
    drop_grads_of_unused_parameters,
    grads_in_ddp_buckets,
    reduce_over_ranks,
    zero_grads_in_buckets,
)
from trl_fp8.nn.conversion import ConversionReport, convert_to_fp8, plan_fp8_conversion
from trl_fp8.plan import Choice, FP8RunPlan, RolloutSettings
from trl_fp8.requirements import check_reward_dependencies
from trl_fp8.rollout.kv_scales import AttentionScaleObserver, observe_prompts
from trl_fp8.rollout.stats import capacity_line
from trl_fp8.stack import warn_outside_tested_stack
from trl_fp8.trainer.callbacks import InvalidateSyncedReference, PrefetchFSDP2Units
from trl_fp8.trainer.exact import exact_logps_and_entropies
from trl_fp8.trainer.layer_checkpointing import RENAMED_CHECKPOINTING_CALLS, keep_layer_options
from trl_fp8.trainer.liger import liger_patches_kept_on_the_model
from trl_fp8.trainer.model_card import fp8_model_card_section
from trl_fp8.trainer.positions import positions_from_mask, takes_sequence_positions
from trl_fp8.trainer.regional_compile import compile_decoder_layers, eager_generation
from trl_fp8.trainer.start_up import (
    check_datasets,
    check_model_sources,
    check_output_writable,
    training_precision,
    trl_arguments,
)
from trl_fp8.tuning import FP8Tuning

logger = logging.getLogger(__name__)

__all__ = ["FP8TrainerMixin", "check_output_dir"]


# How each rollout statistic (`RolloutStats.read`, the engine's KV size) combines over the ranks' engines.
ROLLOUT_STATS_REDUCTION = {"preemptions": "sum", "kv_cache_tokens": "min"}


class FP8TrainerMixin:
    """The FP8 precision flow, rollouts on the trainer's FP8 weights and FP8 export for a TRL trainer.

    A subclass names its config class (`_fp8_config_class`), the TRL config it extends (`_trl_config_name`) and the
    TRL module that builds its `VLLMGeneration` (`_trl_trainer_module`).
    """

    _fp8_config_class: type
    _trl_config_name: str
    _trl_trainer_module: str

    def __init__(
        self,
        model,
        reward_funcs=None,
        args=None,
        *trainer_args,
        fp8_module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        tuning: FP8Tuning | None = None,
        **trainer_kwargs,
    ):
        config_class, trl_name = self._fp8_config_class, self._trl_config_name
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = config_class(f"{str(name).rstrip('/').split('/')[-1]}-FP8-{self._name}")
        if not isinstance(args, config_class):
            raise TypeError(
                f"{type(self).__name__} needs an {config_class.__name__}, got {type(args).__name__}. Build the same "
                f"settings with trl_fp8.{config_class.__name__}(...): it takes every {trl_name} field."
            )
        tuning = FP8Tuning.of(tuning)  # kept on the plan: `self.tuning`
        tuning.check(args)  # the tuning's options against this run's config, before anything loads
        warn_outside_tested_stack()
        check_no_weight_sharding(args)  # before loading a model that could not train
        check_sharding_supports(args, trainer_kwargs.get("peft_config"), model)
        check_output_dir(model, args.output_dir, config_class.__name__)
        check_output_writable(args, config_class.__name__)  # not found by save_model() after the whole run
        check_reward_dependencies(reward_funcs)
        self._check_start_up(args, trainer_kwargs)
        if args.use_vllm:  # before the model loads: its memory lands in the allocator's new segments
            from trl_fp8.rollout.vllm.engine import sleep_mode_allocator

            if said := sleep_mode_allocator(args):
                logger.log(*said)
        check_model_sources(model, reward_funcs, args)  # before transformers asks the Hub for a typo, or offline
        check_datasets(trl_arguments(super().__init__, model, reward_funcs, args, *trainer_args, **trainer_kwargs))
        loaded_here = isinstance(model, str)
        if loaded_here:
            model = self._load_model(model, args, trainer_kwargs.get("quantization_config"))
        self._fp8_filter = fp8_module_filter_fn
        self._peft_config = trainer_kwargs.get("peft_config")
        # The run's decisions, made once before anything is converted; `args` stays as the user gave it.
        plan = FP8RunPlan.build(args, getattr(model, "config", None), lora=self._peft_config is not None,
                                module_filter_fn=fp8_module_filter_fn, tuning=tuning,
                                rollout_func=trainer_kwargs.get("rollout_func") is not None)  # fmt: skip
        self.fp8_report = self._convert(model, args, plan)
        self.fp8_report.precision = training_precision(model, args)  # the start-up summary says what trains
        self.fp8_export_report = self._plan_fp8_outside_training(model, args, plan.layers)
        observer, kv_cache = self._fp8_kv_observer(model, plan.fp8_kv_cache)
        stored = self._fp8_stored_modules
        rollout = dataclasses.replace(plan.rollout, kv_observer=observer,
                                      fp8_modules=None if stored is None else frozenset(stored))  # fmt: skip
        self.plan = plan = plan.replace(fp8_kv_cache=kv_cache, rollout=rollout)
        plan.say_start_up(args)
        self._saving_training_checkpoint = False
        self._checkpoint_saved_for_push = False  # `push_to_hub` wrote the checkpoint before asking the Hub
        self._capacity_reported = False
        # TRL would say that model_init_kwargs / quantization_config are ignored: they were applied by `_load_model`
        applied = contextlib.nullcontext()
        if loaded_here:
            applied = dropped_log_records(self._trl_trainer_module, "You passed `model_init_kwargs`",
                                          "You passed `quantization_config`")  # fmt: skip
        resolved_args = plan.trainer_args(args)  # TRL's copy, with the plan's resolved values
        with self._fp8_vllm_generation(args, plan.rollout), warnings.catch_warnings(), applied:
            if plan.liger_kernels.automatic:  # TRL's deprecation of the option speaks to a user who set it
                warnings.filterwarnings("ignore", r"`use_liger_kernel=True` is deprecated", FutureWarning)
            super().__init__(model, reward_funcs, resolved_args, *trainer_args, **trainer_kwargs)
        if self.tuning.ddp_gradient_as_bucket_view:
            grads_in_ddp_buckets(self.accelerator)  # before train() wraps the model in DDP
        if self.tuning.fsdp2_prefetch_layers is not None:
            self.add_callback(PrefetchFSDP2Units(self.tuning.fsdp2_prefetch_layers))
        if self.ref_model is not None and args.fp8_recipe is not None:
            self._convert(unwrap_model(self.ref_model), args, plan)
            # Never trained (TRL scores with it under no_grad): frozen, its FP8 weights are quantized once, not at
            # every optimizer step.
            unwrap_model(self.ref_model).requires_grad_(False)
            if args.sync_ref_model:  # TRL blends the policy into the reference through `.data`: requantize after
                self.add_callback(InvalidateSyncedReference(self.ref_model))
        # Scoring and training forwards number each sequence's tokens from its first, as the rollouts did
        self._sequence_positions = takes_sequence_positions(unwrap_model(self.model))
        # After TRL's own wrapping (PEFT, Liger, gradient checkpointing): the graphs are traced at the first forward.
        self.compiled_decoder_layers = compile_decoder_layers(self.model) if self.tuning.compile_decoder_layers else 0
        if args.use_vllm:
            from trl_fp8.rollout.vllm.generation import check_rollout_class

            check_rollout_class(self.vllm_generation)

    @property
    def tuning(self) -> FP8Tuning:
        """The run's `FP8Tuning` (the trainer's `tuning=` keyword), as its plan keeps it."""
        return self.plan.tuning

    def train(self, *args, **kwargs):
        # Liger's kernels go on this model only: a model built later in the process (on CPU too) is transformers' own.
        liger = self.args.use_liger_kernel
        with liger_patches_kept_on_the_model(self.model) if liger else contextlib.nullcontext():
            return super().train(*args, **kwargs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           *args, **kwargs):  # fmt: skip
        # Scoring without gradients (old and reference log-probs) takes `logprob_batch_size` sequences at a time;
        # the training forward keeps TRL's micro-batch.
        if self.args.logprob_batch_size is not None and not torch.is_grad_enabled():
            batch_size = self.args.logprob_batch_size
        if getattr(self.args, "exact_on_policy", False):  # the engine's kernels, op by op (`trainer.exact`)
            return exact_logps_and_entropies(
                self, model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs
            )
        # TRL gives no position ids: each left-padded prompt's tokens would sit where the rollout did not put them
        with positions_from_mask(model, self._sequence_positions):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs
            )

    def _check_start_up(self, args, trainer_kwargs: dict) -> None:
        """Refuse, before the model loads, what this trainer's own options cannot do (a trainer adds its checks)."""

    # --- model ----------------------------------------------------------------------------------------------------

    @staticmethod
    def _fp8_kv_observer(model: nn.Module, choice: Choice) -> tuple[AttentionScaleObserver | None, Choice]:
        """The observer that measures the K/V scales to push where the plan chose an FP8 KV cache (else None), and the
        choice as it stands: an automatic FP8 cache on a model whose scales cannot be measured is kept BF16, with
        that reason (a user's own fp8_kv_cache=True raises)."""
        if not choice.on:
            return None, choice
        try:
            return AttentionScaleObserver(model), choice
        except ValueError as exc:
            if not choice.automatic:
                raise
            return None, Choice(False, f"kept BF16, as its K/V scales cannot be measured on this model ({exc})")

    @staticmethod
    def _load_model(model_id: str, args, quantization_config):
        """Load a model name the way TRL's trainers do, so it can be converted before TRL wraps it."""
        kwargs = dict(args.model_init_kwargs or {})
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
            kwargs["device_map"] = None
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        return create_model_from_path(model_id, **kwargs)

    @staticmethod
    def _convert(model: nn.Module, args, plan: FP8RunPlan) -> ConversionReport:
        if args.fp8_recipe is None:
            return ConversionReport(recipe="bf16")
        # the weight cache chosen once, for the policy (the reference follows)
        config = args.fp8_linear_config(plan.fp8_weight_cache.value, tuning=plan.tuning)
        # device: where it will train; a model loaded on CPU would make torchao emulate
        return convert_to_fp8(model, selection=plan.layers, config=config, device=args.device)

    def _plan_fp8_outside_training(self, model: nn.Module, args, layers: LayerSelection) -> ConversionReport | None:
        """BF16 training with FP8 rollouts or an FP8 checkpoint: the layers stored in FP8 there, chosen with the run's
        own layer options. None when training in FP8 (its FP8 layers are what is stored) or when nothing is FP8."""
        if args.fp8_recipe is not None:
            return None
        if not args.fp8_outside_training:
            if self._fp8_filter is not None:
                raise ValueError(
                    "fp8_module_filter_fn chooses FP8 layers, but nothing is FP8 here: fp8_recipe=None trains in "
                    "BF16, save_fp8_checkpoint=False saves BF16 and the rollouts are not rollout_precision='fp8'. "
                    "Drop it, or set save_fp8_checkpoint=True / rollout_precision='fp8'."
                )
            return None
        report, _ = plan_fp8_conversion(unwrap_model(model), selection=layers)
        logger.info("High-precision training; FP8 rollouts/checkpoint: %s", report.summary())
        return report

    @property
    def _fp8_stored_modules(self) -> set[str] | None:
        """The layers that rollouts and the checkpoint store in FP8 (None: read them from the model's FP8 layers)."""
        return None if self.fp8_export_report is None else set(self.fp8_export_report.converted)

    @contextlib.contextmanager
    def _fp8_vllm_generation(self, args, settings: RolloutSettings):
        """Make TRL build `FP8VLLMGeneration` with the plan's rollout settings instead of `VLLMGeneration` (it has no
        factory hook for it)."""
        if not args.use_vllm:
            yield
            return
        import importlib

        from trl_fp8.rollout.vllm.generation import FP8VLLMGeneration

        trl_module = importlib.import_module(self._trl_trainer_module)
        original = trl_module.VLLMGeneration
        trl_module.VLLMGeneration = functools.partial(FP8VLLMGeneration, settings=settings)
        try:
            yield
        finally:
            trl_module.VLLMGeneration = original

    # --- rollouts ---------------------------------------------------------------------------------------------------

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        observer = self.plan.rollout.kv_observer
        if observer is not None and not observer.has_observations:
            self._calibrate_kv_scales(prompt_ids)  # the first sync needs KV scales before any training forward
        with eager_generation(getattr(self, "compiled_decoder_layers", 0)):  # keeps the graphs for training
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _calibrate_kv_scales(self, prompt_ids: list[list[int]]) -> None:
        model = unwrap_model(self.model)  # under FSDP2 the root unit itself (fully_shard works in place)
        chunk, pad_id = self.args.per_device_train_batch_size, self._tokenizer.pad_token_id
        observe_prompts(model, prompt_ids, pad_id, chunk, self.accelerator.device)

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        if self.accelerator.sync_gradients:  # the step's gradients are reduced; the optimizer runs next
            drop_grads_of_unused_parameters(self.model_wrapped)
        return loss

    def _generate_and_score_completions(self, inputs):
        zero_grads_in_buckets(self.model_wrapped)  # before the step's micro-batches; DDP wraps the model in train()
        with keep_layer_options(self.model, self.args), warnings.catch_warnings():  # keep_layer_options: TRL's
            # no-grad scoring would drop `every_n_layers`. The warnings: TRL calls transformers' old names for them.
            warnings.filterwarnings("ignore", RENAMED_CHECKPOINTING_CALLS, FutureWarning)
            output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["fp8/num_fp8_layers"].append(float(self.fp8_report.num_fp8_layers))
        report = self._rollout_report
        if report is not None and report.last_sync_seconds is not None:
            # The slowest rank's sync is the one every rank waits for.
            synced = reduce_over_ranks({"ms": 1e3 * report.last_sync_seconds}, {"ms": "max"}, self.accelerator.device)
            self._metrics[mode]["fp8/weight_sync_ms"].append(synced["ms"])
            report.last_sync_seconds = None
        self._log_rollout_capacity(output, mode)
        return output

    @property
    def _rollout_report(self):
        """What the vLLM engine settled and did (`FP8VLLMGeneration.report`), or None without vLLM rollouts."""
        return self.vllm_generation.report if self.args.use_vllm else None

    def _log_rollout_capacity(self, output, mode) -> None:
        """Per rollout, what the colocated engine did (`vllm/*`: peak running and waiting sequences, preemptions,
        peak KV-cache use); after the first, one line on what its KV cache holds against a BF16 engine's."""
        report = self._rollout_report
        if report is None or report.rollout_stats is None:
            return
        generation = self.vllm_generation
        # Every rank logs the same numbers: the peaks over all engines, their preemptions summed, the smallest cache.
        values = {**report.rollout_stats.read(), "kv_cache_tokens": float(report.kv_cache_tokens or 0)}
        values = reduce_over_ranks(values, ROLLOUT_STATS_REDUCTION, self.accelerator.device)
        values["preemptions"] /= getattr(generation, "tensor_parallel_size", 1) or 1  # each engine on tp ranks
        kv_tokens = int(values.pop("kv_cache_tokens"))
        for key, value in values.items():
            self._metrics[mode][f"vllm/{key}"].append(value)
        if kv_tokens:
            self._metrics[mode]["vllm/kv_cache_tokens"].append(float(kv_tokens))
        if kv_tokens and not self._capacity_reported:
            self._capacity_reported = True
            seq_len = int(output["prompt_mask"].sum(1).max()) + self.max_completion_length
            fp8_weights = self.plan.rollout.rollout_precision != "bf16"
            line = capacity_line(unwrap_model(self.model), kv_tokens, fp8_weights=fp8_weights,
                                 fp8_kv=self.plan.rollout.kv_observer is not None, seq_len=seq_len,
                                 rollout_seqs=len(output["prompt_ids"]))  # fmt: skip
            self.accelerator.print(f"[trl-fp8] vLLM engine: {line} This process's rollouts have "
                                   f"{len(output['prompt_ids'])} sequences.")  # fmt: skip

    # --- saving -------------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model, trial):
        # Training checkpoints must stay resumable: keep the BF16 master weights there.
        self._saving_training_checkpoint = True
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            self._saving_training_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Write a block-FP8 checkpoint (vLLM/transformers `quant_method: fp8`) to `output_dir`.

        With `save_fp8_checkpoint=False`, or for intermediate training checkpoints, this is `Trainer.save_model`.
        """
        if _internal_call and output_dir is None and self._checkpoint_saved_for_push:
            self._checkpoint_saved_for_push = False  # transformers' save inside `push_to_hub`: written already
            return
        output_dir = output_dir or self.args.output_dir
        check_output_dir(self.accelerator.unwrap_model(self.model), output_dir, type(self.args).__name__)
        if not self.args.save_fp8_checkpoint or self._saving_training_checkpoint:
            return super().save_model(output_dir, _internal_call)
        model = self.accelerator.unwrap_model(self.model)
        fsdp2 = self.accelerator.is_fsdp2  # what accelerate applied (on CPU it falls back to DDP)
        state_dict = None
        if self.args.save_bf16_master_weights and fsdp2:
            state_dict = self.accelerator.get_state_dict(self.model)  # gathered: a collective, on every rank

        def write_extra(folder: Path) -> None:  # into the new checkpoint, before it is swapped in
            if self.args.save_bf16_master_weights:
                model.save_pretrained(folder / "bf16_master", state_dict=state_dict)
            torch.save(self.args, folder / TRAINING_ARGS_NAME)

        if self.args.should_save or fsdp2:  # FSDP2: every rank gathers each tensor, the main process writes
            save_fp8_checkpoint(
                model,
                output_dir,
                self.processing_class,
                fp8_modules=self._fp8_stored_modules,
                power_of_two_scales=self.args.fp8_power_of_two_scales,
                write_extra=write_extra,
                before_swap=self._finish_current_push,  # never change a folder while it is being uploaded
                progress=not self.args.disable_tqdm and self.args.should_save,
                write=self.args.should_save,
            )
        self.accelerator.wait_for_everyone()

    def push_to_hub(self, *args, **kwargs):
        """`Trainer.push_to_hub` of the block-FP8 checkpoint, written to `output_dir` before any Hub call (transformers
        creates the repository first): a failed upload leaves the checkpoint there, and the error says where."""
        self.save_model(_internal_call=True)
        self._checkpoint_saved_for_push = True
        try:
            return super().push_to_hub(*args, **kwargs)
        except Exception as exc:
            raise RuntimeError(
                f"The FP8 checkpoint is saved in {self.args.output_dir}, but pushing it to the Hugging Face Hub "
                f"failed ({type(exc).__name__}: {exc}). Push that folder once the Hub is reachable: `hf upload "
                f"<org/name> {self.args.output_dir}`, or trainer.push_to_hub() again."
            ) from exc
        finally:
            self._checkpoint_saved_for_push = False

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # Transformers copies the checkpoint's model files over the output folder's one by one, then uploads the
        # folder; files of an earlier save that the checkpoint lacks (FP8 shards, adapters, bf16_master) would be
        # uploaded beside them as one mixed model. Remove those first, and never while an upload reads the folder.
        if self.is_world_process_zero() and self.args.hub_strategy != "end":
            if self.args.hub_always_push:
                self._finish_current_push()
            in_flight = getattr(self, "push_in_progress", None)
            if in_flight is None or in_flight.is_done():  # else transformers skips this push
                keep = {p.name for p in Path(checkpoint_folder).iterdir() if is_checkpoint_entry(p.name)}
                drop_checkpoint_entries(self.args.output_dir, keep | {TRAINING_ARGS_NAME})
        super()._push_from_checkpoint(checkpoint_folder)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=[*tags, "fp8", "trl-fp8"])
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        with open(path, "a") as f:
            f.write("\n" + fp8_model_card_section(self.fp8_report, self.args, self.fp8_export_report,
                                                   trainer_name=type(self).__name__, plan=self.plan))  # fmt: skip


def check_output_dir(model, output_dir: str, config_name: str) -> None:
    """Refuse, before anything is loaded or written, to save into the folder the model was loaded from (or into a
    folder inside it): a block-FP8 checkpoint there would replace the user's weights. `config_name`: the config
    class the error tells the user to give another output_dir."""
    source = model if isinstance(model, str) else getattr(model, "name_or_path", None)
    if problem := output_overwrites_model(source, output_dir):
        raise ValueError(
            f"{problem} Give the trainer another output_dir ({config_name}(output_dir=...)), e.g. "
            f"{Path(str(source).rstrip('/')).name}-fp8-grpo."
        )


@contextlib.contextmanager
def dropped_log_records(logger_name: str, *fragments: str):
    """Leave out of logger `logger_name`'s output, within the block, the records whose message holds one of
    `fragments` (a TRL message that does not hold for this trainer; accelerate's logger prefixes the rank)."""
    log = logging.getLogger(logger_name)

    def keep(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in fragments)

    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)
