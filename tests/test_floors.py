"""The benchmarks' floors (`benchmarks/floors.py`): the least time a GPU's data-sheet peaks allow for a linear layer's
forward + backward and for a training step, against counts made here by hand."""

import pytest

from benchmarks.bench_rollout import HARDWARE, SHAPES
from benchmarks.floors import (
    act_quant_bytes,
    decoder_linears,
    gemm_floor_s,
    linear_floor_s,
    train_step_floor_s,
    weight_quant_bytes,
)

HW = HARDWARE["H200"]


def test_a_gemm_is_bound_by_its_flops_when_large_and_by_its_bytes_when_thin():
    m, k, n = 8192, 4096, 4096
    assert gemm_floor_s(m, k, n, False, HW) == 2 * m * k * n / 989e12
    assert gemm_floor_s(m, k, n, True, HW) == 2 * m * k * n / 1979e12  # FP8's peak: twice the FLOPs a second
    # one token: the weight's bytes bound it (1 byte a weight in FP8, 2 in BF16), the output is BF16
    assert gemm_floor_s(1, k, n, True, HW) == (k + k * n + 2 * n) / 4.8e12
    assert gemm_floor_s(1, k, n, False, HW) == (2 * k + 2 * k * n + 2 * n) / 4.8e12


def test_quantization_bytes_count_the_bf16_read_the_fp8_writes_and_the_scales():
    # 256 tokens x 512: read 2 bytes each, write 1 byte in each of two layouts, a float32 scale per 128 in each
    assert act_quant_bytes(256, 512) == 256 * 512 * (2 + 1 + 1) + 2 * 4 * (256 * 512 // 128)
    # a 384 x 512 weight: read 2 bytes, write 1, a float32 scale per 128 x 128 block (3 x 4 of them)
    assert weight_quant_bytes(384, 512) == 384 * 512 * 3 + 4 * 12


def test_a_linear_layers_floor_is_its_three_gemms_and_in_fp8_its_quantization_passes():
    m, k, n = 8192, 4096, 1024
    gemms = {fp8: gemm_floor_s(m, k, n, fp8, HW) + gemm_floor_s(m, n, k, fp8, HW) + gemm_floor_s(n, m, k, fp8, HW)
             for fp8 in (False, True)}  # fmt: skip
    assert linear_floor_s(m, k, n, False, HW) == gemms[False]
    passes = act_quant_bytes(m, k) + act_quant_bytes(m, n)
    for weight_quantizations in (0, 1, 2):
        expected = gemms[True] + (passes + weight_quantizations * weight_quant_bytes(n, k)) / HW["hbm"]
        assert linear_floor_s(m, k, n, True, HW, weight_quantizations) == pytest.approx(expected, rel=1e-12)
    assert linear_floor_s(m, k, n, True, HW) < linear_floor_s(m, k, n, False, HW)


def test_a_training_steps_floor_is_its_layers_attention_and_lm_head():
    """Without checkpointing and without the weight cache, a step's linear part is the sum of its layers' linear
    floors; checkpointing adds one forward of every checkpointed layer; the cache one weight quantization fewer."""
    shape, layers, batch, seq, mb = SHAPES["1.7b"], 28, 8, 1152, 2
    m = batch * seq
    for fp8 in (False, True):
        step = train_step_floor_s(shape, layers, batch, seq, mb, fp8, HW, checkpoint_every_n=0, weight_cache=False)
        linears = layers * sum(linear_floor_s(m, k, n, fp8, HW) for k, n in decoder_linears(shape))
        assert step["linear_gemms_s"] + step["fp8_quantization_s"] == pytest.approx(mb * linears, rel=1e-12)
        # causal attention: 2 x seq^2 x (heads x 128) FLOPs a layer and sequence forward, the backward twice that
        assert step["attention_s"] == pytest.approx(mb * 3 * layers * batch * 2 * seq**2 * 16 * 128 / 989e12)
        h, vocab = shape["hidden_size"], shape["vocab_size"]
        assert step["lm_head_s"] == pytest.approx(mb * 3 * 2 * m * h * vocab / 989e12)  # BF16 in both flows
        assert step["floor_s"] == pytest.approx(sum(v for key, v in step.items() if key != "floor_s"))
    plain = train_step_floor_s(shape, layers, batch, seq, mb, True, HW, checkpoint_every_n=0)
    every2 = train_step_floor_s(shape, layers, batch, seq, mb, True, HW, checkpoint_every_n=2)
    every1 = train_step_floor_s(shape, layers, batch, seq, mb, True, HW, checkpoint_every_n=1)
    fprop = layers * sum(gemm_floor_s(m, k, n, True, HW) for k, n in decoder_linears(shape))
    assert every1["linear_gemms_s"] - plain["linear_gemms_s"] == pytest.approx(mb * fprop)
    assert every2["linear_gemms_s"] - plain["linear_gemms_s"] == pytest.approx(mb * fprop / 2)
    uncached = train_step_floor_s(shape, layers, batch, seq, mb, True, HW, checkpoint_every_n=0, weight_cache=False)
    weights = layers * sum(weight_quant_bytes(n, k) for k, n in decoder_linears(shape)) / HW["hbm"]
    assert uncached["fp8_quantization_s"] - plain["fp8_quantization_s"] == pytest.approx(mb * weights * (1 - 1 / mb))
    # at this shape FP8's floor is below BF16's: half the GEMM time, plus the quantization passes
    assert every1["floor_s"] < train_step_floor_s(shape, layers, batch, seq, mb, False, HW)["floor_s"]


def test_the_benchmarks_put_the_floor_beside_each_row():
    """bench_train_step and bench_linear add a row's floor and its fraction where the GPU's peaks are known, for the
    flows the floor models (torchao's other recipes get none), and nothing on a device without known peaks."""
    from benchmarks import bench_linear, bench_train_step

    class Args:
        shape, layers, micro_batch, seq_len, micro_batches = "tiny", None, 2, 256, 2

    row = {"flow": "fp8_nocache", "step_s": 0.5}
    bench_train_step.add_floor(row, Args, HW)
    expected = train_step_floor_s(SHAPES["tiny"], 2, 2, 256, 2, True, HW, weight_cache=False)
    assert row["floor"] == expected and row["of_floor"] == expected["floor_s"] / 0.5
    bf16 = {"flow": "bf16", "step_s": 0.5}
    bench_train_step.add_floor(bf16, Args, None)
    assert "floor" not in bf16  # no peaks for this device

    cached = {"ms": 2.0}
    bench_linear.add_floor(cached, "trl_fp8 blockwise (cached W)", 8192, 4096, 4096, HW)
    assert cached["floor_ms"] == 1e3 * linear_floor_s(8192, 4096, 4096, True, HW, 1)
    assert cached["of_floor"] == cached["floor_ms"] / 2.0
    torchao = {"ms": 2.0}
    bench_linear.add_floor(torchao, "torchao tensorwise", 8192, 4096, 4096, HW)
    assert "floor_ms" not in torchao
