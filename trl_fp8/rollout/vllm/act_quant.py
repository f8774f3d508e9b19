"""vLLM's fused SiLU-and-mul + FP8 group quantization, run by trl-fp8's kernel where it gives the same bits, faster.

vLLM's block-FP8 engines quantize `down_proj`'s input with one CUDA op, `torch.ops._C.silu_and_mul_per_block_quant`
(the compile pass `fuse_act_quant` puts it in the dense MLP, and vLLM's Triton fused MoE calls it between the two
expert GEMMs). vLLM 0.26 runs it far below the speed its bytes allow (docs/contributing/engineering-notes.md, "The
activation quantization kernel, in detail"). `install` re-registers the op's CUDA kernel with
`trl_fp8.kernels.vllm_silu_mul_quant` through `torch.library`, so every caller (compiled graphs and their CUDA
graphs included) runs it, but only after checking on this GPU, before the engine starts, that

1. the two kernels write the same bytes (FP8 values and scales) on probe inputs covering both scale layouts,
   scale caps, zero groups, saturating and underflowing values, and the token counts that select each compiled
   variant of the Triton kernel (which also compiles them all before vLLM captures its CUDA graphs); and
2. trl-fp8's kernel takes less GPU time at the engine's MLP width, a decode batch and the engine's scale layout
   (both timed inside a CUDA graph, as vLLM's decode steps run them);

and, once registered, the probes give vLLM's bytes again through the op itself (the dispatcher passes a Python
kernel its arguments its own way). Otherwise, or where a check fails to run, vLLM's kernel stays, and the returned
line says why.

The registration covers the op in the whole process, so the decision is kept per engine: an engine of another
device, width, scale layout or speed requirement is checked anew against vLLM's own kernel (`InstallKey`); an engine
of the same settings shares the decision in force; an engine asking for vLLM's kernel gets it back (`uninstall`), and
so does the process once no live engine uses ours (`in_force`: whether an engine's choice still holds). This is a
small patch of vLLM's behaviour written so that it could go upstream as a kernel change: no value changes, only the
time. The check and the registration's lifetime are `rollout.vllm._override`'s, shared with `norm_quant`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_fp8.rollout.capacity import expert_count, text_config
from trl_fp8.rollout.vllm import _override
from trl_fp8.rollout.vllm._compat import SILU_MUL_QUANT_OP, silu_mul_quant_op
from trl_fp8.rollout.vllm._override import graph_time_us

__all__ = ["OP_NAME", "InstallKey", "SiluQuantChoice", "first_difference", "first_difference_between",
           "graph_time_us", "in_force", "install", "install_for_model", "installed", "mlp_shape", "probe_inputs",
           "run_op", "uninstall", "vllm_kernel_op"]  # fmt: skip

NAMESPACE, OP_NAME = SILU_MUL_QUANT_OP
vllm_kernel_op = silu_mul_quant_op  # vLLM's op, or None where vLLM's compiled ops are not here
_installation = _override.Installation()  # our registration in this process, and the engines keeping it


@dataclass(frozen=True)
class InstallKey:
    """What an engine's check of the kernel depends on: a decision holds for another engine only with the same key."""

    device: str
    width: int
    decode_tokens: int
    scale_transposed: bool
    require_faster: bool


@dataclass(frozen=True)
class SiluQuantChoice(_override.KernelChoice):
    """What `install` decided: whether trl-fp8's kernel now runs the op, with which numerics, and why."""


def run_op(op, x: torch.Tensor, group_size: int, scale_ub, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(out, scales)` of `op` (vLLM's op or ours, same signature) on `x [M, 2N]`, buffers allocated as vLLM's
    wrapper allocates them (`vllm._custom_ops.silu_and_mul_per_block_quant`)."""
    m, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(m, n, device=x.device, dtype=torch.float8_e4m3fn)
    if transposed:
        scales = torch.empty(n // group_size, m, device=x.device, dtype=torch.float32).t()
    else:
        scales = torch.empty(m, n // group_size, device=x.device, dtype=torch.float32)
    op(out, x, scales, group_size, scale_ub, transposed)
    return out, scales


def probe_inputs(width: int, device) -> list[tuple[torch.Tensor, int, torch.Tensor | None, bool]]:
    """`(x [M, 2 * N], group_size, scale_ub, transposed)` cases: token counts 1, 7, 16 and 200 (Triton's
    specializations of M: one, a multiple of 16, neither), MLP widths 256 and `width`, both scale layouts, with and
    without a scale cap, groups of 128 and 64; values of ordinary size, large (SiLU's exp over- and underflowing),
    tiny (the scale floor), and all-zero groups."""
    g = torch.Generator(device="cpu").manual_seed(0)
    cases = []
    for i, (m, n) in enumerate([(1, 256), (7, width), (16, 256), (200, width)]):
        x = torch.randn(m, 2 * n, generator=g)
        x[:, : n // 4] *= 40.0  # gates far into both tails of exp
        x[:, n // 4 : n // 2] *= 1e-5  # groups whose scale is the floor
        x[0, n // 2 : n // 2 + 128] = 0.0  # an all-zero group
        x = x.to(device=device, dtype=torch.bfloat16)
        ub = torch.tensor(0.05, device=device) if i % 2 else None
        for transposed in (False, True):
            cases.append((x, 128, ub, transposed))
        cases.append((x, 64, None, bool(i % 2)))
    return cases


def _run_case(op, case) -> tuple[torch.Tensor, torch.Tensor]:
    return run_op(op, *case)


def _compare(outputs, references, case) -> str | None:
    x, group_size, ub, transposed = case
    why = _override.count_differences(outputs, references, ("FP8 values", "scales"))
    if why is None:
        return None
    return f"{why} differ at {tuple(x.shape)}, groups of {group_size}, scale cap {ub is not None}, transposed {transposed}"


def first_difference(numerics: str, vllm_op, cases) -> str | None:
    """None when trl-fp8's kernel with `numerics` writes `vllm_op`'s bytes on every case, else what differs first."""
    return first_difference_between(_kernel(numerics), cases, [run_op(vllm_op, *case) for case in cases])


def first_difference_between(op, cases, references) -> str | None:
    """None when `op` writes the bytes of `references` (`run_op` results, one per case) on every case, else what
    differs first."""
    return _override.first_difference(_run_case, _compare, op, cases, references)


def _kernel(numerics: str):
    """trl-fp8's kernel with vLLM's op's signature, defaults included: the dispatcher hands a Python kernel only the
    leading arguments up to the last one that differs from its schema default (vLLM's Triton fused MoE passes
    `scale_ub=None, is_scale_transposed=False`, which arrive as nothing)."""
    from trl_fp8.kernels.vllm_silu_mul_quant import silu_and_mul_per_block_quant

    def ours(out, x, scales, group_size, scale_ub=None, is_scale_transposed=False):
        silu_and_mul_per_block_quant(out, x, scales, group_size, scale_ub, is_scale_transposed, numerics=numerics)

    return ours


def _numerics() -> tuple[str, ...]:
    from trl_fp8.kernels.vllm_silu_mul_quant import NUMERICS  # (Triton, imported where a check runs)

    return NUMERICS


def install(
    width: int,
    device,
    *,
    decode_tokens: int = 256,
    scale_transposed: bool = True,
    require_faster: bool = True,
    owner: object | None = None,
) -> SiluQuantChoice:
    """Run vLLM's `silu_and_mul_per_block_quant` on trl-fp8's kernel in this process, where it gives vLLM's bits on
    `device` and is faster at MLP width `width` (the model's `intermediate_size`) and `decode_tokens` tokens with
    the scales in the layout the engine asks for (`scale_transposed`: column-major, as vLLM's compiled dense MLPs
    do; row-major, as its Triton fused MoE does); call it before the engine is built. `require_faster=False`
    (`FP8Tuning(vllm_act_quant_kernel="trl_fp8")`) installs it wherever the bits match, faster or not.

    The same engine settings (`InstallKey`) get the decision in force; other settings are checked anew, with vLLM's
    kernel back first. With `owner` (the engine's rollout object), ours stays while `owner` or another engine using
    it lives, and vLLM's comes back when the last is gone; without, until `uninstall`, which gives vLLM its kernel
    back at once."""
    key = InstallKey(str(torch.device(device)), width, decode_tokens, scale_transposed, require_faster)
    if (current := _installation.current(key, owner)) is not None:
        return current
    uninstall()  # an engine of other settings is checked against vLLM's own kernel
    vllm_op = vllm_kernel_op()
    if vllm_op is None:
        return SiluQuantChoice(False, f"vLLM's torch.ops._C.{OP_NAME} is not here (no vLLM, or a vLLM without it)")
    if width % 128:
        return SiluQuantChoice(False, f"MLP width {width} is not a multiple of 128")

    def timed(vllm_op, ours):
        x = torch.randn(decode_tokens, 2 * width, device=device, dtype=torch.bfloat16)
        return (lambda: run_op(vllm_op, x, 128, None, scale_transposed)), (
            lambda: run_op(ours, x, 128, None, scale_transposed)
        )

    check = _override.OpCheck(
        NAMESPACE, OP_NAME, _numerics, _kernel, lambda: probe_inputs(width, device), _run_case, _compare, timed,
        graph_time_us, f"{decode_tokens} x {width}", f"{'column' if scale_transposed else 'row'}-major scales",
    )  # fmt: skip
    return _override.check_and_install(
        _installation, check, vllm_op, device, key, require_faster=require_faster, owner=owner,
        choice_type=SiluQuantChoice,
    )  # fmt: skip


def mlp_shape(config, decode_sequences: int = 256) -> tuple[int, int]:
    """`(width, rows)` of the op's calls in a decode step of `decode_sequences` sequences of a model with this
    (transformers) config: the experts' width and routed rows for a mixture of experts, else the MLP's."""
    text = text_config(config)
    if expert_count(config) and getattr(text, "moe_intermediate_size", None):
        return text.moe_intermediate_size, decode_sequences * getattr(text, "num_experts_per_tok", 1)
    return text.intermediate_size, decode_sequences


def install_for_model(model, device, *, require_faster: bool = True, owner: object | None = None) -> SiluQuantChoice:
    """`install` at the shape and scale layout of `model`'s decode steps (`mlp_shape`; vLLM's Triton fused MoE asks
    for row-major scales), for the engine of `owner`."""
    width, rows = mlp_shape(model.config)
    return install(
        width, device, decode_tokens=rows, scale_transposed=not expert_count(model.config),
        require_faster=require_faster, owner=owner,
    )  # fmt: skip


def installed() -> SiluQuantChoice | None:
    """The kernel choice in force in this process, or None when `install` has not replaced vLLM's."""
    return _installation.installed()


def in_force(choice: SiluQuantChoice | None) -> SiluQuantChoice | None:
    """`choice` (an engine's `install`) as it holds now: an installation no longer in force (vLLM's kernel back, or
    another engine's check in its place) says so, with what its check measured."""
    return _installation.in_force(choice)


def uninstall() -> None:
    """Give the op its vLLM kernel back (destroying our registration restores the one it covered), whatever engines
    use ours."""
    _installation.uninstall()
