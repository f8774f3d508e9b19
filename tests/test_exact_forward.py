"""Exact mode's forward (`trl_fp8.nn.exact_forward`) on the reference kernels computes what Hugging Face's forward
computes: the same log-probabilities of the completion tokens, each sequence numbered from its first token, and the
same gradients. In float32 the two differ only in the order of float32 sums (bound: 1e-4 on a log-probability,
about 100x float32's rounding over a few layers of 256-wide sums); with FP8 layers a last-bit difference upstream
can move one activation element across an FP8 rounding boundary, so that comparison takes FP8's bound instead."""

import copy

import torch

from trl_fp8 import convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.exact_forward import exact_token_logprobs, rope_table

PROMPT, COMPLETION = 6, 5


def _batch(vocab=256):
    """Left-padded prompts of 6, 3 and 1 tokens; completions of 5, 2 and 4 tokens, right-padded."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, vocab, (3, PROMPT + COMPLETION), generator=g)
    mask = torch.ones_like(ids)
    for row, (prompt, completion) in enumerate([(6, 5), (3, 2), (1, 4)]):
        mask[row, : PROMPT - prompt] = 0
        mask[row, PROMPT + completion :] = 0
    return ids * mask, mask


def _hf_logprobs(model, ids, mask):
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # each sequence from its first token, as vLLM numbers it
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logps = logits[:, -COMPLETION - 1 : -1].float().log_softmax(-1)
    return logps.gather(-1, ids[:, -COMPLETION:, None])[..., 0] * mask[:, -COMPLETION:]


def test_the_exact_forward_computes_hugging_faces_log_probabilities_and_gradients():
    model = tiny_qwen3(num_hidden_layers=2)
    ids, mask = _batch()
    ours, _ = exact_token_logprobs(model, ids, mask, COMPLETION)
    theirs = _hf_logprobs(model, ids, mask)
    assert ours.shape == (3, COMPLETION) and ours.dtype == torch.float32
    assert torch.equal(ours == 0, mask[:, -COMPLETION:] == 0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)

    ours.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    theirs.sum().backward()
    # every parameter the forward reads gets a gradient (embeddings, norms, projections, lm_head)
    assert grads.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-3, atol=1e-3 * scale, msg=name)


def test_the_exact_forward_with_gradient_checkpointing_gives_the_same_values_and_gradients():
    model = tiny_qwen3(num_hidden_layers=2)
    ids, mask = _batch()
    plain, _ = exact_token_logprobs(model, ids, mask, COMPLETION)
    plain.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()  # (transformers 5.24 renamed it)
    checkpointed, _ = exact_token_logprobs(model, ids, mask, COMPLETION)
    checkpointed.sum().backward()
    assert torch.equal(plain, checkpointed)
    for before, p in zip(grads, model.parameters(), strict=True):
        assert torch.equal(before, p.grad)


def test_the_exact_forward_of_an_fp8_model_and_its_temperature_follow_hugging_face():
    model = tiny_qwen3(num_hidden_layers=2)
    convert_to_fp8(model)
    ids, mask = _batch()
    with torch.no_grad():
        ours, entropies = exact_token_logprobs(model, ids, mask, COMPLETION, temperature=0.7, with_entropy=True)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits / 0.7
        theirs = logits[:, -COMPLETION - 1 : -1].float().log_softmax(-1).gather(-1, ids[:, -COMPLETION:, None])
        theirs = theirs[..., 0] * mask[:, -COMPLETION:]
        # FP8's bound: an activation element moved across an e4m3 rounding boundary changes by up to 2^-3 of itself
        # (e4m3 keeps 3 mantissa bits); spread over a 256-wide row it moves a logit by a few hundredths at most
        full = logits[:, -COMPLETION - 1 : -1].float().log_softmax(-1)
        theirs_entropy = -(full.exp() * full).sum(-1) * mask[:, -COMPLETION:]
    torch.testing.assert_close(entropies, theirs_entropy, rtol=0, atol=0.05)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05)
    assert (ours - theirs).abs().median() < 1e-4  # most tokens: no boundary crossed, float32 agreement


def test_the_exact_forward_runs_in_the_engines_dtype():
    model = tiny_qwen3(num_hidden_layers=2)  # float32 masters
    ids, mask = _batch()
    table = rope_table(model, ids.shape[1]).to(torch.bfloat16)  # the engine's, handed to both
    ours, _ = exact_token_logprobs(model, ids, mask, COMPLETION, dtype=torch.bfloat16, cos_sin_cache=table)
    cast = copy.deepcopy(model).to(torch.bfloat16)  # what the engine holds: the masters cast to bfloat16
    theirs, _ = exact_token_logprobs(cast, ids, mask, COMPLETION, cos_sin_cache=table)
    assert torch.equal(ours, theirs)


def test_with_an_fp8_kv_cache_the_forward_quantizes_on_the_given_scales_and_observes_what_the_model_would():
    """`kv_scales` reach each layer's attention (a scale far off moves the log-probabilities; one per layer is
    required); `observe` sees each layer's query, keys and values as the model's own attention receives them, so the
    FP8 KV cache's observer measures the same amax from either forward (float32: within float32's rounding of the
    norms and RoPE, 1e-5 relative). Compared without padding: Hugging Face's forward computes (and its observer
    measures) the padding positions too, the exact forward only the tokens."""
    import pytest

    from trl_fp8.rollout.kv_scales import AttentionScaleObserver

    model = tiny_qwen3(num_hidden_layers=2)
    ids, mask = _batch()
    observer = AttentionScaleObserver(model)
    with torch.no_grad():
        _hf_logprobs(model, ids, torch.ones_like(mask))
        theirs = observer.scales()
        exact_token_logprobs(model, ids, torch.ones_like(mask), COMPLETION, observe=observer.record)
        ours = observer.scales()
        assert ours.keys() == theirs.keys() and len(ours) == 3 * 2
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=0, msg=name)
        plain, _ = exact_token_logprobs(model, ids, mask, COMPLETION)
        layers = [(ours[f"model.layers.{i}.self_attn.{x}_scale"] for x in "qkv") for i in range(2)]
        fitted, _ = exact_token_logprobs(model, ids, mask, COMPLETION, kv_scales=[tuple(s) for s in layers])
        coarse = [(torch.tensor(0.5),) * 3] * 2  # steps of 0.5 x 2^-3: most keys round to zero
        off, _ = exact_token_logprobs(model, ids, mask, COMPLETION, kv_scales=coarse)
    real = mask[:, -COMPLETION:].bool()
    fitted_error = (fitted - plain)[real].abs().max()
    assert 0 < fitted_error < (off - plain)[real].abs().max()
    with pytest.raises(ValueError, match="1 layers' scales for a model of 2 layers"):
        exact_token_logprobs(model, ids, mask, COMPLETION, kv_scales=coarse[:1])
