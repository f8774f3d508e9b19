"""vLLM's RMSNorm as its batch-invariant mode runs it (`rms_norm_batch_invariant`: its Triton kernel without the
residual add, the CUDA fused add + RMSNorm with it), on the first 8 rows alone and within 300 (the exactness gates,
`tests/gpu/test_exactness_gates_gpu.py`). A process of its own: vLLM's CUDA kernels read `VLLM_BATCH_INVARIANT` once
per process, and outside the mode they pick their block size by row count. Prints one JSON line.

    VLLM_BATCH_INVARIANT=1 python batch_invariant_rms_norm.py
"""

import json

import torch

try:  # vLLM 0.31's module; 0.26 kept it among the layers
    from vllm.model_executor.determinism.batch_invariant import rms_norm_batch_invariant
except ImportError:
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

RESULT = "rms-norm-rows:"  # the line the test reads
HIDDEN = 4096  # Qwen3-8B's


def rows(m: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, HIDDEN, device="cuda", generator=g).mul(4).bfloat16()


def difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "equal"
    diff = a.float() != b.float()
    where = tuple(int(i) for i in diff.nonzero()[0])
    gap = (a.float() - b.float()).abs().max().item()
    return f"{int(diff.sum())} of {diff.numel()} elements differ, first at {where}, largest gap {gap:.3g}"


x, r = rows(300, 2), rows(300, 3)
w = (1 + 0.1 * rows(1, 4).float()).bfloat16().view(-1)
eps = 1e-6


def with_residual(m: int):
    return rms_norm_batch_invariant(x[:m].clone(), w, eps, residual=r[:m].clone())  # (in place: copies)


(out8, res8), (out300, res300) = with_residual(8), with_residual(300)
found = {
    "without residual": difference(rms_norm_batch_invariant(x[:8].contiguous(), w, eps),
                                   rms_norm_batch_invariant(x, w, eps)[:8]),
    "with residual, output": difference(out8, out300[:8]),
    "with residual, residual": difference(res8, res300[:8]),
}  # fmt: skip
print(RESULT + json.dumps(found), flush=True)
