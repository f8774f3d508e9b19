"""Host time a colocated vLLM engine spends on its outputs between decode steps, with TRL's `SamplingParams`
(`logprobs=0`) and vLLM's defaults against the trainer's `vllm_token_ids_only` (`detokenize=False`,
`flat_logprobs=True`).

A colocated engine runs in the trainer's process (TRL sets `VLLM_ENABLE_V1_MULTIPROCESSING=0`): after each decode
step, vLLM's `OutputProcessor` turns every sequence's new token (and, with the defaults, its log-prob token) into
text and stores its log-prob, on the same thread that schedules the next step. This drives that processor alone,
with each sequence's sampled token and log-prob fed in as the engine core would hand them over, so it needs vLLM
importable but no GPU: the time is CPU time, on whatever CPU runs it. The reading of the finished outputs' log-probs,
which runs after the rollout, is timed too and counted in: the trainer's (`sampling.flat_logprobs_read_directly`:
vLLM's flat arrays read directly where the log-probs are flat, TRL's `extract_logprobs` otherwise), with TRL's own
beside it (`trl_extract_seconds`). The tokenizer is `bench_grpo`'s word-level one over Qwen3's 151,936 ids. A
rollout's host time is the processor's calls plus the garbage collector's pauses between them (vLLM's defaults keep
a dict and a `Logprob` object per generated token until the rollout ends, which the collector walks again and again).
The run checks that every setting returns the same token ids and log-probs.

    python -m benchmarks.bench_output_processing                       # 128 x 2048 and 256 x 2048
    python -m benchmarks.bench_output_processing --points 64x1024
"""

from __future__ import annotations

import gc
import platform
import time

import numpy as np

from benchmarks.common import arg_parser, metadata, results_path, write_json
from benchmarks.host_sampling import GcPauses
from trl_fp8.rollout.vllm.sampling import TOKEN_IDS_ONLY, flat_logprobs_read_directly

SETTINGS = {
    "vllm_defaults": {},
    "detokenize_off": {"detokenize": False},
    "token_ids_only": TOKEN_IDS_ONLY,  # what the trainer sets
}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def rollout(tokenizer, seqs: int, new_tokens: int, prompt_len: int, sampling: dict, seed: int = 0) -> dict:
    """Feed vLLM's `OutputProcessor` one decode step at a time, as its engine core would; time each step's call."""
    import trl.generation.vllm_generation as trl_generation
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.outputs import LogprobsLists

    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    processor = OutputProcessor(tokenizer, log_stats=False)
    for i in range(seqs):
        # What TRL's colocated generate asks for (logprobs=0; LLM.generate returns finished requests only).
        params = SamplingParams(
            max_tokens=new_tokens, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, **sampling
        )
        request = EngineCoreRequest(
            request_id=str(i), prompt_token_ids=rng.integers(2, vocab, prompt_len).tolist(), mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
            data_parallel_rank=None, external_req_id=str(i),
        )  # fmt: skip
        processor.add_request(request, None)
    steps, finished = [], []
    gc.collect()
    with GcPauses() as pauses:
        for step in range(new_tokens):
            tokens = rng.integers(2, vocab, seqs)
            logprobs = -rng.exponential(1.0, seqs).astype(np.float32)
            last = step == new_tokens - 1
            outputs = [
                EngineCoreOutput(
                    request_id=str(i),
                    new_token_ids=[int(tokens[i])],
                    new_logprobs=LogprobsLists(
                        tokens[i : i + 1, None], logprobs[i : i + 1, None], np.ones(1, np.int64)
                    ),
                    finish_reason=FinishReason.LENGTH if last else None,
                )  # fmt: skip
                for i in range(seqs)
            ]
            pauses.timing, start = True, time.perf_counter()
            result = processor.process_outputs(outputs)
            steps.append(time.perf_counter() - start)
            pauses.timing = False
            finished += result.request_outputs
    outputs = sorted(finished, key=lambda o: int(o.request_id))
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    start = time.perf_counter()
    logprobs, _ = trl_generation.extract_logprobs(outputs)  # TRL's reading of them, after the rollout
    trl_extract_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with flat_logprobs_read_directly():  # the trainer's: from vLLM's flat arrays where they are flat, else TRL's
        trainers_logprobs, _ = trl_generation.extract_logprobs(outputs)
    extract_seconds = time.perf_counter() - start
    assert trainers_logprobs == logprobs  # (NaN-free: the log-probs fed in are finite)
    steps_ms = np.array(steps) * 1e3
    return {
        # host time the rollout costs: between decode steps, and the trainer's reading of the outputs after the last
        "seconds": float(steps_ms.sum() / 1e3 + pauses.outside_seconds + extract_seconds),
        "process_outputs_seconds": float(steps_ms.sum() / 1e3),
        "trl_extract_seconds": trl_extract_seconds,
        "trainer_extract_seconds": extract_seconds,
        "ms_per_step": float(steps_ms.mean()),
        "median_step_ms": float(np.median(steps_ms)),
        "worst_step_ms": float(steps_ms.max()),
        "gc_collections": pauses.count,
        "gc_seconds": pauses.seconds,
        "gc_seconds_between_calls": pauses.outside_seconds,
        "_completions": completions,
        "_logprobs": logprobs,
    }


def main(argv=None):
    parser = arg_parser(__doc__, out="benchmarks/results/output_processing_cpu.json")
    parser.add_argument("--points", nargs="+", default=["128x2048", "256x2048"], help="SxN: S sequences, N tokens")
    parser.add_argument("--prompt_len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936, help="tokenizer size (Qwen3's)")
    args = parser.parse_args(argv)

    import vllm

    from benchmarks.bench_grpo import vocab_tokenizer

    tokenizer = vocab_tokenizer(args.vocab)
    device = f"{cpu_name()} (one thread)"
    meta = metadata(device=device)
    meta["versions"]["vllm"] = vllm.__version__
    results = []
    for point in args.points:
        seqs, new_tokens = (int(v) for v in point.split("x"))
        rows = {}
        for name, sampling in SETTINGS.items():
            rows[name] = rollout(tokenizer, seqs, new_tokens, args.prompt_len, sampling)
        returned = {name: (row.pop("_completions"), row.pop("_logprobs")) for name, row in rows.items()}
        reference = rows["vllm_defaults"]
        for name, row in rows.items():
            same = returned[name] == returned["vllm_defaults"]
            row.update(point=point, setting=name, sampling=SETTINGS[name],
                       same_tokens_and_logprobs=same,
                       seconds_saved=reference["seconds"] - row["seconds"])  # fmt: skip
            results.append(row)
            print(f"{point} {name:15s} {row['seconds']:.2f} s ({row['ms_per_step']:.2f} ms a step, worst "
                  f"{row['worst_step_ms']:.0f} ms; GC {row['gc_collections']} x, {row['gc_seconds']:.2f} s), "
                  f"same tokens and log-probs: {same}", flush=True)  # fmt: skip
    path = write_json(results_path(args.out, "output_processing", "cpu"),
                      {"benchmark": "output_processing", **meta, "prompt_len": args.prompt_len, "vocab": args.vocab,
                       "results": results})  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
