"""On an SM90 GPU: an FP8 layer's forward and backward never make the host wait for the GPU (no device-to-host copy,
no stream synchronization), so the host can queue a micro-batch's layers ahead of the GPU, as BF16's do.

`torch.cuda.set_sync_debug_mode("error")` raises at any synchronizing PyTorch call (an `.item()`, a `.tolist()`,
`torch.bincount`'s size check, `nonzero`); the first call of each layer, which compiles Triton's and DeepGEMM's kernels,
runs outside it. The layers run as the trainer runs them: the dense layer with and without its cached FP8 weight, the
experts on both grouped kernels with gradients added in place, at Qwen3-30B-A3B's expert shape.
"""

import contextlib

import pytest
import torch

from trl_fp8 import FP8Linear, FP8LinearConfig

pytestmark = pytest.mark.gpu


@contextlib.contextmanager
def host_never_waits():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _forward_backward(layer, *inputs):
    x = inputs[0].detach().requires_grad_()
    out = layer(x, *inputs[1:])
    out.backward(torch.ones_like(out))
    return out


@pytest.mark.parametrize("backend", ["scaled_mm", "deepgemm"])
@pytest.mark.parametrize("cache_with_grad", [True, False])
def test_fp8_linear_forward_and_backward_never_sync(backend, cache_with_grad):
    from trl_fp8.ops import deep_gemm

    if backend == "deepgemm" and deep_gemm.available() is not None:
        pytest.skip(deep_gemm.available())
    layer = torch.nn.Linear(2048, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    FP8Linear.convert_(layer, FP8LinearConfig(backend=backend, cache_with_grad=cache_with_grad))
    x = torch.randn(4, 1000, 2048, device="cuda", dtype=torch.bfloat16)
    _forward_backward(layer, x)  # compiles
    with host_never_waits():
        for _ in range(2):  # the second call sees the first's cached weight and gradient
            _forward_backward(layer, x)
    torch.cuda.synchronize()


def _experts(kernel):
    """FP8 experts at Qwen3-30B-A3B's shape as the trainer runs them, a routing of 1,024 tokens, and one forward and
    backward done (the compiles; `.grad` left for the next backward to add into)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from trl_fp8.nn.experts import FP8Experts, grouped_gemm_kernel

    if kernel == "deepgemm" and grouped_gemm_kernel("auto", torch.zeros(1, device="cuda").bfloat16()) != "deepgemm":
        pytest.skip("no DeepGEMM here (vLLM's bundled copy on an SM90 GPU)")
    config = Qwen3MoeConfig(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            vocab_size=128)  # fmt: skip
    experts = Qwen3MoeExperts(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    cfg = FP8LinearConfig(
        backend="scaled_mm", experts_gemm=kernel, fuse_wgrad_accumulation=True, cache_with_grad=False
    )
    FP8Experts.convert_(experts, cfg)
    x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    index = torch.topk(torch.randn(1024, 128, device="cuda"), 8, dim=-1).indices
    weights = torch.full((1024, 8), 1 / 8, device="cuda", dtype=torch.bfloat16)
    _forward_backward(experts, x, index, weights)
    return experts, x, index, weights


@pytest.mark.parametrize("kernel", ["triton", "deepgemm"])
def test_fp8_experts_forward_and_backward_never_sync(kernel):
    experts, *inputs = _experts(kernel)
    with host_never_waits():
        for _ in range(2):
            _forward_backward(experts, *inputs)
    torch.cuda.synchronize()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0


def test_the_check_catches_a_host_sync(monkeypatch):
    """The check fails where the layer syncs: the rows per expert counted by `torch.bincount`, as up to 2026-11-28."""
    from trl_fp8.nn import experts as experts_module

    experts, *inputs = _experts("triton")
    monkeypatch.setattr(experts_module, "expert_counts", lambda ids, n: torch.bincount(ids, minlength=n))
    with pytest.raises(RuntimeError, match="synchroniz"), host_never_waits():
        _forward_backward(experts, *inputs)
    torch.cuda.synchronize()
