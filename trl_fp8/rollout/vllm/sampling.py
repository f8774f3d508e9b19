"""What a colocated engine hands back for each sampled token: its id and log-prob, all that TRL reads.

vLLM's defaults also turn every sampled token and every log-prob token into text, and keep one dict and one `Logprob`
object per generated token. In a colocated engine that work runs on the engine's own thread between decode steps,
several times the host time of token ids alone, with garbage-collection pauses that grow as those objects pile up
(`benchmarks/bench_output_processing.py`; the times: docs/contributing/internals.md, "Token ids and log-probs only").
`detokenize=False` and `flat_logprobs=True` give the same token ids and log-probs without it. TRL merges
`GRPOConfig.generation_kwargs` into the `SamplingParams` of every colocated rollout, so the trainer sets them there.
"""

from __future__ import annotations

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
