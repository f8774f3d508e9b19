"""trl-fp8's kernel for vLLM's fused `rms_norm_per_block_quant` (`trl_fp8.kernels.vllm_rms_norm_quant`), in Triton's
CPU interpreter against the float32 reference of vLLM's arithmetic (its order of summation included), and the start-up
choice around it (`trl_fp8.rollout.vllm.norm_quant`, on `rollout.vllm._override`'s machinery, shared with
`act_quant`). On a GPU, tests/gpu/test_norm_quant_gpu.py compares it with vLLM's own kernel bit for bit."""

from __future__ import annotations

import gc
import re
from fractions import Fraction
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import Qwen3Config

from trl_fp8 import FP8GRPOConfig, FP8Tuning
from trl_fp8.kernels import vllm_rms_norm_quant
from trl_fp8.kernels.vllm_rms_norm_quant import (
    FP8_MAX,
    MIN_SCALE,
    block_threads,
    rms_norm_per_block_quant,
    rms_norm_per_block_quant_reference,
)
from trl_fp8.rollout.vllm import norm_quant
from trl_fp8.rollout.vllm.norm_quant import ProbeCase, run_op

from fake_vllm import count_kernel_calls, op_with_schema

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")  # conftest: exact fp32 -> e4m3 / bf16 casts


def _case(m, hidden, *, residual=True, seed=0, dtype=torch.bfloat16, **kwargs) -> ProbeCase:
    """A probe-like call: ordinary values, a zero row, a large row, a tiny group (`norm_quant`'s), weights with a
    large group and a tiny one."""
    g = torch.Generator().manual_seed(seed)
    x, r = norm_quant._rows(m, hidden, g, residual)
    w = 1 + 0.1 * torch.randn(hidden, generator=g)
    w[:128] *= 30.0
    w[128:256] *= 1e-3
    to = partial(torch.Tensor.to, dtype=dtype)
    return ProbeCase(to(x), to(w), kwargs.pop("epsilon", 1e-6), residual=None if r is None else to(r), **kwargs)


def _reference(case: ProbeCase, threads=None):
    return rms_norm_per_block_quant_reference(
        case.x, case.weight, case.epsilon, case.group_size, case.scale_ub, case.residual, threads
    )


def _assert_reference_bits(outputs, case: ProbeCase, threads=None):
    q, s, r = _reference(case, threads)
    assert torch.equal(outputs[0].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(outputs[1], s)  # the logical [M, groups] view, whichever storage the flag asked for
    if case.residual is not None:
        assert torch.equal(outputs[2].view(torch.int16), r.view(torch.int16))
        assert not torch.equal(outputs[2], case.residual)  # overwritten (the case's own copy is left alone)


def _ours(numerics="ieee"):
    return partial(rms_norm_per_block_quant, numerics=numerics)


@pytest.mark.parametrize(
    ("m", "hidden", "residual", "kwargs"),
    [
        (1, 256, False, {"transposed": False}),
        (7, 384, True, {}),  # 96 of vLLM's threads hold the row (not a power of two)
        (5, 1536, True, {"group_size": 64, "transposed": False}),  # 384 threads
        (3, 5120, False, {"scale_ub": torch.tensor(0.01)}),  # 2.5 vectors a thread; the cap saturates
        (6, 2560, True, {"tma_alignment": 4}),  # scales 8 rows apart
        (20, 128, True, {"group_size": 64, "epsilon": 1e-5}),  # a warp of 32 threads
        (257, 1280, True, {}),  # beyond 256 tokens: a block of 256 threads, 1.25 vectors each
    ],
)
def test_kernel_writes_the_reference_bits(m, hidden, residual, kwargs):
    case = _case(m, hidden, residual=residual, **kwargs)
    outputs = run_op(_ours(), case)
    _assert_reference_bits(outputs, case)
    scales = outputs[1]
    if case.transposed:
        assert scales.stride(0) == 1 and scales.stride(1) == (-(-m // 4) * 4 if case.tma_alignment else m)
    else:
        assert scales.is_contiguous()


def test_kernel_takes_strided_rows_half_precision_and_no_rows():
    case = _case(5, 512)
    strided = case._replace(x=torch.nn.functional.pad(case.x, (0, 64))[:, :512])
    assert strided.x.stride(0) == 576
    _assert_reference_bits(run_op(_ours(), strided), strided)
    half = _case(4, 384, dtype=torch.float16, seed=1)
    _assert_reference_bits(run_op(_ours(), half), half)
    empty = ProbeCase(torch.empty(0, 256, dtype=torch.bfloat16), case.weight[:256], 1e-6)
    assert run_op(_ours(), empty)[0].shape == (0, 256)


def test_fast_numerics_run_too():
    """The "fast" variant (approximate divisions on a GPU) is the same arithmetic in the interpreter."""
    case = _case(5, 512, seed=2)
    ieee = run_op(_ours(), case)
    assert norm_quant.first_difference_between(_ours("fast"), [case], [ieee]) is None
    with pytest.raises(ValueError, match="numerics='exact'"):
        run_op(_ours("exact"), case)


def test_vllms_block_is_512_threads_up_to_256_tokens_then_256(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert [block_threads(m, 4096) for m in (1, 256, 257)] == [512, 512, 256]
    assert block_threads(1, 384) == 384 and block_threads(300, 384) == 256
    for value, invariant in [("1", True), (" 2x", True), ("0", False), ("x1", False), ("", False)]:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", value)  # vLLM's `atoi(value) != 0`
        assert block_threads(300, 4096) == (512 if invariant else 256), value


def test_the_order_of_summation_decides_the_last_bit_of_the_sum_of_squares():
    """vLLM's order (a thread's fused multiply-adds, the warp's shuffle tree, the warps one after the other) is not
    a plain float32 sum, and a block of 256 threads sums in another order than one of 512: a kernel that summed the
    squares its own way would not give vLLM's rms, and with it a few of its FP8 values, in every row."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(256, 4096, generator=g) * 3).bfloat16().float().numpy()
    x += (torch.randn(256, 4096, generator=g) * 5).bfloat16().float().numpy()  # (with a residual: not exact squares)
    vllm_512 = vllm_rms_norm_quant._sum_of_squares(x, 512)
    vllm_256 = vllm_rms_norm_quant._sum_of_squares(x, 256)
    exact = (x.astype(np.float64) ** 2).sum(axis=1)
    assert (vllm_512 != vllm_256).sum() > 10 and (vllm_512 != np.float32(exact)).sum() > 10
    assert np.abs(vllm_512 / exact - 1).max() < 1e-5  # the same sum, to float32's rounding
    # and at 257 tokens the kernel takes 256 threads' order, as vLLM does: a row (found by search) whose FP8 values
    # or scales differ between the two orders, 257 times
    g = torch.Generator().manual_seed(19)
    x, r = (torch.randn(64, 2048, generator=g) * 2).bfloat16(), (torch.randn(64, 2048, generator=g) * 4).bfloat16()
    w = (1 + 0.1 * torch.randn(2048, generator=g)).bfloat16()
    case = ProbeCase(x[37].expand(257, -1).contiguous(), w, 1e-6, residual=r[37].expand(257, -1).contiguous())
    outputs = run_op(_ours(), case)
    _assert_reference_bits(outputs, case, threads=256)
    q512, s512, _ = _reference(case, threads=512)
    assert not (torch.equal(outputs[0].view(torch.uint8), q512.view(torch.uint8)) and torch.equal(outputs[1], s512))


def test_fma_of_the_reference_rounds_once():
    """`_fma32` is the GPU's `fma.rn.f32`: rounded once, where float64 then float32 would round twice."""
    a, b, c = np.float32(1 + 2**-18), np.float32(2**-24 - 2**-42), np.float32(1 + 2**-23)
    # the exact a * b + c is 1 + 2^-23 + 2^-24 - 2^-60, just below a tie: once rounded, down to c
    assert vllm_rms_norm_quant._fma32(np.array([a]), np.array([b]), np.array([c]))[0] == c
    assert np.float32(np.float64(a) * np.float64(b) + np.float64(c)) == np.float32(1 + 2**-22)  # (twice: up)
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(2000).astype(np.float32) * rng.choice([1e-3, 1.0, 1e3], 2000) for _ in range(3))
    got = vllm_rms_norm_quant._fma32(a, b, c)
    for ai, bi, ci, gi in zip(a[:300], b[:300], c[:300], got[:300], strict=True):
        exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
        near = np.float32(float(exact))
        options = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
        best = min(options, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.int32)) & 1))
        assert gi == best


def test_reference_follows_vllms_rules():
    """The sum is the residual add in float32 (written back in BF16); rms is 1/sqrt(mean square + eps); the
    normalized value is rounded to BF16 before and after the weight; scale = min(amax, cap) / 448, floored at
    1 / (448 * 512); values saturate at +-448; zero rows and tiny groups get the floor."""
    case = _case(8, 512, seed=4)
    q, s, r = _reference(case)
    x = case.x.double() + case.residual.double()
    assert torch.equal(r, x.bfloat16())  # (the float32 sum of two BF16 values is exact)
    rms = torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + case.epsilon)
    y = ((x * rms).bfloat16().double() * case.weight.double()).bfloat16().double()
    amax = y.view(8, 4, 128).abs().amax(-1)
    torch.testing.assert_close(s.double(), (amax / FP8_MAX).clamp(min=MIN_SCALE), rtol=1e-2, atol=0)
    assert torch.all(s[0] == MIN_SCALE) and torch.all(q[0].float() == 0)  # input and residual cancel: a zero row
    assert torch.all(s[:, 1] == MIN_SCALE)  # the group of tiny values (columns 128-256, times tiny weights)
    assert torch.all(q[1:].float().abs().amax(dim=1) == FP8_MAX)  # each row's largest value
    q_cap, s_cap, _ = _reference(case._replace(scale_ub=torch.tensor(1e-3)))
    assert torch.all((s_cap == MIN_SCALE) | (s_cap <= 1e-3 / FP8_MAX * (1 + 2**-23)))  # capped, or the floor
    assert (q_cap.float().abs() == FP8_MAX).sum() > 100


def test_kernel_refuses_what_vllms_op_would_not_hand_it_here():
    case = _case(4, 256)
    out, scales = torch.empty(4, 256, dtype=torch.float8_e4m3fn), torch.empty(4, 2)
    args = (case.weight, scales, 1e-6, None, None)
    with pytest.raises(NotImplementedError, match=r"FP8Tuning\(vllm_norm_quant_kernel='vllm'\)"):
        rms_norm_per_block_quant(torch.empty(4, 256, dtype=torch.int8), case.x, *args, 128, False)
    with pytest.raises(ValueError, match="group_size must be 64 or 128"):
        rms_norm_per_block_quant(out, case.x, *args, 32, False)
    with pytest.raises(ValueError, match="outer scale stride must be 1"):
        rms_norm_per_block_quant(out, case.x, case.weight, torch.empty(2, 4).t(), 1e-6, None, None, 128, False)
    with pytest.raises(ValueError, match="contiguous residual"):
        rms_norm_per_block_quant(out, case.x, case.weight, scales, 1e-6, None, case.residual.t().contiguous().t(),
                                 128, False)  # fmt: skip
    with pytest.raises(NotImplementedError, match="takes rows of up to"):
        wide = torch.empty(1, 32768, dtype=torch.bfloat16)
        rms_norm_per_block_quant(torch.empty(1, 32768, dtype=torch.float8_e4m3fn), wide, wide[0], torch.empty(1, 256),
                                 1e-6, None, None, 128, False)  # fmt: skip


def test_probes_cover_the_variants_the_engine_calls():
    """Both sides of 256 tokens where the row is wide enough for the block's size to matter, the residual add and
    not, both scale layouts and the TMA-aligned one, a cap, groups of 64, a strided row, another epsilon."""
    wide = norm_quant.probe_inputs((4096, 512), "cpu")
    rows = {(c.x.shape, c.residual is not None, c.transposed) for c in wide}
    for m in (7, 300):
        for residual in (False, True):
            assert {((m, 4096), residual, False), ((m, 4096), residual, True)} <= rows
    assert {c.x.shape[0] for c in wide if c.x.shape[1] == 4096} >= {1, 256, 257}
    assert {c.x.shape[0] for c in wide if c.x.shape[1] == 512} == {7, 20}  # (one block size for narrow rows)
    assert any(c.tma_alignment for c in wide) and any(c.scale_ub is not None for c in wide)
    assert any(c.group_size == 64 for c in wide) and any(c.x.stride(0) != c.x.shape[1] for c in wide)
    assert {c.epsilon for c in wide} == {1e-6, 1e-5}


def test_engine_widths_are_the_hidden_size_and_an_mla_models_latent_norms():
    dense = Qwen3Config(hidden_size=256, intermediate_size=768, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=64, rms_norm_eps=1e-5)  # fmt: skip
    assert norm_quant.engine_widths(dense) == (256, (), 1e-5)
    mla = SimpleNamespace(hidden_size=7168, q_lora_rank=1536, kv_lora_rank=512, rms_norm_eps=1e-6)
    assert norm_quant.engine_widths(mla) == (7168, (1536, 512), 1e-6)


def test_install_keeps_vllms_kernel_where_vllms_op_is_not_here():
    if norm_quant.vllm_kernel_op() is not None:
        pytest.skip("vLLM's ops are loaded here: tests/gpu/test_norm_quant_gpu.py covers the install")
    choice = norm_quant.install(256, "cpu")
    assert not choice.installed and "is not here" in choice.reason and norm_quant.installed() is None


def _reference_op(result, x, weight, scale, epsilon, scale_ub, residual, group_size, is_scale_transposed):
    """A stand-in for vLLM's op on the CPU: the reference arithmetic, written into vLLM's buffers (the CPU tests also
    register it as the kernel of an op with vLLM's schema)."""
    q, s, r = rms_norm_per_block_quant_reference(x, weight, epsilon, group_size, scale_ub, residual)
    result.copy_(q)
    scale.copy_(s)
    if residual is not None:
        residual.copy_(r)


@pytest.fixture(scope="module")
def op_with_vllms_schema():
    """An op defined with vLLM's schema for `rms_norm_per_block_quant`, on the CPU: `_reference_op` is its kernel,
    as vLLM's CUDA kernel is the real op's."""
    from trl_fp8.rollout.vllm._compat import NORM_QUANT_SCHEMA

    yield from op_with_schema("trl_fp8_test_vllm_norm", norm_quant.OP_NAME, NORM_QUANT_SCHEMA, _reference_op)


def _patch_vllm_op(monkeypatch, op, timings=None, call=True) -> list:
    """vLLM's op replaced by `op`; `timings` (vLLM's kernel's, then ours) or, by default, ours faster at every check
    (each timed call run once, unless `call=False`); returns the list each timing appends to."""
    timed = []
    monkeypatch.setattr(norm_quant, "vllm_kernel_op", lambda: op)
    monkeypatch.setattr(norm_quant, "NAMESPACE", "trl_fp8_test_vllm_norm")
    given = iter(timings) if timings is not None else None

    def timer(fn, reps=20):
        if call:
            fn()
        timed.append(1)
        return next(given) if given is not None else 1.0 + len(timed) % 2

    monkeypatch.setattr(norm_quant, "graph_time_us", timer)
    return timed


def _install(**kwargs):
    return norm_quant.install(256, "cpu", decode_tokens=4, **kwargs)


def _our_kernel_runs(op, calls: list) -> bool:
    """Whether `op` runs trl-fp8's kernel (counted in `calls`) rather than the reference (vLLM's stand-in); both give
    the reference bits."""
    calls.clear()
    case = _case(3, 256, seed=5)
    _assert_reference_bits(run_op(op, case), case)
    return bool(calls)


def test_install_keeps_vllms_kernel_where_the_bits_differ(monkeypatch):
    def off_by_one_scale(result, x, weight, scale, *args):
        _reference_op(result, x, weight, scale, *args)
        scale[0, 0] = torch.nextafter(scale[0, 0], torch.tensor(1.0))

    def residual_left_alone(result, x, weight, scale, epsilon, scale_ub, residual, *args):
        _reference_op(
            result, x, weight, scale, epsilon, scale_ub, None if residual is None else residual.clone(), *args
        )

    monkeypatch.setattr(norm_quant, "vllm_kernel_op", lambda: off_by_one_scale)
    choice = _install()
    assert not choice.installed and "does not reproduce vLLM's bits" in choice.reason
    assert "ieee numerics: 0 of 1792 FP8 values and 1 of 14 scales differ at (7, 256), groups of 128, residual " \
        "False, scale cap False, row-major scales" in choice.reason  # fmt: skip
    monkeypatch.setattr(norm_quant, "vllm_kernel_op", lambda: residual_left_alone)
    choice = _install()
    assert re.search(r"ieee numerics: 0 of 1792 FP8 values, 0 of 14 scales and 17\d\d of 1792 residual values differ "
                     r"at \(7, 256\), groups of 128, residual True", choice.reason), choice.reason  # fmt: skip
    assert norm_quant.installed() is None


def test_install_keeps_vllms_kernel_where_it_cannot_be_checked_or_is_slower(monkeypatch):
    """Same bits here, but no CUDA graph to time it in: any failure of a check leaves vLLM's kernel, saying why; and
    a kernel timed slower stays out under "auto"."""
    monkeypatch.setattr(norm_quant, "vllm_kernel_op", lambda: _reference_op)
    choice = _install()
    assert not choice.installed and choice.reason.startswith("trl-fp8's kernel could not be checked here")
    _patch_vllm_op(monkeypatch, _reference_op, timings=[1.0, 2.0])  # vLLM's kernel faster
    slower = _install()
    assert not slower.installed and slower.reason.startswith(
        "same bits, but not faster here: 2.0 us against vLLM's 1.0"
    )
    assert slower.numerics == "ieee" and norm_quant.installed() is None


def test_install_refuses_an_op_of_other_arguments_and_widths_off_the_groups(monkeypatch):
    library = torch.library.Library("trl_fp8_test_vllm_norm_e8m0", "DEF")  # noqa: TOR901
    try:  # a later vLLM's op, with power-of-two scales trl-fp8's kernel does not write
        library.define(
            "rms_norm_per_block_quant(Tensor! result, Tensor input, Tensor weight, Tensor! scale, float epsilon, "
            "Tensor? scale_ub, Tensor!? residual, int group_size, bool is_scale_transposed, bool scale_ue8m0=False) "
            "-> ()"
        )
        other = torch.ops.trl_fp8_test_vllm_norm_e8m0.rms_norm_per_block_quant.default
        monkeypatch.setattr(norm_quant, "vllm_kernel_op", lambda: other)
        choice = _install()
        assert not choice.installed and "takes other arguments" in choice.reason and "scale_ue8m0" in choice.reason
    finally:
        library._destroy()
    monkeypatch.setattr(norm_quant, "vllm_kernel_op", lambda: _reference_op)
    choice = norm_quant.install(256, "cpu", widths=(200,))
    assert not choice.installed and "(256, 200) are not all multiples of 128" in choice.reason


def test_installed_kernel_runs_the_op_with_the_reference_bits_until_uninstall(monkeypatch, op_with_vllms_schema):
    """Installed through the op (its schema has no defaults: the dispatcher hands the kernel all nine arguments),
    the op runs trl-fp8's kernel with the reference bits, residual included; `uninstall` gives the reference back."""
    timed = _patch_vllm_op(monkeypatch, op_with_vllms_schema)
    calls = count_kernel_calls(monkeypatch, norm_quant)
    try:
        choice = _install(scale_transposed=False)
        assert choice.installed and norm_quant.installed() is choice and len(timed) == 2, choice.reason
        assert "ieee numerics" in choice.reason and "at 4 x 256 (row-major scales, a call with the residual add and " \
            "one without)" in choice.reason  # fmt: skip
        assert _our_kernel_runs(op_with_vllms_schema, calls)
        assert _install(scale_transposed=False) is choice and len(timed) == 2  # the same settings: no new check
    finally:
        norm_quant.uninstall()
    assert norm_quant.installed() is None and not _our_kernel_runs(op_with_vllms_schema, calls)


def test_install_keeps_vllms_kernel_where_torch_refuses_the_registration(monkeypatch, op_with_vllms_schema):
    """torch refuses a second Python kernel for an op's dispatch key (torch 2.11: where another library registered
    one from Python): vLLM's kernel stays, and the reason says why, with what the checks measured."""
    _patch_vllm_op(monkeypatch, op_with_vllms_schema)

    def refuse(self, *args, **kwargs):
        raise RuntimeError("This is not allowed since there's already a kernel registered from python")

    monkeypatch.setattr(torch.library.Library, "impl", refuse)
    choice = _install()
    assert not choice.installed and norm_quant.installed() is None
    assert choice.reason.startswith("trl-fp8's kernel could not be registered for vLLM's op, so vLLM's stays")
    assert choice.numerics == "ieee" and choice.trl_fp8_us == 1.0


def test_trl_fp8_choice_installs_the_kernel_where_the_bits_match_whatever_its_speed(monkeypatch, op_with_vllms_schema):
    _patch_vllm_op(monkeypatch, op_with_vllms_schema, timings=[1.0, 2.0])
    try:
        choice = _install(require_faster=False)
        assert choice.installed and "2.0 us against vLLM's 1.0 us" in choice.reason
        assert "asked for whatever its speed" in choice.reason
    finally:
        norm_quant.uninstall()


def test_the_kernel_stays_while_any_engine_using_it_lives(monkeypatch, op_with_vllms_schema):
    """Two engines of the same settings share one check and one registration; an engine of other settings is
    checked anew; once the engines using the kernel are gone, vLLM's is back."""

    class Engine:
        pass

    timed = _patch_vllm_op(monkeypatch, op_with_vllms_schema)
    calls = count_kernel_calls(monkeypatch, norm_quant)
    try:
        first, second = Engine(), Engine()
        choice = _install(owner=first)
        assert choice.installed and _install(owner=second) is choice and len(timed) == 2
        del first
        gc.collect()
        assert norm_quant.installed() is choice and _our_kernel_runs(op_with_vllms_schema, calls)
        other = _install(scale_transposed=False, owner=second)  # another engine's settings: checked anew
        assert other.installed and len(timed) == 4 and norm_quant.in_force(other) is other
        replaced = norm_quant.in_force(choice)
        assert not replaced.installed and "another engine checked it at its own settings" in replaced.reason
        del second
        gc.collect()
        assert norm_quant.installed() is None and not _our_kernel_runs(op_with_vllms_schema, calls)
    finally:
        norm_quant.uninstall()


class _StandInEngine:
    """What `FP8VLLMGeneration._choose_norm_quant_kernel` reads of its engine: a dense model of hidden size 256."""

    def __init__(self, **settings):
        from trl_fp8.rollout.settings import RolloutSettings
        from trl_fp8.rollout.vllm.generation import RolloutReport

        config = Qwen3Config(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64)  # fmt: skip
        self.model = SimpleNamespace(config=config)
        self.accelerator = SimpleNamespace(device=torch.device("cpu"))
        self.settings, self.report = RolloutSettings(**settings), RolloutReport()


def test_an_engines_report_and_setting_choose_the_kernel(monkeypatch, op_with_vllms_schema):
    """The engine's start-up records its choice (`report.norm_quant_choice`, installed only while in force); an
    engine asking for vLLM's kernel (`vllm_norm_quant_kernel="vllm"`) gets it back; the act-quant choice is its own."""
    from trl_fp8.rollout.settings import RolloutSettings
    from trl_fp8.rollout.vllm import act_quant
    from trl_fp8.rollout.vllm.generation import FP8VLLMGeneration

    _patch_vllm_op(monkeypatch, op_with_vllms_schema, call=False)  # (not the interpreter at 256 x 256 for nothing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        engine = _StandInEngine()
        FP8VLLMGeneration._choose_norm_quant_kernel(engine)
        choice = engine.report.norm_quant_choice
        assert choice.installed and norm_quant.installed() is choice, choice.reason
        assert engine.report.checked_act_quant is None and act_quant.installed() is None
        vllm_engine = _StandInEngine(norm_quant_kernel="vllm")
        FP8VLLMGeneration._choose_norm_quant_kernel(vllm_engine)
        assert norm_quant.installed() is None and vllm_engine.report.norm_quant_choice is None
        gone = engine.report.norm_quant_choice
        assert not gone.installed and "vLLM's kernel runs the op again" in gone.reason
        assert gone.trl_fp8_us == choice.trl_fp8_us  # what the check measured
    finally:
        norm_quant.uninstall()
    tuning = FP8Tuning(vllm_norm_quant_kernel="vllm")
    args = SimpleNamespace(rollout_precision="fp8", fp8_power_of_two_scales=False, vllm_fp8_backend="auto",
                           vllm_fp8_moe_backend="auto", vllm_jit_cache_dir=None, vllm_token_ids_only=True)  # fmt: skip
    assert RolloutSettings.from_args(args, tuning).norm_quant_kernel == "vllm"
    assert RolloutSettings.from_args(args).norm_quant_kernel == "auto"


@pytest.mark.parametrize("kernel", ["vllm", "trl_fp8"])
def test_config_refuses_the_setting_where_it_would_do_nothing(kernel, monkeypatch):
    base = dict(output_dir="unused", use_cpu=True, bf16=False)
    monkeypatch.setattr("trl_fp8.config.check_vllm_version", lambda: "0.31.0")  # a config with use_vllm=True builds
    tuning = FP8Tuning(vllm_norm_quant_kernel=kernel)
    with pytest.raises(ValueError, match="vllm_norm_quant_kernel='.*'\\) sets up vLLM rollouts, but use_vllm=False"):
        tuning.check(FP8GRPOConfig(**base))
    with pytest.raises(ValueError, match="rollout_precision='bf16'. Drop vllm_norm_quant_kernel"):
        tuning.check(FP8GRPOConfig(**base, use_vllm=True, rollout_precision="bf16"))
    with pytest.raises(ValueError, match="`trl vllm-serve` server runs the kernels it was started with"):
        tuning.check(FP8GRPOConfig(**base, use_vllm=True, vllm_mode="server"))
    with pytest.raises(ValueError, match="vllm_norm_quant_kernel='cuda'\\) is unknown"):
        FP8Tuning(vllm_norm_quant_kernel="cuda")
