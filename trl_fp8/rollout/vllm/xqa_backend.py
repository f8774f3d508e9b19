"""vLLM's FlashInfer attention backend with XQA decode reading the FP8 KV cache's scales from device tensors.

vLLM's `FlashInferImpl` hands XQA `self.scale * layer._k_scale_float` and a `bmm2_scale` cached from
`layer._v_scale_float` on its first call: Python floats, which a CUDA graph captures once. The scales a sync writes
later (in place, into `layer._k_scale` and `layer._v_scale`) would never reach a decode step replayed from a graph.
`LiveScaleFlashInferImpl` hands XQA device tensors instead (FlashInfer's XQA takes either), so each replay reads the
scales of the latest sync: XQA's own `kv_scale` (the layer's `_v_scale`) and `q_scale`, a persistent tensor computed
from the layer's scales outside CUDA graphs (`xqa_scales.LiveXQAScales`: at every eager forward, prefills and the
profile run included, and after a reload), so a captured decode runs XQA and no scale arithmetic. They reach XQA
through the function vLLM's forward calls, wrapped once (`_compat.route_xqa_scales_in_vllm`); everything else is
vLLM's. vLLM resolves this module when an engine asks for the `CUSTOM` attention backend that
`trl_fp8.rollout.vllm.plugin.register` names (see `rollout.vllm.attention`).

Importing it tells vLLM, for this process, that XQA's kernels are there: on Hopper FlashInfer builds them from its
own sources (nvcc and `ninja`), while vLLM only looks for a download (`VLLM_HAS_FLASHINFER_CUBIN`, cached on first
read, so its caches are cleared here).
"""

from __future__ import annotations

import os

import torch
from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl, FlashInferMetadataBuilder

from trl_fp8.rollout.vllm._compat import XQA_DECODE_KERNEL, forget_flashinfer_availability, route_xqa_scales_in_vllm
from trl_fp8.rollout.vllm.attention import xqa_env
from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

os.environ.update(xqa_env())
forget_flashinfer_availability()
route_xqa_scales_in_vllm()

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class LiveScaleFlashInferImpl(FlashInferImpl):
    """`FlashInferImpl` whose XQA decode reads the layer's scales from device tensors at every call and replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.live_xqa_scales = LiveXQAScales(self.scale, self.head_size)

    def _fp8_cache(self) -> bool:
        return str(self.kv_cache_dtype).startswith("fp8")

    def get_xqa_bmm1_scale(self, layer: torch.nn.Module, q_data_type: torch.dtype):
        if not self._fp8_cache():
            return super().get_xqa_bmm1_scale(layer, q_data_type)
        if q_data_type not in _FP8 and self.live_xqa_scales.scales is not None:
            return self.live_xqa_scales.scales  # XQA's own scales, precomputed: nothing to compute in the graph
        # an FP8 query (not on Hopper), or no eager call yet: correct, at the cost of kernels inside the graph
        scale = layer._k_scale * self.scale
        return scale * layer._q_scale if q_data_type in _FP8 else scale

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if self._fp8_cache():
            self.bmm2_scale = layer._v_scale  # XQA's value scale; vLLM would cache the float on the first call
            self.live_xqa_scales.refresh(layer)  # eager calls only: a no-op while a CUDA graph is captured
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        super().process_weights_after_loading(act_dtype)
        self.live_xqa_scales.refresh()  # a reload has just rewritten the layer's scales; before any replay reads them


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
