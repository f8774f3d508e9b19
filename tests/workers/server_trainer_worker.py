"""One trainer rank of FP8 GRPO in server mode on two GPUs, pushing to a `trl vllm-serve` of two tensor-parallel
workers, launched by tests/gpu/test_vllm_server_gpu.py:

    accelerate launch --config_file <TRL's multi_gpu.yaml> --num_processes 2 \
        tests/workers/server_trainer_worker.py MODEL_DIR OUT_DIR PORT

After training and one more sync, the main process asks every server worker for the digests of layer 1's fused
FP8 weights and scales and for its tensor-parallel rank, and writes them to `OUT_DIR/rank0.json` beside the digests
of the partitions it expects each rank to hold (the trainer's own FP8 tensors, cut as vLLM cuts them) and the log
history.
"""

import json
import os
import sys
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE.parent / "gpu"), str(HERE)]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def rpc(port: int, method: str, *args) -> list:
    """Every server worker's answer to `method` (vLLM's `/collective_rpc`, dev mode), in worker order."""
    request = urllib.request.Request(
        f"http://localhost:{port}/collective_rpc",
        data=json.dumps({"method": method, "args": list(args)}).encode(),
        headers={"Content-Type": "application/json"},
    )
    return json.loads(urllib.request.urlopen(request, timeout=60).read())["results"]


def main():
    from test_vllm_gpu import fused_partition, fused_parts
    from vllm_weight_digest import tensor_digest

    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward

    model_dir, out, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    args = FP8GRPOConfig(
        **GRPO_SETTINGS, output_dir=str(out / "run"), max_steps=12, logging_steps=1, bf16=True, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="server", vllm_server_port=port,
        vllm_server_timeout=120, tis="token",
    )  # fmt: skip
    trainer = FP8GRPOTrainer(model_dir, say_letter_reward, args, train_dataset=say_letter_dataset(2048))
    trainer.train()
    trainer.vllm_generation.sync_weights()
    model = trainer.accelerator.unwrap_model(trainer.model)
    tp_size = 2
    expected = {rank: {} for rank in range(tp_size)}
    for name, (parts, kv) in fused_parts(model.model.layers[1]).items():
        ours = [p.quantized_weight() for p in parts]
        for rank in range(tp_size):
            weight, scale = fused_partition(ours, model.config, rank, tp_size, kv, deepgemm=True)
            expected[rank][f"model.layers.1.{name}.weight"] = tensor_digest(weight)
            expected[rank][f"model.layers.1.{name}.weight_scale_inv"] = tensor_digest(scale)
    if trainer.accelerator.is_main_process:
        names = json.dumps(sorted(expected[0]))
        record = {
            "served": rpc(port, "trl_fp8_weight_digest", names),
            # vLLM's /collective_rpc answers str() of anything but a dict or a list
            "served_ranks": [int(rank) for rank in rpc(port, "trl_fp8_tensor_parallel_rank")],
            "expected": expected,
            "log_history": trainer.state.log_history,
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps(record, indent=1))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
