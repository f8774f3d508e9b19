"""vLLM rollout throughput and per-step weight-sync time: BF16 vs vLLM's online FP8 vs trl_fp8's FP8 (± FP8 KV).

    python benchmarks/bench_rollout.py                       # GPU host with vLLM; Qwen3-8B shape, random weights
    python benchmarks/bench_rollout.py --engines fp8 fp8_kv --append   # add rows to the same results file

Each engine runs in its own child process, built the way `FP8GRPOTrainer` builds it (config-only folder, dummy
load, CUDA graphs on), next to a trainer-side model of the same shape on the same GPU:

- `bf16`: BF16 weights pushed each step (what TRL does today);
- `vllm_fp8`: BF16 weights pushed, vLLM quantizes them itself (`quantization="fp8"`, per-tensor weights);
- `fp8`: trl_fp8's block-FP8 weights and scales, quantized on the trainer's GPU and pushed (the unified flow);
- `fp8_kv`: the same plus an FP8 KV cache with q/k/v scales measured on the trainer's forward.

Per engine: generation throughput (output tokens / s) for `--prompts` x `--prompt_len` in / 1024 out and for
`--long_prompts` x 4096 out (ignore_eos, temperature 1), and the weight sync of one step (quantization included,
median of 3). `fp8_kv` also times the trainer forward with and without the KV-scale observer. Writes
`benchmarks/results/rollout_<device>.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import previous_rows, run_all, versions  # noqa: E402

SHAPES = {  # Qwen3 configs: hidden, intermediate, layers, heads, kv heads, vocab
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=151936),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=151936),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=4096),
}  # fmt: skip
ENGINES = {  # engine: (trainer in FP8, rollout precision, FP8 KV cache)
    "bf16": (False, "bf16", False),
    "vllm_fp8": (False, "fp8_online", False),
    "fp8": (True, "fp8", False),
    "fp8_kv": (True, "fp8", True),
}


def build_trainer_model(shape: str):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):  # built in BF16 on the GPU: no FP32 copy for the allocator to keep cached
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def timed_generate(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, seed=0)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def run_engine(args):
    import torch
    from vllm_engine import start_engine, sync

    from trl_fp8 import convert_to_fp8
    from trl_fp8.fp8_linear import FP8Linear
    from trl_fp8.kv_scales import AttentionScaleObserver

    train_fp8, precision, fp8_kv = ENGINES[args.engine]
    model = build_trainer_model(args.shape)
    if train_fp8:
        convert_to_fp8(model)
    row = {"engine": args.engine, "rollout_precision": precision, "fp8_kv_cache": fp8_kv}

    scales = None
    if fp8_kv:
        ids = torch.randint(0, model.config.vocab_size, (4, 2048), device="cuda")

        def forward_ms(reps=5):
            with torch.no_grad():
                model(ids)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(reps):
                    model(ids)
                torch.cuda.synchronize()
            return 1e3 * (time.perf_counter() - start) / reps

        plain = forward_ms()
        observer = AttentionScaleObserver(model)
        observed = forward_ms()
        row["trainer_forward_ms"] = {"without_kv_observer": plain, "with_kv_observer": observed, "tokens": ids.numel()}
        scales = observer.scales()

    torch.cuda.empty_cache()  # vLLM sizes its KV cache from the memory free at start-up
    start = time.perf_counter()
    max_len = args.prompt_len + max(args.new_tokens, args.long_tokens) + 16
    llm = start_engine(
        model, precision, Path(args.workdir), fp8_kv_cache=fp8_kv, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=max_len, max_num_seqs=args.prompts,
    )  # fmt: skip
    row["engine_start_s"] = time.perf_counter() - start

    syncs, quantize = [], []
    for _ in range(3):
        for m in model.modules():  # a new optimizer step: the FP8 weights must be quantized again
            if isinstance(m, FP8Linear):
                m.invalidate()
        if train_fp8:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for m in model.modules():
                if isinstance(m, FP8Linear):
                    m.quantized_weight()
            torch.cuda.synchronize()
            quantize.append(time.perf_counter() - t0)
            for m in model.modules():
                if isinstance(m, FP8Linear):
                    m.invalidate()
        syncs.append(sync(llm, model, precision, scales))
    row["weight_sync_ms"] = 1e3 * statistics.median(syncs)
    if quantize:
        row["quantize_ms"] = 1e3 * statistics.median(quantize)

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def prompts(n):
        return [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(n)]

    timed_generate(llm, prompts(8), 16)  # warm-up
    row[f"gen_{args.new_tokens}"] = {
        "prompts": args.prompts,
        **timed_generate(llm, prompts(args.prompts), args.new_tokens),
    }
    row[f"gen_{args.long_tokens}"] = {
        "prompts": args.long_prompts,
        **timed_generate(llm, prompts(args.long_prompts), args.long_tokens),
    }
    print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=list(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--shape", choices=list(SHAPES), default="8b")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt_len", type=int, default=256)
    parser.add_argument("--new_tokens", type=int, default=1024)
    parser.add_argument("--long_prompts", type=int, default=64)
    parser.add_argument("--long_tokens", type=int, default=4096)
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.6)
    parser.add_argument("--workdir", default="/tmp/trl_fp8_rollout")
    parser.add_argument("--append", action="store_true", help="merge into an existing results file")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.engine:
        return run_engine(args)

    import torch

    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"rollout_{device.replace(' ', '_')}.json")
    result = {
        "benchmark": "vLLM rollout throughput and weight-sync time",
        "device": device,
        "date": datetime.date.today().isoformat(),
        "versions": versions("torch", "vllm", "transformers", "trl", "torchao"),
        "shape": {"name": args.shape, **SHAPES[args.shape]},
        "workload": {
            k: getattr(args, k) for k in ("prompts", "prompt_len", "new_tokens", "long_prompts", "long_tokens")
        },
        "results": [],
    }
    if args.append:
        result["results"] = previous_rows(out, result, ("shape",), "engine", args.engines)
    failed = run_all(__file__, "--engine", args.engines, sys.argv[1:], result, out, "engine", list(ENGINES))
    base = {r["engine"]: r for r in result["results"]}.get("bf16")
    long_key, short_key = f"gen_{args.long_tokens}", f"gen_{args.new_tokens}"
    print(
        f"{'engine':<10}{'start s':>9}{'sync ms':>9}{short_key + ' tok/s':>18}{long_key + ' tok/s':>18}{'vs bf16':>16}"
    )
    for r in result["results"]:
        speed = (
            f"{r[short_key]['tokens_per_s'] / base[short_key]['tokens_per_s']:.2f}x/"
            f"{r[long_key]['tokens_per_s'] / base[long_key]['tokens_per_s']:.2f}x"
            if base
            else "-"
        )
        print(
            f"{r['engine']:<10}{r['engine_start_s']:>9.0f}{r['weight_sync_ms']:>9.0f}"
            f"{r[short_key]['tokens_per_s']:>18.0f}{r[long_key]['tokens_per_s']:>18.0f}{speed:>16}"
        )
    print(f"wrote {out}")
    if failed:
        raise SystemExit(f"failed engines: {failed}")


if __name__ == "__main__":
    main()
