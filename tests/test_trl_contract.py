"""The contract with TRL and transformers: every name trl-fp8 overrides, replaces or reads exists with the signature
it expects. A TRL release that renames one of them makes these tests fail, instead of an override that silently
stops running (KV scales not calibrated, TIS dropped, rollouts on BF16 weights)."""

import dataclasses
import importlib
import inspect

import pytest
import transformers
import trl
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8RLOOConfig, FP8RLOOTrainer
from trl_fp8.stack import TESTED, release
from trl_fp8.trainer.mixin import FP8TrainerMixin


def params(func) -> list[str]:
    return list(inspect.signature(func).parameters)


LOGPS_PARAMS = ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"]
# Hooks the trainers override: (class, name, the leading parameters the override relies on)
HOOKS = [
    (GRPOTrainer, "_generate_single_turn", ["self", "prompt_ids"]),
    (RLOOTrainer, "_generate_single_turn", ["self", "prompt_ids"]),
    (GRPOTrainer, "_generate_and_score_completions", ["self", "inputs"]),
    (RLOOTrainer, "_generate_and_score_completions", ["self", "inputs"]),
    (GRPOTrainer, "_compute_loss", ["self", "model", "inputs"]),
    (GRPOTrainer, "_get_per_token_logps_and_entropies", LOGPS_PARAMS),
    (RLOOTrainer, "_get_per_token_logps_and_entropies", LOGPS_PARAMS),
    (GRPOTrainer, "_save_checkpoint", ["self", "model", "trial"]),
    (RLOOTrainer, "_save_checkpoint", ["self", "model", "trial"]),
    (transformers.Trainer, "train", ["self", "resume_from_checkpoint"]),
    (transformers.Trainer, "save_model", ["self", "output_dir", "_internal_call"]),
    (transformers.Trainer, "_push_from_checkpoint", ["self", "checkpoint_folder"]),
    (transformers.Trainer, "push_to_hub", ["self", "commit_message"]),
    (GRPOTrainer, "training_step", ["self", "model", "inputs"]),
    (RLOOTrainer, "training_step", ["self", "model", "inputs"]),
    (GRPOTrainer, "create_model_card", ["self", "model_name", "dataset_name", "tags"]),
    (VLLMGeneration, "_init_vllm", ["self"]),
    (VLLMGeneration, "sync_weights", ["self"]),
    (VLLMGeneration, "_iter_named_params", ["self"]),
    (VLLMGeneration, "generate", ["self", "prompts", "images", "num_generations"]),
]


@pytest.mark.parametrize("cls, name, leading", HOOKS, ids=[f"{c.__name__}.{n}" for c, n, _ in HOOKS])
def test_every_hook_we_override_exists_with_its_parameters(cls, name, leading):
    assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name} is gone"
    assert params(getattr(cls, name))[: len(leading)] == leading


def test_exact_mode_reads_trls_scoring_arguments_and_trainer_attributes_by_their_names():
    """`trainer.exact` takes `compute_entropy` and `compute_aux_loss` by name and refuses every later input (images,
    token types); it reads the trainer's `temperature` and `vllm_generation`, which TRL's `__init__` sets."""
    assert params(GRPOTrainer._get_per_token_logps_and_entropies)[6:8] == ["compute_entropy", "compute_aux_loss"]
    source = inspect.getsource(GRPOTrainer.__init__)
    assert "self.temperature = " in source and "self.vllm_generation = " in source


def test_our_overrides_are_the_hooks_trl_calls():
    """Each method the FP8 classes define over TRL's is one of the hooks above or our own (never a typo that TRL
    would not call)."""
    from trl_fp8.rollout.vllm.generation import FP8VLLMGeneration

    hooked = [(c, n) for c, n, _ in HOOKS]
    for ours, theirs in ((FP8GRPOTrainer, GRPOTrainer), (FP8RLOOTrainer, RLOOTrainer),
                         (FP8VLLMGeneration, VLLMGeneration)):  # fmt: skip
        for klass in (ours, FP8TrainerMixin):
            for name, value in vars(klass).items():
                if callable(value) and hasattr(theirs, name) and not name.startswith("__"):
                    owner = next(c for c in theirs.__mro__ if name in vars(c))
                    assert any(n == name and issubclass(c, owner) for c, n in hooked), (
                        f"{klass.__name__}.{name} overrides {owner.__name__}.{name}, which HOOKS does not list"
                    )


@pytest.mark.parametrize("module", ["trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer"])
def test_the_rollout_class_is_built_through_a_module_name_we_can_swap(module):
    """TRL has no factory for its rollout class: the trainer swaps `VLLMGeneration` in the module that builds it."""
    trl_module = importlib.import_module(module)
    assert trl_module.VLLMGeneration is VLLMGeneration
    assert "VLLMGeneration(" in inspect.getsource(trl_module)


def test_the_batch_keys_we_read_and_write_are_trls():
    """`_generate_and_score_completions`'s keys that the mismatch metrics and TIS read, and the ratio `_compute_loss`
    multiplies by (only when `use_vllm`, which the trainer raises for rollouts with their own log-probs)."""
    produce = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for key in ("sampling_per_token_logps", "old_per_token_logps", "completion_mask", "prompt_ids", "prompt_mask",
                "completion_ids", "importance_sampling_ratio"):  # fmt: skip
        assert f'"{key}"' in produce, key
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    assert 'inputs["importance_sampling_ratio"]' in loss and "self.use_vllm" in loss


def test_scoring_in_the_training_forward_fits_trls_loss_and_scoring():
    """`score_in_training_forward` relies on TRL's loss computing the policy's log-probs (one call of
    `_get_per_token_logps_and_entropies`) before it reads the ratio from the batch, on the scoring pass being left out
    when importance sampling is off and rollouts train within one step, and on TRL's importance-sampling modes being
    the ones `importance_sampling_ratio` computes."""
    from trl_fp8.trainer.importance_sampling import IMPORTANCE_SAMPLING_MODES

    loss = inspect.getsource(GRPOTrainer._compute_loss)
    logps_at = loss.index("self._get_per_token_logps_and_entropies(")
    assert loss.count("self._get_per_token_logps_and_entropies(") == 1
    assert (
        logps_at
        < loss.index('inputs.get("importance_sampling_ratio")')
        < loss.index('inputs["importance_sampling_ratio"]')
    )
    # a micro-batch trained on again (num_iterations > 1) is the same dict, which keeps the mark of its scoring
    assert "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]" in inspect.getsource(
        GRPOTrainer._prepare_inputs
    )
    produce = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "self.args.gradient_accumulation_steps % generate_every != 0 or (" in produce
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in produce
    for mode in IMPORTANCE_SAMPLING_MODES:
        assert f'"{mode}"' in produce, mode


def test_the_config_fields_we_set_exist():
    grpo = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    for name in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "use_vllm",
                 "vllm_enable_sleep_mode", "use_liger_kernel", "liger_kernel_config", "model_init_kwargs"):  # fmt: skip
        assert name in grpo, name
    assert "token_truncate" in inspect.getsource(trl.trainer.grpo_config)
    rloo = {f.name for f in dataclasses.fields(RLOOConfig)}
    assert {"use_vllm", "vllm_mode", "vllm_enable_sleep_mode", "model_init_kwargs"} <= rloo
    assert {f.name for f in dataclasses.fields(FP8GRPOConfig)} >= set(grpo)
    assert {f.name for f in dataclasses.fields(FP8RLOOConfig)} >= rloo


def test_the_helpers_we_import_exist():
    from transformers.trainer import TRAINING_ARGS_NAME
    from trl.generation.vllm_client import VLLMClient
    from trl.import_utils import is_math_verify_available
    from trl.models.utils import disable_gradient_checkpointing
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward
    from trl.trainer.utils import create_model_from_path, pad

    assert TRAINING_ARGS_NAME and callable(is_math_verify_available) and callable(disable_gradient_checkpointing)
    assert callable(VLLMClient.update_named_params) and callable(create_model_from_path) and callable(pad)
    assert all(callable(f) for f in (accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward))
    # transformers re-registers this hook each time checkpointing is enabled; layer_checkpointing removes the old one
    assert "make_inputs_require_grads" in inspect.getsource(transformers.modeling_utils)
    # the colocated generate reads the rollout's log-probs through this module name, which the flat reader replaces
    import trl.generation.vllm_generation as trl_generation

    assert callable(trl_generation.extract_logprobs)
    assert "extract_logprobs(all_outputs)" in inspect.getsource(VLLMGeneration.generate)


def test_what_the_start_up_checks_and_the_example_script_rely_on_exists():
    """The dataset check finds the trainers' datasets by parameter name (and GRPO's `environment_factory`) and
    refuses what TRL would read as `x["prompt"]`; the output check asks `should_save`; the example resolves
    `--resume_from_checkpoint true` with transformers' `get_last_checkpoint`, reads unknown flags from TRL's parser's
    remaining strings, and `accelerate launch -q` reports a failed single-process run without a traceback."""
    from accelerate.commands.launch import simple_launcher
    from transformers.trainer_utils import get_last_checkpoint
    from trl import TrlParser

    leading = ["self", "model", "reward_funcs", "args", "train_dataset", "eval_dataset"]
    for trainer in (GRPOTrainer, RLOOTrainer):
        assert params(trainer.__init__)[: len(leading)] == leading
        assert 'x["prompt"] for x in inputs' in inspect.getsource(trainer)
    assert "environment_factory" in params(GRPOTrainer.__init__)
    assert isinstance(transformers.TrainingArguments.should_save, property)
    assert callable(get_last_checkpoint) and "return_remaining_strings" in params(TrlParser.parse_args_and_config)
    # `-q`: accelerate's launcher exits 1 without raising where the run failed (accelerate 1.16 moved the check into
    # the subprocess helper that `simple_launcher` calls)
    launcher_source = inspect.getsource(simple_launcher)
    if "_run_subprocess(" in launcher_source:
        from accelerate.commands.launch import _run_subprocess

        assert "_run_subprocess(cmd, current_env, args.quiet)" in launcher_source
        assert "if not quiet:" in inspect.getsource(_run_subprocess)
    else:
        assert "if not args.quiet:" in launcher_source
    from trl_fp8.trainer.layer_checkpointing import CHECKPOINTING_KWARGS_NAMES

    # keep_layer_options reads either name (transformers 5.24 has both, the GPU suite's 5.17 the old one)
    assert {f.name for f in dataclasses.fields(transformers.TrainingArguments)} & set(CHECKPOINTING_KWARGS_NAMES)


def test_the_launch_internals_we_set_or_read_exist():
    """DDP's gradients as bucket views go through accelerate's DDP handler (read when train() wraps the model); the
    FSDP2 compute dtype is read from the FSDP2 group's mixed-precision policy."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    assert "ddp_handler.to_kwargs()" in inspect.getsource(Accelerator.prepare_model)
    assert "gradient_as_bucket_view" in {f.name for f in dataclasses.fields(DistributedDataParallelKwargs)}
    assert callable(FSDPModule._get_fsdp_state)
    assert "self.mp_policy = mp_policy" in inspect.getsource(FSDPParamGroup.__init__)


def test_this_trl_is_a_tested_release():
    assert release(trl.__version__) in TESTED["trl"], trl.__version__


def test_transformers_zeroes_gradients_through_the_wrapped_model():
    """`zero_grads_in_buckets` keeps DDP's gradients in its buckets by replacing the DDP module's `zero_grad`: that
    works while transformers' training loop zeroes through `model.zero_grad()` (the wrapped model), not through the
    optimizer."""
    source = inspect.getsource(transformers.Trainer)
    assert "model.zero_grad()" in source
    assert "optimizer.zero_grad(" not in source


def test_fsdp2_gradient_accumulation_runs_as_the_planner_and_the_trainer_count_it():
    """`trl-fp8 plan` and FP8GRPOTrainer count FSDP2's whole BF16 gradients between micro-batches and turn on
    accelerate's sync_each_batch where they would not fit: that holds while transformers' training loop runs all but
    a step's last micro-batch under accelerate's `no_sync` unless `sync_each_batch` is set, accelerate carries out
    `no_sync` under FSDP2 as `set_requires_gradient_sync(False)`, and its FSDP2 policy reduces in the compute dtype."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    loop = inspect.getsource(transformers.Trainer)
    assert 'plugin_kwargs.get("sync_each_batch", False)' in loop and "self.accelerator.no_sync" in loop
    assert "model.set_requires_gradient_sync(False)" in inspect.getsource(Accelerator.no_sync)
    assert '"reduce_dtype": dtype' in inspect.getsource(FullyShardedDataParallelPlugin)
