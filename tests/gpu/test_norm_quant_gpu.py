"""trl-fp8's kernel for vLLM's fused `rms_norm_per_block_quant` against vLLM's own, bit for bit, and the op
re-registered by `trl_fp8.rollout.vllm.norm_quant.install` (SM90, vLLM installed)."""

import pytest
import torch
from vllm_op_checks import (
    assert_op_has_schema,
    assert_some_numerics_gives_vllms_bits,
    cuda_kernel_names,
    vllm_op_or_skip,
)

pytestmark = pytest.mark.gpu


def test_vllms_op_has_the_schema_the_cpu_tests_call_it_with():
    """The CPU tests call trl-fp8's kernel through an op defined with `NORM_QUANT_SCHEMA`, as the dispatcher calls
    vLLM's, and `install` refuses an op of other arguments: the loaded op's arguments (names, types, defaults,
    mutability) must be that schema's."""
    from trl_fp8.rollout.vllm import norm_quant
    from trl_fp8.rollout.vllm._compat import NORM_QUANT_SCHEMA

    assert_op_has_schema(vllm_op_or_skip(norm_quant), "rms_norm_per_block_quant", NORM_QUANT_SCHEMA)


def test_trl_fp8_kernel_writes_vllms_bits_at_engine_shapes():
    """The probe cases at the hidden sizes of the 1.7B, 8B and 32B models and an MLA model's latent widths, and
    decode and prefill shapes with the residual add: one of the two numerics gives vLLM's bytes (FP8 values, scales,
    residual) everywhere (which one says how vLLM's kernel was compiled)."""
    from trl_fp8.rollout.vllm import norm_quant
    from trl_fp8.rollout.vllm.norm_quant import ProbeCase, first_difference, probe_inputs

    vllm_op = vllm_op_or_skip(norm_quant)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = probe_inputs((4096, 2048, 5120), "cuda") + probe_inputs((7168, 1536, 512), "cuda", epsilon=1e-5)
    for m, n in [(256, 4096), (4096, 4096), (512, 5120), (3, 2048), (8192, 1024)]:
        x = (torch.randn(m, n, device="cuda", generator=g) * 4).bfloat16()
        r = (torch.randn(m, n, device="cuda", generator=g) * 8).bfloat16()
        w = (1 + 0.2 * torch.randn(n, device="cuda", generator=g)).bfloat16()
        cases += [ProbeCase(x, w, 1e-6, residual=r), ProbeCase(x, w, 1e-6, transposed=False, tma_alignment=0)]
    assert_some_numerics_gives_vllms_bits(first_difference, vllm_op, cases)


def test_install_runs_the_op_on_trl_fp8s_kernel_with_the_same_bits_and_uninstall_gives_it_back():
    from vllm import _custom_ops as vllm_ops

    from trl_fp8.rollout.vllm import norm_quant

    vllm_op_or_skip(norm_quant)
    norm_quant.uninstall()  # from vLLM's kernel, whatever an earlier engine test in this process installed
    x = (torch.randn(256, 4096, device="cuda") * 3).bfloat16()
    residual = (torch.randn(256, 4096, device="cuda") * 5).bfloat16()
    weight = (1 + 0.1 * torch.randn(4096, device="cuda")).bfloat16()

    def call(with_residual=True, transposed=True):  # vLLM's own wrapper, as its compiled graphs call the op
        r = residual.clone() if with_residual else None
        q, s = vllm_ops.rms_norm_per_block_quant(
            x, weight, 1e-6, torch.float8_e4m3fn, [1, 128], scale_ub=None, residual=r, is_scale_transposed=transposed
        )
        return q, s, r

    def same(a, b):
        return (torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
                and a[1].stride() == b[1].stride() and (a[2] is None or torch.equal(a[2], b[2])))  # fmt: skip

    variants = [(True, True), (False, True), (True, False), (False, False)]
    before = {v: call(*v) for v in variants}
    assert "_rms_norm_quant_kernel" not in " ".join(cuda_kernel_names(call))
    try:
        choice = norm_quant.install(4096, torch.device("cuda"))
        print(f"\n{choice.reason}")
        if not choice.installed:
            assert "not faster" in choice.reason, choice.reason  # the bits are the previous test's business
            pytest.skip(choice.reason)
        assert norm_quant.installed() == choice and choice.trl_fp8_us < choice.vllm_us
        assert norm_quant.install(4096, torch.device("cuda")) is choice  # idempotent
        for variant in variants:
            assert same(call(*variant), before[variant]), variant
        assert any("_rms_norm_quant_kernel" in name for name in cuda_kernel_names(call))
        assert any("_rms_norm_quant_kernel" in name for name in cuda_kernel_names(lambda: call(False, False)))
    finally:
        norm_quant.uninstall()
    assert norm_quant.installed() is None
    assert not any("_rms_norm_quant_kernel" in name for name in cuda_kernel_names(call))
