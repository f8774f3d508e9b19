"""One rank of a multi-process FP8 GRPO run on CPU, launched by tests/test_multiprocess.py through `torchrun`.

    torchrun --nproc_per_node 2 tests/workers/ddp_grpo_worker.py MODEL_DIR OUT_DIR [ddp|fsdp2|zero2|ddp_tis]

Trains the tiny Qwen3 for a few steps under DDP, FSDP2 or DeepSpeed ZeRO-2 (gloo; `ddp_tis`: DDP on rollouts that a
`rollout_func` samples with their log-probs, corrected by token TIS scored in the micro-batches' forwards), exports
the block-FP8 checkpoint (rank 0 writes it), and writes `OUT_DIR/rank<r>.json` with what every rank must agree on:
its log history, a digest of its parameters and a digest of the FP8 tensors it would push to vLLM.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402


def tensor_digest(pairs) -> str:
    h = hashlib.sha256()
    for name, t in pairs:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 shards: digest the whole tensor
        t = t.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def sampled_with_logprobs(model_dir):
    """A `rollout_func` sampling from the trainer's own model and returning the sampled tokens' log-probs."""
    from transformers import AutoTokenizer

    from fake_vllm import sampling_rollout_func

    return sampling_rollout_func(AutoTokenizer.from_pretrained(model_dir),
                                 lambda trainer: trainer.accelerator.unwrap_model(trainer.model))  # fmt: skip


def main():
    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
    from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "ddp"
    sharding = {}
    if mode == "fsdp2":
        layers = {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"], "reshard_after_forward": True}
        sharding = {"fsdp": True, "fsdp_config": layers}
    elif mode == "zero2":  # DeepSpeed ZeRO-2: gradients and optimizer states partitioned, whole weights on every rank
        zero2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                 "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": False}}  # fmt: skip
        sharding = {"deepspeed": zero2}
    args = FP8GRPOConfig(
        **{
            **GRPO_SETTINGS,
            "output_dir": str(out_dir / "run"),
            "max_steps": 2,
            "per_device_train_batch_size": 8,
            "logging_steps": 1,
            "use_cpu": True,
            "bf16": False,
            "disable_tqdm": True,
            "save_bf16_master_weights": True,
            "report_to": "none",
            **sharding,
            **({"tis": "token"} if mode == "ddp_tis" else {}),
        }
    )
    rollouts = {"rollout_func": sampled_with_logprobs(model_dir)} if mode == "ddp_tis" else {}
    trainer = FP8GRPOTrainer(model_dir, say_letter_reward, args, train_dataset=say_letter_dataset(256), **rollouts)
    trainer.train()
    trainer.save_model(str(out_dir / "fp8"))
    model = trainer.accelerator.unwrap_model(trainer.model)
    from torch.distributed.tensor import DTensor

    record = {
        "sharded": isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor),
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "grads_in_ddp_buckets": getattr(trainer.model_wrapped, "gradient_as_bucket_view", None),
        "zeroed_in_buckets": "zero_grad" in vars(trainer.model_wrapped),  # zero_grads_in_buckets applied
        "log_history": trainer.state.log_history,
        "params": tensor_digest(model.named_parameters()),
        "pushed_fp8": tensor_digest(rollout_weight_tensors(model, "fp8")),
    }
    (out_dir / f"rank{record['rank']}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
