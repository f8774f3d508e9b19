"""vLLM's fused RMSNorm (+ residual add) + FP8 group quantization, run by trl-fp8's kernel where it gives the same bits,
faster.

vLLM's block-FP8 engines normalize and quantize the input of every block-FP8 linear fed by an RMSNorm (q/k/v and
gate/up after each layer's two norms, with the residual add or without) in one CUDA op,
`torch.ops._C.rms_norm_per_block_quant`, which the compile pass `fuse_norm_quant` (on by default) puts in the graph.
vLLM 0.31's kernel reads each row three times with one block per token, at about an eighth of the speed its bytes
allow. `install` re-registers the op's CUDA kernel with `trl_fp8.kernels.vllm_rms_norm_quant` (one read of the row
from memory) through `torch.library`, as `act_quant` does for the SiLU-and-mul quantization, only after checking on
this GPU, before the engine starts, that

1. the two kernels write the same bytes (FP8 values, scales, and the residual the op overwrites) on probe inputs at
   the engine's widths (`probe_inputs`): with and without the residual add, both scale layouts (and TMA-aligned
   column-major scales), token counts on both sides of 256 (where vLLM's block halves, which changes its order of
   summation), a scale cap (saturating values), groups of 64, a strided input, zero rows and groups whose scale is
   the floor (which also compiles the Triton variants the engine calls before vLLM captures its CUDA graphs); and
2. trl-fp8's kernel takes less GPU time at the engine's hidden size and a decode batch, with the residual add and
   without (both timed inside a CUDA graph, as vLLM's decode steps run them);

and, once registered, the probes give vLLM's bytes again through the op itself. Otherwise, or where a check fails to
run, vLLM's kernel stays, and the returned line says why. The check and the registration's lifetime per engine are
`rollout.vllm._override`'s (`InstallKey`, `in_force`, `uninstall`, as in `act_quant`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from trl_fp8.rollout.capacity import text_config
from trl_fp8.rollout.vllm import _override
from trl_fp8.rollout.vllm._compat import NORM_QUANT_OP, NORM_QUANT_SCHEMA, norm_quant_op
from trl_fp8.rollout.vllm._override import graph_time_us

__all__ = ["OP_NAME", "InstallKey", "NormQuantChoice", "ProbeCase", "engine_widths", "first_difference",
           "first_difference_between", "graph_time_us", "in_force", "install", "install_for_model", "installed",
           "probe_inputs", "run_op", "uninstall", "vllm_kernel_op"]  # fmt: skip

NAMESPACE, OP_NAME = NORM_QUANT_OP
vllm_kernel_op = norm_quant_op  # vLLM's op, or None where vLLM's compiled ops are not here
_installation = _override.Installation()  # our registration in this process, and the engines keeping it


@dataclass(frozen=True)
class InstallKey:
    """What an engine's check of the kernel depends on: a decision holds for another engine only with the same key."""

    device: str
    widths: tuple[int, ...]
    decode_tokens: int
    scale_transposed: bool
    require_faster: bool


@dataclass(frozen=True)
class NormQuantChoice(_override.KernelChoice):
    """What `install` decided: whether trl-fp8's kernel now runs the op, with which numerics, and why."""


class ProbeCase(NamedTuple):
    """One call of the op: `x [M, H]` (a row stride of its own allowed), its `weight [H]`, and the op's other
    arguments; `residual` is copied for each run (the op overwrites it); `tma_alignment` 4 pads the column-major
    scales' stride to a multiple of 4 rows, as vLLM's wrapper does for DeepGEMM."""

    x: torch.Tensor
    weight: torch.Tensor
    epsilon: float
    group_size: int = 128
    scale_ub: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    transposed: bool = True
    tma_alignment: int = 0


def run_op(op, case: ProbeCase, fresh_residual: bool = True) -> tuple[torch.Tensor, ...]:
    """`(out, scales)`, plus the residual after the call where the case has one, of `op` (vLLM's op or ours, same
    signature), buffers allocated as vLLM's wrapper allocates them (`vllm._custom_ops.rms_norm_per_block_quant`).
    `fresh_residual=False` runs on the case's residual itself (a timing loop), not a copy."""
    x = case.x
    m, hidden = x.shape
    groups = hidden // case.group_size
    out = torch.empty(m, hidden, device=x.device, dtype=torch.float8_e4m3fn)
    if case.transposed and case.tma_alignment:
        rows = -(-m // case.tma_alignment) * case.tma_alignment
        scales = torch.empty_strided((m, groups), (1, rows), device=x.device, dtype=torch.float32)
    elif case.transposed:
        scales = torch.empty(groups, m, device=x.device, dtype=torch.float32).t()
    else:
        scales = torch.empty(m, groups, device=x.device, dtype=torch.float32)
    residual = case.residual
    if residual is not None and fresh_residual:
        residual = residual.clone()
    op(out, x, case.weight, scales, case.epsilon, case.scale_ub, residual, case.group_size, case.transposed)
    return (out, scales) if residual is None else (out, scales, residual)


def _rows(m: int, hidden: int, g: torch.Generator, residual: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(x, residual)` float32 rows: ordinary values, a zero row (input and residual cancelling where there is a
    residual), a row a thousand times larger, and a group of tiny values whose scale is the floor."""
    x = torch.randn(m, hidden, generator=g) * 2
    r = torch.randn(m, hidden, generator=g) * 4 if residual else None
    x[:, hidden // 4 : hidden // 4 + 128] *= 1e-4
    if r is not None:
        r[:, hidden // 4 : hidden // 4 + 128] *= 1e-4
    if m > 2:
        x[1] *= 1e3
        if r is not None:
            r[1] *= 1e3
            x[0] = -r[0].bfloat16().float()
        else:
            x[0] = 0.0
    return x, r


def probe_inputs(widths, device, epsilon: float = 1e-6) -> list[ProbeCase]:
    """The probe cases at each of `widths` (the engine's: `engine_widths`): 7 and 300 tokens (vLLM's block of 512
    threads, then of 256, which sums the squares in another order; 20 where rows are too narrow to tell them apart),
    with the residual add and without, both scale layouts; and at the first width: 1 token (and 256 and 257, on both
    sides of the change), TMA-aligned scales, a scale cap that saturates, groups of 64, a strided input, another
    epsilon. Weights of ordinary size, with a group of large ones and a group of tiny ones."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def on(t):
        return None if t is None else t.to(device=device, dtype=torch.bfloat16)

    cases = []
    for i, hidden in enumerate(widths):
        w = 1 + 0.1 * torch.randn(hidden, generator=g)
        w[:128] *= 30.0
        w[128:256] *= 1e-3
        weight = on(w)
        halves = hidden // 4 > 256  # whether vLLM's block of 256 threads sums the row in another order than 512
        for m in (7, 300 if halves else 20):
            for residual in (False, True):
                x, r = _rows(m, hidden, g, residual)
                for transposed in (False, True):
                    cases.append(ProbeCase(on(x), weight, epsilon, residual=on(r), transposed=transposed))
        if i:
            continue
        for m in (1, 256, 257) if halves else (1,):
            x, r = _rows(m, hidden, g, True)
            cases.append(ProbeCase(on(x), weight, epsilon, residual=on(r)))
        x, r = _rows(7, hidden, g, True)
        cases.append(ProbeCase(on(x), weight, epsilon, residual=on(r), tma_alignment=4))
        cap = torch.tensor(0.01, device=device)
        cases.append(ProbeCase(on(x), weight, epsilon, scale_ub=cap, residual=on(r)))
        cases.append(ProbeCase(on(x), weight, epsilon, group_size=64, residual=on(r), transposed=False))
        strided = on(torch.nn.functional.pad(x, (0, 128)))[:, :hidden]  # rows hidden + 128 apart
        cases.append(ProbeCase(strided, weight, epsilon, residual=on(r)))
        cases.append(ProbeCase(on(x), weight, 1e-5 if epsilon != 1e-5 else 1e-6, residual=on(r)))
    return cases


def _compare(outputs, references, case: ProbeCase) -> str | None:
    names = ("FP8 values", "scales", "residual values")[: len(outputs)]
    why = _override.count_differences(outputs, references, names)
    if why is None:
        return None
    x = case.x
    stride = "" if x.stride(0) == x.shape[1] else f" (rows {x.stride(0)} apart)"
    layout = "row-major" if not case.transposed else "TMA-aligned" if case.tma_alignment else "column-major"
    return (f"{why} differ at {tuple(x.shape)}{stride}, groups of {case.group_size}, residual "
            f"{case.residual is not None}, scale cap {case.scale_ub is not None}, {layout} scales, epsilon "
            f"{case.epsilon:g}")  # fmt: skip


def first_difference(numerics: str, vllm_op, cases) -> str | None:
    """None when trl-fp8's kernel with `numerics` writes `vllm_op`'s bytes on every case, else what differs first."""
    return first_difference_between(_kernel(numerics), cases, [run_op(vllm_op, case) for case in cases])


def first_difference_between(op, cases, references) -> str | None:
    """None when `op` writes the bytes of `references` (`run_op` results, one per case) on every case, else what
    differs first."""
    return _override.first_difference(run_op, _compare, op, cases, references)


def _kernel(numerics: str):
    """trl-fp8's kernel with vLLM's op's signature (the schema has no defaults: the dispatcher passes all nine)."""
    from trl_fp8.kernels.vllm_rms_norm_quant import rms_norm_per_block_quant

    def ours(out, x, weight, scales, epsilon, scale_ub, residual, group_size, is_scale_transposed):
        rms_norm_per_block_quant(
            out, x, weight, scales, epsilon, scale_ub, residual, group_size, is_scale_transposed, numerics=numerics
        )

    return ours


def _numerics() -> tuple[str, ...]:
    from trl_fp8.kernels.vllm_rms_norm_quant import NUMERICS  # (Triton, imported where a check runs)

    return NUMERICS


def _other_arguments(vllm_op) -> str | None:
    """None when `vllm_op` takes the arguments of `NORM_QUANT_SCHEMA` (the ones trl-fp8's kernel takes), else
    what it takes. (An op without a schema, a stand-in, passes.)"""
    schema = getattr(vllm_op, "_schema", None)
    if schema is None:
        return None
    names = [arg.name for arg in schema.arguments]
    expected = [
        part.split("=")[0].split()[-1] for part in NORM_QUANT_SCHEMA[1 : NORM_QUANT_SCHEMA.index(")")].split(",")
    ]
    return None if names == expected else ", ".join(names)


def install(
    hidden_size: int,
    device,
    *,
    widths: tuple[int, ...] = (),
    epsilon: float = 1e-6,
    decode_tokens: int = 256,
    scale_transposed: bool = True,
    require_faster: bool = True,
    owner: object | None = None,
) -> NormQuantChoice:
    """Run vLLM's `rms_norm_per_block_quant` on trl-fp8's kernel in this process, where it gives vLLM's bits on
    `device` at the model's `hidden_size` and its other normalized `widths` (an MLA model's `q_lora_rank` and
    `kv_lora_rank`), and is faster at `decode_tokens` x `hidden_size` with the scales in the layout the engine asks
    for (`scale_transposed`: column-major, as DeepGEMM and CUTLASS take them; the probes check both layouts); call it
    before the engine is built. `require_faster=False` (`FP8Tuning(vllm_norm_quant_kernel="trl_fp8")`) installs it
    wherever the bits match, faster or not.

    The same engine settings (`InstallKey`) get the decision in force; other settings are checked anew, with vLLM's
    kernel back first. With `owner` (the engine's rollout object), ours stays while `owner` or another engine using
    it lives, and vLLM's comes back when the last is gone; without, until `uninstall`, which gives vLLM its kernel
    back at once."""
    all_widths = tuple(dict.fromkeys((hidden_size, *widths)))
    key = InstallKey(str(torch.device(device)), all_widths, decode_tokens, scale_transposed, require_faster)
    if (current := _installation.current(key, owner)) is not None:
        return current
    uninstall()  # an engine of other settings is checked against vLLM's own kernel
    vllm_op = vllm_kernel_op()
    if vllm_op is None:
        return NormQuantChoice(False, f"vLLM's torch.ops._C.{OP_NAME} is not here (no vLLM, or a vLLM without it)")
    if (other := _other_arguments(vllm_op)) is not None:
        return NormQuantChoice(False, f"vLLM's {OP_NAME} takes other arguments than trl-fp8's kernel ({other})")
    if any(width % 128 for width in all_widths):
        return NormQuantChoice(False, f"the normalized widths {all_widths} are not all multiples of 128")

    def timed(vllm_op, ours):
        g = torch.Generator(device="cpu").manual_seed(1)
        x, r = (torch.randn(2, decode_tokens, hidden_size, generator=g) * 2).to(device=device, dtype=torch.bfloat16)
        weight = torch.ones(hidden_size, device=device, dtype=torch.bfloat16)
        plain = ProbeCase(x, weight, epsilon, transposed=scale_transposed)
        added = plain._replace(residual=r)

        def call(op):
            return lambda: (run_op(op, plain), run_op(op, added, fresh_residual=False))

        return call(vllm_op), call(ours)

    layout = "column" if scale_transposed else "row"
    check = _override.OpCheck(
        NAMESPACE, OP_NAME, _numerics, _kernel, lambda: probe_inputs(all_widths, device, epsilon), run_op, _compare,
        timed, graph_time_us, f"{decode_tokens} x {hidden_size}",
        f"{layout}-major scales, a call with the residual add and one without",
    )  # fmt: skip
    return _override.check_and_install(
        _installation, check, vllm_op, device, key, require_faster=require_faster, owner=owner,
        choice_type=NormQuantChoice,
    )  # fmt: skip


def engine_widths(config) -> tuple[int, tuple[int, ...], float]:
    """`(hidden_size, other widths, epsilon)` of the RMSNorms that feed a model's linears (this transformers config):
    the hidden size, and an MLA model's `q_lora_rank` and `kv_lora_rank` (its latent norms)."""
    text = text_config(config)
    others = tuple(getattr(text, name) for name in ("q_lora_rank", "kv_lora_rank") if getattr(text, name, None))
    return text.hidden_size, others, float(getattr(text, "rms_norm_eps", 1e-6))


def install_for_model(model, device, *, require_faster: bool = True, owner: object | None = None) -> NormQuantChoice:
    """`install` at `model`'s normalized widths and epsilon (`engine_widths`) and a decode step of 256 sequences,
    for the engine of `owner`."""
    hidden_size, widths, epsilon = engine_widths(model.config)
    return install(
        hidden_size, device, widths=widths, epsilon=epsilon, require_faster=require_faster, owner=owner
    )  # fmt: skip


def installed() -> NormQuantChoice | None:
    """The kernel choice in force in this process, or None when `install` has not replaced vLLM's."""
    return _installation.installed()


def in_force(choice: NormQuantChoice | None) -> NormQuantChoice | None:
    """`choice` (an engine's `install`) as it holds now: an installation no longer in force (vLLM's kernel back, or
    another engine's check in its place) says so, with what its check measured."""
    return _installation.in_force(choice)


def uninstall() -> None:
    """Give the op its vLLM kernel back (destroying our registration restores the one it covered), whatever engines
    use ours."""
    _installation.uninstall()
