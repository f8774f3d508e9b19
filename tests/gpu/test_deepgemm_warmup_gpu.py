"""DeepGEMM's kernels compiled by parallel workers land in the cache that vLLM's warm-up reads (SM90 with nvcc)."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_parallel_workers_compile_every_kernel_the_full_warmup_needs(tmp_path):
    from trl_fp8.rollout.vllm.deepgemm_warmup import precompile_deepgemm
    from trl_fp8.rollout.vllm.kernels import deepgemm_unavailable_reason, rollout_kernel

    if deepgemm_unavailable_reason() is not None:
        pytest.skip(deepgemm_unavailable_reason())
    os.environ.update(rollout_kernel("deepgemm", jit_cache_dir=tmp_path / "dg").env)
    shapes, max_tokens = [(1024, 512)], 512
    first = precompile_deepgemm(shapes, max_tokens, workers=4, progress=False)
    print(f"\n4 workers: {first.kernels_after} kernels, {first.token_counts} token counts, {first.seconds:.0f} s")
    assert not first.failures and first.workers == 4 and first.kernels_after > 0
    assert precompile_deepgemm(shapes, max_tokens, workers=4).skipped  # recorded: a warm start does nothing

    # vLLM's "full" warm-up (every token count, one process) afterwards: it should find every kernel on disk.
    full = precompile_deepgemm(shapes, max_tokens, workers=1, full=True, force=True, progress=False)
    print(f"full sweep after: {full.kernels_after - full.kernels_before} new kernels, {full.seconds:.0f} s")
    assert not full.failures and full.kernels_after == first.kernels_after
    torch.cuda.synchronize()
