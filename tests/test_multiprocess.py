"""FP8 GRPO in two processes (DDP over gloo, CPU) through `torchrun`, as a user launches several GPUs.

The ranks must agree on everything but wall-clock times: the log history (TRL and our metrics reduced over ranks),
the parameters after the optimizer steps, and the FP8 tensors each would push to vLLM. The export written by rank 0
must equal, tensor for tensor and bit for bit, a one-process export of the same trained weights.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trl_fp8 import convert_to_fp8, save_fp8_checkpoint
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

from conftest import HANG_GUARD_S, WORKERS, clean_subprocess_env, free_port

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def torchrun_two(*args, processes: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2 ARGS...` (or `processes`) from the repository root, asserting it succeeded."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
           str(free_port()), *map(str, args)]  # fmt: skip
    # PYTHONFAULTHANDLER: a rank that aborts in native code (SIGABRT, once seen here) prints every thread's stack
    env = {**clean_subprocess_env(), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    tokenizer = tiny_char_tokenizer()
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    torchrun_two(WORKERS / "ddp_grpo_worker.py", root / "model", root / "out")
    ranks = [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    return root / "out", ranks


def test_ranks_agree_on_metrics_weights_and_pushed_fp8_tensors(two_rank_run):
    _, (r0, r1) = two_rank_run
    assert r0["world_size"] == r1["world_size"] == 2 and r0["distributed_type"] == "DistributedType.MULTI_CPU"
    assert r0["grads_in_ddp_buckets"] is True  # gradients as views of DDP's buckets: no second copy
    assert r0["zeroed_in_buckets"] is True  # and kept so through gradient accumulation
    logs0, logs1 = r0["log_history"], r1["log_history"]
    assert len(logs0) == len(logs1) == 3  # two logged steps and the end-of-training summary
    for a, b in zip(logs0, logs1, strict=True):
        assert a.keys() == b.keys()
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}
    assert logs0[0]["fp8/num_fp8_layers"] == 28 and logs0[0]["grad_norm"] > 0  # the first step moved the weights
    assert r0["params"] == r1["params"]
    assert r0["pushed_fp8"] == r1["pushed_fp8"]


def test_ranks_score_their_rollouts_in_the_micro_batches_together(tmp_path):
    """DDP on rollouts with their own log-probs and token TIS, scored in each micro-batch's training forward: every
    micro-batch's metrics are reduced over both ranks (one collective each, paired on every rank), so the ranks log
    the same values, and they train the same weights."""
    tokenizer = tiny_char_tokenizer()
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    torchrun_two(WORKERS / "ddp_grpo_worker.py", tmp_path / "model", tmp_path / "out", "ddp_tis")
    r0, r1 = (json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1))
    steps = [log for log in r0["log_history"] if "loss" in log]
    assert len(steps) == 2
    for log in steps:
        assert 0 < log["sampling/importance_sampling_ratio/mean"] <= 2.0 and "fp8/mismatch/kl_k3" in log
    for a, b in zip(r0["log_history"], r1["log_history"], strict=True):
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}
    assert r0["params"] == r1["params"]


def test_rank0_export_equals_a_one_process_export_of_the_same_weights(two_rank_run, tmp_path):
    out, (r0, _) = two_rank_run
    assert_export_is_a_one_process_export(out, r0, tmp_path)


def assert_export_is_a_one_process_export(out: Path, r0: dict, tmp_path: Path) -> None:
    """Rank 0's export and pushed FP8 tensors are a one-process export of the master weights the ranks ended with."""
    from transformers import AutoModelForCausalLM

    from workers.ddp_grpo_worker import tensor_digest

    model = AutoModelForCausalLM.from_pretrained(out / "fp8" / "bf16_master", dtype=torch.float32)
    assert tensor_digest(model.named_parameters()) == r0["params"]  # the master weights the ranks ended with
    convert_to_fp8(model)
    assert tensor_digest(rollout_weight_tensors(model, "fp8")) == r0["pushed_fp8"]
    save_fp8_checkpoint(model, tmp_path / "one", progress=False)
    ours, theirs = load_file(out / "fp8" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    assert ours.keys() == theirs.keys() and any(t.dtype == torch.float8_e4m3fn for t in ours.values())
    for name, t in ours.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t.view(torch.uint8), theirs[name].view(torch.uint8))
    assert json.loads((out / "fp8" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [
        128,
        128,
    ]


def test_deepspeed_zero2_ranks_agree_and_export_what_they_trained(tmp_path):
    """DeepSpeed ZeRO-2 (gradients and optimizer states partitioned, whole weights on every rank; transformers'
    `deepspeed=` config) on two gloo processes: the ranks end with the same logs, weights and FP8 tensors for vLLM,
    the first step moved the weights, and rank 0's export is a one-process export of them."""
    pytest.importorskip("deepspeed")
    tokenizer = tiny_char_tokenizer()
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    torchrun_two(WORKERS / "ddp_grpo_worker.py", tmp_path / "model", out, "zero2")
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["distributed_type"] == "DistributedType.DEEPSPEED" and not r0["sharded"]
    for a, b in zip(r0["log_history"], r1["log_history"], strict=True):
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}
    assert r0["log_history"][0]["grad_norm"] > 0
    assert r0["params"] == r1["params"] and r0["pushed_fp8"] == r1["pushed_fp8"]
    assert_export_is_a_one_process_export(out, r0, tmp_path)


def test_the_demo_runs_under_torchrun_with_two_processes(tmp_path):
    """The documented multi-process launch of the demo (docs/rollouts.md): rank 0 writes the warm-started model while the other waits
    (no half-written initial model is read; it lives beside the output folder, not in it), both train, one FP8 checkpoint is saved and reloaded."""
    proc = torchrun_two("examples/grpo_fp8.py", "--max_steps", "2", "--output_dir", tmp_path / "demo")
    assert proc.stdout.count("Saved the FP8 checkpoint") == 1
    assert "after GRPO (FP8 checkpoint reloaded" in proc.stdout
    assert (tmp_path / "demo" / "model.safetensors").exists()
    assert not (tmp_path / "demo" / "initial_model").exists()  # the exported checkpoint holds the trained model only
    assert (tmp_path / "demo_initial_model" / "model.safetensors").exists()


def test_fp8_layers_train_sync_and_export_under_fsdp2(tmp_path):
    """FP8Linear on FSDP2-sharded weights, gathered two layers ahead: training equals an unsharded replica bit for bit
    (losses, weights), the tensors for vLLM are gathered one at a time and equal the replica's, and the export written
    by rank 0 from the shards equals a one-process export of the replica, tensor for tensor."""
    torchrun_two(WORKERS / "fsdp2_fp8_worker.py", tmp_path)
    r0, r1 = (json.loads((tmp_path / f"fsdp2_rank{r}.json").read_text()) for r in (0, 1))
    assert r0["sharded"] and r1["sharded"]  # the layers really held DTensor shards
    # two layers ahead, forward and backward (fewer at the ends of the 4-layer stack), on every rank
    assert r0["prefetched"] == 4 and r0["leads"] == r1["leads"] == [[2, 0], [2, 1], [1, 2], [0, 2]]
    for r in (r0, r1):
        assert r["losses"]["sharded"] == r["losses"]["replica"]
        assert r["params"]["sharded"] == r["params"]["replica"] != r["initial_params"]
        assert r["pushed_fp8"]["sharded"] == r["pushed_fp8"]["replica"]
    sharded, replica = (load_file(tmp_path / d / "model.safetensors") for d in ("sharded", "replica"))
    assert sharded.keys() == replica.keys() and sum(t.dtype == torch.float8_e4m3fn for t in sharded.values()) == 28
    for name, t in sharded.items():
        assert torch.equal(t.view(torch.uint8), replica[name].view(torch.uint8)), name


def test_fsdp2_with_bf16_compute_pushes_and_exports_the_fp8_weights_the_forward_multiplies(tmp_path):
    """accelerate's FSDP2 units and policy (fp32 masters, BF16 compute), each unit gathering two ahead: the FP8 KV
    cache's scales can be measured by the run's first forward; the FP8 tensors for vLLM and the export are the
    blocks the forward quantized from the BF16 all-gathered weight, bit for bit, on every rank; quantizing the fp32
    masters (the rule the sync must not follow) gives other bits. Shards holding whole 128-row blocks gather FP8
    data and scales; the others (k/v: 128 rows over 2 ranks) gather the BF16 weight, with the same result."""
    torchrun_two(WORKERS / "fsdp2_fp8_worker.py", tmp_path, "bf16")
    r0, r1 = (json.loads((tmp_path / f"fsdp2_bf16_rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["used_fp8"] == r["forward_fp8"]  # every FP8 layer's pushed blocks are those its forward multiplied
        assert r["pushed_fp8"] == r["one_process_fp8"]["torch.bfloat16"] != r["one_process_fp8"]["torch.float32"]
        assert r["pushed_dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float8_e4m3fn"]
        aligned = r["aligned"]
        assert len(aligned) == 28
        assert {n for n, ok in aligned.items() if not ok} == {
            f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("k_proj", "v_proj")
        }
    assert r0["pushed_fp8"] == r1["pushed_fp8"]
    # gathered two layers ahead over accelerate's units: the embedding, 4 layers, the norm with lm_head (one unit)
    assert r0["prefetched"] == r1["prefetched"] == 6
    assert r0["reduced"] == r1["reduced"] == {"peak": 1, "preemptions": 3, "tokens": 9}  # metrics every rank logs
    # KV-cache scales measured before any training forward, through accelerate's units: q, k and v of every layer
    assert r0["kv_scales"] == r1["kv_scales"]
    assert sorted(r0["kv_scales"]) == [f"model.layers.{i}.self_attn.{t}_scale" for i in range(4) for t in "kqv"]
    assert all(0 < s < float("inf") for s in r0["kv_scales"].values())
    ours, one = (load_file(tmp_path / d / "model.safetensors") for d in ("sharded_bf16", "one_bf16"))
    assert ours.keys() == one.keys() and sum(t.dtype == torch.float8_e4m3fn for t in ours.values()) == 28
    for name, t in ours.items():
        assert torch.equal(t.view(torch.uint8), one[name].view(torch.uint8)), name


def test_compiled_decoder_layers_train_under_fsdp2_as_eager_ones(tmp_path):
    """`compile_decoder_layers` with FSDP2 (accelerate's units, BF16 policy and TRL's RAM-efficient loading, two layers
    gathered ahead): the layers compiled at start-up, before sharding, train bit for bit as eager ones (Dynamo's
    aot_eager backend runs the same ops), so FSDP2's gathers and reduce-scatters reach the compiled layers' FP8
    weights and gradients."""
    torchrun_two(WORKERS / "fsdp2_fp8_worker.py", tmp_path, "compiled_bf16")
    r0, r1 = (json.loads((tmp_path / f"fsdp2_compiled_rank{r}.json").read_text()) for r in (0, 1))
    print("Dynamo graphs per rank:", r0["graphs"], r1["graphs"])
    for r in (r0, r1):
        assert r["compiled_layers"] == 4 and r["graphs"] >= 1
        assert r["compiled"] == r["eager"]
        assert r["eager"]["losses"][0] != r["eager"]["losses"][-1]  # the weights moved
    assert r0["eager"]["params"] == r1["eager"]["params"]  # the same model on both ranks
    assert r0["eager"]["losses"] != r1["eager"]["losses"]  # from different batches


def test_fsdp2_shards_experts_by_expert_and_syncs_and_exports_their_fp8_blocks(tmp_path):
    """A mixture of experts under FSDP2 with BF16 compute (3 experts over 2 ranks: 2 and 1): each rank quantizes its
    whole experts and the FP8 blocks are gathered; the tensors for vLLM (per expert, in the checkpoint's names) and
    the export equal those of a one-process BF16 copy of the masters, bit for bit."""
    torchrun_two(WORKERS / "fsdp2_fp8_worker.py", tmp_path, "moe_bf16")
    r0, r1 = (json.loads((tmp_path / f"fsdp2_moe_bf16_rank{r}.json").read_text()) for r in (0, 1))
    for r in (r0, r1):
        assert r["experts_sharded"] == ["model.layers.0.mlp.experts"] and r["aligned"]["model.layers.0.mlp.experts"]
        assert r["used_fp8"] == r["forward_fp8"]
        assert r["pushed_fp8"] == r["one_process_fp8"]["torch.bfloat16"] != r["one_process_fp8"]["torch.float32"]
    assert r0["pushed_fp8"] == r1["pushed_fp8"]
    ours, one = (load_file(tmp_path / d / "model.safetensors") for d in ("sharded_moe_bf16", "one_moe_bf16"))
    assert ours.keys() == one.keys()
    assert "model.layers.0.mlp.experts.2.down_proj.weight_scale_inv" in ours  # the expert rank 1 held
    for name, t in ours.items():
        assert torch.equal(t.view(torch.uint8), one[name].view(torch.uint8)), name


def test_hsdp_gathers_the_fp8_blocks_within_each_shard_group(tmp_path):
    """HSDP, as over two nodes of two GPUs (4 gloo ranks, a 2x2 mesh: sharded within a pair, replicated across the
    pairs): every rank pushes and exports the FP8 blocks its forward multiplied, those of a one-process BF16 copy."""
    torchrun_two(WORKERS / "fsdp2_fp8_worker.py", tmp_path, "hsdp_bf16", processes=4)
    records = [json.loads((tmp_path / f"fsdp2_hsdp_bf16_rank{r}.json").read_text()) for r in range(4)]
    for r in records:
        assert r["placements"] == "(Replicate(), Shard(dim=0))"
        assert r["used_fp8"] == r["forward_fp8"]
        assert r["pushed_fp8"] == r["one_process_fp8"]["torch.bfloat16"] != r["one_process_fp8"]["torch.float32"]
        assert r["pushed_fp8"] == records[0]["pushed_fp8"]
        assert {n for n, ok in r["aligned"].items() if not ok} == {
            f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("k_proj", "v_proj")
        }
    ours, one = (load_file(tmp_path / d / "model.safetensors") for d in ("sharded_hsdp_bf16", "one_hsdp_bf16"))
    assert ours.keys() == one.keys()
    for name, t in ours.items():
        assert torch.equal(t.view(torch.uint8), one[name].view(torch.uint8)), name


def test_gradients_stay_in_ddp_buckets_through_gradient_accumulation(tmp_path):
    """transformers zeroes gradients to None after each step; the next step's micro-batches under no_sync would then
    accumulate into new tensors beside DDP's buckets (a second copy of every gradient). `zero_grads_in_buckets` keeps
    them views once DDP has rebuilt its buckets (after its first step); without it, they are not."""
    torchrun_two(WORKERS / "ddp_bucket_views_worker.py", tmp_path)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # steps 2 and 3, three micro-batches each, against the views of the step before; DDP rebuilds its buckets
        # once, in the second step, so its micro-batches get new views either way
        assert record["with"][3:] == [True] * 3, record
        assert record["without"][3:5] == [False] * 2, record
        # a layer no rank used in the last step stays where it was, as with plain DDP; used by one rank, it moves
        assert record["ours_unused"] == record["plain_unused"] == [True, True, False], record
