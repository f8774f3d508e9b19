"""Trainer vs vLLM log-probs on the same sampled tokens: does the rollout engine run the trainer's model?

    python benchmarks/bench_identity.py [--hidden 1024 --layers 4]     # GPU host with vLLM (kit in ../shared/gpu)

For each engine setting, one child process (vLLM holds on to GPU state) builds the same random Qwen3-shaped model,
starts vLLM, samples completions with their log-probs, scores the very same tokens with the trainer-side model and
reports mean / max |delta logp| and the KL(rollout || train) k3 estimate:

- `bf16`: BF16 trainer, vLLM on the BF16 checkpoint (the mismatch every GRPO user already has);
- `fp8`: trainer with trl_fp8 blockwise FP8 layers, vLLM on our block-FP8 checkpoint (the unified flow); then the
  trainer's weights change, the new FP8 weights and scales go to the running engine through vLLM's layerwise
  `reload_weights`, and the check runs again (`fp8 after reload`).

Writes `benchmarks/results/identity_<device>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build_model(args, seed=0):
    import torch

    from trl_fp8.tiny_model import tiny_qwen3

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


def run_engine(args):
    """Child process: one engine setting, prints one JSON line per check."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: the worker is reachable for reloads
    import torch
    from vllm import LLM, SamplingParams

    from trl_fp8 import convert_to_fp8
    from trl_fp8.export import fp8_checkpoint_tensors, save_fp8_checkpoint

    work = Path(args.workdir)
    model = build_model(args)
    if args.engine == "fp8":
        convert_to_fp8(model)
        ckpt = work / "fp8"
        save_fp8_checkpoint(model, ckpt, progress=False)
    else:
        ckpt = work / "bf16"
        model.save_pretrained(ckpt)
    llm = LLM(
        model=str(ckpt), tokenizer=None, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        gpu_memory_utilization=0.3, max_model_len=512, seed=0, enable_prefix_caching=False,
        logprobs_mode="processed_logprobs",
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab, (32,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, logprobs=0, seed=0, detokenize=False)

    def check(label):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        comps = [list(o.outputs[0].token_ids) for o in outs]
        lps = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs]
        stats = compare(trainer_logps(model, prompts, comps), lps)
        print(json.dumps({"check": label, **stats}), flush=True)
        return comps

    before = check(args.engine)
    if args.engine == "fp8":
        with torch.no_grad():  # an "optimizer step": every weight moves
            for p in model.parameters():
                p.add_(torch.randn_like(p) * p.float().std().to(p.dtype) * 0.2)
        worker = llm.llm_engine.model_executor.driver_worker.worker
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        worker.reload_weights(weights_iterator=fp8_checkpoint_tensors(model, check_finite=False))
        end.record()
        torch.cuda.synchronize()
        after = check("fp8 after reload")
        changed = sum(a != b for a, b in zip(after, before, strict=True))
        print(json.dumps({"check": "reload", "ms": start.elapsed_time(end), "changed_completions": changed}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["bf16", "fp8"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="/tmp/trl_fp8_identity")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--init_std", type=float, default=0.05)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.engine:
        return run_engine(args)

    import torch

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    rows = []
    for engine in ("bf16", "fp8"):
        cmd = [sys.executable, __file__, "--engine", engine] + sys.argv[1:]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
            raise SystemExit(f"engine {engine} failed (exit {proc.returncode})")
        rows.extend(lines)
    device = torch.cuda.get_device_name()
    import vllm

    result = {
        "benchmark": "trainer vs vLLM log-probs on the same sampled tokens",
        "device": device,
        "date": datetime.date.today().isoformat(),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "init_std")},
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "results": rows,
    }
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"identity_{device.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'check':<20}{'mean |dlogp|':>14}{'max |dlogp|':>14}{'KL k3':>12}")
    for r in rows:
        if "abs_logp_diff_mean" in r:
            print(
                f"{r['check']:<20}{r['abs_logp_diff_mean']:>14.2e}{r['abs_logp_diff_max']:>14.2e}{r['kl_k3']:>12.2e}"
            )
        else:
            print(r)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
