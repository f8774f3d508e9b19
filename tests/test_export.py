"""The block-FP8 exporter (`trl_fp8.checkpoint.save`): checkpoints that transformers and vLLM load, written in
shards with an index, mixture-of-experts layers per expert under the model's own checkpoint names, and a BF16 model's
FP8 layers planned by the conversion rules. Saved folders swapped in whole: `test_checkpoint_folder.py`; the trainer's
`save_model`: `test_grpo_trainer.py`."""

import json

import torch
from safetensors.torch import load_file
from test_fp8_experts import INTER, E, H, K, tiny_moe
from torch import nn

from trl_fp8 import convert_to_fp8, dequantize_blocks, save_fp8_checkpoint
from trl_fp8.demo.tiny_model import tiny_qwen3

from conftest import assert_fp8_equal, rel_err


def test_export_streams_shards_that_transformers_reloads(tmp_path):
    """A small `max_shard_size` splits the checkpoint into several files written one at a time, with an index; the
    tensors are those of a single-file export."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trl_fp8 import convert_to_fp8, save_fp8_checkpoint

    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model)
    save_fp8_checkpoint(model, tmp_path / "one", progress=False)
    save_fp8_checkpoint(model, tmp_path / "many", progress=False, max_shard_size=2**20)
    files = sorted(p.name for p in (tmp_path / "many").glob("model-*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    single = load_file(tmp_path / "one" / "model.safetensors")
    assert set(index["weight_map"]) == set(single) and set(index["weight_map"].values()) == set(files)
    for f in files:
        for name, t in load_file(tmp_path / "many" / f).items():
            assert index["weight_map"][name] == f
            assert torch.equal(t.view(torch.uint8), single[name].view(torch.uint8))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    assert not list((tmp_path / "many").glob("part-*")) and not list((tmp_path / "many").glob(".tmp-*"))
    AutoModelForCausalLM.from_pretrained(tmp_path / "many")  # transformers follows the index


def test_export_writes_per_expert_fp8_tensors_that_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_moe()
    convert_to_fp8(model)
    save_fp8_checkpoint(model, tmp_path / "fp8", progress=False)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    experts = model.model.layers[0].mlp.experts
    for e in range(E):
        prefix = f"model.layers.0.mlp.experts.{e}"
        for part, rows in (("gate_proj", slice(0, INTER)), ("up_proj", slice(INTER, 2 * INTER))):
            assert_fp8_equal(saved[f"{prefix}.{part}.weight"], saved[f"{prefix}.{part}.weight_scale_inv"],
                             experts.gate_up_proj[e, rows])  # fmt: skip
        assert_fp8_equal(saved[f"{prefix}.down_proj.weight"], saved[f"{prefix}.down_proj.weight_scale_inv"],
                         experts.down_proj[e])  # fmt: skip
    assert saved["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
    assert not any("gate_up_proj" in k for k in saved)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert config["modules_to_not_convert"] == ["lm_head", "model.layers.0.mlp.gate"]  # the router stays BF16

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")  # CPU: transformers dequantizes to BF16
    q, s = experts.quantized_expert_weight("down_proj")
    expected = dequantize_blocks(q[1], s[1]).to(torch.bfloat16)
    assert torch.equal(reloaded.model.layers[0].mlp.experts.down_proj[1], expected)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        err = rel_err(reloaded.float()(ids).logits, model(ids).logits)
    assert err < 0.12, err  # FP8 weights, unquantized activations and BF16 norms: measured 0.049


def test_mixtral_experts_export_under_mixtrals_own_checkpoint_names(tmp_path):
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                                             num_experts_per_tok=K, num_hidden_layers=1, num_attention_heads=2,
                                             num_key_value_heads=1, head_dim=128))  # fmt: skip
    convert_to_fp8(model)
    save_fp8_checkpoint(model, tmp_path / "fp8", progress=False)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    experts = model.model.layers[0].mlp.experts
    w1, w3 = "model.layers.0.block_sparse_moe.experts.3.w1", "model.layers.0.block_sparse_moe.experts.3.w3"
    assert_fp8_equal(saved[f"{w1}.weight"], saved[f"{w1}.weight_scale_inv"], experts.gate_up_proj[3, :INTER])
    assert_fp8_equal(saved[f"{w3}.weight"], saved[f"{w3}.weight_scale_inv"], experts.gate_up_proj[3, INTER:])
    kept = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.block_sparse_moe.gate" in kept  # vLLM's name for the router
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        assert (
            rel_err(AutoModelForCausalLM.from_pretrained(tmp_path / "fp8").float()(ids).logits, model(ids).logits)
            < 0.12
        )


def test_bf16_model_with_convolutions_exports_in_fp8(tmp_path):
    """The exporter plans a BF16 model's FP8 layers with the same rules: a Conv1d is stored as is, in BF16."""
    from safetensors.torch import load_file

    from trl_fp8 import save_fp8_checkpoint

    model = tiny_qwen3(num_hidden_layers=1)
    model.model.layers[0].conv1d = nn.Conv1d(256, 256, 4, groups=256)  # the shape of a Mamba / LFM2 conv
    out = save_fp8_checkpoint(model, tmp_path / "ckpt", progress=False)
    tensors = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert tensors["model.layers.0.conv1d.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
