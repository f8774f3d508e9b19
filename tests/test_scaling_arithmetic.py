"""`python -m benchmarks.scaling_arithmetic` (docs/contributing/scaling-details.md's tables): its numbers follow
from the library's rules
(FSDP2's dim-0 chunks against 128-row blocks, vLLM's partitions, the FP8 checkpoint's bytes), and its results file
records its run."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.benchmark_scripts  # not in the default run; `-m benchmark_scripts` runs them


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The script as the docs run it, from the repository root, into a temporary results file."""
    out = tmp_path_factory.mktemp("scaling") / "scaling.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scaling_arithmetic", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(out.read_text()), proc.stdout


def rows(result, key, model):
    return [r for r in result[key] if r["model"] == model]


def test_the_results_file_records_its_run_and_the_tables_are_printed(run):
    result, stdout = run
    assert {"device", "gpus", "date", "versions", "command", "assumptions"} <= set(result)
    assert result["command"].startswith("python -m benchmarks.scaling_arithmetic")
    assert result["versions"]["torch"] and set(result["models"]) == {"Qwen3-8B", "Qwen3-32B", "Qwen3-30B-A3B"}
    for heading in ("FSDP2 shards", "vLLM tensor parallel", "The FP8 sync per step", "per GPU (GiB)"):
        assert heading in stdout
    assert "| q_proj | 4096x4096 |" in stdout  # Markdown rows, ready to paste


def test_shards_hold_whole_blocks_exactly_where_fsdp2s_chunks_are_multiples_of_128_rows(run):
    result, _ = run
    for r in result["alignment"]:
        rows_ = r["shape"][0]
        for w, ok in r["aligned"].items():
            assert ok == (math.ceil(rows_ / int(w)) % r["rows_per_block"] == 0), (r, w)
    kinds = {r["kind"]: r for r in rows(result, "alignment", "Qwen3-8B")}
    # k/v: 8 kv heads x 128 = 1024 rows = 8 blocks: whole blocks on up to 8 shards, not on 16
    for kv in ("k_proj", "v_proj"):
        assert [w for w, ok in kinds[kv]["aligned"].items() if ok] == ["2", "4", "8"]
    experts = [r for r in rows(result, "alignment", "Qwen3-30B-A3B") if r["kind"].startswith("experts.")]
    assert experts and all(all(r["aligned"].values()) for r in experts)  # sharded by expert: always whole


def test_the_sync_gathers_fewer_bytes_in_fp8_than_in_bf16_than_as_fp32_masters(run):
    result, _ = run
    for g in result["gather_bytes"]:
        assert g["fp8_layers_fp32"] == 2 * g["fp8_layers_bf16"]
        if g["fp8_weights_gathered_in_bf16"] < g["fp8_weights"]:
            assert g["fp8_layers_rule"] < g["fp8_layers_bf16"]
        else:
            assert g["fp8_layers_rule"] == g["fp8_layers_bf16"]
    # Qwen3-8B on 8 shards: every weight aligned, every dim a multiple of 128: 1 byte a weight + 4 per 128x128 block
    (g8,) = [g for g in rows(result, "gather_bytes", "Qwen3-8B") if g["shards"] == 8]
    fp8_params = result["models"]["Qwen3-8B"]["fp8_params"]
    assert g8["fp8_weights_gathered_in_bf16"] == 0 and g8["fp8_layers_rule"] == fp8_params + 4 * fp8_params // 128**2
    for r in result["sync"]:
        if r["fp8"] is not None:
            assert r["fp8"]["seconds"] <= r["bf16"]["seconds"] and (r["fp32"] is None
                                                                   or r["bf16"]["seconds"] < r["fp32"]["seconds"])  # fmt: skip


def test_each_engine_receives_the_fp8_checkpoints_bytes():
    """The bytes pushed into an engine are the FP8 checkpoint's, as `trl-fp8 plan` sizes vLLM's weights."""
    from benchmarks.scaling_arithmetic import build, sync, tensors
    from trl_fp8.rollout.capacity import ModelShape, weight_bytes

    config, model, fp8_modules = build("Qwen3-8B")
    (ddp, *_, server) = sync("Qwen3-8B", tensors(model, fp8_modules))
    assert ddp["engine_bytes"] == weight_bytes(ModelShape.from_config(config), fp8=True)
    assert ddp["fp8"] is None  # DDP: each rank pushes its own copy
    assert server["fp8"]["server_bytes"] == ddp["engine_bytes"] < ddp["engine_bytes_bf16"]


def test_tensor_parallel_partitions_hold_whole_blocks_or_experts_run_expert_parallel(run):
    result, _ = run
    for r in result["tensor_parallel"]:
        assert r["accepted"] and r["whole_blocks"], r
    moe = {r["tp"]: r for r in rows(result, "tensor_parallel", "Qwen3-30B-A3B")}
    inter = result["models"]["Qwen3-30B-A3B"]["config"]["moe_intermediate_size"]
    for tp, r in moe.items():  # experts split below whole blocks (768 / 4 = 192) go expert parallel instead
        assert r["enable_expert_parallel"] == (inter % tp != 0 or (inter // tp) % 128 != 0), tp
    assert [tp for tp, r in moe.items() if r["kv_replicated"]] == [8]  # 4 kv heads: one a rank up to TP=4
    assert not any(r["kv_replicated"] for r in rows(result, "tensor_parallel", "Qwen3-8B"))  # 8 kv heads


def test_hsdp_memory_per_gpu_stays_with_the_node_and_fsdp2_over_every_gpu_shrinks(run):
    result, _ = run
    for model in result["models"]:
        for optim in ("adamw_torch", "adamw_bnb_8bit"):
            mem = [r for r in rows(result, "memory", model) if r["optim"] == optim]
            assert len({r["hsdp_bytes"] for r in mem}) == 1 and len({r["ddp_bytes"] for r in mem}) == 1
            assert mem[0]["fsdp2_bytes"] == mem[0]["hsdp_bytes"]  # one node: the same shards
            fsdp2 = [r["fsdp2_bytes"] for r in mem]
            assert fsdp2 == sorted(fsdp2, reverse=True) and all(r["ddp_bytes"] > r["hsdp_bytes"] for r in mem)
        adamw, eight_bit = ([r for r in rows(result, "memory", model) if r["optim"] == o] for o in
                            ("adamw_torch", "adamw_bnb_8bit"))  # fmt: skip
        assert all(b["hsdp_bytes"] < a["hsdp_bytes"] for a, b in zip(adamw, eight_bit, strict=True))
