"""trl-fp8's kernel for vLLM's fused `silu_and_mul_per_block_quant` against vLLM's own, bit for bit, and the op
re-registered by `trl_fp8.rollout.vllm.act_quant.install` (SM90, vLLM installed)."""

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
    """The CPU tests call trl-fp8's kernel through an op defined with `SILU_MUL_QUANT_SCHEMA`, as the dispatcher
    calls vLLM's: the loaded op's arguments (names, types, defaults) must be that schema's."""
    from trl_fp8.rollout.vllm import act_quant
    from trl_fp8.rollout.vllm._compat import SILU_MUL_QUANT_SCHEMA

    assert_op_has_schema(vllm_op_or_skip(act_quant), "silu_and_mul_per_block_quant", SILU_MUL_QUANT_SCHEMA)


def test_trl_fp8_kernel_writes_vllms_bits_at_engine_shapes():
    """The probe cases and the engine's decode, prefill and expert shapes: one of the two numerics gives vLLM's
    bytes everywhere (which one says how vLLM's kernel was compiled)."""
    from trl_fp8.rollout.vllm import act_quant
    from trl_fp8.rollout.vllm.act_quant import first_difference, probe_inputs

    vllm_op = vllm_op_or_skip(act_quant)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = probe_inputs(12288, "cuda") + probe_inputs(768, "cuda")
    for m, n in [(256, 12288), (4096, 12288), (2048, 768), (3, 6144)]:
        x = (torch.randn(m, 2 * n, device="cuda", generator=g) * 4).bfloat16()
        cases += [(x, 128, None, True), (x, 128, None, False)]
    assert_some_numerics_gives_vllms_bits(first_difference, vllm_op, cases)


def test_install_runs_the_op_on_trl_fp8s_kernel_with_the_same_bits_and_uninstall_gives_it_back():
    from vllm import _custom_ops as vllm_ops

    from trl_fp8.rollout.vllm import act_quant

    vllm_op_or_skip(act_quant)
    act_quant.uninstall()  # from vLLM's kernel, whatever an earlier engine test in this process installed
    x = (torch.randn(256, 2 * 6144, device="cuda") * 3).bfloat16()

    def call():
        return vllm_ops.silu_and_mul_per_block_quant(x, 128, torch.float8_e4m3fn, None, True)  # vLLM's own wrapper

    def call_as_fused_moe():  # row-major scales, as vLLM's Triton fused MoE asks (the op's trailing defaults)
        return vllm_ops.silu_and_mul_per_block_quant(x, group_size=128, quant_dtype=torch.float8_e4m3fn)

    before, before_moe = call(), call_as_fused_moe()
    assert "_silu_mul_quant_kernel" not in " ".join(cuda_kernel_names(call))
    try:
        choice = act_quant.install(6144, torch.device("cuda"))
        print(f"\n{choice.reason}")
        if not choice.installed:
            assert "not faster" in choice.reason, choice.reason  # the bits are the previous test's business
            pytest.skip(choice.reason)
        assert act_quant.installed() == choice and choice.trl_fp8_us < choice.vllm_us
        assert act_quant.install(6144, torch.device("cuda")) is choice  # idempotent
        after = call()
        assert torch.equal(after[0].view(torch.uint8), before[0].view(torch.uint8))
        assert torch.equal(after[1], before[1]) and after[1].stride() == before[1].stride()
        after_moe = call_as_fused_moe()
        assert torch.equal(after_moe[0].view(torch.uint8), before_moe[0].view(torch.uint8))
        assert torch.equal(after_moe[1], before_moe[1]) and after_moe[1].stride() == before_moe[1].stride()
        assert any("_silu_mul_quant_kernel" in name for name in cuda_kernel_names(call_as_fused_moe))
        assert any("_silu_mul_quant_kernel" in name for name in cuda_kernel_names(call))
    finally:
        act_quant.uninstall()
    assert act_quant.installed() is None
    assert not any("_silu_mul_quant_kernel" in name for name in cuda_kernel_names(call))
