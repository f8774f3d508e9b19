"""A vLLM engine's own log-probabilities of the tokens it sampled, against its prompt log-probabilities of the same
sequences (the exactness gates, `tests/gpu/test_exactness_gates_gpu.py`): vLLM must agree with itself before a trainer
can agree with it. Prints one JSON line.

    python vllm_self_logprobs.py MODEL_DIR   # run with VLLM_BATCH_INVARIANT=1 (and DeepGEMM, E8M0 off) for the gate
"""

import json
import random
import sys

from vllm import LLM, SamplingParams

RESULT = "self-logprobs:"  # the line the test reads, among vLLM's own output
model = sys.argv[1]
# vLLM's batch-invariant recipe for exactness: no compilation (its fusions decide bits a trainer cannot reproduce),
# CUDA graphs for decode only, FlashAttention, no prefix cache (the scoring pass recomputes every position).
llm = LLM(model=model, gpu_memory_utilization=0.2, max_model_len=256, attention_backend="FLASH_ATTN",
          linear_backend="deep_gemm", compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
          enable_prefix_caching=False, seed=0)  # fmt: skip
rng = random.Random(0)
vocab = llm.llm_engine.model_config.get_vocab_size()
prompts = [[rng.randrange(4, vocab) for _ in range(rng.randrange(5, 60))] for _ in range(16)]
sampled = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=1.0, max_tokens=64, logprobs=0, seed=1, ignore_eos=True))  # fmt: skip
sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, sampled, strict=True)]
scored = llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, prompt_logprobs=0))
tokens = differ = 0
largest = 0.0
for prompt, out, score, seq in zip(prompts, sampled, scored, sequences, strict=True):
    for k, token in enumerate(out.outputs[0].token_ids):
        decode = out.outputs[0].logprobs[k][token].logprob
        prefill = score.prompt_logprobs[len(prompt) + k][seq[len(prompt) + k]].logprob
        tokens += 1
        if decode != prefill:
            differ += 1
            largest = max(largest, abs(decode - prefill))
print(RESULT, json.dumps({"tokens": tokens, "differ": differ, "largest_abs_diff": largest}), flush=True)
