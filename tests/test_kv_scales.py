"""The KV-scale observer (`trl_fp8.rollout.kv_scales`): q, k and v measured exactly as attention sees them, against a
recomputed reference, without changing the model; and the trainer's calibration on the prompts before the first sync,
which runs the decoder only, a micro-batch at a time."""

import pytest
import torch

from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.rollout.kv_scales import AttentionScaleObserver

from fake_vllm import tiny_trainer


def _reference_qkv(model, ids):
    """q (after q_norm and RoPE), k (after k_norm and RoPE) and v of every layer, recomputed from the layer inputs."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    captured, handles = {}, []
    for i, layer in enumerate(model.model.layers):

        def hook(module, args, kwargs, i=i):
            captured[i] = (kwargs["hidden_states"], kwargs["position_embeddings"])

        handles.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
        out = {}
        for i, (h, (cos, sin)) in captured.items():
            attn = model.model.layers[i].self_attn
            shape = (*h.shape[:-1], -1, attn.head_dim)
            q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
            k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
            v = attn.v_proj(h).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            out[i] = (q, k, v)
    for handle in handles:
        handle.remove()
    return out


def test_kv_observer_measures_q_k_v_exactly_as_attention_sees_them_without_changing_the_model():
    model = tiny_qwen3()
    ids = torch.randint(0, 256, (2, 19))
    with torch.no_grad():
        before = model(ids).logits
    observer = AttentionScaleObserver(model)
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    scales = observer.scales()
    assert list(scales) == sorted(f"model.layers.{i}.self_attn.{x}_scale" for i in range(4) for x in "qkv")
    reference = _reference_qkv(model, ids)
    for i, (q, k, v) in reference.items():
        for leaf, x in zip("qkv", (q, k, v), strict=True):
            expected = x.abs().amax().item() / 448.0
            assert scales[f"model.layers.{i}.self_attn.{leaf}_scale"].item() == pytest.approx(expected, rel=1e-6)
    # Nothing ran since: the same scales again. A forward on larger inputs raises them (running max per sync).
    assert all(torch.equal(a, b) for a, b in zip(observer.scales().values(), scales.values(), strict=True))
    with torch.no_grad():
        model(ids * 0 + 7)
        model(ids)
        model.model.embed_tokens.weight.mul_(3.0)
        model(ids)
    assert observer.scales()["model.layers.0.self_attn.v_scale"] > scales["model.layers.0.self_attn.v_scale"]


def test_kv_scale_calibration_runs_the_model_in_chunks_with_one_position_of_logits(fake_vllm, tmp_path):
    # Through the model itself (FSDP2's root unit must run first: tests/test_multiprocess.py), but the head sees one
    # position per prompt, never a vocabulary-sized logits tensor per token.
    trainer = tiny_trainer(tmp_path, fp8_kv_cache=True, per_device_train_batch_size=8, num_generations=8)
    model = trainer.model
    head_inputs, model_batches = [], []
    model.lm_head.register_forward_pre_hook(lambda mod, args: head_inputs.append(tuple(args[0].shape[:2])))
    model.register_forward_pre_hook(lambda mod, args, kwargs: model_batches.append(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)  # fmt: skip
    prompts = [[2, 5, 6, 7][: 1 + i % 4] for i in range(20)]
    trainer._calibrate_kv_scales(prompts)
    assert model_batches == [8, 8, 4] and head_inputs == [(8, 1), (8, 1), (4, 1)]
    scales = trainer.vllm_generation.settings.kv_observer.scales()
    # The same amax as running the whole model chunk by chunk (the head never matters).
    observer = trainer.vllm_generation.settings.kv_observer
    from trl.trainer.utils import pad

    with torch.no_grad():
        for start in range(0, 20, 8):
            ids = [torch.tensor(p) for p in prompts[start : start + 8]]
            mask = pad([torch.ones_like(t) for t in ids], padding_value=0, padding_side="left")
            model(input_ids=pad(ids, padding_value=0, padding_side="left"), attention_mask=mask)
    assert observer.scales() == scales
