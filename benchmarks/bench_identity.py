"""Trainer vs vLLM log-probs on the same sampled tokens: does the rollout engine run the trainer's model?

    python -m benchmarks.bench_identity [--hidden 1024 --layers 4]     # GPU host with vLLM (kit in ../shared/gpu)

For each setting, one child process (vLLM holds on to GPU state) builds the same random Qwen3-shaped model, starts
vLLM the way `FP8GRPOTrainer` does (config-only folder, dummy load, then the trainer's tensors pushed through
layerwise `reload_weights`), samples completions with their log-probs, scores the very same tokens with the
trainer-side model and reports mean / max |delta logp| and the KL(rollout || train) k3 estimate:

- `bf16`: BF16 trainer, BF16 rollout (the mismatch every GRPO user already has);
- `fp8`: trl_fp8 blockwise FP8 trainer, rollout on its own FP8 weights and scales (the unified flow); then every
  weight moves, the new FP8 weights go to the running engine, and the check runs again (`fp8 after reload`);
- `fp8_online`: BF16 trainer, vLLM quantizes the BF16 weights itself (`quantization="fp8"`): BF16-train /
  FP8-rollout, the setting Jet-RL shows drifting;
- `bf16_train_fp8_rollout`: BF16 trainer, rollout on block-FP8 weights from our quantizer (same weights vLLM's
  blockwise online quantization would make): isolates the cost of training in a precision the rollout lacks;
- `fp8_kv`: the unified flow plus an FP8 KV cache whose q/k/v scales come from the trainer's forward;
- `fp8_pow2`: the unified flow with power-of-two block scales (`fp8_power_of_two_scales=True`).

The FP8 settings run once per `--backends` kernel (vLLM's DeepGEMM, Cutlass or Triton block-FP8 GEMM): each keeps
our weights and scales, so differences between them are the kernels' own arithmetic.

Writes `benchmarks/results/identity_<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.common import arg_parser, metadata, results_path, run_child, write_json
from trl_fp8.config import VLLM_FP8_BACKENDS


def build_model(args, seed=0):
    import torch

    from trl_fp8.demo.tiny_model import tiny_qwen3

    model = tiny_qwen3(
        seed=seed,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512),
        initializer_range=args.init_std,  # peakier than the default 0.02, so log-probs are not all ~ -log(vocab)
        dtype=torch.bfloat16,
    )
    return model.cuda().eval()


def trainer_logps(model, prompts, completions):
    import torch

    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            ids = torch.tensor([p + c], device="cuda")
            logits = model(ids).logits[0, len(p) - 1 : -1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c, device="cuda")[:, None])[:, 0])
    return out


def compare(train, rollout):
    import torch

    t, r = torch.cat(train), torch.cat([torch.tensor(x, device="cuda") for x in rollout])
    delta = t - r
    return {
        "abs_logp_diff_mean": delta.abs().mean().item(),
        "abs_logp_diff_max": delta.abs().max().item(),
        "kl_k3": (torch.exp(delta) - 1 - delta).mean().item(),
        "tokens": delta.numel(),
    }


SETTINGS = {  # setting: (trainer in FP8, rollout precision, FP8 KV cache)
    "bf16": (False, "bf16", False),
    "fp8": (True, "fp8", False),
    "fp8_online": (False, "fp8_online", False),
    "bf16_train_fp8_rollout": (False, "fp8", False),
    "fp8_kv": (True, "fp8", True),
    "fp8_pow2": (True, "fp8", False),
}


def run_engine(args):
    """Child process: one setting, prints one JSON line per check."""
    import torch
    from vllm import SamplingParams

    from benchmarks.vllm_engine import engine_kernels, start_engine, sync
    from trl_fp8 import FP8LinearConfig, convert_to_fp8
    from trl_fp8.rollout.kv_scales import AttentionScaleObserver

    setting, _, backend = args.engine.partition(":")
    train_fp8, precision, fp8_kv = SETTINGS[setting]
    model = build_model(args)
    if train_fp8:
        convert_to_fp8(model, config=FP8LinearConfig(power_of_two_scales=setting == "fp8_pow2"))
    observer = AttentionScaleObserver(model) if fp8_kv else None
    llm = start_engine(
        model, precision, Path(args.workdir), fp8_kv_cache=fp8_kv, backend=backend or "auto", enforce_eager=True,
        gpu_memory_utilization=0.3, max_model_len=512,
    )  # fmt: skip
    kernels = engine_kernels(llm)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (32,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, logprobs=0, seed=0, detokenize=False)
    if observer is not None:
        with torch.no_grad():
            model(torch.tensor(prompts, device="cuda"))  # what the trainer's forward would have measured
    sync(llm, model, precision, observer.scales() if observer else None)

    def check(label):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        comps = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
        stats = compare(trainer_logps(model, prompts, comps), lps)
        print(json.dumps({"check": label, **stats, **kernels}), flush=True)
        return comps

    before = check(args.engine)
    if setting == "fp8":
        with torch.no_grad():  # an "optimizer step": every weight moves
            for p in model.parameters():
                p.add_(torch.randn_like(p) * p.float().std().to(p.dtype) * 0.2)
        seconds = sync(llm, model, precision)
        after = check(f"{args.engine} after reload")
        changed = sum(a != b for a, b in zip(after, before, strict=True))
        print(json.dumps({"check": "reload", "ms": 1e3 * seconds, "changed_completions": changed}))


def main():
    parser = arg_parser(__doc__, out="benchmarks/results/identity_<device>.json", workdir="/tmp/trl_fp8_identity")
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # "setting" or "setting:backend"
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument(
        "--backends", nargs="+", default=["auto"], choices=VLLM_FP8_BACKENDS,
        help="vLLM block-FP8 kernels to run the FP8 settings on",
    )  # fmt: skip
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--init_std", type=float, default=0.05)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    args = parser.parse_args()
    if args.engine:
        return run_engine(args)

    import torch

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    rows = []
    for setting in args.settings:
        fp8 = SETTINGS[setting][1] == "fp8"
        for engine in [f"{setting}:{b}" for b in args.backends] if fp8 else [setting]:
            rows.extend(run_child(__spec__.name, "--engine", engine, sys.argv[1:]) or [])
    device = torch.cuda.get_device_name()

    result = {
        "benchmark": "trainer vs vLLM log-probs on the same sampled tokens",
        **metadata(device),
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "init_std")},
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "backends": args.backends,
        "results": rows,
    }
    out = write_json(results_path(args.out, "identity", device), result)
    print(f"{'check':<32}{'mean |dlogp|':>14}{'max |dlogp|':>14}{'KL k3':>12}  vLLM linear kernel")
    for r in rows:
        if "abs_logp_diff_mean" in r:
            print(
                f"{r['check']:<32}{r['abs_logp_diff_mean']:>14.2e}{r['abs_logp_diff_max']:>14.2e}{r['kl_k3']:>12.2e}"
                f"  {r['linear_kernel']}"
            )
        else:
            print(r)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
