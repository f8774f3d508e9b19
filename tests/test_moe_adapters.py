"""LoRA on mixture-of-experts experts (PEFT's `target_parameters` on transformers 5's 3-D `gate_up_proj` /
`down_proj`, which PEFT wraps in nested `ParamWrapper`s): the adapter changes the FP8 forward, and the exported
checkpoint and the vLLM sync carry the experts PEFT's own merge makes, quantized by our quantizer, while the live
model, its adapter and its FP8 caches stay as they were and keep training."""

import copy
import json
import types

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from test_fp8_experts import INTER, E, tiny_moe

from trl_fp8 import convert_to_fp8, dequantize_blocks, save_fp8_checkpoint
from trl_fp8.checkpoint.save import fp8_module_names
from trl_fp8.nn.experts import FP8Experts
from trl_fp8.rollout.vllm.engine import rollout_weight_tensors
from trl_fp8.rollout.vllm.experts import EngineExperts

from conftest import assert_fp8_equal, rel_err
from fake_vllm import FakeMoEEngine, tiny_trainer

EXPERTS = "model.layers.0.mlp.experts"
EXPERT_LORA = dict(target_modules=[], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def trained_looking(model, seed=1):
    """Move every trainable (adapter) parameter away from where it is (LoRA's B starts at zero)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return model


def lora_on_fp8_experts(model=None):
    model = model or tiny_moe()
    convert_to_fp8(model)
    return trained_looking(get_peft_model(model, LoraConfig(r=4, lora_alpha=8, **EXPERT_LORA)))


def base_experts(peft_model) -> FP8Experts:
    experts = peft_model.get_base_model().get_submodule(EXPERTS).get_base_layer()
    assert isinstance(experts, FP8Experts)
    return experts


def checkpoint_experts(experts) -> dict[str, torch.Tensor]:
    """Every expert projection of experts layer `experts` under its Qwen3-MoE checkpoint name."""
    names = {}
    for e in range(E):
        names[f"{EXPERTS}.{e}.gate_proj"] = experts.gate_up_proj[e, :INTER]
        names[f"{EXPERTS}.{e}.up_proj"] = experts.gate_up_proj[e, INTER:]
        names[f"{EXPERTS}.{e}.down_proj"] = experts.down_proj[e]
    return names


def merged_experts(peft_model) -> dict[str, torch.Tensor]:
    """The experts `merge_and_unload()` makes (on a copy), under their checkpoint names."""
    return checkpoint_experts(copy.deepcopy(peft_model).merge_and_unload().get_submodule(EXPERTS))


def assert_experts_are(tensors: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    """The FP8 tensors and scales under each name are bit for bit the (independent) block-FP8 quantization."""
    for name, weight in weights.items():
        assert_fp8_equal(tensors[f"{name}.weight"], tensors[f"{name}.weight_scale_inv"], weight)


def test_the_export_holds_the_experts_peft_merges_quantized_by_our_quantizer(tmp_path):
    model = lora_on_fp8_experts()
    experts = base_experts(model)
    experts.quantized_expert_weight("down_proj")  # a filled FP8 cache of the unmerged base weights
    invalidations = experts._fp8_invalidations
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merged_experts(model)

    save_fp8_checkpoint(model, tmp_path / "fp8", progress=False)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    assert_experts_are(saved, merged)
    up = f"{EXPERTS}.1.up_proj"  # the adapter shows: the base weight's quantization is another
    assert rel_err(merged[up], checkpoint_experts(experts)[up]) > 0.1
    assert not any("lora" in k or "base_layer" in k for k in saved)
    kept = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert kept == ["lm_head", "model.layers.0.mlp.gate"]  # the router beside the wrapped experts stays BF16

    # The live model is untouched: masters, adapter, the FP8 cache, no merge left behind.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert experts._fp8_invalidations == invalidations
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_the_fp8_forward_multiplies_the_exported_experts_up_to_float32_rounding(monkeypatch):
    """The forward quantizes PEFT's `W + BA` (its parametrization), the export PEFT's merged `W + BA`: the same sum
    rounded apart in float32 only, so their FP8 values differ at most where a value sits on a rounding boundary,
    far less than FP8 rounding moves the merged weight."""
    model = lora_on_fp8_experts()
    used = {}
    quantize = FP8Experts.quantized_expert_weight

    def spy(self, name):
        used[name] = quantize(self, name)
        return used[name]

    monkeypatch.setattr(FP8Experts, "quantized_expert_weight", spy)
    ids = torch.randint(0, 128, (2, 16))
    logits = model(ids).logits
    forward_fp8 = dict(used)  # what the forward with the adapter multiplied
    with model.disable_adapter():
        assert rel_err(model(ids).logits, logits) > 0.1  # the adapter changes the FP8 forward
    monkeypatch.undo()
    exported = dict(rollout_weight_tensors(model, "fp8"))
    merged = copy.deepcopy(model).merge_and_unload().get_submodule(EXPERTS)
    for leaf, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        export = torch.stack([torch.cat([dequantize_blocks(exported[f"{EXPERTS}.{e}.{part}.weight"],
                                                           exported[f"{EXPERTS}.{e}.{part}.weight_scale_inv"])
                                         for part in parts]) for e in range(E)])  # fmt: skip
        q, s = forward_fp8[leaf]
        forward = torch.stack([dequantize_blocks(q[e], s[e]) for e in range(E)])
        assert rel_err(forward, export) < 0.5 * rel_err(export, getattr(merged, leaf)), leaf


def test_the_rollout_sync_pushes_and_writes_in_place_the_merged_experts():
    """The reload's per-expert tensors, and the in-place write of the stacked experts into the engine (proven against
    the reload first, then used after an adapter step), both hold the merged experts."""
    model = lora_on_fp8_experts()
    pushed = list(rollout_weight_tensors(model, "fp8"))
    assert_experts_are(dict(pushed), merged_experts(model))

    engine = FakeMoEEngine({EXPERTS: base_experts(model)})
    engine.load(pushed)
    worker = types.SimpleNamespace(model_runner=engine)
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(
        model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker))))  # fmt: skip
    writer, why = EngineExperts.verified(model, llm, fp8_module_names(model), convert=keep_layout)
    assert writer is not None, why
    trained_looking(model, seed=2)  # an adapter step
    writer.write()
    assert_engine_holds(engine, copy.deepcopy(model).merge_and_unload().get_submodule(EXPERTS))


def keep_layout(fp8_backend, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale):
    return w13, w2, w13_scale, w2_scale  # what vLLM's conversion for the Triton MoE backend does


def assert_engine_holds(engine, experts) -> None:
    """The fake engine's stacked FP8 experts are bit for bit the quantization of `experts`' weights."""
    layer = engine.layers[EXPERTS]
    for e in range(E):
        assert_fp8_equal(layer.w13_weight[e], layer.w13_weight_scale_inv[e], experts.gate_up_proj[e])
        assert_fp8_equal(layer.w2_weight[e], layer.w2_weight_scale_inv[e], experts.down_proj[e])


def test_the_adapter_keeps_training_after_an_export_and_the_next_export_follows_it(tmp_path):
    model = lora_on_fp8_experts()
    experts = base_experts(model)
    masters = {n: p.detach().clone() for n, p in experts.named_parameters()}
    adapter = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(adapter) == 4 and all("mlp.experts" in n for n in adapter)  # A and B of both projections
    save_fp8_checkpoint(model, tmp_path / "first", progress=False)

    optimizer = torch.optim.SGD(adapter.values(), lr=1.0)
    model(torch.randint(0, 128, (2, 16)), labels=torch.randint(0, 128, (2, 16))).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapter.values())
    before = {n: p.detach().clone() for n, p in adapter.items()}
    optimizer.step()
    assert all(not torch.equal(p, before[n]) for n, p in adapter.items())
    assert all(torch.equal(p, masters[n]) for n, p in experts.named_parameters())  # the base stays frozen

    save_fp8_checkpoint(model, tmp_path / "second", progress=False)
    assert_experts_are(load_file(tmp_path / "second" / "model.safetensors"), merged_experts(model))


def test_merging_lora_into_fp8_experts_requantizes_them(tmp_path):
    """`merge_and_unload()` writes the merge through `.data` (no version bump): the FP8 experts' cached blocks of the
    unmerged weights must not be what the merged model multiplies and exports."""
    model = lora_on_fp8_experts()
    base_experts(model).quantized_expert_weight("gate_up_proj")
    merged = model.merge_and_unload()
    save_fp8_checkpoint(merged, tmp_path / "fp8", progress=False)
    assert_experts_are(load_file(tmp_path / "fp8" / "model.safetensors"), checkpoint_experts(merged.get_submodule(
        EXPERTS)))  # fmt: skip


def test_lora_on_mixtral_experts_exports_under_mixtrals_checkpoint_names(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=128, hidden_size=256, intermediate_size=INTER, num_local_experts=E,
                           num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=128)  # fmt: skip
    model = lora_on_fp8_experts(MixtralForCausalLM(config))
    merged = copy.deepcopy(model).merge_and_unload().get_submodule(EXPERTS)
    save_fp8_checkpoint(model, tmp_path / "fp8", progress=False)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    w3 = "model.layers.0.block_sparse_moe.experts.3.w3"
    assert_fp8_equal(saved[f"{w3}.weight"], saved[f"{w3}.weight_scale_inv"], merged.gate_up_proj[3, INTER:])
    kept = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.block_sparse_moe.gate" in kept


def test_grpo_syncs_lora_experts_in_place_and_saves_them_merged(fake_vllm, tmp_path, monkeypatch):
    import trl_fp8.rollout.vllm.experts as vllm_experts

    monkeypatch.setattr(vllm_experts, "_vllm_converter", lambda: keep_layout)
    trainer = tiny_trainer(tmp_path, model=tiny_moe(), peft_config=LoraConfig(r=4, lora_alpha=8, **EXPERT_LORA))
    generation, model = trainer.vllm_generation, trainer.model
    config = json.loads((generation.engine_dir / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.gate" in config["modules_to_not_convert"]  # vLLM builds a BF16 router
    trained_looking(model)
    llm = fake_vllm.instances[-1]
    engine = FakeMoEEngine({EXPERTS: base_experts(model)})
    llm.llm_engine.model_executor.driver_worker.worker.model_runner = engine
    llm.on_reload = engine.load
    generation.sync_weights()
    assert_experts_are(dict(llm.pushed), merged_experts(model))
    assert generation.engine_experts, "the in-place expert sync was not proven against the reload"

    trained_looking(model, seed=2)
    generation.sync_weights()
    assert not any(".experts." in n for n, _ in llm.pushed)  # written in place, no longer through the reload
    merged = copy.deepcopy(model).merge_and_unload().get_submodule(EXPERTS)
    assert_engine_holds(engine, merged)
    trainer.save_model(str(tmp_path / "fp8"))
    assert_experts_are(load_file(tmp_path / "fp8" / "model.safetensors"), checkpoint_experts(merged))


def test_no_grad_forwards_follow_the_experts_adapter_written_in_place():
    """LoRA on the experts hands each forward a new `W + BA` tensor; a new adapter state may get the last one's
    address, and under no_grad no step count tells them apart either. Forwards with the adapter written in place
    between them (as loading other adapter weights does) must each multiply the adapter as it is then: the FP8
    forward of the adapter merged into a copy, within the FP8 error against the unquantized model."""
    model = lora_on_fp8_experts()
    reference = get_peft_model(tiny_moe(), LoraConfig(r=4, lora_alpha=8, **EXPERT_LORA))
    ids = torch.randint(0, 128, (2, 16))
    generator = torch.Generator().manual_seed(2)
    previous = None
    for _ in range(10):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    if "lora_B" in name:
                        p.normal_(0, 0.05, generator=generator)
                    reference.get_parameter(name).copy_(p)
            logits = model(ids).logits
            merged = copy.deepcopy(model).merge_and_unload()(ids).logits
            exact = reference(ids).logits
        fp8_error = rel_err(merged, exact)
        assert rel_err(logits, merged) <= fp8_error
        if previous is not None:
            assert rel_err(exact, previous) > fp8_error  # each write moves the logits by more than the FP8 error
        previous = exact
    experts = base_experts(model)  # nothing cached from a `W + BA`: the cache is of the module's own parameters
    assert all(key[0] == getattr(experts, name).data_ptr() for name, (key, _) in experts._fp8_weight_cache.items())
