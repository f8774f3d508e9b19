"""One rank of an FSDP2 run of FP8 layers on CPU (gloo), launched by tests/test_multiprocess.py through `torchrun`.

    torchrun --nproc_per_node 2 tests/workers/fsdp2_fp8_worker.py OUT_DIR [fp32|bf16|moe_bf16]
    torchrun --nproc_per_node 4 tests/workers/fsdp2_fp8_worker.py OUT_DIR hsdp_bf16
    torchrun --nproc_per_node 2 tests/workers/fsdp2_fp8_worker.py OUT_DIR compiled_bf16

accelerate applies FSDP only on accelerators (on CPU it falls back to DDP), so this shards with torch's own
`fully_shard`, as accelerate does on GPUs: each decoder layer, then the root.

fp32 (no mixed precision): every rank also trains an unsharded replica on the same batches; with identical batches on
every rank FSDP2's averaged gradients equal the replica's. Each layer gathers two layers ahead (`FP8Tuning.fsdp2_prefetch_layers`). Writes `OUT_DIR/fsdp2_rank<r>.json` (losses, digests of
the whole parameters and of the FP8 tensors for vLLM, for both models) and, from rank 0, the two exports
`OUT_DIR/sharded` and `OUT_DIR/replica`.

bf16 (accelerate's units and policy: fp32 masters, BF16 all-gathers for compute, fp32 gradient reduction): the FP8 KV
cache's scales are measured by the run's first forward (as before the first rollout); after training, one
more forward records the FP8 weights each layer multiplied; the record holds their digest, the digest of the tensors
for vLLM, and of the same tensors from a one-process BF16 copy of the gathered fp32 masters and from the fp32 masters
themselves (the rule FSDP2 must not follow); which weights' shards hold whole 128-row blocks; and the export from
rank 0 goes to `OUT_DIR/sharded_bf16` beside a one-process export of the BF16 copy in `OUT_DIR/one_bf16`.

compiled_bf16: accelerate's units and policy (with TRL's cpu_ram_efficient_loading), each unit gathering two ahead,
once with eager decoder layers and once with `FP8Tuning(compile_decoder_layers=True)` applied before sharding (as the trainer does: at
start-up, before accelerate prepares the model), Dynamo's `aot_eager` backend (the same ops as eager, so the same
bits). Writes
`OUT_DIR/fsdp2_compiled_rank<r>.json`: each run's losses and parameter digests, and how many layers were compiled.
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


def finish_distributed() -> None:
    """Every rank done before any closes its connections: a rank tearing down gloo beside a peer's last exchange
    aborted natively, rarely, in CI."""
    dist.barrier()
    dist.destroy_process_group()


def main():
    from ddp_grpo_worker import tensor_digest
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from trl_fp8 import FP8LinearConfig, convert_to_fp8, save_fp8_checkpoint
    from trl_fp8.demo.tiny_model import tiny_qwen3
    from trl_fp8.distributed import prefetch_fsdp2_units
    from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

    out = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "fp32"
    if mode == "compiled_bf16":
        return compiled_layers(out)
    if mode in ("bf16", "moe_bf16", "hsdp_bf16"):
        return mixed_precision(out, moe=mode == "moe_bf16", hsdp=mode == "hsdp_bf16")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = tiny_qwen3(seed=0, vocab_size=128)
    convert_to_fp8(model, config=FP8LinearConfig(cache_quantized_weight=False))
    replica = copy.deepcopy(model)
    initial = tensor_digest(model.named_parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # `fsdp2_prefetch_layers=2`: gathers issued two layers ahead change when weights arrive, never which
    prefetched = prefetch_fsdp2_units(model, 2)
    leads = [
        [
            len(layer._get_fsdp_state()._states_to_forward_prefetch),
            len(layer._get_fsdp_state()._states_to_backward_prefetch),
        ]
        for layer in model.model.layers
    ]
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
        "prefetched": prefetched,
        "leads": leads,
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
    finish_distributed()


def tiny_moe(seed: int):
    """A two-layer Qwen3-MoE (3 experts: FSDP2 gives the two ranks 2 and 1) with a dense MLP in its second layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=128,
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=3,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            mlp_only_layers=[1],
        )  # fmt: skip
    )


def shard_like_accelerate(model, policy, mesh=None, cpu_ram_efficient_loading=False):
    """FSDP2 units as accelerate lays them out on GPUs, by its own `fsdp2_prepare_model` (each decoder layer, the input
    embedding, the final norm and lm_head as one unit, then the root), given a stand-in for the Accelerator: accelerate
    applies FSDP only on accelerators. `cpu_ram_efficient_loading` as TRL's fsdp2.yaml sets it: the model goes to the
    meta device, is sharded there, and gets rank 0's weights broadcast."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(model._no_split_modules),
        mixed_precision_policy=policy,
        cpu_ram_efficient_loading=cpu_ram_efficient_loading,
    )
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        device=torch.device("cpu"),
        mixed_precision="bf16",
        is_main_process=dist.get_rank() == 0,
        torch_device_mesh=mesh,
        parallelism_config=SimpleNamespace(fsdp_dim_names=mesh.mesh_dim_names) if mesh is not None else None,
    )
    return fsdp2_prepare_model(accelerator, model)


def mixed_precision(out: Path, moe: bool = False, hsdp: bool = False):
    from ddp_grpo_worker import tensor_digest
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor

    from trl_fp8 import FP8Linear, FP8LinearConfig, convert_to_fp8, save_fp8_checkpoint
    from trl_fp8.demo.tiny_model import tiny_qwen3
    from trl_fp8.distributed import fp8_shards_align, prefetch_fsdp2_units, reduce_over_ranks
    from trl_fp8.nn.experts import FP8Experts
    from trl_fp8.rollout.kv_scales import AttentionScaleObserver, observe_prompts
    from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    build = tiny_moe if moe else (lambda seed: tiny_qwen3(seed=seed, vocab_size=128))
    model = build(0)
    config = FP8LinearConfig(cache_quantized_weight=False)
    convert_to_fp8(model, config=config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # HSDP (4 ranks): shards over pairs of ranks, replicated across the pairs, as over the GPUs of two nodes
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    model = shard_like_accelerate(model, policy, mesh)
    # fsdp2_prefetch_layers=2 over accelerate's units (the embedding, each layer, the norm with lm_head): the FP8
    # blocks checked below are the same
    prefetched = prefetch_fsdp2_units(model, 2) if not (moe or hsdp) else None
    # The FP8 KV cache's scales are measured before the first rollout, by the first forward of the run: it must enter
    # through the root unit (a decoder entered alone made every unit a root, and accelerate's tail unit refused).
    observer = AttentionScaleObserver(model)
    observe_prompts(model, [[5, 6, 7], [8, 9, 10, 11, 12], [13]], pad_token_id=0, micro_batch=2, device="cpu")
    kv_scales = {n: t.item() for n, t in observer.scales().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    g = torch.Generator().manual_seed(rank)  # each rank its own batches, as in data-parallel training
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 64), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    used = {}  # what each FP8 layer multiplies in a forward after the last step

    def record(name):
        def hook(module, args):
            w = module._fp8_weight()
            used[f"{name}.weight"], used[f"{name}.weight_scale_inv"] = w.q, w.scale_inv

        return hook

    fp8_layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    handles = [m.register_forward_pre_hook(record(n)) for n, m in fp8_layers.items()]
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 8), generator=g))
    for h in handles:
        h.remove()
    aligned = {n: fp8_shards_align(m.weight) for n, m in fp8_layers.items()}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, FP8Experts)}
    aligned.update({n: fp8_shards_align(m.down_proj, rows_per_block=1) for n, m in experts.items()})
    pushed = dict(rollout_weight_tensors(model, "fp8"))
    masters = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # fp32, gathered
    copies = {}
    for dtype in (torch.bfloat16, torch.float32):
        one = build(1)
        one.load_state_dict(masters)
        convert_to_fp8(one.to(dtype), config=config)
        copies[str(dtype)] = one
    record_ = {
        "rank": rank,
        "prefetched": prefetched,
        "aligned": aligned,
        "used_fp8": tensor_digest(sorted((k, v) for k, v in pushed.items() if k in used)),
        "forward_fp8": tensor_digest(sorted(used.items())),
        "pushed_fp8": tensor_digest(pushed.items()),
        "one_process_fp8": {k: tensor_digest(rollout_weight_tensors(m, "fp8")) for k, m in copies.items()},
        "kv_scales": kv_scales,
        "pushed_dtypes": sorted({str(t.dtype) for t in pushed.values()}),
        "experts_sharded": [n for n, m in experts.items() if isinstance(m.down_proj, DTensor)],
        "placements": str(model.model.layers[0].self_attn.o_proj.weight.placements),
        "reduced": reduce_over_ranks(
            {"peak": rank, "preemptions": 1 + rank, "tokens": 10 - rank},
            {"preemptions": "sum", "tokens": "min"},
            "cpu",
        ),  # fmt: skip
    }
    tag = "moe_bf16" if moe else "hsdp_bf16" if hsdp else "bf16"
    save_fp8_checkpoint(model, out / f"sharded_{tag}", progress=False, write=rank == 0)
    if rank == 0:
        save_fp8_checkpoint(copies[str(torch.bfloat16)], out / f"one_{tag}", progress=False)
    (out / f"fsdp2_{tag}_rank{rank}.json").write_text(json.dumps(record_, indent=1))
    finish_distributed()


def compiled_layers(out: Path):
    from ddp_grpo_worker import tensor_digest
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from trl_fp8 import FP8LinearConfig, convert_to_fp8
    from trl_fp8.demo.tiny_model import tiny_qwen3
    from trl_fp8.distributed import prefetch_fsdp2_units
    from trl_fp8.trainer.regional_compile import compile_decoder_layers

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = {"rank": rank}
    for run in ("eager", "compiled"):
        model = tiny_qwen3(seed=0, vocab_size=128)
        convert_to_fp8(model, config=FP8LinearConfig(cache_quantized_weight=False))
        if run == "compiled":
            record["compiled_layers"] = compile_decoder_layers(model, backend="aot_eager")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shard_like_accelerate(model, policy, cpu_ram_efficient_loading=True)
        prefetch_fsdp2_units(model, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        g = torch.Generator().manual_seed(rank)  # each rank its own batches
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 128, (4, 64), generator=g)
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        record[run] = {"losses": losses, "params": tensor_digest(model.named_parameters())}
    from torch._dynamo.utils import counters

    record["graphs"] = counters["stats"]["unique_graphs"]  # Dynamo really traced the layers
    (out / f"fsdp2_compiled_rank{rank}.json").write_text(json.dumps(record, indent=1))
    finish_distributed()


if __name__ == "__main__":
    main()
