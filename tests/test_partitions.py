"""Tensor-parallel partitions of the FP8 layers: the shapes each vLLM rank runs, and the splits refused at start-up."""

import pytest
import torch

from trl_fp8 import convert_to_fp8
from trl_fp8.checkpoint.save import fp8_module_names
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.rollout.vllm.deepgemm_warmup import engine_gemm_shapes
from trl_fp8.rollout.vllm.partitions import (
    check_tensor_parallel,
    partition_shape,
    tensor_parallel_env,
    tensor_parallel_overrides,
)


def test_partition_shapes_follow_vllms_column_and_row_splits():
    assert partition_shape("q_proj", 4096, 4096, 2) == (2048, 4096)
    assert partition_shape("down_proj", 4096, 12288, 4) == (4096, 3072)  # row parallel: the inputs split
    assert partition_shape("o_proj", 4096, 4096, 1) == (4096, 4096)
    assert partition_shape("k_proj", 1024, 4096, 4, head_dim=128) == (256, 4096)
    assert partition_shape("k_proj", 128, 256, 2, head_dim=128) == (128, 256)  # one head: replicated, not split


def test_precompiled_shapes_are_one_ranks_partitions():
    # tiny Qwen3: hidden 256, 2 query heads and 1 key/value head of 128, intermediate 512
    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model)
    names = fp8_module_names(model)
    assert engine_gemm_shapes(model, names) == [(256, 256), (256, 512), (512, 256), (1024, 256)]
    # TP=2: qkv = 128 + 128 + 128 (the key/value head replicated), gate/up 2 x 256, o_proj K 128, down_proj K 256
    assert engine_gemm_shapes(model, names, 2) == [(256, 128), (256, 256), (384, 256), (512, 256)]


def test_splits_below_whole_blocks_are_refused_with_the_sizes_that_work():
    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model)
    names = fp8_module_names(model)
    assert check_tensor_parallel(model, names, 1) == {} and check_tensor_parallel(model, names, 2) == {}
    with pytest.raises(ValueError, match=r"vllm_tensor_parallel_size=4 splits model.layers.0.mlp.down_proj .*"
                                         r"parts of 128.*|vllm_tensor_parallel_size=4 splits .*in \[1, 2\]"):  # fmt: skip
        check_tensor_parallel(model, names, 4)
    # layers kept in BF16 are vLLM's to split
    assert check_tensor_parallel(model, {n for n in names if "self_attn" in n}, 1) == {}


def test_experts_split_below_whole_blocks_run_expert_parallel():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                            num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    convert_to_fp8(model)
    names = fp8_module_names(model)
    assert any(n.endswith("mlp.experts") for n in names)
    assert check_tensor_parallel(model, names, 2) == {}  # experts' intermediate 256 / 2: whole blocks
    assert check_tensor_parallel(model, names, 4) == {"enable_expert_parallel": True}  # 64: whole experts instead


def test_allreduce_norm_fusion_is_off_where_nvlink_multicast_is_off():
    def values(environ, tp=2):
        return {name: value for name, (value, _why) in tensor_parallel_overrides(tp, environ).items()}

    off = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
    assert values({"NCCL_NVLS_ENABLE": "0"}) == off
    assert values({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}) == off
    assert values({}) == {}  # multicast available: vLLM's choice stands
    assert values({"NCCL_NVLS_ENABLE": "0"}, tp=1) == {}  # one rank: no all-reduce


def test_flashinfer_allreduce_is_off_where_nvlink_multicast_is_off():
    """vLLM 0.31 turns FlashInfer's all-reduce (multicast workspace first) on by default; 0.26 had it off."""
    assert tensor_parallel_env(2, {"NCCL_NVLS_ENABLE": "0"})["VLLM_ALLREDUCE_USE_FLASHINFER"][0] == "0"
    assert tensor_parallel_env(2, {}) == {} and tensor_parallel_env(1, {"NCCL_NVLS_ENABLE": "0"}) == {}


def test_custom_allreduce_is_off_where_the_allocator_runs_on_expandable_segments():
    """FP8GRPOTrainer turns expandable segments on in sleep mode; vLLM's custom all-reduce then exits the engine
    after its CUDA graphs are captured (cudaIpcGetMemHandle refuses that memory), so NCCL all-reduces instead."""
    expandable = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments: True"}
    overrides = tensor_parallel_overrides(2, expandable)
    assert (
        overrides["disable_custom_all_reduce"][0] is True
        and "expandable segments" in overrides["disable_custom_all_reduce"][1]
    )
    assert "compilation_config" not in overrides  # multicast on: the fusion stays
    assert tensor_parallel_overrides(2, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}) == {}
    assert tensor_parallel_overrides(1, expandable) == {}  # one rank: no all-reduce
    both = tensor_parallel_overrides(4, {**expandable, "NCCL_NVLS_ENABLE": "0"})
    assert set(both) == {"compilation_config", "disable_custom_all_reduce"}
