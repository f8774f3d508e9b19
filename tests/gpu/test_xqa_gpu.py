"""FlashInfer's XQA decode on the FP8 KV cache with the scales of every sync (`trl_fp8.rollout.vllm.attention`), on
the GPU: a decode captured in a CUDA graph must follow KV scales changed after the capture, and the backend's direct
call of XQA with precomputed scales must give FlashInfer's own results with XQA alone in the graph."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("needs an SM90 GPU", allow_module_level=True)

pytest.importorskip("vllm")
pytest.importorskip("flashinfer")


def test_captured_xqa_decode_follows_scales_changed_after_capture():
    """The check `choose_kv_attention` runs at engine start: tensor scales (as trl-fp8's backend passes them) follow
    the new values at replay; Python floats (as vLLM's FlashInfer backend passes them) keep the captured ones, which
    the same check reports, so it can fail."""
    from trl_fp8.rollout.vllm.attention import decode_follows_live_scales, xqa_env

    os.environ.update(xqa_env())
    assert decode_follows_live_scales() is None
    for heads in ({"q_heads": 16, "kv_heads": 4, "head_dim": 128}, {"q_heads": 8, "kv_heads": 8, "head_dim": 64}):
        assert decode_follows_live_scales(**heads) is None, heads
    stale = decode_follows_live_scales(float_scales=True)
    assert stale is not None and "does not follow the KV scales" in stale, stale


def test_without_a_refresh_the_captured_decode_keeps_the_precomputed_q_scale_and_the_check_fails():
    """The scale tensors change after the capture but `q_scale` is not recomputed: the replay reads the new v_scale
    and the stale q_scale, so the logits are off by 4x; the check says so. The refresh is what carries new scales."""
    from trl_fp8.rollout.vllm.attention import decode_follows_live_scales, xqa_env

    os.environ.update(xqa_env())
    stale = decode_follows_live_scales(refresh=False)
    assert stale is not None and "does not follow the KV scales" in stale, stale


def _decode_case(layout: str, window_left: int, with_sinks: bool, seqs=16, q_heads=32, kv_heads=8, head_dim=128):
    """A decode batch over an FP8 paged cache (NHD: vLLM's packed K and V views; HND: a tensor each), its layer's
    scales and the arguments vLLM's forward passes FlashInfer's XQA decode, less the scales."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    page, pages_per_seq = 16, 8
    blocks = seqs * pages_per_seq
    k_scale, v_scale = 0.02, 0.015
    if layout == "NHD":
        packed = torch.randn(blocks, page, kv_heads, 2 * head_dim, generator=gen, device="cuda")
        packed[..., :head_dim] /= k_scale
        packed[..., head_dim:] /= v_scale
        k_cache, v_cache = packed.to(torch.float8_e4m3fn).split(head_dim, dim=-1)
    else:
        shape = (blocks, kv_heads, page, head_dim)
        k_cache = (torch.randn(shape, generator=gen, device="cuda") / k_scale).to(torch.float8_e4m3fn)
        v_cache = (torch.randn(shape, generator=gen, device="cuda") / v_scale).to(torch.float8_e4m3fn)
    layer = torch.nn.Module()
    layer._k_scale = torch.tensor(k_scale, device="cuda")
    layer._v_scale = torch.tensor(v_scale, device="cuda")
    args = dict(
        query=torch.randn(seqs, q_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16),
        kv_cache=(k_cache, v_cache), workspace_buffer=torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda"),
        block_tables=torch.randperm(blocks, generator=gen, device="cuda").view(seqs, -1).int(),
        seq_lens=torch.randint(1, page * pages_per_seq + 1, (seqs,), generator=gen, device="cuda").int(),
        max_seq_len=page * pages_per_seq, window_left=window_left, kv_layout=layout, q_len_per_req=1,
        sinks=torch.randn(q_heads, generator=gen, device="cuda") if with_sinks else None,
    )  # fmt: skip
    return layer, args


@pytest.mark.parametrize("layout, window_left, with_sinks", [("NHD", -1, False), ("HND", 31, True)])
def test_the_direct_xqa_call_gives_flashinfers_wrapper_output_to_the_bit(layout, window_left, with_sinks):
    """`_compat.xqa_decode_with_scales` (reached through the marker, as vLLM's forward reaches it) against
    `flashinfer.decode.xqa_batch_decode_with_kv_cache` given the same XQA scales as floats: the same bits. And
    against the wrapper on tensor scales (it then derives q_scale in other roundings): within an output ulp."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    from trl_fp8.rollout.vllm._compat import route_xqa_scales
    from trl_fp8.rollout.vllm.attention import xqa_env
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    os.environ.update(xqa_env())
    layer, args = _decode_case(layout, window_left, with_sinks)
    head_dim = args["query"].shape[-1]
    live = LiveXQAScales(head_dim**-0.5, head_dim)
    live.refresh(layer)
    q_scale, kv_scale = live.scales.q_scale.item(), layer._v_scale.item()
    bmm1 = q_scale * kv_scale / head_dim**0.5  # the wrapper derives q_scale = bmm1 / kv_scale * sqrt(head_dim)
    derived = torch.tensor(bmm1 / kv_scale * head_dim**0.5, dtype=torch.float32).item()
    assert derived == q_scale  # the premise: XQA gets the same float32 q_scale either way

    def wrapper(**scales):
        return xqa_batch_decode_with_kv_cache(**args, **scales, out=torch.empty_like(args["query"]))

    expected = wrapper(bmm1_scale=bmm1, bmm2_scale=kv_scale)
    assert torch.equal(wrapper(bmm1_scale=bmm1, bmm2_scale=kv_scale), expected)  # XQA is deterministic
    calls = []
    decode = route_xqa_scales(lambda **kwargs: calls.append(kwargs))
    out = torch.empty_like(args["query"])
    assert decode(**args, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, out=out) is out and not calls
    torch.cuda.synchronize()
    assert torch.equal(out, expected), (out.float() - expected.float()).abs().max()
    assert out.isfinite().all() and out.float().abs().max() > 0
    tensor_scales = wrapper(bmm1_scale=layer._k_scale * head_dim**-0.5, bmm2_scale=layer._v_scale)
    torch.testing.assert_close(tensor_scales, out, rtol=2**-7, atol=2**-7 * out.float().abs().max().item())


def _replay_kernels(graph) -> list[str]:
    """The CUDA kernels one replay of `graph` runs, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type.name == "CUDA"]


def test_a_captured_decode_with_precomputed_scales_runs_xqa_alone():
    """The point of precomputing: inside the graph, the direct call runs the kernels XQA runs on float scales and
    nothing else, where the wrapper on tensor scales runs its scale arithmetic ahead of XQA."""
    from flashinfer.decode import xqa_batch_decode_with_kv_cache

    from trl_fp8.rollout.vllm._compat import route_xqa_scales
    from trl_fp8.rollout.vllm.attention import xqa_env
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    os.environ.update(xqa_env())
    layer, args = _decode_case("NHD", -1, False)
    head_dim = args["query"].shape[-1]
    live = LiveXQAScales(head_dim**-0.5, head_dim)
    decode = route_xqa_scales(xqa_batch_decode_with_kv_cache)
    out = torch.empty_like(args["query"])

    def precomputed():
        live.refresh(layer)  # as the backend's forward: a no-op inside the capture
        decode(**args, bmm1_scale=live.scales, bmm2_scale=layer._v_scale, out=out)

    runs = {
        "precomputed": precomputed,
        "floats": lambda: decode(**args, bmm1_scale=0.02 * head_dim**-0.5, bmm2_scale=0.015, out=out),
        "tensors": lambda: decode(
            **args, bmm1_scale=layer._k_scale * head_dim**-0.5, bmm2_scale=layer._v_scale, out=out
        ),  # fmt: skip
    }
    kernels = {}
    for name, run in runs.items():
        run()  # builds and warms up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        kernels[name] = _replay_kernels(graph)
    assert kernels["precomputed"] == kernels["floats"], kernels
    assert len(kernels["tensors"]) > len(kernels["floats"]), kernels  # the profiler sees the arithmetic kernels


def test_auto_chooses_xqa_on_hopper_and_the_backend_registers():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from trl_fp8.rollout.vllm._compat import LIVE_SCALE_BACKEND, register_custom_attention
    from trl_fp8.rollout.vllm.attention import choose_kv_attention

    choice = choose_kv_attention("auto")
    assert choice.kernel == "xqa" and choice.backend == "CUSTOM", choice.reason
    assert choice.env["VLLM_HAS_FLASHINFER_CUBIN"] == "1"
    assert register_custom_attention() is None
    assert AttentionBackendEnum.CUSTOM.get_path() == LIVE_SCALE_BACKEND
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend.get_name() == "CUSTOM" and backend.get_impl_cls().__name__ == "LiveScaleFlashInferImpl"
