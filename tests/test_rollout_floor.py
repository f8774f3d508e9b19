"""The rollout floor of the benchmarks (`bench_rollout.floor_tokens_per_s`): the bytes a model's decode steps read,
and a lower bound on a rollout's time that holds whatever order vLLM schedules the sequences in."""

import json
from pathlib import Path

import pytest
import torch

from benchmarks.bench_rollout import HARDWARE, SHAPES, floor_tokens_per_s, model_bytes, refloor

ROOT = Path(__file__).resolve().parents[1]

H100 = HARDWARE["H100"]


def test_model_bytes_count_the_linear_layers_of_the_benchmark_model():
    """The shape's arithmetic gives the parameters of the model the benchmarks build from it (Qwen3, head_dim 128,
    untied lm_head): every nn.Linear but lm_head, in 1 byte (FP8) or 2 (BF16), lm_head in BF16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES["tiny"], head_dim=128, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    linear = sum(m.weight.numel() for n, m in linears if "lm_head" not in n)
    lm_head = model.lm_head.weight.numel()
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * 128

    bf16, fp8 = model_bytes(SHAPES["tiny"], False, False), model_bytes(SHAPES["tiny"], True, True)
    assert bf16["weights"] == 2 * linear + 2 * lm_head and fp8["weights"] == linear + 2 * lm_head
    assert bf16["kv_per_token"] == 2 * kv and fp8["kv_per_token"] == kv
    assert bf16["flops_per_token"] == 2 * (linear + lm_head)


def test_the_floor_of_a_rollout_that_fits_reads_the_weights_once_per_new_token():
    """Every sequence in the cache at once: N decode steps, each reading the weights, plus each token's context."""
    sizes = model_bytes(SHAPES["8b"], fp8_linear=False, fp8_kv=False)
    seqs, prompt, new = 64, 256, 1024
    floor = floor_tokens_per_s(sizes, H100, False, seqs, prompt, new, kv_tokens=10**9)
    kv_reads = sum(seqs * (prompt + t) for t in range(new))
    memory_s = (new * sizes["weights"] + kv_reads * sizes["kv_per_token"]) / H100["hbm"]
    prefill_s = seqs * prompt * sizes["flops_per_token"] / H100["bf16"]
    assert floor["floor_decode_steps"] == new and floor["bound"] == "memory"
    assert floor["floor_tokens_per_s"] == pytest.approx(seqs * new / (prefill_s + memory_s), rel=1e-9)


def test_a_smaller_kv_cache_or_a_concurrency_cap_takes_more_decode_steps():
    """A decode step reads at most the whole KV cache: a rollout whose context reads exceed it needs more steps
    (each reading the weights again), and so does a cap on the sequences at once."""
    sizes = model_bytes(SHAPES["8b"], fp8_linear=True, fp8_kv=True)
    seqs, prompt, new = 256, 256, 2048
    kv_reads = seqs * (new * prompt + new * (new - 1) / 2)
    roomy = floor_tokens_per_s(sizes, H100, True, seqs, prompt, new, kv_tokens=seqs * (prompt + new))
    tight = floor_tokens_per_s(sizes, H100, True, seqs, prompt, new, kv_tokens=196_192)
    capped = floor_tokens_per_s(sizes, H100, True, seqs, prompt, new, kv_tokens=10**9, max_num_seqs=64)
    assert roomy["floor_decode_steps"] == new
    assert tight["floor_decode_steps"] == round(kv_reads / 196_192) > new
    assert capped["floor_decode_steps"] == seqs * new // 64
    assert tight["floor_tokens_per_s"] < roomy["floor_tokens_per_s"]
    assert capped["floor_tokens_per_s"] < roomy["floor_tokens_per_s"]
    # FP8 + FP8 KV's floor is 3.7x BF16's at this point of the committed H100 run (BF16: 51,888 KV tokens)
    bf16 = floor_tokens_per_s(model_bytes(SHAPES["8b"], False, False), H100, False, seqs, prompt, new, 51_888)
    assert 3.5 < tight["floor_tokens_per_s"] / bf16["floor_tokens_per_s"] < 4.0


def test_refloor_rewrites_the_floors_of_a_results_file_and_keeps_its_measurements(tmp_path):
    point = {"seqs": 256, "new_tokens": 2048, "tokens_per_s": 3648.0, "seconds": 143.7, "floor_tokens_per_s": 3679.0,
             "concurrency": 22, "bound": "memory", "of_floor": 0.99}  # fmt: skip
    row = {"engine": "bf16", "rollout_precision": "bf16", "fp8_kv_cache": False, "kv_cache_tokens": 51_888,
           "max_num_seqs": 256, "linear_kernel": "k", "engine_start_s": 86.0, "weight_sync_ms": 189.0,
           "points": [point]}  # fmt: skip
    result = {"device": "NVIDIA H100 80GB HBM3", "shape": {"name": "8b", **SHAPES["8b"]}, "prompt_len": 256,
              "hardware_peaks": H100, "results": [row]}  # fmt: skip
    path = tmp_path / "rollout.json"
    path.write_text(json.dumps(result))
    refloor(path)
    (new,) = json.loads(path.read_text())["results"][0]["points"]
    assert new["tokens_per_s"] == 3648.0 and new["seconds"] == 143.7 and "concurrency" not in new
    expected = floor_tokens_per_s(model_bytes(SHAPES["8b"], False, False), H100, False, 256, 256, 2048, 51_888, 256)
    assert new["floor_tokens_per_s"] == pytest.approx(expected["floor_tokens_per_s"])
    assert new["of_floor"] == pytest.approx(3648.0 / expected["floor_tokens_per_s"]) and new["of_floor"] < 0.99


def test_grpo_rollout_floor_is_one_engines_generation_batch_at_full_length():
    from benchmarks.bench_grpo import rollout_floor

    settings = {"shape": "8b", "generation_batch": 128, "prompt_len": 128, "completion_len": 2048}
    row = {"rollout_precision": "fp8", "fp8_kv_cache": True, "kv_cache_tokens": 201_504,
           "step_time": {"rollout_s": 30.0}}  # fmt: skip
    floor = rollout_floor(row, settings, "NVIDIA H100 80GB HBM3")
    direct = floor_tokens_per_s(model_bytes(SHAPES["8b"], True, True), H100, True, 128, 128, 2048, 201_504)
    assert floor["floor_s"] == pytest.approx(128 * 2048 / direct["floor_tokens_per_s"])
    assert floor["of_floor"] == pytest.approx(floor["floor_s"] / 30.0)
    assert rollout_floor(row, settings, "some other GPU") is None  # no data-sheet peaks: no floor claimed
    # An engine over two GPUs decodes both ranks' 256 sequences, each GPU holding half of every weight and cached
    # token: every term of the floor halves, against one GPU decoding the 256 with the same cache.
    tp2 = rollout_floor(row, settings | {"vllm_tensor_parallel_size": 2}, "NVIDIA H100 80GB HBM3")
    halves = {key: value / 2 for key, value in model_bytes(SHAPES["8b"], True, True).items()}
    direct = floor_tokens_per_s(halves, H100, True, 256, 128, 2048, 201_504)
    assert tp2["floor_s"] == pytest.approx(256 * 2048 / direct["floor_tokens_per_s"])
    one_gpu = floor_tokens_per_s(model_bytes(SHAPES["8b"], True, True), H100, True, 256, 128, 2048, 201_504)
    assert tp2["floor_s"] == pytest.approx(0.5 * 256 * 2048 / one_gpu["floor_tokens_per_s"])


def test_grpo_rows_carry_the_planners_kv_estimate_for_their_engine():
    """What `trl-fp8 plan` prints for the run's settings, beside vLLM's figure (the planner's goal: within 10%)."""
    from benchmarks.bench_grpo import planned_kv_tokens
    from trl_fp8.rollout.capacity import ModelShape, rollout_capacity

    settings = {"shape": "8b", "generation_batch": 128, "prompt_len": 128, "completion_len": 2048, "vllm_memory": 0.3}
    row = {"rollout_precision": "bf16", "fp8_kv_cache": False, "kv_cache_tokens": 51_440, "gpu_memory_gib": 79.1787}
    shape = ModelShape.from_config(dict(SHAPES["8b"], head_dim=128, tie_word_embeddings=False))
    expected = rollout_capacity(shape, int(79.1787 * 2**30), 0.3, fp8_weights=False, fp8_kv=False, seq_len=2176,
                                max_num_seqs=128).kv_tokens  # fmt: skip
    planned = planned_kv_tokens(row, settings)
    assert planned == {"kv_tokens": expected, "error": pytest.approx(expected / 51_440 - 1)}
    fp8kv = planned_kv_tokens(row | {"rollout_precision": "fp8", "fp8_kv_cache": True}, settings)
    assert fp8kv["kv_tokens"] > 3 * expected  # half the weight bytes and half the bytes per token
    assert planned_kv_tokens(row | {"kv_cache_tokens": None}, settings) is None
