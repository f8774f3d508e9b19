"""How much does FP8 amplify tiny kernel differences? A CPU experiment behind the trainer-vs-vLLM mismatch.

    python benchmarks/probe_fp8_rounding_sensitivity.py      # CPU, a few minutes

vLLM holds the trainer's FP8 weights bit for bit, yet FP8/FP8 log-probs differ more than BF16/BF16 ones
(`bench_identity.py`). The hypothesis: two stacks never compute bit-identical activations (fused attention, norm
and activation kernels round differently), and FP8's 3-bit mantissa turns those last-bit differences into
whole-step flips of the quantized activations. This probe isolates that effect on the exact emulation: the same
model is run twice, once as is and once with 10% of every linear layer's BF16 input elements moved by one BF16 ulp
(the size of one kernel's rounding disagreement), in BF16 and in FP8 (blockwise, emulated), and the mean
|delta logp| of tokens sampled from the model is compared. The same random model
as `bench_identity.py` (4 layers, hidden 1024, init std 0.05). Writes `results/fp8_rounding_sensitivity_cpu.json`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import versions  # noqa: E402


def perturb_linear_inputs(model, flip_fraction: float, seed: int):
    """Every linear layer's BF16 input gets a random `flip_fraction` of its elements moved by one BF16 ulp up or down:
    the last-bit disagreement two kernel stacks produce."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)

    def hook(module, args):
        (x,) = args
        assert x.dtype == torch.bfloat16
        flip = (torch.rand(x.shape, generator=g) < flip_fraction) & (x != 0)  # int16 -1 of a zero is a NaN
        sign = torch.randint(0, 2, x.shape, generator=g, dtype=torch.int16) * 2 - 1
        return ((x.contiguous().view(torch.int16) + flip.to(torch.int16) * sign).view(torch.bfloat16),)

    return [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]


def logps(model, ids):
    import torch

    with torch.no_grad():
        logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def main():
    import torch

    from trl_fp8 import FP8LinearConfig, convert_to_fp8
    from trl_fp8.demo.tiny_model import tiny_qwen3

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--init_std", type=float, default=0.05)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=96)
    parser.add_argument("--flip_fraction", type=float, default=0.1)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fp8_rounding_sensitivity_cpu.json"))
    args = parser.parse_args()

    torch.manual_seed(0)
    bf16 = tiny_qwen3(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512), initializer_range=args.init_std, dtype=torch.bfloat16,
    ).eval()  # fmt: skip
    fp8 = copy.deepcopy(bf16)
    convert_to_fp8(fp8, config=FP8LinearConfig(backend="emulated"))
    ids = torch.randint(0, args.vocab, (args.sequences, args.length), generator=torch.Generator().manual_seed(1))
    # Score tokens the model itself finds likely (sampled from it), as rollouts are, not uniform random ones.
    with torch.no_grad():
        probs = torch.softmax(bf16(ids).logits[:, :-1].float(), -1)
    ids = torch.cat([ids[:, :1], torch.multinomial(probs.reshape(-1, args.vocab), 1).reshape(args.sequences, -1)], 1)

    rows = []
    for name, model in (("bf16", bf16), ("fp8", fp8)):
        clean = logps(model, ids)
        handles = perturb_linear_inputs(model, args.flip_fraction, seed=2)
        noisy = logps(model, ids)
        for h in handles:
            h.remove()
        delta = (clean - noisy).abs()
        rows.append(
            {"precision": name, "abs_logp_diff_mean": delta.mean().item(), "abs_logp_diff_max": delta.max().item()}
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "log-prob change from a rounding-size perturbation of every linear input, BF16 vs FP8 (emulated)",
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
        "versions": versions("torch", "transformers", "torchao"),
        "args": vars(args),
        "results": rows,
        "fp8_over_bf16": rows[1]["abs_logp_diff_mean"] / rows[0]["abs_logp_diff_mean"],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"FP8 / BF16 sensitivity: {result['fp8_over_bf16']:.1f}x; wrote {args.out}")


if __name__ == "__main__":
    main()
