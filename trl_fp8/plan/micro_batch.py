"""A start-up note where blockwise FP8 training would be bound by the host: narrow layers in small micro-batches.

An FP8 linear layer costs the host about the same time at every call (quantizer launches, three blockwise GEMM
calls, autograd glue), while its GEMMs grow with the tokens of the micro-batch. Where the layers are narrow and the
micro-batches small, the GPU waits for the host and FP8 trains slower than BF16; larger micro-batches, fewer of them
a step, give the GEMMs the time to cover the host's. The note is said where that was measured: dense models no wider
than `HOST_BOUND_HIDDEN_SIZE` in micro-batches of fewer than `HOST_BOUND_MICRO_BATCH_TOKENS` tokens (the speeds:
docs/contributing/benchmark-details.md, "The training phase alone"). Wider models, unmeasured sizes and
mixture-of-experts models (whose expert layers were measured apart, docs/moe.md) get no note.
"""

from __future__ import annotations

from trl_fp8.config import BLOCKWISE
from trl_fp8.plan.choices import start_up_sequence_tokens
from trl_fp8.rollout.capacity import expert_count, text_config

__all__ = [
    "HOST_BOUND_HIDDEN_SIZE",
    "HOST_BOUND_MICRO_BATCH_TOKENS",
    "SPEEDS_IN_THE_DOCS",
    "dense_hidden_size",
    "larger_micro_batch",
    "small_micro_batch_note",
]

HOST_BOUND_HIDDEN_SIZE = 2048  # the widest hidden size measured host-bound (Qwen3-1.7B's)
# Micro-batch tokens below which FP8 training at a hidden size up to HOST_BOUND_HIDDEN_SIZE is host-bound: the
# micro-batch at which it matched BF16's in the measurement on docs/contributing/benchmark-details.md, "The training
# phase alone".
HOST_BOUND_MICRO_BATCH_TOKENS = 16 * 1152
SPEEDS_IN_THE_DOCS = (  # said with the advice, by the trainer and by `trl-fp8 plan`
    "FP8 against BF16 in such micro-batches and in larger ones, measured: the Benchmarks page of the documentation, "
    "'The training phase alone'"
)


def dense_hidden_size(config) -> int | None:
    """The hidden size of a dense decoder's config (a multimodal config's text model), or None for a
    mixture-of-experts model or a config without one."""
    if config is None or expert_count(config):
        return None
    return getattr(text_config(config), "hidden_size", None)


def larger_micro_batch(hidden_size: int | None, micro_batch: int, steps: int, seq_len: int | None) -> int | None:
    """The micro-batch that takes blockwise FP8 training of a dense model of `hidden_size` to
    `HOST_BOUND_MICRO_BATCH_TOKENS`, where micro-batches of `micro_batch` sequences of up to `seq_len` tokens would
    leave it host-bound; None where they would not, or where no larger micro-batch keeps a step's sequences
    (`micro_batch` x `steps`, the gradient accumulation steps). The answer divides the step's sequences: the
    smallest such that reaches those tokens, else all of them."""
    if hidden_size is None or hidden_size > HOST_BOUND_HIDDEN_SIZE:
        return None
    if not seq_len or micro_batch * seq_len >= HOST_BOUND_MICRO_BATCH_TOKENS:
        return None
    sequences = micro_batch * steps  # per process and optimizer step
    target = -(-HOST_BOUND_MICRO_BATCH_TOKENS // seq_len)
    larger = [n for n in range(micro_batch + 1, sequences + 1) if sequences % n == 0]
    return next((n for n in larger if n >= target), sequences) if larger else None


def small_micro_batch_note(hidden_size: int | None, args) -> str | None:
    """The start-up note of a blockwise FP8 run where `larger_micro_batch` has an answer (sequences sized as the
    memory planner sizes them at start-up): what is host-bound, where the measurements are, and the
    `per_device_train_batch_size` / `gradient_accumulation_steps` pair that keeps a step's sequences."""
    if args.fp8_recipe != BLOCKWISE:
        return None
    micro_batch, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    seq_len = start_up_sequence_tokens(args)
    suggested = larger_micro_batch(hidden_size, micro_batch, steps, seq_len)
    if suggested is None:
        return None
    sequences = micro_batch * steps
    return (
        f"micro-batches of at most {micro_batch} x {seq_len} tokens are small for FP8 training at hidden size "
        f"{hidden_size}: the GPU waits for the host, which issues each FP8 layer's launches. {SPEEDS_IN_THE_DOCS}. "
        f"per_device_train_batch_size={suggested} with gradient_accumulation_steps={sequences // suggested} keeps "
        f"the {sequences} sequences of a step in fewer, larger micro-batches; `trl-fp8 plan MODEL --micro_batch "
        f"{suggested}` gives the memory they take"
    )
