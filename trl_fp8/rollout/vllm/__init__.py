"""vLLM: the FP8 generation TRL drives, its kernels, experts and DeepGEMM warm-up. Every private vLLM access lives in `_compat.py`."""
