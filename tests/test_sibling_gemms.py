"""Sibling FP8 layers (q/k/v, gate/up) run as one GEMM per pass: the same values per layer as running each alone,
fewer kernels, the same FP8 bytes for vLLM and the checkpoint (CPU, exact FP8 emulation).

The stacked GEMM gets every FP8 operand of the layers run alone (blocks and groups never straddle two layers), but
the CPU may sum a product in another fp32 order for another shape, thread count or CPU; a value that lands on the
other side of an FP8 rounding boundary then moves by one FP8 step, the unit of the FP8 error itself. So values that
depend on a summation are compared against that error, measured against the same model unquantized in fp32
(`high_precision`); only FP8 weights, quantized from the same weights by the same quantizer, must match bit for bit.
"""

import copy
import hashlib

import pytest
import torch

from trl_fp8 import FP8GRPOConfig, FP8LinearConfig, FP8Tuning, convert_to_fp8, save_fp8_checkpoint
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.sibling_gemms import FP8SiblingGroup, group_fp8_siblings, sibling_group_problem
from trl_fp8.ops import emulated
from trl_fp8.rollout.vllm.engine import rollout_weight_tensors

from fake_vllm import tiny_trainer


def pair(dtype=torch.float32, layers=2):
    """The same tiny Qwen3 twice: each FP8 layer alone, and siblings as one GEMM."""
    base = tiny_qwen3(seed=0, dtype=dtype, num_hidden_layers=layers)
    alone, fused = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(alone, config=FP8LinearConfig())
    convert_to_fp8(fused, config=FP8LinearConfig(fuse_sibling_gemms=True))
    return alone, fused


def high_precision(dtype=torch.float32, layers=2):
    """The models of `pair` unquantized, in fp32: the reference that FP8 errors are measured against."""
    return tiny_qwen3(seed=0, dtype=dtype, num_hidden_layers=layers).float()


def forward_backward(model, ids):
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def assert_within_fp8_error(fused, alone, reference, name="") -> None:
    """`fused` is closer to `alone` than `alone` is to the unquantized `reference` (relative norms): the same FP8
    math with a rounding flipped here and there. Two FP8 evaluations rounded independently everywhere would be about
    sqrt(2) times that error apart, and a layer handed another's rows far more."""
    assert rel(fused, alone) <= rel(alone, reference), name


def assert_same_training_math(alone, fused, reference, ids):
    """Logits and every gradient of the grouped model within FP8 error of the layers run alone."""
    logits_a, grads_a = forward_backward(alone, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    logits_r, grads_r = forward_backward(reference, ids)
    assert grads_a.keys() == grads_f.keys() == grads_r.keys()
    assert_within_fp8_error(logits_f, logits_a, logits_r, "logits")
    for name, g in grads_a.items():
        assert_within_fp8_error(grads_f[name], g, grads_r[name], name)


def test_conversion_groups_qkv_and_gate_up_per_decoder_layer():
    alone, fused = pair()
    for layer in fused.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj._fp8_group[0].members == [attn.q_proj, attn.k_proj, attn.v_proj]
        assert mlp.gate_proj._fp8_group[0].members == [mlp.gate_proj, mlp.up_proj]
        assert attn.o_proj._fp8_group is None and mlp.down_proj._fp8_group is None
    assert all(getattr(m, "_fp8_group", None) is None for m in alone.modules())
    assert group_fp8_siblings(fused) == []  # already grouped: converting again changes nothing


def test_one_gemm_computes_what_each_layer_computes_fp32():
    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    assert_same_training_math(alone, fused, high_precision(), ids)


def test_one_gemm_computes_what_each_layer_computes_bf16():
    """BF16 masters: the forward is the same math. The stacked DGrad sums q, k and v's contributions to dx in one
    fp32 accumulation, where three layers round each to BF16 and add them in BF16: one rounding instead of five, so
    its gradients must be no less accurate than the layers' alone against the fp32 model, up to the spread between
    two equally valid roundings (each error a norm over thousands of roundings: a small fraction of it)."""
    alone, fused = pair(torch.bfloat16)
    reference = high_precision(torch.bfloat16)
    ids = torch.randint(0, 200, (2, 24))
    logits_a, grads_a = forward_backward(alone, ids)
    logits_f, grads_f = forward_backward(fused, ids)
    logits_r, grads_r = forward_backward(reference, ids)
    assert_within_fp8_error(logits_f, logits_a, logits_r, "logits")
    for name, g in grads_r.items():
        assert rel(grads_f[name], g) <= 1.15 * rel(grads_a[name], g), name


def count_kernels(monkeypatch):
    counts = dict.fromkeys(("gemm", "quantize_act", "quantize_weight"), 0)
    for name in counts:
        original = getattr(emulated, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(emulated, name, counted)
    return counts


def test_siblings_launch_a_third_of_the_gemms(monkeypatch):
    """Per decoder layer, forward: 7 FProp GEMMs alone, 4 grouped (qkv, o, gate_up, down); backward: 14 GEMMs and 7
    output-gradient quantizations alone, 8 and 4 grouped, and the DGrad weight layout re-quantized only for o and
    down (a group multiplies by the FP8 stack its cache holds)."""
    ids = torch.randint(0, 200, (2, 24))
    measured = {}
    for label, model in zip(("alone", "fused"), pair(), strict=True):
        model(input_ids=ids)  # weights quantized and cached
        counts = count_kernels(monkeypatch)
        logits = model(input_ids=ids).logits
        forward = dict(counts)
        logits.float().pow(2).mean().backward()
        measured[label] = forward, {k: counts[k] - forward[k] for k in counts}
        monkeypatch.undo()
    layers = 2
    assert measured["alone"] == (
        {"gemm": 7 * layers, "quantize_act": 4 * layers, "quantize_weight": 0},
        {"gemm": 14 * layers, "quantize_act": 7 * layers, "quantize_weight": 7 * layers},
    )
    assert measured["fused"] == (
        {"gemm": 4 * layers, "quantize_act": 4 * layers, "quantize_weight": 0},
        {"gemm": 8 * layers, "quantize_act": 4 * layers, "quantize_weight": 2 * layers},
    )


def test_without_the_cache_a_group_quantizes_its_stacked_weights_once_per_forward(monkeypatch):
    """Without the FP8 weight cache (FSDP2's default: each forward quantizes the weights it gathered), a group stacks
    its members' weights and quantizes them with one kernel: per decoder layer 4 weight quantizations per forward
    instead of 7, the same FP8 blocks as each member quantized alone, and the forward within FP8 error of it."""
    base = tiny_qwen3(seed=0, num_hidden_layers=2)
    alone, fused = copy.deepcopy(base), copy.deepcopy(base)
    convert_to_fp8(alone, config=FP8LinearConfig(cache_quantized_weight=False))
    convert_to_fp8(fused, config=FP8LinearConfig(fuse_sibling_gemms=True, cache_quantized_weight=False))
    group = fused.model.layers[0].self_attn.q_proj._fp8_group[0]
    stacked = group.fp8_weight()
    rows = [m.out_features for m in group.members]
    for member, q, s in zip(group.members, stacked.q.split(rows), stacked.scale_inv.split([r // 128 for r in rows]),
                            strict=True):  # fmt: skip
        own = member._quantize(member.weight)
        assert torch.equal(q.view(torch.uint8), own.q.view(torch.uint8)) and torch.equal(s, own.scale_inv)
    ids = torch.randint(0, 200, (2, 24))
    quantized = {}
    for label, model in (("alone", alone), ("fused", fused)):
        counts = count_kernels(monkeypatch)
        with torch.no_grad():
            model(input_ids=ids)
        quantized[label] = counts["quantize_weight"]
        monkeypatch.undo()
    assert quantized == {"alone": 7 * 2, "fused": 4 * 2}
    assert_same_training_math(alone, fused, high_precision(), ids)


def checkpoint_digest(model, path):
    save_fp8_checkpoint(model, path, progress=False)
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_vllm_sync_and_checkpoint_hold_the_same_bytes(tmp_path):
    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    forward_backward(alone, ids), forward_backward(fused, ids)  # the fused layers' caches now view the stacks
    assert isinstance(fused.model.layers[0].self_attn.k_proj._fp8_weight_cache[1].q._base, torch.Tensor)
    pushed_alone = dict(rollout_weight_tensors(alone, "fp8"))
    pushed_fused = dict(rollout_weight_tensors(fused, "fp8"))
    assert pushed_alone.keys() == pushed_fused.keys()
    for name, t in pushed_alone.items():
        u = pushed_fused[name]
        assert t.dtype == u.dtype and torch.equal(
            t.contiguous().view(torch.uint8), u.contiguous().view(torch.uint8)
        ), name
    assert checkpoint_digest(fused, tmp_path / "fused") == checkpoint_digest(alone, tmp_path / "alone")


def test_optimizer_steps_refresh_the_stacked_weight():
    """Three SGD steps: each parameter's update within FP8 error of the layers' alone (against the unquantized
    model's update), and every FP8 weight the quantization of the current weight, bit for bit."""
    alone, fused = pair()
    reference = high_precision()
    ids = torch.randint(0, 200, (2, 24))
    models = (alone, fused, reference)
    start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]  # (Adam would amplify noise)
    for _ in range(3):
        for model, opt in zip(models, opts, strict=True):
            opt.zero_grad()
            forward_backward(model, ids)
            opt.step()
    updates = [{n: p.detach() - start[n] for n, p in m.named_parameters()} for m in models]
    for name, update in updates[0].items():
        assert_within_fp8_error(updates[1][name], update, updates[2][name], name)
    for module in fused.modules():
        if hasattr(module, "quantized_weight"):
            from trl_fp8 import quantize_blocks

            q, s = module.quantized_weight()
            q_ref, s_ref = quantize_blocks(module.weight.detach())
            assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_a_member_called_alone_twice_or_on_another_input_runs_alone():
    """Each call returns its own layer's output for the input as it is now (an output handed to the wrong caller,
    or computed before an in-place change, is off by far more than FP8 error)."""
    alone, fused = pair()
    attn_a, attn_f = alone.model.layers[0].self_attn, fused.model.layers[0].self_attn
    attn_r = high_precision().model.layers[0].self_attn
    x, y = torch.randn(2, 5, 256), torch.randn(2, 5, 256)

    def check(name, x):
        out = getattr(attn_f, name)(x)
        assert_within_fp8_error(out, getattr(attn_a, name)(x), getattr(attn_r, name)(x), name)

    check("k_proj", x)  # first caller: computes all three, returns k
    check("k_proj", x)  # again on the same input: runs alone
    check("q_proj", x)  # the pending q
    check("v_proj", y)  # another input: a new stack computed for y
    check("v_proj", x)
    x.add_(1.0)  # an in-place change: nothing computed before it is handed out
    check("q_proj", x)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_scoring_passes_without_autograd(mode):
    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    reference = high_precision()
    with ctx():
        a, f, r = (model(input_ids=ids).logits for model in (alone, fused, reference))
    assert_within_fp8_error(f, a, r)
    assert_same_training_math(alone, fused, reference, ids)  # the cache made under inference mode is not reused


def test_gradient_checkpointing_recomputes_the_same_group():
    alone, fused = pair()
    for model in (alone, fused):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    assert_same_training_math(alone, fused, high_precision(), torch.randint(0, 200, (2, 24)))


def test_lora_adapters_on_grouped_base_layers():
    from peft import LoraConfig, get_peft_model

    models = []
    for model in (*pair(), high_precision()):
        torch.manual_seed(1)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
        models.append(get_peft_model(model, config))
    alone, fused, reference = models
    assert group_fp8_siblings(fused) == []
    assert_same_training_math(alone, fused, reference, torch.randint(0, 200, (2, 24)))
    assert any("lora_A" in n and p.grad is not None for n, p in fused.named_parameters())


def test_deep_copy_gets_its_own_group():
    _, fused = pair()
    clone = copy.deepcopy(fused)
    group = clone.model.layers[1].mlp.gate_proj._fp8_group[0]
    assert group.members == [clone.model.layers[1].mlp.gate_proj, clone.model.layers[1].mlp.up_proj]
    ids = torch.randint(0, 200, (2, 24))
    torch.testing.assert_close(clone(input_ids=ids).logits, fused(input_ids=ids).logits)


def test_unfit_groups_are_refused_by_name():
    _, fused = pair()
    layer = fused.model.layers[0]
    assert sibling_group_problem([layer.self_attn.o_proj]) == "fewer than two layers"
    assert sibling_group_problem([layer.self_attn.o_proj, layer.mlp.down_proj]) == (
        "the layers have different input dims"
    )
    with pytest.raises(ValueError, match="already belongs to a sibling group"):
        FP8SiblingGroup([layer.self_attn.q_proj, layer.self_attn.o_proj])
    with pytest.raises(ValueError, match="fuse_sibling_gemms applies to the blockwise recipe only"):
        FP8LinearConfig(recipe="tensorwise", fuse_sibling_gemms=True)
    with pytest.raises(ValueError, match="fp8_recipe=None trains in BF16"):
        FP8Tuning(fuse_sibling_gemms=True).check(FP8GRPOConfig(output_dir="unused", use_cpu=True, fp8_recipe=None))


def test_a_dropped_layer_stack_frees_without_the_garbage_collector():
    """Members and group refer to each other; the group's references are weak, so dropping the layers frees them at
    once (a reference cycle would hold a dropped model's GPU memory until the collector runs), and a pickled model
    gets its groups back."""
    import gc
    import io
    import weakref

    from torch import nn

    from trl_fp8 import FP8Linear

    def stack():
        attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, FP8Linear.convert_(nn.Linear(128, 128, bias=False), FP8LinearConfig()))
        assert len(group_fp8_siblings(attn)) == 1
        return attn

    gc.disable()
    try:
        attn = stack()
        layer = weakref.ref(attn.q_proj)
        del attn
        assert layer() is None
    finally:
        gc.enable()
    attn = stack()
    buffer = io.BytesIO()
    torch.save(attn, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.k_proj._fp8_group[0].members == [loaded.q_proj, loaded.k_proj, loaded.v_proj]


def fp8_copies(model) -> dict:
    """`{storage weak reference: bytes}` of every FP8 weight copy (the values and scales of an `FP8Weight`) that the
    model's modules reach through their attributes (layer caches, sibling groups), found by walking them."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from trl_fp8.nn.linear import FP8Weight

    found, seen = {}, set()

    def walk(obj):
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type, type(torch))):
            return
        seen.add(id(obj))
        if isinstance(obj, FP8Weight):
            for storage in (obj.q.untyped_storage(), obj.scale_inv.untyped_storage()):
                found[storage.data_ptr()] = StorageWeakRef(storage), storage.nbytes()
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                walk(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                walk(item)
        elif hasattr(obj, "__dict__"):
            walk(vars(obj))

    for module in model.modules():
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                walk(value)
    return dict(found.values())


def train_step_then_push(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    forward_backward(model, ids)
    opt.step()
    dict(rollout_weight_tensors(model, "fp8"))  # the push after the step quantizes the new weights


def test_a_grouped_model_holds_one_fp8_copy_at_the_push_and_releases_all_of_it():
    """After an optimizer step the sync quantizes each weight once: the grouped model holds one FP8 copy, as the
    ungrouped one does (members quantizing alone beside the old stack held both). Releasing the caches (sleep mode)
    frees every copy, and reports the bytes freed: the stack that the members' caches view included."""
    from trl_fp8.nn.linear import fp8_weight_cache_bytes, release_fp8_weight_caches

    alone, fused = pair()
    ids = torch.randint(0, 200, (2, 24))
    held = {}
    for label, model in (("alone", alone), ("fused", fused)):
        train_step_then_push(model, ids)
        copies = fp8_copies(model)
        held[label] = sum(copies.values())
        assert fp8_weight_cache_bytes(model) == held[label]
        released = release_fp8_weight_caches(model)
        freed = sum(size for ref, size in copies.items() if ref.expired())
        assert (released, freed) == (held[label], held[label]), label
        assert fp8_copies(model) == {} and fp8_weight_cache_bytes(model) == 0
    fp8_params = sum(m.weight.numel() for m in alone.modules() if hasattr(m, "quantized_weight"))
    assert held["fused"] == held["alone"] == fp8_params + 4 * fp8_params // 128**2  # 1 byte + 1 fp32 per block


def test_sleep_mode_frees_every_fp8_copy_of_a_grouped_model(fake_vllm, tmp_path):
    """The trainer's colocated sync in sleep mode lets go of the FP8 copies: the bytes it reports are the bytes of
    the copies that died, the groups' stacks included, and none is left."""
    trainer = tiny_trainer(tmp_path, vllm_enable_sleep_mode=True, tuning=FP8Tuning(fuse_sibling_gemms=True))
    model, generation = trainer.model, trainer.vllm_generation
    assert model.model.layers[0].self_attn.k_proj._fp8_group is not None
    with torch.no_grad():  # a scoring pass: the default cache holds its copies (a training forward lets them go)
        model(torch.tensor([[1, 2, 3]]))
    copies = fp8_copies(model)
    generation.sync_weights()
    freed = sum(size for ref, size in copies.items() if ref.expired())
    assert generation.report.released_cache_bytes == freed == sum(copies.values()) > 0
    assert fp8_copies(model) == {}


def lora_on_parameters(model, targets):
    """LoRA through PEFT's `target_parameters` on the attention layers `targets`: each forward, PEFT parametrizes
    such a layer's weight as `W + BA`, only for the time of that layer's own call."""
    from peft import LoraConfig, get_peft_model

    params = [f"self_attn.{name}.weight" for name in targets]
    torch.manual_seed(1)  # the same adapter on every model
    return get_peft_model(model, LoraConfig(r=4, target_modules=[], target_parameters=params, init_lora_weights=False))


@pytest.mark.parametrize("targets", [("k_proj", "v_proj"), ("v_proj",)])
def test_lora_on_target_parameters_of_grouped_layers(targets):
    """The first sibling's call stacks the plain weights, before the adapted layers' calls make theirs `W + BA`: the
    grouped model must still multiply the adapter, as the layers alone do (handing them the pending outputs dropped
    it). Three SGD steps with gradient checkpointing: the adapted layers leave their group after the first step, not
    within it (the first backward recomputes its forward, which must see the group it saw), their siblings stay."""
    models = []
    for model in (*pair(), high_precision()):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        models.append(lora_on_parameters(model, targets))
    alone, fused, reference = models
    ids = torch.randint(0, 200, (2, 24))
    with torch.no_grad():
        with fused.disable_adapter():
            without = fused(input_ids=ids).logits
        logits_a, logits_f, logits_r = (model(input_ids=ids).logits for model in models)
    # The adapter moves the logits by more than the FP8 error the comparison below allows: dropping it would show.
    assert rel(logits_f, without) > rel(logits_a, logits_r)
    assert_within_fp8_error(logits_f, logits_a, logits_r, "logits")

    attn = fused.get_base_model().model.layers[0].self_attn
    layers = {name: getattr(attn, name) for name in ("q_proj", "k_proj", "v_proj")}
    layers = {name: layer.get_base_layer() if name in targets else layer for name, layer in layers.items()}
    optimizers = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in models]
    for step in range(3):
        for optimizer in optimizers:
            optimizer.zero_grad()
        assert_same_training_math(alone, fused, reference, ids)
        if step == 0:
            assert layers["q_proj"]._fp8_group[0].members == list(layers.values())
        for optimizer in optimizers:
            optimizer.step()
    assert all(layers[name]._fp8_group is None for name in targets)
    kept = [layer for name, layer in layers.items() if name not in targets]
    assert (kept[0]._fp8_group[0].members if kept[0]._fp8_group else [kept[0]]) == kept
    mlp = fused.get_base_model().model.layers[0].mlp
    assert mlp.gate_proj._fp8_group[0].members == [mlp.gate_proj, mlp.up_proj]
    assert any("lora_B" in n and p.grad is not None for n, p in fused.named_parameters())


@pytest.mark.parametrize("fuse", [False, True])
def test_no_grad_forwards_follow_an_adapter_written_in_place(fuse):
    """Under LoRA on `target_parameters`, each forward hands the layer a new `W + BA` tensor; a new adapter state may
    get the last one's address, and under no_grad no step count tells them apart either. Forwards with the adapter
    written in place between them (as loading other adapter weights does) must each multiply the adapter as it is
    then: the FP8 forward of the adapter merged into a copy, within the FP8 error against the unquantized model."""
    model = lora_on_parameters(pair()[int(fuse)], ("k_proj", "v_proj"))
    reference = lora_on_parameters(high_precision(), ("k_proj", "v_proj"))
    ids = torch.randint(0, 200, (2, 24))
    generator = torch.Generator().manual_seed(2)
    previous = None
    for _ in range(10):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3, generator=generator)
                    reference.get_parameter(name).copy_(p)
            logits = model(input_ids=ids).logits
            merged = copy.deepcopy(model).merge_and_unload()(input_ids=ids).logits
            exact = reference(input_ids=ids).logits
        fp8_error = rel(merged, exact)
        assert rel(logits, merged) <= fp8_error
        if previous is not None:
            assert rel(exact, previous) > fp8_error  # each write moves the logits by more than the FP8 error
        previous = exact
    for module in model.modules():  # nothing cached from a `W + BA`: a layer's cache is its own parameter's
        if isinstance(getattr(module, "_fp8_weight_cache", None), tuple):
            assert module._fp8_weight_cache[0][0] == module.weight.data_ptr()
