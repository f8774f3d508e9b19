"""FlashInfer's XQA decode on the FP8 KV cache with the scales of every sync (`trl_fp8.rollout.vllm.attention`), on
the GPU: a decode captured in a CUDA graph must follow KV scales changed after the capture."""

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
