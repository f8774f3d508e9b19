"""vLLM's RMSNorm as its batch-invariant mode runs it (`rms_norm_batch_invariant`: its Triton kernel without the
residual add, the CUDA fused add + RMSNorm with it), on 4,096 rows in one launch against the same rows in launches of
8 (a decode step's rows against a prefill's), at the hidden sizes of the 76M accuracy model (768) and Qwen3-8B (4096):
the exactness gates, `tests/gpu/test_exactness_gates_gpu.py`. A process of its own: vLLM's CUDA kernels read
`VLLM_BATCH_INVARIANT` once per process, and outside the mode they pick their block size by row count. Prints one
JSON line.

    VLLM_BATCH_INVARIANT=1 python batch_invariant_rms_norm.py
"""

import json

import torch

try:  # vLLM 0.31's module; 0.26 kept it among the layers
    from vllm.model_executor.determinism.batch_invariant import rms_norm_batch_invariant
except ImportError:
    from vllm.model_executor.layers.batch_invariant import rms_norm_batch_invariant

RESULT = "rms-norm-rows:"  # the line the test reads
ROWS, CHUNK = 4096, 8  # (a rounding flip is rare per element: thousands of rows make a reordered sum show)
EPS = 1e-6


def rows(m: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, hidden, device="cuda", generator=g).mul(4).bfloat16()


def difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(a, b):
        return "equal"
    differ = (a != b).any(-1)
    gap = (a.float() - b.float()).abs().max().item()
    return f"{int(differ.sum())} of {a.shape[0]} rows differ, the first row {int(differ.nonzero()[0])}, largest gap {gap:.3g}"


def norm(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor | None):
    """One launch over all of `x`'s rows: (output, residual) with the residual add, (output, None) without."""
    if r is None:
        return rms_norm_batch_invariant(x.contiguous(), w, EPS), None
    return rms_norm_batch_invariant(x.clone(), w, EPS, residual=r.clone())  # (in place: copies)


found = {}
for hidden in (768, 4096):
    x, r = rows(ROWS, hidden, 2), rows(ROWS, hidden, 3)
    w = (1 + 0.1 * rows(1, hidden, 4).float()).bfloat16().view(-1)
    for residual in (None, r):
        whole = norm(x, w, residual)
        pieces = [norm(x[i : i + CHUNK], w, None if residual is None else residual[i : i + CHUNK])
                  for i in range(0, ROWS, CHUNK)]  # fmt: skip
        what = f"hidden {hidden}, " + ("without residual" if residual is None else "with residual")
        found[what + ", output"] = difference(torch.cat([p[0] for p in pieces]), whole[0])
        if residual is not None:
            found[what + ", residual"] = difference(torch.cat([p[1] for p in pieces]), whole[1])
print(RESULT + json.dumps(found), flush=True)
