"""vLLM's FlashInfer attention backend with XQA decode reading the FP8 KV cache's scales from device tensors.

vLLM's `FlashInferImpl` hands XQA `self.scale * layer._k_scale_float` and a `bmm2_scale` cached from
`layer._v_scale_float` on its first call: Python floats, which a CUDA graph captures once. The scales a sync writes
later (in place, into `layer._k_scale` and `layer._v_scale`) would never reach a decode step replayed from a graph.
`LiveScaleFlashInferImpl` passes the tensors instead (FlashInfer's XQA takes either), so each replay reads the
scales of the latest sync; everything else is vLLM's. vLLM resolves this module when an engine asks for the
`CUSTOM` attention backend that `trl_fp8.rollout.vllm.plugin.register` names (see `rollout.vllm.attention`).

Importing it tells vLLM, for this process, that XQA's kernels are there: on Hopper FlashInfer builds them from its
own sources (nvcc and `ninja`), while vLLM only looks for a download (`VLLM_HAS_FLASHINFER_CUBIN`, cached on first
read, so its caches are cleared here).
"""

from __future__ import annotations

import os

import torch
from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl, FlashInferMetadataBuilder

from trl_fp8.rollout.vllm._compat import XQA_DECODE_KERNEL, forget_flashinfer_availability
from trl_fp8.rollout.vllm.attention import xqa_env

os.environ.update(xqa_env())
forget_flashinfer_availability()

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class LiveScaleFlashInferImpl(FlashInferImpl):
    """`FlashInferImpl` whose XQA decode reads the layer's k/v (and q) scale tensors at every call and replay."""

    def get_xqa_bmm1_scale(self, layer: torch.nn.Module, q_data_type: torch.dtype):
        if not str(self.kv_cache_dtype).startswith("fp8"):
            return super().get_xqa_bmm1_scale(layer, q_data_type)
        scale = layer._k_scale * self.scale  # one tiny kernel, inside the decode graph
        return scale * layer._q_scale if q_data_type in _FP8 else scale

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if str(self.kv_cache_dtype).startswith("fp8"):
            self.bmm2_scale = layer._v_scale  # XQA's value scale; vLLM would cache the float on the first call
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)


class LiveScaleFlashInferMetadataBuilder(FlashInferMetadataBuilder):
    """vLLM's builder, refusing to start when an FP8 cache's decode would not run on XQA: FlashInfer's other decode
    kernels take the scales as floats, which CUDA graphs would keep from their capture."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        decode = getattr(self, "flashinfer_trtllm_api_decode_kernel", None)
        if str(getattr(self, "cache_dtype", "")).startswith("fp8"):  # the cache dtype as configured ("fp8", ...)
            if decode is None or getattr(decode, "value", None) != XQA_DECODE_KERNEL:
                raise RuntimeError(
                    f"trl-fp8's attention backend (CUSTOM) needs FlashInfer's XQA decode, but vLLM chose {decode!r} "
                    "for this engine's FP8 KV cache (XQA runs on Hopper with query heads a multiple of the KV heads "
                    "and head dims 16-256). Use --attention-backend FLASH_ATTN."
                )


class LiveScaleFlashInferBackend(FlashInferBackend):
    """vLLM's FlashInfer backend under the `CUSTOM` name, with `LiveScaleFlashInferImpl`; Hopper only."""

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FlashInferImpl]:
        return LiveScaleFlashInferImpl

    @staticmethod
    def get_builder_cls() -> type[FlashInferMetadataBuilder]:
        return LiveScaleFlashInferMetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) == (9, 0)
