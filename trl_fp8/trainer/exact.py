"""Exact mode's scoring: TRL's per-token log-probabilities (and entropies) computed by the exact forward on the
colocated engine's own kernels and rotary table (`FP8GRPOConfig.exact_on_policy`), in place of the model's forward
in `_get_per_token_logps_and_entropies`; with an FP8 KV cache, on the scales the engine held for the rollout, and
feeding the scale observer as the model's own attention would."""

from __future__ import annotations

import torch

from trl_fp8.nn.exact_forward import exact_token_logprobs


def exact_logps_and_entropies(
    trainer, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
    compute_aux_loss=False, **inputs,
):  # fmt: skip
    """TRL's `(logps, entropies, aux_loss)` for `input_ids`, `batch_size` sequences a forward. Any other input TRL
    gives (images, token types: every name after `compute_aux_loss`) is refused, not dropped."""
    given = [name for name, value in inputs.items() if value is not None]
    if given or compute_aux_loss:
        raise ValueError(
            f"exact_on_policy=True scores text-only dense models; this batch has {', '.join(given) or 'an aux loss'}."
        )
    generation = trainer.vllm_generation  # its engine's kernels and rotary table, taken when the engine started
    table = generation.exact_rotary_table
    observer = trainer.plan.rollout.kv_observer  # an FP8 KV cache's: fed what the attention quantizes

    def observe(module, q, k, v):
        if observer.enabled:  # (as the observed attention of `rollout.kv_scales` checks it)
            observer.record(module, q, k, v)

    policy = trainer.accelerator.unwrap_model(model)
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        part = slice(start, start + batch_size)
        lp, ent = exact_token_logprobs(
            policy, input_ids[part], attention_mask[part], logits_to_keep, temperature=trainer.temperature,
            dtype=table.dtype, cos_sin_cache=table.to(input_ids.device), kernels=generation.exact_kernels,
            with_entropy=compute_entropy, kv_scales=generation.exact_kv_scales,
            observe=observe if observer is not None else None,
        )  # fmt: skip
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), (torch.cat(entropies) if compute_entropy else None), None
