"""One rank of FP8 GRPO on two GPUs with vLLM colocated on each, launched by tests/gpu/test_multi_gpu.py:

    accelerate launch --config_file <TRL's multi_gpu.yaml | fsdp2.yaml> --num_processes 2 \
        tests/workers/multi_gpu_worker.py MODEL_DIR OUT_DIR [VLLM_TP [fp8_kv|bf16_kv [levers|plain]]]

VLLM_TP=2 makes the two ranks one tensor-parallel vLLM engine (TRL's `vllm_tensor_parallel_size`), which sleeps
between rollouts (`vllm_enable_sleep_mode`, with the expandable segments it brings); fp8_kv turns on
the FP8 KV cache (its scales measured before the first rollout); levers (FSDP2 only) sets logprob_batch_size=32 and
FP8Tuning(fsdp2_prefetch_layers=2, fuse_sibling_gemms=True).
After training, every rank checks that its own engine holds the trainer's FP8 weights bit for bit (under FSDP2 each
weight is gathered for that, by every rank in the same order), then writes `OUT_DIR/rank<r>.json` (log history,
digests of the whole parameters and of the FP8 tensors for vLLM); `save_model` writes the export from rank 0.
"""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE.parent / "gpu"), str(HERE)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def prefetch_set(model) -> bool:
    """Whether the first decoder layer's FSDP2 unit gathers layers ahead of its own (FP8Tuning.fsdp2_prefetch_layers)."""
    from torch.distributed.fsdp import FSDPModule

    layer = model.model.layers[0]
    return isinstance(layer, FSDPModule) and bool(layer._get_fsdp_state()._states_to_forward_prefetch)


def main():
    from ddp_grpo_worker import tensor_digest
    from test_vllm_gpu import assert_engine_holds_trainer_fp8
    from torch.distributed.tensor import DTensor

    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Tuning
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
    from trl_fp8.rollout.vllm.engine import expandable_segments_on, rollout_weight_tensors

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    vllm_tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    fp8_kv = len(sys.argv) > 4 and sys.argv[4] == "fp8_kv"
    levers = len(sys.argv) > 5 and sys.argv[5] == "levers"
    lever_args = dict(logprob_batch_size=32) if levers else {}
    tuning = FP8Tuning(fsdp2_prefetch_layers=2, fuse_sibling_gemms=True) if levers else None
    args = FP8GRPOConfig(
        **{**GRPO_SETTINGS, "per_device_train_batch_size": 16},
        output_dir=str(out / "run"), max_steps=3, logging_steps=1, bf16=True, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25, tis="token", save_bf16_master_weights=True,
        vllm_tensor_parallel_size=vllm_tp, fp8_kv_cache=fp8_kv,
        # the engine over both GPUs sleeps between rollouts: with the expandable segments that sleep mode turns on,
        # vLLM's custom all-reduce must be off (tensor_parallel_overrides), or the engine exits after its graphs
        vllm_enable_sleep_mode=vllm_tp > 1,
        vllm_fp8_backend=os.environ.get("TRL_FP8_TEST_FP8_BACKEND", "auto"),  # a kernel to compare, by hand
        **lever_args,
    )  # fmt: skip
    trainer = FP8GRPOTrainer(model_dir, say_letter_reward, args, train_dataset=say_letter_dataset(512), tuning=tuning)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert_engine_holds_trainer_fp8(trainer)
    parallel = trainer.vllm_generation.llm.llm_engine.vllm_config.parallel_config
    record = {
        "rank": trainer.accelerator.process_index,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "grads_in_ddp_buckets": getattr(trainer.model_wrapped, "gradient_as_bucket_view", None),
        "zeroed_in_buckets": "zero_grad" in vars(trainer.model_wrapped),  # zero_grads_in_buckets applied
        "sharded": isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor),
        "prefetch_set": prefetch_set(model),
        "log_history": trainer.state.log_history,
        "params": tensor_digest(model.named_parameters()),
        "pushed_fp8": tensor_digest(rollout_weight_tensors(model, "fp8")),
        # what the engine ran with: over both GPUs in sleep mode, expandable segments on and the custom all-reduce off
        "engine": {
            "tensor_parallel_size": parallel.tensor_parallel_size,
            "disable_custom_all_reduce": parallel.disable_custom_all_reduce,
            "sleep_mode": bool(args.vllm_enable_sleep_mode),
            "expandable_segments": expandable_segments_on(),
        },
    }
    trainer.save_model(str(out / "fp8"))
    (out / f"rank{record['rank']}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
