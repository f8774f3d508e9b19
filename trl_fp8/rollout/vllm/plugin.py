"""trl-fp8's vLLM plugin (`vllm.general_plugins` entry point `trl_fp8`): vLLM calls `register` in each of its
processes (engine core, workers, a `trl vllm-serve` server) before it builds a model.

It registers trl-fp8's attention backend as vLLM's `CUSTOM` one (`rollout.vllm.attention`), which an engine runs only
when asked (`attention_backend="CUSTOM"`, `--attention-backend CUSTOM`); other engines are untouched. Nothing is
imported from vLLM's attention backends until then. It also points `VLLM_TUNED_CONFIG_FOLDER` at the Triton tiles
trl-fp8 tuned for block-FP8 experts at decode (`rollout.vllm.tuned_moe`), unless the user named a folder: vLLM reads a
file there only for the expert shape, GPU and dtype it names, and its own files for every other layer.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def register() -> None:
    """Point vLLM at trl-fp8's tuned MoE tiles (unless the user named a folder), and register
    `LiveScaleFlashInferBackend` as vLLM's CUSTOM attention backend, unless another package already holds that name
    (then say so: an engine asking for CUSTOM gets that package's backend)."""
    from trl_fp8.rollout.vllm._compat import LIVE_SCALE_BACKEND, register_custom_attention
    from trl_fp8.rollout.vllm.tuned_moe import tuned_moe_config_env

    tuned = tuned_moe_config_env()
    if tuned:
        os.environ.update(tuned)
        logger.debug("VLLM_TUNED_CONFIG_FOLDER=%s (trl-fp8's tuned MoE tiles)", tuned["VLLM_TUNED_CONFIG_FOLDER"])
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
