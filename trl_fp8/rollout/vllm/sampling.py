"""What a colocated engine hands back for each sampled token: its id and log-prob, all that TRL reads.

vLLM's defaults also turn every sampled token and every log-prob token into text, and keep one dict and one `Logprob`
object per generated token. In a colocated engine that work runs on the engine's own thread between decode steps,
several times the host time of token ids alone, with garbage-collection pauses that grow as those objects pile up
(`benchmarks/bench_output_processing.py`; the times: docs/contributing/internals.md, "Token ids and log-probs only").
`detokenize=False` and `flat_logprobs=True` give the same token ids and log-probs without it. TRL merges
`GRPOConfig.generation_kwargs` into the `SamplingParams` of every colocated rollout, so the trainer sets them there.

After the rollout TRL's `extract_logprobs` reads vLLM's flat log-probs back one position at a time, through the very
dict and `Logprob` object per token that `flat_logprobs` spared (1.4-1.9 s for 128 x 2,048 tokens on a CPU core).
`flat_logprob_lists` reads the same lists straight from the flat arrays where each token has one log-prob (TRL's
`logprobs=0`: the sampled token's), and `flat_logprobs_read_directly` puts it in place of TRL's reader for a rollout,
with the garbage collector paused meanwhile.
"""

from __future__ import annotations

import contextlib
import gc
import math

# vLLM `SamplingParams` fields: no text, and log-probs kept in flat lists (no per-token dict and `Logprob` object).
TOKEN_IDS_ONLY = {"detokenize": False, "flat_logprobs": True}


def with_token_ids_only(generation_kwargs: dict | None) -> tuple[dict, str]:
    """`generation_kwargs` with `TOKEN_IDS_ONLY` added, and a line for the start-up log saying what was set.

    A field the user set stays as set. `stop` strings keep vLLM's text (vLLM matches them on it, and refuses them
    with `detokenize=False`)."""
    kwargs = dict(generation_kwargs or {})
    added, kept = {}, []
    for name, value in TOKEN_IDS_ONLY.items():
        if name in kwargs:
            kept.append(f"{name}={kwargs[name]!r} (set in generation_kwargs)")
        elif name == "detokenize" and kwargs.get("stop"):
            kept.append("detokenize=True (vLLM matches the `stop` strings in generation_kwargs on the text)")
        else:
            kwargs[name] = added[name] = value
    said = ", ".join(f"{k}={v}" for k, v in added.items())
    reason = f"{said}: TRL reads token ids and log-probs only" if added else "vLLM's defaults"
    if kept:
        reason += "; kept " + ", ".join(kept)
    return kwargs, reason


def flat_logprob_lists(all_outputs) -> tuple[list | None, list | None] | None:
    """What TRL's `extract_logprobs` returns for `all_outputs` (vLLM `RequestOutput`s): per completion, per token, the
    log-probs and their token ids by rank (NaN as None), or `(None, None)` when an output has no log-probs. Read from
    vLLM's `FlatLogprobs` arrays directly; None (read them TRL's way) unless every output's log-probs are flat with
    exactly one per token."""
    all_logprobs, all_token_ids = [], []
    for outputs in all_outputs:
        for output in outputs.outputs:
            flat = output.logprobs
            if flat is None:
                return None, None
            starts = getattr(flat, "start_indices", None)  # vLLM 0.26-0.31's FlatLogprobs: plain lists
            if (
                not isinstance(starts, list)
                or len(flat.token_ids) != len(starts)
                or starts != list(range(len(starts)))
            ):
                return None  # not flat lists, or several log-probs a token: TRL sorts each token's by rank itself
            all_logprobs.append([[None if math.isnan(value) else value] for value in flat.logprobs])
            all_token_ids.append([[token_id] for token_id in flat.token_ids])
    return all_logprobs, all_token_ids


@contextlib.contextmanager
def flat_logprobs_read_directly():
    """While active, TRL's colocated generate reads the rollout's log-probs with `flat_logprob_lists`, its own
    `extract_logprobs` where that declines."""
    import trl.generation.vllm_generation as trl_generation

    trls = trl_generation.extract_logprobs

    def extract_logprobs(all_outputs):
        # Two small lists a token and no cycle among them: the collector, run every 700 of them, would walk the
        # whole process again and again (most of the time of 128 x 2,048 tokens on a CPU core) for nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            read = flat_logprob_lists(all_outputs)
            return trls(all_outputs) if read is None else read
        finally:
            if collecting:
                gc.enable()

    trl_generation.extract_logprobs = extract_logprobs
    try:
        yield
    finally:
        trl_generation.extract_logprobs = trls
