"""Convert a tiny Qwen3 to blockwise FP8 and train it next to its BF16 twin (CPU: exact FP8 emulation).

    python examples/fp8_linear_demo.py [--steps 30]

Prints the conversion report, then the language-modelling loss of both copies step by step on the same data.
"""

import argparse
import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from trl_fp8 import convert_to_fp8  # noqa: E402
from trl_fp8.tiny_model import tiny_qwen3  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    bf16 = tiny_qwen3(seed=args.seed).to(device)
    fp8 = copy.deepcopy(bf16)
    print(convert_to_fp8(fp8).summary())

    # A learnable toy stream: repeated random 16-token motifs.
    g = torch.Generator().manual_seed(args.seed)
    motifs = torch.randint(0, 256, (8, 16), generator=g)
    opts = {m: torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (bf16, fp8)}
    print(f"{'step':>4} {'bf16 loss':>10} {'fp8 loss':>10}")
    for step in range(1, args.steps + 1):
        ids = motifs[torch.randint(0, 8, (8, 8), generator=g)].reshape(8, 128).to(device)
        losses = []
        for model, opt in opts.items():
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if step == 1 or step % 5 == 0:
            print(f"{step:>4} {losses[0]:>10.4f} {losses[1]:>10.4f}")


if __name__ == "__main__":
    main()
