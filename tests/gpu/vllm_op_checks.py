"""What the GPU tests of trl-fp8's kernels for vLLM ops share (test_act_quant_gpu.py, test_norm_quant_gpu.py,
test_vllm_gpu.py): vLLM's op or a skip, the bit check against it, the CUDA kernels a call runs, and the op's arguments
against our schema."""

import pytest
import torch


def vllm_op_or_skip(module):
    """vLLM's compiled op that `module` (`rollout.vllm.act_quant` or `norm_quant`) replaces; a skip where it is absent."""
    op = module.vllm_kernel_op()
    if op is None:
        pytest.skip(f"vLLM's {module.OP_NAME} is not here")
    return op


def assert_some_numerics_gives_vllms_bits(first_difference, vllm_op, cases) -> None:
    """trl-fp8's kernel, built with IEEE or with fast division and square root, gives vLLM's bytes on every case
    under one of the two (`first_difference(numerics, vllm_op, cases)` is None): which one says how vLLM's kernel
    was compiled."""
    differences = {numerics: first_difference(numerics, vllm_op, cases) for numerics in ("ieee", "fast")}
    print(f"\nagainst vLLM's kernel: {differences}")
    assert None in differences.values(), differences


def cuda_kernel_names(fn) -> set[str]:
    """The CUDA kernels `fn()` runs (those inside CUDA graphs it replays included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {event.name for event in prof.events() if event.device_type.name == "CUDA"}


def assert_op_has_schema(op, name: str, schema: str) -> None:
    """`op`'s arguments (names, types, defaults, mutability) are those of an op `name` defined with `schema`, the
    schema the CPU tests call trl-fp8's kernel through, as the dispatcher calls vLLM's."""
    namespace = f"trl_fp8_gpu_test_schema_{name}"
    library = torch.library.Library(namespace, "DEF")  # noqa: TOR901
    try:
        library.define(f"{name}{schema}")
        expected = getattr(getattr(torch.ops, namespace), name).default

        def arguments(o):
            return [(arg.name, str(arg.type), arg.default_value, bool(arg.alias_info and arg.alias_info.is_write))
                    for arg in o._schema.arguments]  # fmt: skip

        assert arguments(op) == arguments(expected)
    finally:
        library._destroy()
