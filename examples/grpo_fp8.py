"""GRPO with the FP8 precision flow, TRL style.

    accelerate launch examples/grpo_fp8.py                      # embedded demo: tiny Qwen3, synthetic task, CPU ok
    accelerate launch examples/grpo_fp8.py --fp8_recipe none    # the same run in BF16, for comparison
    accelerate launch examples/grpo_fp8.py \
        --model_name_or_path Qwen/Qwen3-0.6B --dataset_name trl-lib/DeepMath-103K \
        --reward_funcs accuracy_reward --use_vllm --tis token   # a real model on a GPU machine, vLLM rollouts
                                                                 # on the trainer's FP8 weights (colocated)
    accelerate launch examples/grpo_fp8.py --use_vllm --fp8_kv_cache    # the demo with vLLM and an FP8 KV cache

Every `FP8GRPOConfig` (hence `GRPOConfig`), `ModelConfig` and TRL GRPO script flag works, and `--config run.yaml`.
With no `--model_name_or_path`, the demo builds a randomly initialised Qwen3-architecture model (dims multiples of
128) and a character tokenizer locally, trains it on "say <letter>" (exact verifier), prints the reward trend and
saves the FP8 checkpoint.
"""

import os
import sys
from pathlib import Path

if "--model_name_or_path" not in " ".join(sys.argv):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the demo builds everything locally
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config  # noqa: E402
from trl.scripts.grpo import GRPOScriptArguments  # noqa: E402

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer  # noqa: E402
from trl_fp8.toy_task import GRPO_SETTINGS  # noqa: E402

DEMO_DEFAULTS = dict(GRPO_SETTINGS, output_dir="grpo_fp8_demo", max_steps=80, logging_steps=5)


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


def demo_model_and_data(output_dir: str, seed: int):
    """Tiny Qwen3 + character tokenizer saved locally (so TRL and vLLM can load them by path) and the toy task."""
    from trl_fp8.tiny_model import tiny_char_tokenizer, tiny_qwen3
    from trl_fp8.toy_task import say_letter_dataset, say_letter_reward

    tokenizer = tiny_char_tokenizer()
    model = tiny_qwen3(seed=seed, vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    path = os.path.join(output_dir, "initial_model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, tokenizer, say_letter_dataset(seed=seed), [say_letter_reward]


def main():
    parser = TrlParser((GRPOScriptArguments, FP8GRPOConfig, ModelConfig))
    demo = "--model_name_or_path" not in " ".join(sys.argv) and "--config" not in sys.argv
    if demo:
        parser.set_defaults(**DEMO_DEFAULTS, bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available())
    script_args, training_args, model_args = parser.parse_args_and_config()

    if model_args.model_name_or_path is None:
        model, tokenizer, train_dataset, reward_funcs = demo_model_and_data(
            training_args.output_dir, training_args.seed
        )
    else:
        from datasets import load_dataset
        from trl.rewards import accuracy_reward, think_format_reward

        registry = {"accuracy_reward": accuracy_reward, "think_format_reward": think_format_reward}
        names = script_args.reward_funcs or ["accuracy_reward"]
        reward_funcs = [registry[n] if n in registry else n for n in names]
        if script_args.reward_model_name_or_path:
            reward_funcs.append(script_args.reward_model_name_or_path)
        model, tokenizer = model_args.model_name_or_path, None
        training_args.model_init_kwargs = {
            "dtype": model_args.dtype or "bfloat16",
            **(training_args.model_init_kwargs or {}),
        }
        dataset = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
        train_dataset = dataset[script_args.dataset_train_split]

    trainer = FP8GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        callbacks=[RewardTrend()],
    )
    trainer.accelerator.print(trainer.fp8_report.summary())
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    what = "FP8 checkpoint" if training_args.save_fp8_checkpoint else "model"
    trainer.accelerator.print(f"Saved the {what} to {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


if __name__ == "__main__":
    main()
