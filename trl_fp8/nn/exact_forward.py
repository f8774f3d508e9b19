"""Exact mode's forward of a dense decoder (Qwen3, Llama, Qwen2): each completion token's log-probability computed
op by op as the rollout engine computes it, on the engine's kernels (`trl_fp8.ops.exact`), so the trainer's values
equal the engine's bit for bit.

Where it departs from Hugging Face's forward, and why:

- the sequences are packed without their padding and numbered from their first token, as vLLM sees them;
- every norm after the first takes the residual add with it (vLLM's fused add + RMSNorm: one launch, its bits);
- rotary angles come from one table (vLLM's `cos_sin_cache`, handed in), not recomputed per forward;
- gate and up are multiplied apart (row for row the same bits as vLLM's merged GEMM) and joined for SiLU-and-mul;
- only the completion tokens' logits are computed, on the lm_head's kernel, and the temperature is applied as
  vLLM's sampler does (in the logits' dtype, skipped at 1);
- with an FP8 KV cache, each layer's attention quantizes its query, keys and values with the scales the engine
  holds (`kv_scales`), and hands what it quantizes to `observe` (the FP8 KV cache's scale observer, which the
  model's own attention would otherwise feed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from trl_fp8.nn.linear import FP8Linear
from trl_fp8.ops import exact
from trl_fp8.ops.exact import REFERENCE_KERNELS, ExactKernels

__all__ = ["check_exact_model", "exact_token_logprobs", "rope_table"]


def rope_table(model: nn.Module, positions: int) -> torch.Tensor:
    """`[positions, head_dim]`: cosines then sines of the model's rotary angles, in the model's dtype (the layout of
    vLLM's `cos_sin_cache`, which exact mode reads from the engine; this one stands in where there is none)."""
    rotary = _decoder(model).rotary_emb
    angles = torch.outer(torch.arange(positions, device=rotary.inv_freq.device).float(), rotary.inv_freq.float())
    scale = getattr(rotary, "attention_scaling", 1.0)
    dtype = next(model.parameters()).dtype
    return torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1).to(dtype)


def check_exact_model(model: nn.Module) -> None:
    """Raise, naming what is not handled, unless the exact forward can compute this model as the engine does: a
    dense decoder laid out as Qwen3, Llama and Qwen2 are, with RMSNorm, rotary positions and gated MLPs."""
    decoder = _decoder(model)
    for i, layer in enumerate(decoder.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        missing = [name for owner, name in ((attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
                                            (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj"),
                                            (layer, "input_layernorm"), (layer, "post_attention_layernorm"))
                   if not hasattr(owner, name)]  # fmt: skip
        if missing:
            raise ValueError(
                f"exact_on_policy=True computes dense decoders laid out as Qwen3, Llama and Qwen2; layer {i} of "
                f"{type(model).__name__} lacks {', '.join(missing)} (a mixture of experts or another layout). Set "
                "exact_on_policy=False."
            )
        if getattr(attn, "sliding_window", None) or getattr(attn, "is_sliding", False):
            raise ValueError(f"exact_on_policy=True has no sliding-window attention (layer {i}); set it to False.")


def _decoder(model: nn.Module) -> nn.Module:
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        raise ValueError(
            f"Exact mode handles dense decoders laid out as Qwen3 and Llama are (model.layers, model.rotary_emb); "
            f"{type(model).__name__} is not."
        )
    return decoder


def _linear(x: torch.Tensor, layer: nn.Module, kernels: ExactKernels) -> torch.Tensor:
    if isinstance(layer, FP8Linear):
        return exact.fp8_linear(x, layer, kernels.fp8_linear)
    if type(layer) is not nn.Linear:
        raise ValueError(f"Exact mode multiplies FP8Linear and nn.Linear layers; {type(layer).__name__} is neither.")
    out = exact.linear(x, layer.weight.to(x.dtype), kernels.linear)
    return out if layer.bias is None else out + layer.bias.to(x.dtype)


def _w(norm: nn.Module, like: torch.Tensor) -> torch.Tensor:
    """A norm's weight in the forward's dtype (the engine holds the BF16 cast of a float32 master)."""
    return norm.weight.to(like.dtype)


def _pack(input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The real tokens of each row, rows one after the other; each numbered from 0; `cu_seqlens`."""
    mask = attention_mask.bool()
    lengths = mask.sum(1)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    positions = torch.cat([torch.arange(int(n), device=input_ids.device) for n in lengths.tolist()])
    return input_ids[mask], positions, cu_seqlens, int(lengths.max())


def _layer(layer, h, residual, positions, cu_seqlens, max_seqlen, cos_sin_cache, kernels, scales=None, observe=None):
    """One decoder layer on packed rows: `(h, residual)` in, `(h, residual)` out, as vLLM's layer hands them on."""
    attn, mlp = layer.self_attn, layer.mlp
    norm = layer.input_layernorm
    if residual is None:
        x, residual = exact.rms_norm(h, _w(norm, h), norm.variance_epsilon, kernels.rms_norm), h
    else:
        x, residual = exact.add_rms_norm(h, residual, _w(norm, h), norm.variance_epsilon, kernels.add_rms_norm)
    tokens, head = x.shape[0], attn.head_dim
    q, k, v = (_linear(x, proj, kernels) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head
        q = exact.rms_norm(q.reshape(-1, head), _w(attn.q_norm, h), attn.q_norm.variance_epsilon, kernels.rms_norm)
        k = exact.rms_norm(k.reshape(-1, head), _w(attn.k_norm, h), attn.k_norm.variance_epsilon, kernels.rms_norm)
    q, k = exact.rotary(positions, q.reshape(tokens, -1), k.reshape(tokens, -1), head, cos_sin_cache, kernels.rotary)
    if observe is not None:  # what the attention receives: q and k after their norms and RoPE, v as projected
        observe(attn, q, k, v)
    out = exact.attention(
        q.reshape(tokens, -1, head), k.reshape(tokens, -1, head), v.reshape(tokens, -1, head),
        cu_seqlens, max_seqlen, attn.scaling, kernels.attention, scales,
    )  # fmt: skip
    h = _linear(out.reshape(tokens, -1), attn.o_proj, kernels)
    norm = layer.post_attention_layernorm
    x, residual = exact.add_rms_norm(h, residual, _w(norm, h), norm.variance_epsilon, kernels.add_rms_norm)
    gate_up = torch.cat([_linear(x, mlp.gate_proj, kernels), _linear(x, mlp.up_proj, kernels)], dim=-1)
    return _linear(exact.silu_and_mul(gate_up, kernels.silu_and_mul), mlp.down_proj, kernels), residual


def _entropies(logits: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """Each row's entropy in float32 (a metric and a token mask in TRL, never differentiated)."""
    with torch.no_grad():
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], rows):
            logp = logits[start : start + rows].float().log_softmax(-1)
            out[start : start + rows] = -(logp.exp() * logp).sum(-1)
    return out


def exact_token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    dtype: torch.dtype | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    kernels: ExactKernels = REFERENCE_KERNELS,
    with_entropy: bool = False,
    kv_scales: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    observe: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probabilities `[B, logits_to_keep]` of the last `logits_to_keep` tokens of each row of
    `input_ids [B, L]` (TRL's prompt + completion, left-padded prompts; 0 where `attention_mask` is 0), as the
    engine computed them when it sampled them, and (`with_entropy`) the entropy of each of their distributions.

    `dtype`: the engine's (the forward runs in it; default the embeddings'); `cos_sin_cache`: the engine's rotary
    table (default `rope_table(model, L)`); `kernels`: the engine's (`rollout.vllm.exact.exact_kernels()`; default
    the references); `kv_scales`: with an FP8 KV cache, each layer's (q_scale, k_scale, v_scale) as the engine
    holds them (`rollout.vllm._compat.engine_attention_scales`); `observe(attention_module, q, k, v)`: called with
    each layer's attention inputs. Differentiable in every parameter the forward reads."""
    decoder = _decoder(model)
    if kv_scales is not None and len(kv_scales) != len(decoder.layers):
        raise ValueError(
            f"kv_scales has {len(kv_scales)} layers' scales for a model of {len(decoder.layers)} layers: the engine "
            "serves another model than the trainer's."
        )
    tokens, positions, cu_seqlens, max_seqlen = _pack(input_ids, attention_mask)
    h, residual = decoder.embed_tokens(tokens), None
    h = h.to(dtype or h.dtype)
    if cos_sin_cache is None:
        cos_sin_cache = rope_table(model, input_ids.shape[1]).to(h.dtype)
    from trl_fp8.trainer.layer_checkpointing import is_checkpointing  # (trainer/ imports nn/: imported here)

    checkpointed = is_checkpointing(model) and torch.is_grad_enabled()
    for i, layer in enumerate(decoder.layers):
        scales = None if kv_scales is None else tuple(s.to(h.device) for s in kv_scales[i])
        args = (layer, h, residual, positions, cu_seqlens, max_seqlen, cos_sin_cache, kernels, scales, observe)
        if checkpointed:  # the recompute reruns the same kernels: the same values
            h, residual = torch.utils.checkpoint.checkpoint(_layer, *args, use_reentrant=False)
        else:
            h, residual = _layer(*args)

    # the completion tokens that are there (mask 1), each predicted from the row before it in the pack
    mask = attention_mask.bool()
    columns = torch.arange(input_ids.shape[1] - logits_to_keep, input_ids.shape[1], device=input_ids.device)
    present = mask[:, columns]
    before = mask.long().cumsum(1)[:, columns] - 1  # the token's own index within its row's real tokens
    rows = (cu_seqlens[:-1, None].long() + before - 1)[present]
    norm = decoder.norm
    h, _ = exact.add_rms_norm(h[rows], residual[rows], _w(norm, h), norm.variance_epsilon, kernels.add_rms_norm)
    logits = _linear(h, model.get_output_embeddings(), kernels)
    if temperature != 1.0:  # vLLM's sampler: float32 division, rounded to the logits' dtype
        logits = (logits.float() / temperature).to(logits.dtype)
    logps = torch.zeros(present.shape, dtype=torch.float32, device=input_ids.device)
    logps[present] = exact.token_logprobs(logits, input_ids[:, columns][present], kernels.token_logprobs)
    if not with_entropy:
        return logps, None
    entropies = torch.zeros_like(logps)
    entropies[present] = _entropies(logits)
    return logps, entropies
