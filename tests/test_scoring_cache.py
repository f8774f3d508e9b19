"""The FP8 weight cache held for forwards without gradients only (`FP8LinearConfig.cache_with_grad=False`,
FP8GRPOTrainer's default): scoring passes and the vLLM sync share one quantization per optimizer step, and a training
micro-batch lets the copies go, so the training step's memory peak holds none. The values are the cached flow's
bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fp8_experts import tiny_moe

from trl_fp8 import FP8GRPOConfig, FP8LinearConfig, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.weight_cache import fp8_weight_cache_bytes
from trl_fp8.ops import emulated


def count_weight_quantizations(monkeypatch) -> list[int]:
    """Row-major weight quantizations from now on (DGrad's column-major layout is quantized in every backward)."""
    calls, original = [], emulated.quantize_weight

    def counted(w, **kw):
        if not kw.get("col_major"):
            calls.append(1)
        return original(w, **kw)

    monkeypatch.setattr(emulated, "quantize_weight", counted)
    return calls


def models(build, fuse_sibling_gemms: bool = False):
    """`(cached through training, cached for scoring only)`: one model converted both ways."""
    base = build()
    through, scoring = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(through, config=FP8LinearConfig(fuse_sibling_gemms=fuse_sibling_gemms))
    convert_to_fp8(scoring, config=FP8LinearConfig(fuse_sibling_gemms=fuse_sibling_gemms, cache_with_grad=False))
    return through, scoring


def tiny_dense():
    return tiny_qwen3(seed=0, num_hidden_layers=2)


@pytest.mark.parametrize("build,fuse", [(tiny_dense, False), (tiny_dense, True), (tiny_moe, False)],
                         ids=["dense", "sibling_groups", "experts"])  # fmt: skip
def test_scoring_keeps_the_cache_and_a_training_forward_lets_it_go(monkeypatch, build, fuse):
    through, scoring = models(build, fuse)
    ids = torch.randint(0, through.config.vocab_size, (2, 24))
    for model in (through, scoring):
        with torch.no_grad():
            model(input_ids=ids)  # the first scoring pass quantizes and caches
    held = fp8_weight_cache_bytes(through)
    assert held > 0 and fp8_weight_cache_bytes(scoring) == held

    calls = count_weight_quantizations(monkeypatch)
    with torch.no_grad():
        scored = [scoring(input_ids=ids).logits for _ in range(3)]  # more scoring passes: served by the cache
    assert calls == [] and fp8_weight_cache_bytes(scoring) == held

    # Two micro-batches: the first uses the scoring copies and lets them go; none is kept from then on.
    outputs = {}
    for label, model in (("through", through), ("scoring", scoring)):
        losses = []
        for _ in range(2):
            loss = model(input_ids=ids).logits.float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        outputs[label] = losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert fp8_weight_cache_bytes(scoring) == 0 and fp8_weight_cache_bytes(through) == held
    assert len(calls) > 0  # the second micro-batch quantized its weights again
    (a_losses, a_grads), (b_losses, b_grads) = outputs["through"], outputs["scoring"]
    assert torch.equal(torch.stack(a_losses), torch.stack(b_losses))  # the same FP8 bits either way
    assert a_grads.keys() == b_grads.keys() and all(torch.equal(a_grads[n], b_grads[n]) for n in a_grads)
    with torch.no_grad():
        assert torch.equal(scoring(input_ids=ids).logits, scored[0])


def test_the_vllm_sync_is_served_by_the_cache_whatever_the_grad_mode(monkeypatch):
    """The sync and the export read `quantized_weight()`, which is no forward: under grad mode (TRL syncs inside its
    training step) it fills and keeps the cache that the scoring passes then use."""
    _, scoring = models(tiny_dense)
    layer = scoring.model.layers[0].mlp.down_proj
    assert torch.is_grad_enabled()
    q, s = layer.quantized_weight()
    assert layer.cache_bytes() == q.numel() + 4 * s.numel()
    calls = count_weight_quantizations(monkeypatch)
    with torch.no_grad():
        scoring(input_ids=torch.randint(0, 200, (1, 8)))
    assert calls.count(1) == sum(1 for m in scoring.modules() if hasattr(m, "fp8_config")) - 1  # all but that one


def test_frozen_weights_stay_cached_in_training_forwards(monkeypatch):
    """A weight that takes no gradient (a LoRA base, the reference model) never changes: its copy stays whatever
    the forward records."""
    _, scoring = models(tiny_dense)
    scoring.requires_grad_(False)
    scoring.lm_head.requires_grad_(True)  # something for the loss to reach
    ids = torch.randint(0, 200, (2, 24))
    scoring(input_ids=ids).logits.sum().backward()
    held = fp8_weight_cache_bytes(scoring)
    calls = count_weight_quantizations(monkeypatch)
    scoring(input_ids=ids).logits.sum().backward()
    assert held > 0 and fp8_weight_cache_bytes(scoring) == held and calls == []


def test_the_layers_take_the_weight_cache_the_plan_chose(tmp_path):
    """The plan chooses the FP8 weight cache once (`choose_fp8_weight_cache`), the FP8 layers' config takes it as it
    is (`fp8_linear_config`): held for scoring only where it fits a GPU (the default), kept through the micro-batches
    off a GPU or where the user set fp8_cache_weights=True, none where the user turned it off."""
    from trl_fp8.demo.tiny_model import tiny_qwen3_config
    from trl_fp8.plan import FP8RunPlan, WeightCache
    from trl_fp8.plan.choices import choose_fp8_weight_cache
    from trl_fp8.rollout.capacity import GPU_MEMORY_BYTES

    def cache_of(**kw) -> WeightCache:
        return FP8RunPlan.build(FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kw),
                                tiny_qwen3_config()).fp8_weight_cache.value  # fmt: skip

    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    on_a_gpu = choose_fp8_weight_cache(tiny_qwen3_config(), args, total_bytes=GPU_MEMORY_BYTES["H100"])
    assert on_a_gpu.automatic and on_a_gpu.value == WeightCache(True, with_grad=False)
    held = args.fp8_linear_config(on_a_gpu.value)
    assert held.cache_quantized_weight is True and held.cache_with_grad is False
    assert cache_of() == WeightCache(True, with_grad=True)  # off a GPU: no GPU memory to spare
    assert cache_of(fp8_cache_weights=True) == WeightCache(True, with_grad=True)
    assert cache_of(fp8_cache_weights=False) == WeightCache(False)
    kept = args.fp8_linear_config(WeightCache(True, with_grad=True))
    assert kept.cache_quantized_weight is True and kept.cache_with_grad is True
    off = args.fp8_linear_config(WeightCache(False))
    assert off.cache_quantized_weight is False and off.cache_with_grad is True
    with pytest.raises(TypeError):
        args.fp8_linear_config()  # no default of its own: the plan's choice, or the caller's
    with pytest.raises(ValueError, match="cache_with_grad=False limits the FP8 weight cache"):
        FP8LinearConfig(cache_quantized_weight=False, cache_with_grad=False)
