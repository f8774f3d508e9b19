"""A vLLM engine's own log-probabilities of the tokens it sampled, against its prompt log-probabilities of the same
sequences (the exactness gates, `tests/gpu/test_exactness_gates_gpu.py`): vLLM must agree with itself before a trainer
can agree with it. Prints one JSON line.

    python vllm_self_logprobs.py MODEL_DIR   # run with `rollout.vllm.exact.exact_engine().env` for the gate
"""

import json
import random
import sys

from vllm import LLM, SamplingParams

from trl_fp8.rollout.vllm.exact import exact_engine

RESULT = "self-logprobs:"  # the line the test reads, among vLLM's own output
model = sys.argv[1]
# exact mode's engine settings (its environment came with the process: vLLM reads it at import)
llm = LLM(model=model, gpu_memory_utilization=0.2, max_model_len=256, seed=0, **exact_engine().llm_kwargs)
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
