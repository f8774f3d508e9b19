"""GRPO with the FP8 precision flow, TRL style.

    accelerate launch examples/grpo_fp8.py                      # embedded demo: tiny Qwen3, synthetic task, CPU ok
    accelerate launch examples/grpo_fp8.py --fp8_recipe none    # the same run without FP8, for comparison
    accelerate launch examples/grpo_fp8.py \
        --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/DeepMath-103K \
        --reward_funcs accuracy_reward --use_vllm --tis token   # a real model on a GPU machine, vLLM rollouts
                                                                 # on the trainer's FP8 weights (colocated)
    accelerate launch examples/grpo_fp8.py --use_vllm --fp8_kv_cache    # the demo with vLLM and an FP8 KV cache

Every `FP8GRPOConfig` (hence `GRPOConfig`), `FP8Tuning` (`--fuse_swiglu`, `--compile_decoder_layers`, ...),
`ModelConfig` and TRL GRPO script flag works, and `--config run.yaml`;
`--reward_funcs` takes TRL's reward names (`accuracy_reward` needs `pip install 'trl-fp8[math]'`) or dotted import paths
`package.module.function`, `--reward_model_name_or_path` a reward model. bitsandbytes 4/8-bit loading is refused.
With no `--model_name_or_path`, the demo builds a Qwen3-architecture model (dims multiples of 128) and a character
tokenizer locally, gives it a brief supervised warm start on "say <letter>" (so that it is right for some letters,
see `trl_fp8/demo/toy_task.py`), trains it with GRPO, saves the checkpoint, and prints the greedy accuracy over every
letter before GRPO and of the saved checkpoint after it. Its files go to `out/grpo_fp8_demo` (without FP8:
`out/grpo_bf16_demo`) unless `--output_dir` says otherwise. Without FP8 the demo's model trains in float32 (with
bfloat16 autocast on a GPU), as the FP8 run's master weights do; the start-up summary says which.

A refusal of the input ends the output in one `error: ...` line (exit code 2); `accelerate launch -q` leaves out
accelerate's own traceback of that exit code after it. `--resume_from_checkpoint true` resumes from the last
checkpoint in `--output_dir`.
"""

import os
import sys
from pathlib import Path

if "--model_name_or_path" not in " ".join(sys.argv):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo builds everything locally
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "vllm_enable_sleep_mode" in " ".join(sys.argv):
    # Before CUDA starts: PyTorch then hands the training step's freed memory back before the sleeping vLLM wakes
    # into its share (vLLM >= 0.26 turns the setting off around its own pool), so a larger share fits.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import trl_fp8  # noqa: E402, F401 - before torch's and TRL's imports: it drops log lines no user can act on

# isort: split
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import DatasetMixtureConfig, ModelConfig, TrlParser, get_dataset, get_peft_config  # noqa: E402
from trl.scripts.grpo import GRPOScriptArguments  # noqa: E402

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Tuning  # noqa: E402
from trl_fp8.cli.rewards import resolve_reward_funcs  # noqa: E402
from trl_fp8.cli.training_script import SHORT_USAGE, UsageError, refusals_in_one_line, resume_checkpoint  # noqa: E402
from trl_fp8.demo.toy_task import DEMO_GRPO_SETTINGS, DEMO_MAX_STEPS  # noqa: E402

DEMO_DEFAULTS = dict(DEMO_GRPO_SETTINGS, output_dir="out/grpo_fp8_demo", max_steps=DEMO_MAX_STEPS, logging_steps=5)
BF16_DEMO_OUTPUT_DIR = "out/grpo_bf16_demo"  # the baseline never overwrites the FP8 checkpoint


class RewardTrend(TrainerCallback):
    """Prints the mean reward at every logging step and the trend at the end."""

    def __init__(self):
        self.history = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs and state.is_world_process_zero:
            reward = float(logs["reward"])  # the progress bar may have formatted it already
            self.history.append((state.global_step, reward))
            print(f"step {state.global_step:>4}  reward {reward:.3f}", flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        if len(self.history) >= 2 and state.is_world_process_zero:
            (s0, r0), (s1, r1) = self.history[0], self.history[-1]
            print(f"reward trend: {r0:.3f} at step {s0} -> {r1:.3f} at step {s1}", flush=True)


def demo_model_and_data(training_args):
    """Tiny Qwen3 + character tokenizer, warm-started and saved locally (TRL and vLLM load it by path), the task,
    and the greedy accuracy of the warm-started model."""
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
    from trl_fp8.demo.toy_task import greedy_accuracy, say_letter_dataset, say_letter_reward, warm_start

    tokenizer = tiny_char_tokenizer()
    # Beside the output folder, not in it: the exported checkpoint holds the trained model only.
    path = training_args.output_dir.rstrip("/\\") + "_initial_model"
    # One process writes the initial model; the others wait, then read it.
    with training_args.main_process_first(desc="demo initial model", local=False):
        if training_args.process_index == 0:
            model = tiny_qwen3(
                seed=training_args.seed, vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0
            )
            warm_start(model, tokenizer, seed=training_args.seed)
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
    from transformers import AutoModelForCausalLM

    accuracy, answers = greedy_accuracy(AutoModelForCausalLM.from_pretrained(path), tokenizer)
    return path, tokenizer, say_letter_dataset(seed=training_args.seed), [say_letter_reward], (accuracy, answers)


def report_accuracy(label: str, accuracy: float, answers: dict[str, str]) -> None:
    shown = ", ".join(f"{c}:{a or '-'}" for c, a in answers.items())
    print(f"greedy accuracy over all {len(answers)} letters, {label}: {100 * accuracy:.1f}%  ({shown})", flush=True)


def start_up(parser):
    """Parse the command line, load the model and data, build the trainer: every refusal of the input comes from
    here. Returns `(trainer, training_args, script_args, tokenizer, demo accuracy before GRPO, checkpoint to
    resume from)`."""
    demo = "--model_name_or_path" not in " ".join(sys.argv) and "--config" not in sys.argv
    if demo:
        parser.set_defaults(**DEMO_DEFAULTS, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    *parsed, unknown = parser.parse_args_and_config(return_remaining_strings=True)
    if unknown:
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)} (--help lists every flag).")
    script_args, training_args, tuning, model_args, dataset_args = parsed
    if demo and training_args.fp8_recipe is None and "--output_dir" not in sys.argv:
        training_args.output_dir = BF16_DEMO_OUTPUT_DIR
    resume = resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    if model_args.load_in_4bit or model_args.load_in_8bit:
        raise UsageError("--load_in_4bit/--load_in_8bit load bitsandbytes layers, which FP8 training cannot "
                         "convert: drop them (FP8 already halves the weights' memory).")  # fmt: skip

    before, eval_dataset = None, None
    if model_args.model_name_or_path is None:
        model, tokenizer, train_dataset, reward_funcs, before = demo_model_and_data(training_args)
    else:
        # As TRL's own GRPO script: its reward names, dotted import paths, a reward model; its dataset options.
        reward_funcs = resolve_reward_funcs(  # its ValueError names the fix: one line
            script_args.reward_funcs or ([] if script_args.reward_model_name_or_path else ["accuracy_reward"]),
            script_args.reward_model_name_or_path,
        )
        model, tokenizer = model_args.model_name_or_path, None
        training_args.model_init_kwargs = {
            "revision": model_args.model_revision,
            "trust_remote_code": training_args.trust_remote_code,
            "attn_implementation": model_args.attn_implementation,
            "dtype": model_args.dtype or "bfloat16",
            **(training_args.model_init_kwargs or {}),
        }
        if dataset_args.datasets:
            dataset = get_dataset(dataset_args)
        elif script_args.dataset_name:
            from datasets import load_dataset

            dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        else:
            raise UsageError("give --dataset_name (or --datasets) with --model_name_or_path.")
        train_dataset = dataset[script_args.dataset_train_split]
        if training_args.eval_strategy != "no":
            eval_dataset = dataset[script_args.dataset_test_split]

    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=[RewardTrend()],
        tuning=tuning,
    )
    return trainer, training_args, script_args, tokenizer, before, resume


def main():
    parser = TrlParser((GRPOScriptArguments, FP8GRPOConfig, FP8Tuning, ModelConfig, DatasetMixtureConfig))
    parser.usage = SHORT_USAGE  # an argparse error prints it before its line: not the usage of every flag
    with refusals_in_one_line():  # a refusal ends the output in its one line, not in a traceback
        trainer, training_args, script_args, tokenizer, before, resume = start_up(parser)
    trainer.accelerator.print(trainer.fp8_report.summary())
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    what = "FP8 checkpoint" if training_args.save_fp8_checkpoint else "model"
    trainer.accelerator.print(f"Saved the {what} to {training_args.output_dir}")
    if before is not None and trainer.accelerator.is_main_process:
        from transformers import AutoModelForCausalLM

        from trl_fp8.demo.toy_task import demo_measured_range, greedy_accuracy

        report_accuracy("before GRPO (warm start)", *before)
        saved = AutoModelForCausalLM.from_pretrained(training_args.output_dir)  # what a user would load
        report_accuracy(
            f"after GRPO ({what} reloaded from {training_args.output_dir})", *greedy_accuracy(saved, tokenizer)
        )
        if training_args.fp8_recipe and training_args.max_steps == DEMO_MAX_STEPS:
            print(demo_measured_range(), flush=True)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
