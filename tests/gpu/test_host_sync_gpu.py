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
    """FP8 experts at Qwen3-30B-A3B's shape as the trainer runs them (`bench_experts`' layer and routing), 1,024
    tokens, and one forward and backward done (the compiles; `.grad` left for the next backward to add into)."""
    from benchmarks.bench_experts import QWEN3_30B_A3B, make_experts, routing
    from trl_fp8.nn.experts import FP8Experts, grouped_gemm_kernel

    if kernel == "deepgemm" and grouped_gemm_kernel("auto", torch.zeros(1, device="cuda").bfloat16()) != "deepgemm":
        pytest.skip("no DeepGEMM here (vLLM's bundled copy on an SM90 GPU)")
    cfg = FP8LinearConfig(
        backend="scaled_mm", experts_gemm=kernel, fuse_wgrad_accumulation=True, cache_with_grad=False
    )
    experts = FP8Experts.convert_(make_experts(QWEN3_30B_A3B, "cuda", "grouped_mm"), cfg)
    x = torch.randn(1024, QWEN3_30B_A3B["hidden_size"], device="cuda", dtype=torch.bfloat16)
    index, weights = routing(1024, QWEN3_30B_A3B, "cuda")
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


def test_the_check_catches_a_host_sync():
    """The check fails where the layer syncs: the rows per expert counted by `torch.bincount`, as up to 2026-11-28."""
    from benchmarks.bench_experts import host_syncing_counts

    experts, *inputs = _experts("triton")
    with pytest.raises(RuntimeError, match="synchroniz"), host_syncing_counts(), host_never_waits():
        _forward_backward(experts, *inputs)
    torch.cuda.synchronize()
