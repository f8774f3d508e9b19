"""Decoder families transformers ships with gated MLPs, mixture-of-experts experts or convolutions, each as a tiny
random model converted to FP8: it converts exactly, with default options and with both fusions, or it is refused by
name.

Per architecture (2 layers, hidden 256, 4 experts, small vocabulary; CPU, exact FP8 emulation):
- the converted model against the float32 model stays within what FP8 rounding explains. `err_w` is the error of the
  model's own forward with only the converted layers' weights rounded to FP8 (128x128 blocks, nothing else changed,
  so the model's semantics are untouched). The converted model also rounds its activations, in 1x128 groups of the
  same e4m3 format: an independent error of the same relative size, so about sqrt(2) * err_w; it must stay under
  3 * err_w, with and without the fusions. A conversion that changes what the model computes (a dropped multiplier or
  clamp, a linear subclass run as a plain `nn.Linear`, experts with another gate) lands far above;
- each block a fusion changed (a fused MLP, an attention or MLP block whose siblings run as one GEMM), fed the very
  inputs the unfused model gave it: the fused and unfused FP8 blocks differ by less than a quarter of the unfused
  block's own FP8 error, in the output and in the gradients. The fusions only change the fp32 summation order (or
  the memory layout an activation reads), a relative change d near 2^-24; an FP8 rounding turns it into one of about
  sqrt(d * u) (u the e4m3 rounding error, a few percent: only the values within d of a rounding boundary move, by
  one FP8 step), and the few roundings in a row of one block's forward and backward keep it well under u / 4.
  Compared on whole models instead, every layer's roundings feed the next one's and such differences grow towards u
  itself, where no bound could tell a reordered sum from a wrong result;
- the fused model's forward and backward give a finite gradient to every parameter the float32 model trains;
- the block-FP8 checkpoint of the converted model is written, and the one of the float32 model (its layers planned by
  `plan_fp8_conversion`, quantized by the exporter) holds the very same tensors.

`python -m tests.test_architectures` prints the table of docs/contributing/architectures-details.md from these same
checks.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is built locally

import pytest
import torch
from torch import nn

from trl_fp8 import ConversionReport, FP8LinearConfig, convert_to_fp8, dequantize_blocks, quantize_blocks
from trl_fp8.checkpoint.save import save_fp8_checkpoint
from trl_fp8.nn.conversion import plan_fp8_conversion
from trl_fp8.nn.experts import is_experts_module

# Hidden 256, two 128-wide heads (one KV head), MLP 512, experts 4 x 128 (top 2): the common projections have whole
# 128x128 blocks.
COMMON = dict(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=128, intermediate_size=512, max_position_embeddings=256, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
MOE = dict(moe_intermediate_size=128, num_experts_per_tok=2)


@dataclass(frozen=True)
class Arch:
    label: str
    config: str  # transformers config class
    model: str  # transformers model class
    kwargs: dict = field(default_factory=dict)
    refused: str | None = None  # what the default conversion's error says, for experts FP8 cannot run


# fmt: off
ARCHITECTURES = {
    "llama": Arch("Llama", "LlamaConfig", "LlamaForCausalLM"),
    "llama_gelu": Arch("Llama, GELU MLP", "LlamaConfig", "LlamaForCausalLM", dict(hidden_act="gelu")),
    "qwen2": Arch("Qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": Arch("Qwen3", "Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": Arch("Phi-3", "Phi3Config", "Phi3ForCausalLM"),
    "gpt_neox": Arch("GPT-NeoX", "GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "qwen2_moe": Arch("Qwen2-MoE", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(MOE, num_experts=4, shared_expert_intermediate_size=256)),
    "qwen3_moe": Arch("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(MOE, num_experts=4)),
    "mixtral": Arch("Mixtral", "MixtralConfig", "MixtralForCausalLM",
                    dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128)),
    "deepseek_v3": Arch("DeepSeek-V3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(MOE, n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                             first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64,
                             qk_nope_head_dim=64, v_head_dim=128, head_dim=64)),
    "qwen3_next": Arch("Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
                       dict(MOE, num_experts=4, shared_expert_intermediate_size=128, linear_num_value_heads=2,
                            linear_num_key_heads=1, linear_key_head_dim=128, linear_value_head_dim=128,
                            layer_types=["linear_attention", "full_attention"])),
    "falcon_h1": Arch("Falcon-H1", "FalconH1Config", "FalconH1ForCausalLM",
                      dict(mamba_d_ssm=256, mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16, mamba_chunk_size=16,
                           mlp_multipliers=[0.5, 2.0])),
    "jamba": Arch("Jamba", "JambaConfig", "JambaForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                       expert_layer_period=2, expert_layer_offset=1, mamba_dt_rank=16)),
    "lfm2": Arch("LFM2", "Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"])),
    "deepseek_v4": Arch("DeepSeek-V4", "DeepseekV4Config", "DeepseekV4ForCausalLM",
                        dict(MOE, n_routed_experts=4, q_lora_rank=128, o_groups=2, o_lora_rank=128,
                             layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                             mlp_layer_types=["moe", "moe"], index_n_heads=2, index_head_dim=128, index_topk=8,
                             sliding_window=8, hc_mult=2),
                        refused="DeepseekV4Experts applies its own gating function"),
    # transformers has no causal LM of GLM-5-Next's text model alone: its decoder, without the LM head
    "glm5_next": Arch("GLM-5-Next (text decoder)", "Glm5NextTextConfig", "Glm5NextTextModel",
                      dict(MOE, num_key_value_heads=2, n_routed_experts=4, mlp_layer_types=["dense", "sparse"],
                           layer_types=["linear_attention", "indexed_attention"], indexer_types=["full", "full"],
                           q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128, v_head_dim=128,
                           linear_num_heads=2, index_n_heads=2, index_topk=16, hc_mult=2),
                      refused="Glm5NextTextExperts has no num_experts / act_fn attributes"),
}
# fmt: on


def missing(name: str) -> str | None:
    """Why the installed transformers cannot build architecture `name`, or None."""
    import transformers

    arch = ARCHITECTURES[name]
    absent = [cls for cls in (arch.config, arch.model) if not hasattr(transformers, cls)]
    return f"transformers {transformers.__version__} has no {', '.join(absent)}" if absent else None


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny float32 model of architecture `name`, randomly initialised."""
    import transformers

    arch = ARCHITECTURES[name]
    config = getattr(transformers, arch.config)(**{**COMMON, **arch.kwargs})
    torch.manual_seed(seed)
    return getattr(transformers, arch.model)(config).eval()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def first_tensor(out) -> torch.Tensor:
    return out if torch.is_tensor(out) else next(o for o in out if torch.is_tensor(o))


def output(model: nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """The logits, or the last hidden states of a model without an LM head."""
    out = model(input_ids=ids, **kwargs)
    return out.logits if "logits" in out else out.last_hidden_state


def forward_backward(model: nn.Module, ids: torch.Tensor):
    """The output and the parameters' gradients of `(output * probe).sum()`, a fixed random probe (those parameters
    on the path these tokens take)."""
    out = output(model, ids)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * probe).sum().backward()
    return out.detach().float(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def weights_rounded_to_fp8(model: nn.Module, names: list[str]) -> nn.Module:
    """A copy of `model` whose layers `names` hold their weights rounded to FP8 (128x128 blocks, per expert for
    experts), computing with the model's own forward."""
    rounded = copy.deepcopy(model)
    modules = dict(rounded.named_modules())
    with torch.no_grad():
        for name in names:
            module = modules[name]
            for param in module.parameters(recurse=False) if is_experts_module(module) else [module.weight]:
                rows = param.reshape(-1, param.shape[-1])
                param.copy_(dequantize_blocks(*quantize_blocks(rows), dtype=param.dtype).reshape(param.shape))
    return rounded


def convert(model: nn.Module, arch: Arch, **options) -> tuple[ConversionReport, list[str]]:
    """`convert_to_fp8` with `options`; for an architecture whose experts are refused, check the refusal names them
    and the opt-out, then convert with `keep_experts_in_bf16=True`. Returns the report and the "fused nothing"
    warnings."""
    keep_experts = arch.refused is not None
    if keep_experts:
        with pytest.raises(ValueError, match=re.escape(arch.refused) + ".*keep_experts_in_bf16=True"):
            with warnings.catch_warnings():  # (the dims warning comes again from the conversion below)
                warnings.simplefilter("ignore")
                convert_to_fp8(copy.deepcopy(model), config=FP8LinearConfig(**options))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = convert_to_fp8(model, config=FP8LinearConfig(**options), keep_experts_in_bf16=keep_experts)
    return report, [str(w.message) for w in caught if "fused nothing" in str(w.message)]


def fused_blocks(report: ConversionReport) -> list[str]:
    """The modules whose forward a fusion changed: fused MLPs, and the blocks holding sibling sets run as one GEMM."""
    blocks = list(report.fused.get("fuse_swiglu", []))
    blocks += [label.rpartition(".")[0] for label in report.fused.get("fuse_sibling_gemms", [])]
    return list(dict.fromkeys(blocks))


def block_inputs(model: nn.Module, names: list[str], ids: torch.Tensor) -> dict[str, tuple[tuple, dict]]:
    """The positional and keyword arguments each module `names` receives in `model`'s forward on `ids`."""
    seen, handles = {}, []
    for name in names:
        hook = lambda mod, args, kwargs, name=name: seen.setdefault(name, (args, kwargs))  # noqa: E731
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        output(model, ids, use_cache=False)  # (a KV cache among the arguments would grow at every block call)
    for handle in handles:
        handle.remove()
    return seen


def block_forward_backward(block: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's output on (a copy of) the given inputs, and the gradients of its input hidden states and parameters
    for a fixed random output gradient, concatenated."""
    args, kwargs = list(args), dict(kwargs)
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = x = kwargs["hidden_states"].detach().clone().requires_grad_()
    else:
        args[0] = x = args[0].detach().clone().requires_grad_()
    block.zero_grad()
    out = first_tensor(block(*args, **kwargs))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * probe).sum().backward()
    grads = [x.grad] + [p.grad for p in block.parameters() if p.grad is not None]
    return out.detach().float(), torch.cat([g.flatten().float() for g in grads])


def check_fused_blocks(model, plain, fused, report: ConversionReport, ids: torch.Tensor) -> None:
    """Each block a fusion changed computes, on the unfused model's inputs, what the unfused block computes (bound
    in the module docstring), and the blocks no fusion changed still run the model's own forward."""
    names = fused_blocks(report)
    inputs = block_inputs(plain, names, ids)
    for name in names:
        args, kwargs = inputs[name]
        out_ref, grad_ref = block_forward_backward(model.get_submodule(name), args, kwargs)
        out_u, grad_u = block_forward_backward(plain.get_submodule(name), args, kwargs)
        out_f, grad_f = block_forward_backward(fused.get_submodule(name), args, kwargs)
        assert rel_err(out_f, out_u) < rel_err(out_u, out_ref) / 4, name
        assert rel_err(grad_f, grad_u) < rel_err(grad_u, grad_ref) / 4, name
    unfused = set(report.not_fused.get("fuse_swiglu", {}))
    assert all("forward" not in vars(m) for n, m in fused.named_modules() if n in unfused)


def check_architecture(name: str, folder: Path) -> Outcome:
    """Run every check of the module docstring on architecture `name`; returns its row of the table."""
    arch = ARCHITECTURES[name]
    model = build(name)
    ids = torch.randint(3, COMMON["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    out_ref, grads_ref = forward_backward(copy.deepcopy(model), ids)

    plain, fused = copy.deepcopy(model), copy.deepcopy(model)
    report, idle_plain = convert(plain, arch)
    fused_report, idle = convert(fused, arch, fuse_swiglu=True, fuse_sibling_gemms=True)
    assert not idle_plain and sorted(fused_report.converted) == sorted(report.converted)
    # One warning, only when a requested fusion applied nowhere.
    assert len(idle) == int(not all(fused_report.fused.values())), idle

    with torch.no_grad():
        err_w = rel_err(output(weights_rounded_to_fp8(model, report.converted), ids), out_ref)
        err_u = rel_err(output(plain, ids), out_ref)
    out_f, grads_f = forward_backward(fused, ids)
    assert 0 < err_u < 3 * err_w and rel_err(out_f, out_ref) < 3 * err_w, (err_u, err_w)
    assert grads_f.keys() == grads_ref.keys() and all(torch.isfinite(g).all() for g in grads_f.values())
    check_fused_blocks(model, plain, fused, fused_report, ids)

    return Outcome(
        arch.label,
        linears=_linears_cell(report, model),
        experts=_experts_cell(report, arch),
        swiglu=_fusion_cell(fused_report, "fuse_swiglu"),
        siblings=_fusion_cell(fused_report, "fuse_sibling_gemms"),
        kept=_kept_cell(report),
        export=check_export(model, plain, report, folder, keep_experts=arch.refused is not None),
    )


def check_export(model: nn.Module, converted: nn.Module, report, folder: Path, keep_experts: bool) -> str:
    """The checkpoint of the converted model, and the one of the float32 model planned by `plan_fp8_conversion` and
    quantized by the exporter, hold the same tensors."""
    from safetensors.torch import load_file

    planned, _ = plan_fp8_conversion(model, keep_experts_in_bf16=keep_experts, warn=False)
    assert sorted(planned.converted) == sorted(report.converted)
    saved = []
    for source, fp8_modules, sub in ((converted, None, "fp8"), (model, set(planned.converted), "planned")):
        out = save_fp8_checkpoint(source, folder / sub, fp8_modules=fp8_modules, progress=False)
        saved.append({k: v for part in sorted(out.glob("*.safetensors")) for k, v in load_file(part).items()})
    assert saved[0].keys() == saved[1].keys()
    for key, tensor in saved[0].items():
        other = saved[1][key]
        assert tensor.dtype == other.dtype and torch.equal(tensor.view(torch.uint8), other.view(torch.uint8)), key
    return f"yes, {sum(t.dtype == torch.float8_e4m3fn for t in saved[0].values())} FP8 tensors; the same from BF16"


@dataclass
class Outcome:
    """One architecture's row of the table."""

    label: str
    linears: str
    experts: str
    swiglu: str
    siblings: str
    kept: str
    export: str


def _leaf(name: str) -> str:
    return re.sub(r"^.*?layers\.\d+\.", "", name)


def _linears_cell(report: ConversionReport, model: nn.Module) -> str:
    return f"{len(report.converted) - len(report.experts)} of {sum(isinstance(m, nn.Linear) for m in model.modules())}"


def _experts_cell(report: ConversionReport, arch: Arch) -> str:
    if report.experts:
        return f"{len(report.experts)} of {len(report.experts)} layers, {report.num_experts} experts"
    if arch.refused:
        return f"refused ({arch.refused}); BF16 with `keep_experts_in_bf16=True`"
    return "none"


def _fusion_cell(report: ConversionReport, fusion: str) -> str:
    reasons = sorted(set(report.not_fused[fusion].values()))
    return f"{len(report.fused[fusion])} fused" + "".join(f"; not fused: {reason}" for reason in reasons)


def _kept_cell(report: ConversionReport) -> str:
    """Modules kept in high precision by reason, and the other parameters that are not embeddings, norms or
    biases."""
    why: dict[str, set[str]] = {}
    for name, reason in report.kept.items():
        why.setdefault(reason, set()).add(_leaf(name))
    for name, reason in report.high_precision_params.items():
        if reason in ("convolution", "router"):
            why.setdefault(reason, set()).add(_leaf(name.rpartition(".")[0]))
        elif reason == "not a linear or expert weight":
            why.setdefault("other parameters", set()).add(_leaf(name).rpartition(".")[2])
    return "; ".join(f"{_names(names)} ({reason})" for reason, names in why.items())


def _names(names: set[str]) -> str:
    listed = ", ".join(f"`{n}`" for n in sorted(names)[:4])
    return listed + (f" and {len(names) - 4} more" if len(names) > 4 else "")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_converts_exactly_or_is_refused_by_name(name, tmp_path):
    if (why := missing(name)) is not None:  # (transformers>=5.5: older releases lack the newest families)
        pytest.skip(why)
    check_architecture(name, tmp_path)


def markdown_table(outcomes: list[Outcome]) -> str:
    header = ["architecture", "linear layers in FP8", "experts in FP8", "`fuse_swiglu`", "`fuse_sibling_gemms`",
              "kept in high precision (why)", "FP8 checkpoint"]  # fmt: skip
    rows = [[o.label, o.linears, o.experts, o.swiglu, o.siblings, o.kept, o.export] for o in outcomes]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows])


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        names = [name for name in ARCHITECTURES if missing(name) is None]
        print(markdown_table([check_architecture(name, Path(tmp) / name) for name in names]))
        for name in ARCHITECTURES.keys() - set(names):
            print(f"\n{ARCHITECTURES[name].label}: not checked, {missing(name)}.")
