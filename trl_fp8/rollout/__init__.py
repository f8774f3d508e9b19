"""Rollouts: what the engine holds and did (capacity, KV scales, statistics); vLLM under `vllm/`."""
