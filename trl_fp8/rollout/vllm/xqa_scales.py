"""XQA's own two scales for the FP8 KV cache, kept as persistent device tensors that a captured decode reads.

FlashInfer's XQA takes `q_scale` and `kv_scale`; its wrapper derives them from vLLM's fused scales
(`kv_scale = bmm2_scale`, `q_scale = bmm1_scale / kv_scale * sqrt(head_dim)`). Given tensors, that derivation runs
as small kernels inside every captured decode. With `bmm1_scale = sm_scale * k_scale` and `bmm2_scale = v_scale`,
`kv_scale` is the layer's `_v_scale` itself and `q_scale = sm_scale * sqrt(head_dim) * k_scale / v_scale`: one
tensor per attention layer, recomputed here outside CUDA graphs (eager forwards, and after a reload rewrote the
layer's scales), so a replayed decode runs XQA alone. No vLLM or FlashInfer import: the CPU tests and the start-up
check (`attention.decode_follows_live_scales`) use it as the backend does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["LiveXQAScales", "XQAScales"]


@dataclass(frozen=True, eq=False, slots=True)
class XQAScales:
    """What `LiveScaleFlashInferImpl.get_xqa_bmm1_scale` hands vLLM's forward in place of `bmm1_scale`; the decode
    function vLLM calls is wrapped (`_compat.route_xqa_scales`) to pass `q_scale` and `kv_scale` to XQA as they are.
    `bmm1_scale()` gives the fused value for any call the wrapper leaves to FlashInfer."""

    q_scale: torch.Tensor  # sm_scale * sqrt(head_dim) * k_scale / v_scale, float32, refreshed in place
    kv_scale: torch.Tensor  # the layer's `_v_scale`
    k_scale: torch.Tensor  # the layer's `_k_scale`
    sm_scale: float

    def bmm1_scale(self) -> torch.Tensor:
        return self.k_scale * self.sm_scale


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only build of torch
        return False


class LiveXQAScales:
    """The precomputed XQA scales of one attention layer (one per attention implementation). `scales` is None until
    the first `refresh`; its `q_scale` tensor keeps its storage from then on, which captured graphs read."""

    def __init__(self, sm_scale: float, head_dim: int):
        self.sm_scale = float(sm_scale)
        self.factor = self.sm_scale * head_dim**0.5
        self.scales: XQAScales | None = None
        self._layer: weakref.ref | None = None  # the implementation does not own its layer

    def refresh(self, layer: torch.nn.Module | None = None) -> bool:
        """Recompute `q_scale` from `layer`'s `_k_scale` and `_v_scale` (None: the layer last given, if it still
        lives). Never while the current stream is being captured: the graph must read the tensor, not recompute it.
        Returns whether it recomputed."""
        if layer is not None:
            self._layer = weakref.ref(layer)
        elif self._layer is None or (layer := self._layer()) is None:
            return False
        if _capturing():
            return False
        k_scale, v_scale = layer._k_scale, layer._v_scale
        old = self.scales
        q_scale = old.q_scale if old is not None else None
        # vLLM's forwards run in inference mode and its reload outside it: the tensor is written in inference mode
        # in both, which may update an inference tensor in place (outside it, PyTorch refuses)
        with torch.inference_mode():
            if q_scale is None or q_scale.device != k_scale.device or q_scale.shape != k_scale.shape:
                q_scale = torch.empty(k_scale.shape, dtype=torch.float32, device=k_scale.device)
            torch.div(k_scale, v_scale, out=q_scale).mul_(self.factor)
        if old is None or old.q_scale is not q_scale or old.kv_scale is not v_scale or old.k_scale is not k_scale:
            self.scales = XQAScales(q_scale, v_scale, k_scale, self.sm_scale)
        return True
