"""On an SM90 GPU: the grouped expert GEMMs (`trl_fp8.kernels.grouped_gemm`) compiled for Hopper, at Qwen3-30B-A3B's
expert shape (`benchmarks/bench_experts.py`: hidden 2048, intermediate 768, 128 experts, top-8).

Bounds: the GPU suite's 4e-3 relative (`test_kernels_gpu.py`): against the fp32 emulation on identical FP8 operands
(the tensor cores sum each 128-deep block with less than fp32 precision, then bf16 rounding), and the whole experts
layer on the grouped kernels against the per-expert loop on cuBLAS (same FP8 operands, both on the GPU).
`tests/test_grouped_gemm.py` runs the same kernels in Triton's CPU interpreter to fp32 rounding.
"""

import copy

import pytest
import torch

from trl_fp8 import FP8LinearConfig
from trl_fp8.ops import emulated

from conftest import rel_err

pytestmark = pytest.mark.gpu

H, INTER, E, TOP_K = 2048, 768, 128, 8


def _routing(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, generator=g), dim=-1), TOP_K, dim=-1)
    return index.cuda(), (weights / weights.sum(-1, keepdim=True)).to("cuda", torch.bfloat16)


def _kernels():
    from trl_fp8.nn.experts import grouped_gemm_kernel

    auto = grouped_gemm_kernel("auto", torch.zeros(1, device="cuda", dtype=torch.bfloat16))
    return ["triton"] + (["deepgemm"] if auto == "deepgemm" else [])


@pytest.mark.parametrize("kernel", ["triton", "deepgemm"])
@pytest.mark.parametrize("tokens", [1024, 8192])
def test_grouped_kernels_match_the_emulation_per_expert(tokens, kernel):
    from trl_fp8.kernels import GroupedRows, k_grouped_gemm, quantize_act, quantize_weight
    from trl_fp8.kernels.weight_quant import quantize_expert_weights_t, transpose_expert_weights
    from trl_fp8.nn.experts import _m_grouped

    if kernel not in _kernels():
        pytest.skip("no DeepGEMM here (vLLM's bundled copy on an SM90 GPU)")
    index, _ = _routing(tokens)
    counts = torch.bincount(index.reshape(-1), minlength=E).tolist()
    rows = GroupedRows(counts, torch.device("cuda"))
    x = torch.randn(rows.num_rows, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows.num_rows, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, 2 * INTER, H, device="cuda", dtype=torch.bfloat16) * 0.02
    xa = quantize_act(x, source_rows=rows.source, rows=True, cols=True)
    dya = quantize_act(dy, source_rows=rows.source, rows=True, cols=True)
    q, s = quantize_weight(w.reshape(E * 2 * INTER, H))
    b = (q.view(E, 2 * INTER, H), s.view(E, 2 * INTER // 128, H // 128))
    bt = quantize_expert_weights_t(w)
    moved = transpose_expert_weights(*b)  # DGrad's operand from the cached blocks: the same bytes
    assert torch.equal(moved[0].view(torch.uint8), bt[0].view(torch.uint8)) and torch.equal(moved[1], bt[1])
    y = _m_grouped(xa, *b, rows, kernel, torch.bfloat16)
    dx = _m_grouped(dya, *bt, rows, kernel, torch.bfloat16)
    dw = k_grouped_gemm(dya.qt, dya.scale_inv_t, xa.qt, xa.scale_inv_t, rows, torch.bfloat16)
    # one program per output tile over every group: the same sums in the same order
    dw_persistent = k_grouped_gemm(dya.qt, dya.scale_inv_t, xa.qt, xa.scale_inv_t, rows, torch.bfloat16,
                                   block_n=64, num_warps=4, num_stages=3, persistent=True)  # fmt: skip
    print(f"persistent WGrad vs a program per expert: rel diff {rel_err(dw_persistent, dw):.2e}")
    assert rel_err(dw_persistent, dw) <= 1e-6
    offsets = rows.offsets.tolist()
    for e in range(0, E, 17):  # a sample of experts
        real = slice(offsets[e], offsets[e] + counts[e])
        tok, grp = slice(offsets[e], offsets[e + 1]), slice(offsets[e] // 128, offsets[e + 1] // 128)
        pairs = (
            (y[real], emulated.gemm(xa.q[real], xa.scale_inv[real], b[0][e], b[1][e], True, torch.float32)),
            (dx[real], emulated.gemm(dya.q[real], dya.scale_inv[real], bt[0][e], bt[1][e], True, torch.float32)),
            (dw[e], emulated.gemm(dya.qt[:, tok], dya.scale_inv_t[:, grp], xa.qt[:, tok], xa.scale_inv_t[:, grp],
                                  False, torch.float32)),
        )  # fmt: skip
        for name, (got, ref) in zip(("fprop", "dgrad", "wgrad"), pairs, strict=True):
            print(f"{kernel} {name} tokens={tokens} expert {e} ({counts[e]} rows): rel diff {rel_err(got, ref):.2e}")
            assert rel_err(got, ref) < 4e-3


@pytest.mark.parametrize("kernel", ["triton", "deepgemm"])
def test_grouped_experts_match_the_per_expert_loop_on_the_gpu(kernel):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from trl_fp8.nn.experts import FP8Experts

    if kernel not in _kernels():
        pytest.skip("no DeepGEMM here (vLLM's bundled copy on an SM90 GPU)")
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    grouped = FP8Experts.convert_(experts, FP8LinearConfig(backend="scaled_mm", experts_gemm=kernel))
    looped = copy.deepcopy(grouped)
    looped._grouped_kernels = False
    index, weights = _routing(1024)
    x = torch.randn(1024, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    results = []
    for module in (grouped, looped):
        xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = module(xg, index, wg)
        out.backward(dy)
        results.append((out, xg.grad, module.gate_up_proj.grad, module.down_proj.grad, wg.grad))
    names = ("out", "dx", "d gate_up_proj", "d down_proj", "d router weights")
    for name, got, ref in zip(names, *results, strict=True):
        print(f"grouped ({kernel}) vs loop {name}: rel diff {rel_err(got, ref):.2e}")
        assert got.dtype == ref.dtype and rel_err(got, ref) < 4e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_added_in_place_on_the_gpu(dtype):
    """`fuse_wgrad_accumulation` on Hopper: two micro-batches, the second's WGrad added into `.grad` by the kernel,
    against autograd's accumulation of the same layer: equal in fp32 (both add the fp32 product to the fp32
    gradient). In BF16 the kernel rounds the sum once; autograd rounds the micro-batch's gradient to BF16, then the
    sum: the two differ by at most a rounding of each sum and one of the second gradient (unit roundoff 2**-8), which
    is large against the sum where the two micro-batches' gradients cancel."""
    import dataclasses

    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from trl_fp8.nn.experts import FP8Experts

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOP_K,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                            vocab_size=128)  # fmt: skip
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to("cuda", dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.02)
        experts.down_proj.normal_(0, 0.02)
    unfused = FP8Experts.convert_(experts, FP8LinearConfig(backend="scaled_mm"))
    fused = copy.deepcopy(unfused)
    fused.fp8_config = dataclasses.replace(fused.fp8_config, fuse_wgrad_accumulation=True)
    second_only = copy.deepcopy(unfused)
    index, weights = _routing(2048)
    x = torch.randn(2048, H, device="cuda", dtype=dtype)
    grads = [torch.randn_like(x) for _ in range(2)]
    for module in (unfused, fused):
        for dy in grads:
            module(x, index, weights.to(dtype)).backward(dy)
    second_only(x, index, weights.to(dtype)).backward(grads[1])
    for name in ("gate_up_proj", "down_proj"):
        got, ref = getattr(fused, name).grad.float(), getattr(unfused, name).grad.float()
        print(f"{dtype} {name}: in place vs autograd's sum, rel diff {rel_err(got, ref):.2e}")
        if dtype == torch.float32:
            assert torch.equal(got, ref)
        else:
            second = getattr(second_only, name).grad.float()
            bound = 2**-8 * (got.abs() + ref.abs() + 2 * second.abs())
            assert ((got - ref).abs() <= bound).all()
            assert not torch.equal(got, torch.zeros_like(got))
