"""The parallel DeepGEMM compilation's CPU side: the engine's GEMM shapes, the split of the work, the command line."""

from __future__ import annotations

import pytest
import torch

from trl_fp8 import convert_to_fp8
from trl_fp8.checkpoint.save import fp8_module_names
from trl_fp8.cli.main import main
from trl_fp8.cli.warmup import model_shapes
from trl_fp8.demo.tiny_model import tiny_qwen3, tiny_qwen3_config
from trl_fp8.rollout.vllm.deepgemm_warmup import engine_gemm_shapes, precompile_deepgemm, split_tasks


def test_engine_shapes_follow_vllms_fused_layers():
    # hidden 256, 2 heads + 1 KV head of 128, intermediate 512: vLLM runs qkv_proj (512 x 256), o_proj (256 x 256),
    # gate_up_proj (1024 x 256) and down_proj (256 x 512).
    model = tiny_qwen3()
    convert_to_fp8(model)
    assert engine_gemm_shapes(model, fp8_module_names(model)) == [(256, 256), (256, 512), (512, 256), (1024, 256)]


def test_engine_shapes_keep_a_lone_sibling_and_drop_unaligned_layers():
    model = tiny_qwen3()
    names = {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj", "lm_head"}
    # q_proj alone (256 x 256), up_proj alone (512 x 256); lm_head (vocab 256 x 256) is a plain GEMM too.
    assert engine_gemm_shapes(model, names) == [(256, 256), (512, 256)]
    odd = tiny_qwen3(vocab_size=200)
    assert engine_gemm_shapes(odd, {"lm_head"}) == []  # N = 200 is not a multiple of 128: not a DeepGEMM layer


def test_engine_shapes_of_a_moe_model_are_its_dense_layers_only():
    """FP8 experts (stacked 3-D weights) run vLLM's fused-MoE kernels: only the attention and the dense MLP of the
    `mlp_only_layers` are DeepGEMM's (2026-11-26, H200: the MoE colocate test failed on the experts' missing `weight`)."""
    from test_fp8_experts import tiny_moe

    model = tiny_moe()
    convert_to_fp8(model)
    names = fp8_module_names(model)
    assert "model.layers.0.mlp.experts" in names
    # qkv 512 x 256, o_proj 256 x 256; layer 1's dense MLP: gate_up 1024 x 256, down 256 x 512
    assert engine_gemm_shapes(model, names) == [(256, 256), (256, 512), (512, 256), (1024, 256)]


def test_split_covers_every_token_count_once_in_contiguous_runs():
    shapes = [(512, 256), (1024, 256)]
    counts = {(512, 256): list(range(1, 12)), (1024, 256): [1, 2, 64, 128]}
    plans = split_tasks(shapes, counts, workers=3)
    assert len(plans) == 3
    for shape in shapes:
        runs = [ms for plan in plans for n, k, ms in plan if (n, k) == shape]
        assert sorted(m for run in runs for m in run) == counts[shape]
        assert all(run == list(range(run[0], run[0] + len(run))) or shape == (1024, 256) for run in runs)
    assert [plan[0][:2] for plan in plans] == [(512, 256), (1024, 256), (512, 256)]  # workers start apart
    assert len(split_tasks(shapes, counts, workers=20)) == 11  # no idle worker is started


def test_precompile_refuses_without_the_engine_settings(monkeypatch):
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM", raising=False)
    with pytest.raises(RuntimeError, match="apply_engine_env"):
        precompile_deepgemm([(512, 256)], 4096)


def test_cli_reads_shapes_from_a_config_folder(tmp_path, capsys):
    tiny_qwen3_config().save_pretrained(tmp_path)
    assert model_shapes(str(tmp_path)) == [(256, 256), (256, 512), (512, 256), (1024, 256)]
    # a server of two ranks: each rank's partitions (tests/test_partitions.py); four would split below a block
    assert model_shapes(str(tmp_path), 2) == [(256, 128), (256, 256), (384, 256), (512, 256)]
    with pytest.raises(ValueError, match="--tensor_parallel_size=4 splits"):
        model_shapes(str(tmp_path), 4)
    with pytest.raises(ValueError, match="no model folder at"):
        model_shapes(str(tmp_path / "missing"))
    assert main(["warmup", str(tmp_path), "--shapes", "512x256"]) == 2
    assert "not both" in capsys.readouterr().err
    if not torch.cuda.is_available():  # DeepGEMM cannot run: one line naming where to run it
        assert main(["warmup", str(tmp_path)]) == 2
        assert "DeepGEMM cannot run here (no CUDA GPU)" in capsys.readouterr().err
