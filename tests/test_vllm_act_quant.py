"""trl-fp8's kernel for vLLM's fused `silu_and_mul_per_block_quant` (`trl_fp8.kernels.vllm_silu_mul_quant`), in
Triton's CPU interpreter against the float32 reference of vLLM's arithmetic, and the start-up choice around it
(`trl_fp8.rollout.vllm.act_quant`). On a GPU, tests/gpu/test_act_quant_gpu.py compares it with vLLM's own kernel
bit for bit."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from trl_fp8 import FP8GRPOConfig, FP8Tuning
from trl_fp8.kernels.vllm_silu_mul_quant import (
    FP8_MAX,
    MIN_SCALE,
    silu_and_mul_per_block_quant,
    silu_and_mul_per_block_quant_reference,
)
from trl_fp8.rollout.vllm import act_quant

from fake_vllm import count_kernel_calls, op_with_schema

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")  # conftest: exact fp32 -> e4m3 casts


@pytest.fixture(autouse=True)
def _quiet_exp_overflow():
    with np.errstate(over="ignore"):  # exp(-gate) overflows to inf for gates below -88, as on the GPU
        yield


def _inputs(m: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * n, generator=g)
    x[:, : n // 4] *= 40.0  # gates deep in both tails of exp
    x[:, n // 4 : n // 2] *= 1e-5  # groups at the scale floor
    x[0, n // 2 : n // 2 + 64] = 0.0  # an all-zero group (of 64; half of one of 128)
    return x.bfloat16()


def _run(x, group_size, scale_ub, transposed, numerics="ieee"):
    """The kernel on buffers allocated as vLLM's wrapper allocates them."""
    return act_quant.run_op(
        partial(silu_and_mul_per_block_quant, numerics=numerics), x, group_size, scale_ub, transposed
    )


@pytest.mark.parametrize(
    ("m", "n", "group_size", "transposed", "scale_ub"),
    [(1, 256, 128, False, None), (37, 384, 128, True, None), (16, 256, 64, False, 0.05), (20, 128, 64, True, 0.05)],
)
def test_kernel_writes_the_reference_bits_in_both_scale_layouts(m, n, group_size, transposed, scale_ub):
    x = _inputs(m, n)
    ub = None if scale_ub is None else torch.tensor(scale_ub)
    out, scales = _run(x, group_size, ub, transposed)
    q_ref, s_ref = silu_and_mul_per_block_quant_reference(x, group_size, ub)
    assert torch.equal(out.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scales, s_ref)  # the logical [M, groups] view, whichever storage the flag asked for
    storage = scales.t() if transposed else scales
    assert storage.is_contiguous()


def test_reference_follows_vllms_rules():
    """scale = amax / 448 (capped, floored at 1 / (448 * 512)); values saturate at +-448; zero groups stay zero;
    the dequantized values are the float32 products to FP8's rounding."""
    x = _inputs(8, 256)
    q, s = silu_and_mul_per_block_quant_reference(x, 128)
    g, u = x.float().chunk(2, dim=-1)
    r = torch.nn.functional.silu(g) * u  # torch's SiLU: within a few float32 ulps of vLLM's formula
    amax = r.view(8, 2, 128).abs().amax(-1)
    torch.testing.assert_close(s, (amax / FP8_MAX).clamp(min=MIN_SCALE), rtol=2**-20, atol=0)
    assert MIN_SCALE == pytest.approx(1 / (448 * 512), rel=1e-7)
    deq = q.float().view(8, 2, 128) * s[..., None]
    big = r.view(8, 2, 128).abs() > s[..., None] * 2**-6  # normal FP8 range: 3 mantissa bits, rel. error <= 2^-4
    rel = ((deq - r.view(8, 2, 128)).abs() / r.view(8, 2, 128).abs())[big]
    assert rel.max() <= 2**-4 * 1.0001
    q_cap, s_cap = silu_and_mul_per_block_quant_reference(x, 128, torch.tensor(1e-3))
    assert s_cap.max() <= 1e-3 and q_cap.float().abs().max() == FP8_MAX  # capped scales saturate the large values
    zero = torch.zeros(2, 256, dtype=torch.bfloat16)
    qz, sz = silu_and_mul_per_block_quant_reference(zero, 128)
    assert torch.all(sz == MIN_SCALE) and torch.all(qz.float() == 0)


def test_fast_numerics_run_too():
    """The "fast" variant (approximate exp and division on a GPU) is the same arithmetic in the interpreter."""
    x = _inputs(5, 256, seed=1)
    ieee, fast = _run(x, 128, None, False), _run(x, 128, None, False, numerics="fast")
    assert torch.equal(ieee[0].view(torch.uint8), fast[0].view(torch.uint8)) and torch.equal(ieee[1], fast[1])
    with pytest.raises(ValueError, match="numerics='exact'"):
        _run(x, 128, None, False, numerics="exact")


def test_kernel_refuses_what_vllms_op_would_not_hand_it_here():
    x = _inputs(4, 256)
    with pytest.raises(NotImplementedError, match=r"FP8Tuning\(vllm_act_quant_kernel='vllm'\)"):
        silu_and_mul_per_block_quant(torch.empty(4, 256, dtype=torch.int8), x, torch.empty(4, 2), 128)
    with pytest.raises(ValueError, match="input \\[M, 2N\\] and out \\[M, N\\]"):
        silu_and_mul_per_block_quant(torch.empty(4, 128, dtype=torch.float8_e4m3fn), x, torch.empty(4, 1), 128)
    with pytest.raises(ValueError, match="group_size must be 64 or 128"):
        silu_and_mul_per_block_quant(torch.empty(4, 256, dtype=torch.float8_e4m3fn), x, torch.empty(4, 8), 32)


def test_mlp_shape_is_the_decode_steps_width_and_rows():
    dense = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=64)  # fmt: skip
    assert act_quant.mlp_shape(dense) == (768, 256)
    moe = Qwen3MoeConfig(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         vocab_size=64)  # fmt: skip
    assert act_quant.mlp_shape(moe, decode_sequences=64) == (128, 128)


def test_install_keeps_vllms_kernel_where_vllms_op_is_not_here():
    if act_quant.vllm_kernel_op() is not None:
        pytest.skip("vLLM's ops are loaded here: tests/gpu/test_act_quant_gpu.py covers the install")
    choice = act_quant.install(768, "cpu")
    assert not choice.installed and "is not here" in choice.reason
    assert act_quant.installed() is None


@pytest.mark.parametrize("name", ["vllm_fp8_moe_backend", "vllm_act_quant_kernel"])
def test_config_refuses_colocated_engine_kernels_where_they_would_do_nothing(name, monkeypatch):
    """The config's `vllm_fp8_moe_backend` when the config is built; `FP8Tuning(vllm_act_quant_kernel=...)` when the
    tuning is built (unknown values) or checked against the config (`FP8Tuning.check`, at the trainer's start)."""
    value = {"vllm_fp8_moe_backend": "triton", "vllm_act_quant_kernel": "vllm"}[name]
    base = dict(output_dir="unused", use_cpu=True, bf16=False)
    monkeypatch.setattr("trl_fp8.config.check_vllm_version", lambda: "0.26.0")  # a config with use_vllm=True builds

    def run(kernel, **settings):
        if name == "vllm_act_quant_kernel":
            FP8Tuning(vllm_act_quant_kernel=kernel).check(FP8GRPOConfig(**base, **settings))
        else:
            FP8GRPOConfig(**base, **settings, **{name: kernel})

    said = name if name == "vllm_fp8_moe_backend" else r"FP8Tuning\(vllm_act_quant_kernel"
    with pytest.raises(ValueError, match="unknown"):
        run("marlin")
    with pytest.raises(ValueError, match=f"{said}='{value}'\\)? sets up vLLM rollouts, but use_vllm=False"):
        run(value)
    with pytest.raises(ValueError, match=f"rollout_precision='bf16'. Drop {name}"):
        run(value, use_vllm=True, rollout_precision="bf16")
    with pytest.raises(ValueError, match="`trl vllm-serve` server runs the kernels it was started with"):
        run(value, use_vllm=True, vllm_mode="server")
    assert FP8GRPOConfig(**base).vllm_fp8_moe_backend == FP8Tuning().vllm_act_quant_kernel == "auto"


def _reference_op(out, x, scales, group_size, scale_ub=None, transposed=False):
    """A stand-in for vLLM's op on the CPU: the reference arithmetic, written into vLLM's buffers (defaults as in
    vLLM's schema: the CPU tests also register it as an op's kernel)."""
    q, s = silu_and_mul_per_block_quant_reference(x, group_size, scale_ub)
    out.copy_(q)
    scales.copy_(s)


def test_install_keeps_vllms_kernel_where_the_bits_differ(monkeypatch):
    def off_by_one_scale(out, x, scales, group_size, scale_ub, transposed):
        _reference_op(out, x, scales, group_size, scale_ub, transposed)
        scales[0, 0] = torch.nextafter(scales[0, 0], torch.tensor(1.0))

    monkeypatch.setattr(act_quant, "vllm_kernel_op", lambda: off_by_one_scale)
    choice = act_quant.install(256, "cpu")
    assert not choice.installed and "does not reproduce vLLM's bits" in choice.reason
    assert "ieee numerics: 0 of 256 FP8 values and 1 of 2 scales differ at (1, 512)" in choice.reason
    assert act_quant.installed() is None


def test_install_keeps_vllms_kernel_where_it_cannot_be_checked(monkeypatch):
    """Same bits here, but no CUDA graph to time it in: any failure of a check leaves vLLM's kernel, saying why."""
    monkeypatch.setattr(act_quant, "vllm_kernel_op", lambda: _reference_op)
    choice = act_quant.install(256, "cpu")
    assert not choice.installed and choice.reason.startswith("trl-fp8's kernel could not be checked here")
    assert act_quant.installed() is None
    timings = iter([1.0, 2.0])  # vLLM's kernel faster
    monkeypatch.setattr(act_quant, "graph_time_us", lambda fn, reps=20: (fn(), next(timings))[1])
    slower = act_quant.install(256, "cpu")
    assert not slower.installed and slower.reason.startswith(
        "same bits, but not faster here: 2.0 us against vLLM's 1.0"
    )
    assert slower.numerics == "ieee" and act_quant.installed() is None


@pytest.fixture(scope="module")
def op_with_vllms_schema():
    """An op defined with vLLM's schema for `silu_and_mul_per_block_quant`, on the CPU: `_reference_op` is its
    kernel, as vLLM's CUDA kernel is the real op's."""
    from trl_fp8.rollout.vllm._compat import SILU_MUL_QUANT_SCHEMA

    yield from op_with_schema("trl_fp8_test_vllm", act_quant.OP_NAME, SILU_MUL_QUANT_SCHEMA, _reference_op)


def _install_over(monkeypatch, op, timings=(2.0, 1.0), **kwargs) -> act_quant.SiluQuantChoice:
    """`install` over `op` (as over vLLM's), with `timings` (vLLM's kernel's, then ours; by default ours faster)."""
    monkeypatch.setattr(act_quant, "vllm_kernel_op", lambda: op)
    monkeypatch.setattr(act_quant, "NAMESPACE", "trl_fp8_test_vllm")
    timings = iter(timings)
    monkeypatch.setattr(act_quant, "graph_time_us", lambda fn, reps=20: (fn(), next(timings))[1])
    return act_quant.install(256, "cpu", decode_tokens=4, scale_transposed=False, **kwargs)


def test_installed_kernel_runs_every_call_as_the_dispatcher_passes_it(monkeypatch, op_with_vllms_schema):
    """The dispatcher leaves out trailing arguments equal to their schema defaults when it calls a Python kernel:
    vLLM's Triton fused MoE (`scale_ub=None, is_scale_transposed=False`) reaches the kernel with four arguments, the
    compiled dense MLP (`None, True`) with six. Every pattern gives the reference bits, from trl-fp8's kernel."""
    from trl_fp8.kernels import vllm_silu_mul_quant

    calls = []

    def counted(*args, **kwargs):
        calls.append(args[4:6])
        return silu_and_mul_per_block_quant(*args, **kwargs)

    monkeypatch.setattr(vllm_silu_mul_quant, "silu_and_mul_per_block_quant", counted)
    try:
        choice = _install_over(monkeypatch, op_with_vllms_schema)
        assert choice.installed, choice.reason
        assert "4 x 256 (row-major scales)" in choice.reason
        calls.clear()
        x = _inputs(6, 256, seed=2)
        for ub, transposed in [(None, False), (torch.tensor(0.05), False), (None, True)]:
            out, scales = act_quant.run_op(op_with_vllms_schema, x, 128, ub, transposed)
            q_ref, s_ref = silu_and_mul_per_block_quant_reference(x, 128, ub)
            assert torch.equal(out.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scales, s_ref)
        assert len(calls) == 3 and calls[0] == (None, False) and calls[2] == (None, True)
    finally:
        act_quant.uninstall()
    calls.clear()
    act_quant.run_op(op_with_vllms_schema, _inputs(2, 256), 128, None, False)
    assert calls == []  # the reference kernel again


def test_install_keeps_vllms_kernel_where_the_op_calls_ours_otherwise(monkeypatch, op_with_vllms_schema):
    """A kernel that needs all six arguments passes the direct checks but not the calls through the op: vLLM's
    kernel stays, and the reason says what failed."""

    def six_arguments_only(numerics):
        def ours(out, x, scales, group_size, scale_ub, is_scale_transposed):
            silu_and_mul_per_block_quant(out, x, scales, group_size, scale_ub, is_scale_transposed, numerics=numerics)

        return ours

    monkeypatch.setattr(act_quant, "_kernel", six_arguments_only)
    choice = _install_over(monkeypatch, op_with_vllms_schema)
    assert not choice.installed and act_quant.installed() is None
    assert "failed the check through vLLM's op" in choice.reason and "missing 2 required positional" in choice.reason
    x = _inputs(2, 256)
    out, _ = act_quant.run_op(op_with_vllms_schema, x, 128, None, False)  # the reference kernel again
    assert torch.equal(out.view(torch.uint8), silu_and_mul_per_block_quant_reference(x, 128)[0].view(torch.uint8))


def test_trl_fp8_choice_installs_the_kernel_where_the_bits_match_whatever_its_speed(monkeypatch, op_with_vllms_schema):
    """`vllm_act_quant_kernel="trl_fp8"` (`require_faster=False`): installed although vLLM's kernel timed faster, and
    only after the same bit checks, through the op too."""
    try:
        choice = _install_over(monkeypatch, op_with_vllms_schema, timings=(1.0, 2.0), require_faster=False)
        assert choice.installed and act_quant.installed() == choice, choice.reason
        assert "2.0 us against vLLM's 1.0 us" in choice.reason and "asked for whatever its speed" in choice.reason
    finally:
        act_quant.uninstall()
    with pytest.raises(ValueError, match="vllm_act_quant_kernel='trl_fp8'\\) sets up vLLM rollouts"):  # known
        FP8Tuning(vllm_act_quant_kernel="trl_fp8").check(FP8GRPOConfig(output_dir="unused", use_cpu=True, bf16=False))


def _patch_vllm_op(monkeypatch, op) -> list:
    """vLLM's op replaced by `op`, ours timed faster at every check; returns the list each timing appends to."""
    timed = []
    monkeypatch.setattr(act_quant, "vllm_kernel_op", lambda: op)
    monkeypatch.setattr(act_quant, "NAMESPACE", "trl_fp8_test_vllm")
    monkeypatch.setattr(
        act_quant, "graph_time_us", lambda fn, reps=20: (fn(), timed.append(1), 1.0 + len(timed) % 2)[2]
    )
    return timed


def test_each_engines_settings_are_checked_anew(monkeypatch, op_with_vllms_schema):
    """The registration covers the whole process; a second engine of another width or scale layout gets its own
    check (against vLLM's kernel), not the first engine's decision, and the same settings get the decision in force."""
    timed = _patch_vllm_op(monkeypatch, op_with_vllms_schema)
    try:
        first = act_quant.install(256, "cpu", decode_tokens=4, scale_transposed=False)
        assert first.installed and len(timed) == 2
        assert act_quant.install(256, "cpu", decode_tokens=4, scale_transposed=False) is first and len(timed) == 2
        other = act_quant.install(384, "cpu", decode_tokens=8, scale_transposed=True)
        assert other.installed and len(timed) == 4 and "8 x 384 (column-major scales)" in other.reason
        assert act_quant.installed() is other and act_quant.in_force(other) is other
        replaced = act_quant.in_force(first)  # the first engine's decision, as its report now gives it
        assert not replaced.installed and "another engine checked it at its own settings" in replaced.reason
    finally:
        act_quant.uninstall()


def test_vllms_kernel_comes_back_when_the_installing_engine_is_gone(monkeypatch, op_with_vllms_schema):
    import gc

    class Engine:
        pass

    _patch_vllm_op(monkeypatch, op_with_vllms_schema)
    try:
        first, second = Engine(), Engine()
        assert act_quant.install(256, "cpu", decode_tokens=4, scale_transposed=False, owner=first).installed
        assert act_quant.install(384, "cpu", decode_tokens=4, scale_transposed=False, owner=second).installed
        del first
        gc.collect()
        assert act_quant.installed() is not None  # the second engine's check installed it last: it stays
        del second
        gc.collect()
        assert act_quant.installed() is None
        x = _inputs(2, 256)  # the reference kernel again
        out, _ = act_quant.run_op(op_with_vllms_schema, x, 128, None, False)
        assert torch.equal(out.view(torch.uint8), silu_and_mul_per_block_quant_reference(x, 128)[0].view(torch.uint8))
    finally:
        act_quant.uninstall()


def test_an_engine_asking_for_vllms_kernel_gets_it(monkeypatch, op_with_vllms_schema):
    """`vllm_act_quant_kernel='vllm'` in a later engine of the process undoes an earlier engine's installation."""
    from types import SimpleNamespace

    from trl_fp8.rollout.settings import RolloutSettings
    from trl_fp8.rollout.vllm.generation import FP8VLLMGeneration, RolloutReport

    _patch_vllm_op(monkeypatch, op_with_vllms_schema)
    try:
        assert act_quant.install(256, "cpu", decode_tokens=4, scale_transposed=False).installed
        engine = SimpleNamespace(settings=RolloutSettings(act_quant_kernel="vllm"), report=RolloutReport())
        FP8VLLMGeneration._choose_act_quant_kernel(engine)
        assert act_quant.installed() is None and engine.report.act_quant_choice is None
    finally:
        act_quant.uninstall()


def _our_kernel_runs(op, calls: list) -> bool:
    """Whether `op` runs trl-fp8's kernel (counted in `calls`) rather than the reference (vLLM's stand-in), which
    give the same bits."""
    calls.clear()
    x = _inputs(2, 256)
    out, _ = act_quant.run_op(op, x, 128, None, False)
    assert torch.equal(out.view(torch.uint8), silu_and_mul_per_block_quant_reference(x, 128)[0].view(torch.uint8))
    return bool(calls)


def test_the_kernel_stays_while_any_engine_using_it_lives(monkeypatch, op_with_vllms_schema):
    """Two engines of the same settings share one check and one registration: the first collected, the kernel stays
    for the second; once both are gone, vLLM's kernel is back."""
    import gc

    class Engine:
        pass

    timed = _patch_vllm_op(monkeypatch, op_with_vllms_schema)
    calls = count_kernel_calls(monkeypatch, act_quant)
    try:
        first, second = Engine(), Engine()
        choice = act_quant.install(256, "cpu", decode_tokens=4, scale_transposed=False, owner=first)
        assert choice.installed and len(timed) == 2
        assert act_quant.install(256, "cpu", decode_tokens=4, scale_transposed=False, owner=second) is choice
        assert len(timed) == 2  # the decision in force, not checked again
        del first
        gc.collect()
        assert act_quant.installed() is choice  # the second engine still uses it
        assert _our_kernel_runs(op_with_vllms_schema, calls)
        del second
        gc.collect()
        assert act_quant.installed() is None and not _our_kernel_runs(op_with_vllms_schema, calls)
    finally:
        act_quant.uninstall()


class _StandInEngine:
    """What `FP8VLLMGeneration._choose_act_quant_kernel` reads of its engine: a dense model of MLP width 256."""

    def __init__(self):
        from types import SimpleNamespace

        from trl_fp8.rollout.settings import RolloutSettings
        from trl_fp8.rollout.vllm.generation import RolloutReport

        config = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64)  # fmt: skip
        self.model = SimpleNamespace(config=config)
        self.accelerator = SimpleNamespace(device=torch.device("cpu"))
        self.settings, self.report = RolloutSettings(), RolloutReport()


def test_an_engines_report_says_installed_only_while_the_kernel_is_in_force(monkeypatch, op_with_vllms_schema):
    """Engines' reports (the trainer's logs, the benchmarks' rows): an engine whose kernel another engine installed
    keeps it, and its report says so, after that engine is collected; once vLLM's kernel is back, the report says
    that instead, and why."""
    import gc

    from trl_fp8.rollout.vllm.generation import FP8VLLMGeneration

    _patch_vllm_op(monkeypatch, op_with_vllms_schema)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        first, second = _StandInEngine(), _StandInEngine()
        FP8VLLMGeneration._choose_act_quant_kernel(first)
        FP8VLLMGeneration._choose_act_quant_kernel(second)
        choice = second.report.act_quant_choice
        assert choice.installed and first.report.act_quant_choice is choice, choice.reason
        del first
        gc.collect()
        assert second.report.act_quant_choice is choice and act_quant.installed() is choice
        act_quant.uninstall()  # (as an engine asking for vLLM's kernel does)
        gone = second.report.act_quant_choice
        assert not gone.installed and "vLLM's kernel runs the op again" in gone.reason, gone.reason
        assert gone.numerics == choice.numerics and gone.trl_fp8_us == choice.trl_fp8_us  # what the check measured
    finally:
        act_quant.uninstall()
