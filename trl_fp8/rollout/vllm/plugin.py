"""trl-fp8's vLLM plugin (`vllm.general_plugins` entry point `trl_fp8`): vLLM calls `register` in each of its
processes (engine core, workers, a `trl vllm-serve` server) before it builds a model.

It registers trl-fp8's attention backend as vLLM's `CUSTOM` one (`rollout.vllm.attention`), which an engine runs only
when asked (`attention_backend="CUSTOM"`, `--attention-backend CUSTOM`); other engines are untouched. Nothing is
imported from vLLM's attention backends until then.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Register `LiveScaleFlashInferBackend` as vLLM's CUSTOM attention backend, unless another package already
    holds that name (then say so: an engine asking for CUSTOM gets that package's backend)."""
    from trl_fp8.rollout.vllm._compat import LIVE_SCALE_BACKEND, register_custom_attention

    try:
        other = register_custom_attention(LIVE_SCALE_BACKEND)
    except ImportError as exc:  # a vLLM without the attention registry: the engine keeps its own backends
        logger.debug("trl-fp8's attention backend not registered: %s", exc)
        return
    if other is not None:
        logger.warning(
            "vLLM's CUSTOM attention backend is already %s; trl-fp8's (%s) is not registered, so FP8-KV engines "
            "started with --attention-backend CUSTOM run that one.", other, LIVE_SCALE_BACKEND,
        )  # fmt: skip
