"""What one decoder layer keeps for backward, per token: BF16 against FP8, and FP8 with the opt-in fusions.

Gradient checkpointing exists because of these bytes: every micro-batch keeps, per layer and token, the tensors its
backward reads. They depend on the shapes and on which ops save what, not on the device, so this counts them exactly
on a CPU: one Qwen3 decoder layer at a model's real dims, a forward over `--tokens` tokens under
`torch.autograd.graph.saved_tensors_hooks`, each saved storage counted once (q, k and v save the same input), and
parameters left out (autograd keeps a reference to them, no copy). Bytes are attributed to the module whose forward
saved them: the linear layers, the MLP's activation, the norms, and the attention core (softmax, RoPE) apart, since
that part is BF16 in every setting and its saved tensors depend on the attention kernel (on a CPU, SDPA's math
fallback; on a GPU, FlashAttention keeps q, k, v, the output and the log-sum-exp).

    python -m benchmarks.bench_saved_activations                   # 8B and 1.7B shapes, writes results/saved_activations.json
    python -m benchmarks.bench_saved_activations --quick           # a tiny shape, prints (writes only with --out)
"""

from __future__ import annotations

import torch

from benchmarks.bench_rollout import SHAPES
from benchmarks.common import RESULTS, arg_parser, metadata, write_json
from trl_fp8 import FP8LinearConfig, convert_to_fp8

SETTINGS = {
    "bf16": None,
    "fp8": FP8LinearConfig(backend="emulated"),
    "fp8_fused": FP8LinearConfig(backend="emulated", fuse_sibling_gemms=True, fuse_swiglu=True),
}
CATEGORIES = ("linear inputs", "MLP activation", "norms", "attention core", "other")


def decoder_layer(shape: str, config: FP8LinearConfig | None):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

    dims = {k: v for k, v in SHAPES[shape].items() if k != "num_hidden_layers"}
    cfg = Qwen3Config(**dims, num_hidden_layers=1, head_dim=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    layer = Qwen3DecoderLayer(cfg, layer_idx=0).to(torch.bfloat16)
    if config is not None:
        convert_to_fp8(layer, config=config)
    return layer, Qwen3RotaryEmbedding(cfg), cfg


def category(module_name: str) -> str:
    leaf = module_name.rsplit(".", 1)[-1]
    if leaf.endswith("_proj"):
        return "linear inputs"
    if leaf in ("mlp", "act_fn"):
        return "MLP activation"
    if "norm" in leaf:
        return "norms"
    if leaf == "self_attn":
        return "attention core"
    return "other"


def saved_bytes(layer, rotary, cfg, tokens: int) -> dict[str, int]:
    """Bytes saved for backward during one forward, by the innermost module saving them. Each byte of memory counts
    once, whichever views of it are saved (q, k and v save the same input; grouped siblings' outputs are column
    slices of one buffer), and goes to the first module that saves it."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    covered: dict[int, torch.Tensor] = {}  # storage -> which of its bytes are already counted
    totals = dict.fromkeys(CATEGORIES, 0)
    stack = ["layer"]

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or not storage.nbytes() or not t.numel():
            return t
        mask = covered.setdefault(ptr, torch.zeros(storage.nbytes(), dtype=torch.bool))
        size = t.element_size()
        elements = torch.arange(storage.nbytes() // size).as_strided(t.shape, t.stride(), t.storage_offset())
        byte_index = (elements.reshape(-1, 1) * size + torch.arange(size)).reshape(-1)
        new = int((~mask[byte_index]).sum())
        mask[byte_index] = True
        totals[category(stack[-1])] += new
        return t

    # No hook on `down_proj` (its own or a global one): either would (rightly) send the fused MLP down its eager
    # path, so what `down_proj` saves counts as the MLP's in every setting.
    handles = []
    for name, module in layer.named_modules():
        if name and not name.endswith("down_proj"):
            handles.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
            handles.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))
    x = torch.randn(1, tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    position_ids = torch.arange(tokens)[None]
    cos_sin = rotary(x, position_ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_embeddings=cos_sin, position_ids=position_ids)
    for h in handles:
        h.remove()
    return totals


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/saved_activations.json",
                        quick="the tiny shape, 128 tokens, nothing written (but to --out)")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", default=["8b", "1.7b"], choices=list(SHAPES))
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.tokens = ["tiny"], 128
    rows = []
    for shape in args.shapes:
        for setting, config in SETTINGS.items():
            layer, rotary, cfg = decoder_layer(shape, config)
            totals = saved_bytes(layer, rotary, cfg, args.tokens)
            per_token = {k: v / args.tokens for k, v in totals.items()}
            outside = sum(v for k, v in per_token.items() if k != "attention core")
            rows.append({"shape": shape, "setting": setting, "bytes_per_token": per_token,
                         "bytes_per_token_outside_attention_core": outside,
                         "num_hidden_layers": SHAPES[shape]["num_hidden_layers"]})  # fmt: skip
            del layer
    print(f"\nBytes kept for backward per token and decoder layer ({args.tokens} tokens), attention core apart")
    print(
        f"{'shape':<7}{'setting':<11}"
        + "".join(f"{c:>16}" for c in CATEGORIES)
        + f"{'outside attn':>14}{'vs bf16':>9}"
    )
    for r in rows:
        base = next(b for b in rows if b["shape"] == r["shape"] and b["setting"] == "bf16")
        ratio = r["bytes_per_token_outside_attention_core"] / base["bytes_per_token_outside_attention_core"]
        r["outside_attention_core_vs_bf16"] = ratio
        print(f"{r['shape']:<7}{r['setting']:<11}" + "".join(f"{r['bytes_per_token'][c]:>16.0f}" for c in CATEGORIES)
              + f"{r['bytes_per_token_outside_attention_core']:>14.0f}{ratio:>9.2f}")  # fmt: skip
    if args.quick and not args.out:
        return
    result = {
        "benchmark": "bytes saved for backward per token and decoder layer (exact count, device-independent)",
        **metadata("cpu (counts, not timings)"),
        "tokens": args.tokens,
        "results": rows,
    }
    print(f"wrote {write_json(args.out or RESULTS / 'saved_activations.json', result)}")


if __name__ == "__main__":
    main()
