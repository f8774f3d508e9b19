"""One rank of an FSDP2 run of FP8 layers on CPU (gloo), launched by tests/test_multiprocess.py through `torchrun`.

    torchrun --nproc_per_node 2 tests/workers/fsdp2_fp8_worker.py OUT_DIR

accelerate applies FSDP only on accelerators (on CPU it falls back to DDP), so this shards with torch's own
`fully_shard`, as accelerate does on GPUs: each decoder layer, then the root. Every rank also trains an unsharded
replica on the same batches; with identical batches on every rank FSDP2's averaged gradients equal the replica's.
Writes `OUT_DIR/fsdp2_rank<r>.json` (losses, digests of the whole parameters and of the FP8 tensors for vLLM, for
both models) and, from rank 0, the two exports `OUT_DIR/sharded` and `OUT_DIR/replica`.
"""

import copy
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    from ddp_grpo_worker import tensor_digest
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trl_fp8 import FP8LinearConfig, convert_to_fp8, save_fp8_checkpoint
    from trl_fp8.demo.tiny_model import tiny_qwen3
    from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_qwen3(seed=0, vocab_size=128)
    convert_to_fp8(model, config=FP8LinearConfig(cache_quantized_weight=False))
    replica = copy.deepcopy(model)
    initial = tensor_digest(model.named_parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = isinstance(model.model.layers[0].mlp.down_proj.weight, DTensor)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False) for m in (model, replica)]
    losses = {"sharded": [], "replica": []}
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 64), generator=g)  # the same batch on every rank
        for name, m, opt in zip(losses, (model, replica), opts, strict=True):
            loss = m(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    record = {
        "rank": rank,
        "sharded": sharded,
        "losses": losses,
        "initial_params": initial,
        "params": {
            "sharded": tensor_digest(model.named_parameters()),
            "replica": tensor_digest(replica.named_parameters()),
        },
        "pushed_fp8": {
            "sharded": tensor_digest(rollout_weight_tensors(model, "fp8")),
            "replica": tensor_digest(rollout_weight_tensors(replica, "fp8")),
        },
    }
    save_fp8_checkpoint(model, out / "sharded", progress=False, write=rank == 0)
    if rank == 0:
        save_fp8_checkpoint(replica, out / "replica", progress=False)
    (out / f"fsdp2_rank{rank}.json").write_text(json.dumps(record, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
