"""`FP8Experts`: the fused experts of a transformers mixture-of-experts layer, with every GEMM in blockwise FP8.

transformers 5 keeps a MoE layer's experts as two 3-D parameters, `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`
(gate and up concatenated along rows), in a module whose forward routes each token to its top-k experts. Converted,
the same module (same parameters, same `state_dict` keys, BF16 master weights) runs each expert's two projections with
the dense layer's blockwise FP8 math (`nn.linear._BlockwiseFP8Matmul`: 128x128 weight blocks per expert, 1x128
activation and gradient groups, FProp, DGrad and WGrad in FP8) on the tokens routed to it. A weight block never
spans two experts (their row counts are multiples of 128), so quantizing `[E, N, K]` as one `[E*N, K]` matrix gives
each expert's own blocks, and the export splits them back into per-expert tensors.

On the GPU backends (`scaled_mm`, `deepgemm`) a projection runs on grouped kernels (`_GroupedExpertsFP8Matmul`):
one layout (`kernels.grouped_gemm.GroupedRows`, each expert's segment padded to a multiple of 128 rows) is built per
layer call by one kernel from the routing counts, which never leave the GPU (no host sync in a MoE layer); the
quantizer reads the sorted rows straight into that layout, in both layouts; FProp and DGrad run on DeepGEMM's
m-grouped GEMM (or `kernels.grouped_gemm.m_grouped_gemm`: `FP8LinearConfig.experts_gemm`), WGrad on
`kernels.grouped_gemm.k_grouped_gemm` (with `FP8LinearConfig.fuse_wgrad_accumulation`, adding into an existing
`.grad` in place: `gradient_to_add_into`); DGrad's weights are moved per expert into the transposed layout from the
blocks the weight cache holds (`kernels.weight_quant.transpose_expert_weights`), or re-quantized there without it. Per
projection that is 2 launches forward and 4 backward, whatever the number of experts. gate_up's quantizer reads the
tokens themselves (`kernels.grouped_gemm.token_maps` names each padded row's token), its input gradient sums each
token's rows in one pass, and the router-weighted sum of each token's expert outputs is one pass each way
(`kernels.moe_combine`). The FP8 operands are the loop's bit for bit (a 128-row group never spans two
experts), so only the fp32 summation order differs. Speed against BF16: docs/moe.md.

Elsewhere (the emulation on CPU) all experts of a projection run as a loop in one autograd node
(`_ExpertsFP8Matmul`): each expert's GEMMs are the dense layer's, bit for bit, without an autograd node per expert
(a Python autograd node costs more host time than a blockwise GEMM's launch: docs/contributing/benchmark-details.md).
That loop over
experts is the exact reference the grouped kernels must equal (tests/test_grouped_gemm.py runs them in Triton's CPU
interpreter against it); experts that receive no token are skipped, uneven token counts are the normal case. The
router stays in high precision (an FP8 router flips top-k choices), and so does anything of a layout this module does
not handle (`expert_layout_problem` names why).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from trl_fp8.config import BLOCK, BLOCKWISE, FP8LinearConfig
from trl_fp8.distributed import gather_quantized, is_sharded
from trl_fp8.nn.linear import blockwise_backward
from trl_fp8.nn.weight_cache import FP8WeightCacheMixin, caches_now, is_own_parameter, weight_cache_key
from trl_fp8.ops import backend_name, select_ops

__all__ = ["FP8Experts", "expert_layout_problem", "is_experts_module"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# Names transformers gives per-expert weights stacked as `[E, N, K]` (the fused layout and its relatives, e.g.
# Nemotron-H's ungated `up_proj` / `down_proj`).
EXPERT_PARAMETER_NAMES = frozenset({*EXPERT_WEIGHTS, "gate_proj", "up_proj"})


def is_experts_module(module: nn.Module) -> bool:
    """A mixture-of-experts experts module, converted or not: its own 3-D parameters are per-expert weights stacked
    along a leading expert dim, named as transformers names them (`gate_up_proj`, `down_proj`, ...) or sized by its
    `num_experts`. Having a 3-D parameter is not enough: convolutions (Mamba's, LFM2's, the gated delta net's
    `conv1d`) and other 3-D weights are not experts, and stay in high precision as modules that are not linear."""
    if isinstance(module, FP8Experts):
        return True
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    stacked = {name: p for name, p in module.named_parameters(recurse=False) if p.ndim == 3}
    num_experts = getattr(module, "num_experts", None)
    by_count = isinstance(num_experts, int) and any(p.shape[0] == num_experts for p in stacked.values())
    return by_count or any(name in EXPERT_PARAMETER_NAMES for name in stacked)


def expert_layout_problem(module: nn.Module, dim_multiple: int = BLOCK) -> str | None:
    """Why `module`'s experts cannot run as FP8 experts, or None: the layout must be transformers' default gated one
    (`gate_up_proj [E, 2I, H]` with gate then up, `down_proj [E, H, I]`, no biases, no transposition, no norm after
    the experts) with I and H multiples of 128."""
    name = type(module).__name__
    params = dict(module.named_parameters(recurse=False))
    if set(params) != set(EXPERT_WEIGHTS):
        return f"{name} holds {sorted(params)}, not the fused gate_up_proj / down_proj layout"
    flags = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
             "has_post_expert_norm": False}  # fmt: skip
    off = [f"{k}={getattr(module, k, None)}" for k, v in flags.items() if getattr(module, k, v) != v]
    if off:
        return f"{name} has an expert layout trl-fp8 does not run in FP8 ({', '.join(off)})"
    if not (isinstance(getattr(module, "num_experts", None), int) and callable(getattr(module, "act_fn", None))):
        return f"{name} has no num_experts / act_fn attributes to route and gate with"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None:
        from transformers.integrations.moe import _default_apply_gate

        if apply_gate is not _default_apply_gate:
            return f"{name} applies its own gating function"
    gate_up, down = params["gate_up_proj"], params["down_proj"]
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return f"{name}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not pair up"
    if (two_i // 2) % dim_multiple or h % dim_multiple:
        return f"dims not multiples of {dim_multiple} (intermediate {two_i // 2}, hidden {h})"
    return None


def _runs_grouped(ops) -> bool:
    """Whether a backend's experts run on the grouped Triton kernels: the real GPU backends do, the emulation loops."""
    return backend_name(ops) in ("scaled_mm", "deep_gemm")


class FP8Experts(FP8WeightCacheMixin, nn.Module):
    """The FP8 forward of a transformers fused-experts module (mixed into its own class by `convert_`)."""

    fp8_config: FP8LinearConfig
    # Whether projections run on the grouped kernels: None picks by backend (`_runs_grouped`); tests set True to run
    # them on CPU in Triton's interpreter against the loop.
    _grouped_kernels: bool | None = None

    @classmethod
    def convert_(cls, module: nn.Module, config: FP8LinearConfig) -> nn.Module:
        """Turn `module` (an experts module `expert_layout_problem` accepts) into FP8 experts in place."""
        if config.recipe != BLOCKWISE:
            raise ValueError(f"FP8 experts implement the blockwise recipe; got recipe={config.recipe!r}.")
        module.__class__ = _fp8_class(type(module))
        module.fp8_config = config
        module._init_weight_cache()
        return module

    def _reset_weight_cache(self) -> None:
        self._fp8_weight_cache: dict[str, tuple[tuple, tuple[torch.Tensor, torch.Tensor]]] = {}  # by weight name

    def _cached_fp8_tensors(self) -> list[torch.Tensor]:
        return [t for _key, value in self._fp8_weight_cache.values() for t in value]

    def quantized_expert_weight(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`(q [E, N, K], scale_inv [E, N/128, K/128])` of `gate_up_proj` or `down_proj`: each expert's 128x128 blocks,
        exactly as the forward multiplies them (what the vLLM sync and the export send)."""
        weight = getattr(self, name)
        if is_sharded(weight):  # FSDP2 between forwards: whole experts per rank; their FP8 blocks are gathered
            return gather_quantized(weight, self._quantize_stack, rows_per_block=1)
        # Only the module's own parameter is cached: LoRA's `target_parameters` hands each forward a new `W + BA`
        # tensor, which a new adapter state may get at the address of the last one (`nn.weight_cache.is_own_parameter`).
        if not (self.fp8_config.cache_quantized_weight and is_own_parameter(self, name, weight)):
            return self._quantize_stack(weight)
        key = weight_cache_key(weight, self._fp8_invalidations)
        cached = self._fp8_weight_cache.get(name)
        value = cached[1] if cached is not None and cached[0] == key else self._quantize_stack(weight)
        if caches_now(self.fp8_config, weight):
            self._fp8_weight_cache[name] = (key, value)
        else:  # a forward recording gradients with cache_with_grad=False: the training step's peak holds no copy
            self._fp8_weight_cache.pop(name, None)
        return value

    def _quantize_stack(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert's 128x128 blocks of a stacked `[E, N, K]` weight: `(q [E, N, K], scale_inv [E, N/128, K/128])`."""
        e, n, k = weight.shape
        ops = select_ops(self.fp8_config, weight.device)
        with torch.no_grad():
            q, s = ops.quantize_weight(weight.detach().reshape(e * n, k),
                                       power_of_two_scales=self.fp8_config.power_of_two_scales)  # fmt: skip
        return q.reshape(e, n, k), s.reshape(e, n // BLOCK, k // BLOCK)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        num_tokens = hidden_states.shape[0]
        top_k = top_k_index.shape[-1]
        expert_ids = top_k_index.reshape(-1)
        order = torch.argsort(expert_ids, stable=True)  # token-expert pairs grouped by expert, token order kept
        counts = expert_counts(expert_ids, self.num_experts)
        if not (self._grouped_kernels or (
            self._grouped_kernels is None and _runs_grouped(select_ops(self.fp8_config, self.gate_up_proj.device))
        )):  # fmt: skip
            return self._forward_loop(hidden_states, order, counts.tolist(), top_k, top_k_weights)
        from trl_fp8.kernels.grouped_gemm import GroupedRows, token_maps

        # The padded layout both projections share, built on the device: the host never waits for the GPU here.
        rows = GroupedRows(counts, hidden_states.device, num_rows=expert_ids.numel())
        # Each (token, slot)'s row in sorted order and in the padded layout; each padded row's token (-1: padding).
        with _on_device(hidden_states):
            pos, slot_rows, token_of_row = token_maps(rows, order, top_k)
        # gate_up reads the tokens through `token_of_row` (no gathered copy) and sums each token's k rows of its input
        # gradient in one pass; the weighted sum at the end is one pass each way too (kernels.moe_combine).
        gate_up = self._experts_linear(hidden_states, "gate_up_proj", None, rows, gather=(token_of_row, slot_rows))
        gate, up = gate_up.chunk(2, dim=-1)
        out = self._experts_linear(self.act_fn(gate) * up, "down_proj", None, rows)
        weights = top_k_weights.reshape(num_tokens, top_k).contiguous()
        return _CombineExperts.apply(out, weights, pos, hidden_states.dtype)

    def _forward_loop(self, hidden_states, order, counts: list[int], top_k: int, top_k_weights) -> torch.Tensor:
        """The experts as a loop over `counts` in one autograd node per projection: the exact reference (emulation)."""
        num_tokens, hidden = hidden_states.shape
        x = hidden_states[order // top_k]
        gate_up = self._experts_linear(x, "gate_up_proj", counts)
        gate, up = gate_up.chunk(2, dim=-1)
        out = self._experts_linear(self.act_fn(gate) * up, "down_proj", counts)
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        # Back to token order, then the sum over each token's k experts in fp32 (as transformers' grouped path does).
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(hidden_states.dtype)

    def _experts_linear(self, x: torch.Tensor, name: str, counts, rows=None, gather=None) -> torch.Tensor:
        """`x[rows of e] @ W[e].T` for every expert e with tokens, in blockwise FP8; the gradient lands in the 3-D
        parameter. With `rows` (a `GroupedRows` layout of the counts) on the grouped kernels, else a loop over
        `counts` (host integers; with `rows` they are not read). `gather`: `x` holds the tokens, read through
        `(token of each padded row, padded row of each token's slot)` (`_GroupedExpertsFP8Matmul`)."""
        weight = getattr(self, name)
        q, s = self.quantized_expert_weight(name)
        cfg = self.fp8_config
        pow2, grad, into_grad = cfg.power_of_two_scales, torch.is_grad_enabled(), cfg.fuse_wgrad_accumulation
        if rows is not None:
            kernel = grouped_gemm_kernel(cfg.experts_gemm, x)
            # Blocks the weight cache holds anyway may be kept for DGrad at no cost in memory (transposed there).
            cached = self._fp8_weight_cache.get(name, (None, None))[1]
            held = cached is not None and cached[0] is q
            return _GroupedExpertsFP8Matmul.apply(x, weight, q, s, rows, kernel, pow2, grad, into_grad, gather, held)
        ops = select_ops(cfg, weight.device)
        return _ExpertsFP8Matmul.apply(x, weight, q, s, tuple(counts), ops, pow2, grad, into_grad)

    def extra_repr(self) -> str:
        return f"{self.num_experts} experts, fp8={self.fp8_config.recipe}"


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many routed rows each expert gets, `[num_experts]` int64 on the ids' device, without the host waiting for
    the GPU: `torch.bincount` on CUDA copies the ids' minimum and maximum to the host (two syncs in every MoE layer,
    which stop the host from queueing work ahead of the GPU). Ids must lie in `[0, num_experts)`, as top-k gives."""
    return torch.zeros(num_experts, device=expert_ids.device, dtype=torch.int64).scatter_add_(
        0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.int64)
    )


def gradient_to_add_into(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight.grad`, where a backward may add the weight's gradient to it in place and return None instead of the
    gradient (`FP8LinearConfig.fuse_wgrad_accumulation`): a dense tensor of the weight's shape, dtype and device,
    contiguous, on a weight that no Python hook watches, in one process, outside double backward and compiled graphs.
    None elsewhere: the gradient is returned, and autograd adds it (and runs whatever hooks it has)."""
    grad = weight.grad
    if grad is None or torch.is_grad_enabled() or torch.compiler.is_compiling() or is_sharded(weight):
        return None
    if grad.layout != torch.strided or grad.shape != weight.shape or grad.dtype != weight.dtype:
        return None
    if grad.device != weight.device or not grad.is_contiguous():
        return None
    if getattr(weight, "_post_accumulate_grad_hooks", None) or getattr(weight, "_backward_hooks", None):
        return None
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:  # DDP's hooks are not visible
        return None
    return grad


class _ExpertsFP8Matmul(torch.autograd.Function):
    """`y[rows of e] = x[rows of e] @ W[e].T` for every expert e, the rows of `x` grouped by expert (`counts`), in
    one autograd node. Per expert it runs exactly the dense layer's math (`nn.linear._BlockwiseFP8Matmul` and
    `blockwise_backward`): 1x128 groups of the expert's own rows, its 128x128 weight blocks `q[e]`, `s[e]`."""

    @staticmethod
    def forward(ctx, x, weight, q, s, counts, ops, pow2: bool, grad_enabled: bool, add_into_grad: bool = False):
        # (grad mode is off inside forward, so the caller says whether a backward can follow)
        wgrad = grad_enabled and ctx.needs_input_grad[1]
        outs, saved, start = [], [], 0
        for e, n in enumerate(counts):
            if not n:
                continue
            act = ops.quantize_act(x[start : start + n], rows=True, cols=wgrad, power_of_two_scales=pow2)
            outs.append(ops.gemm(act.q, act.scale_inv, q[e], s[e], True, x.dtype)[:n])
            if wgrad:  # the FP8 x.T WGrad needs, not the BF16 rows
                saved += [act.qt, act.scale_inv_t]
            start += n
        ctx.save_for_backward(weight, *saved)
        ctx.counts, ctx.ops, ctx.pow2, ctx.x_dtype, ctx.add_into_grad = counts, ops, pow2, x.dtype, add_into_grad
        return torch.cat(outs) if outs else x.new_zeros((0, weight.shape[1]))

    @staticmethod
    def backward(ctx, grad_out):
        weight, *saved = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_xs = []
        into = gradient_to_add_into(weight) if need_w and ctx.add_into_grad else None
        # experts without tokens get no gradient
        grad_w = into if into is not None else torch.zeros_like(weight) if need_w else None
        start = 0
        for e, n in enumerate(ctx.counts):
            if not n:
                continue
            saved_x, saved = (saved[:2], saved[2:]) if need_w else ((), saved)
            grad_x, (grad_we,) = blockwise_backward(grad_out[start : start + n], (weight[e],), saved_x, ctx.ops,
                                                    ctx.pow2, need_x, (need_w,), ctx.x_dtype)  # fmt: skip
            if need_x:
                grad_xs.append(grad_x)
            if need_w:
                if into is not None:
                    grad_w[e] += grad_we  # as autograd would add it
                else:
                    grad_w[e] = grad_we
            start += n
        grad_x = (torch.cat(grad_xs) if grad_xs else grad_out.new_zeros((0, weight.shape[2]))) if need_x else None
        return grad_x, None if into is not None else grad_w, None, None, None, None, None, None, None


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (a model spread over several GPUs)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.cache
def _deepgemm_runs_here(device_index: int) -> bool:
    # What `select_ops` requires of backend="deepgemm": an SM90 GPU and vLLM's bundled DeepGEMM.
    from trl_fp8.ops import blockwise_scaled_mm_supported, deep_gemm

    return blockwise_scaled_mm_supported(torch.device("cuda", device_index)) and deep_gemm.available() is None


def grouped_gemm_kernel(choice: str, x: torch.Tensor) -> str:
    """The grouped FProp/DGrad kernel for `x`: "deepgemm" (DeepGEMM's m-grouped GEMM, BF16 output, SM90) or
    "triton" (`kernels.grouped_gemm.m_grouped_gemm`). `choice` "auto" takes DeepGEMM where it can run: it is the
    faster of the two on the same operands at the expert shapes measured (docs/contributing/engineering-notes.md)."""
    if choice == "triton" or not x.is_cuda:
        return "triton"
    runs = x.dtype == torch.bfloat16 and _deepgemm_runs_here(x.device.index or 0)
    if choice == "deepgemm" and not runs:
        from trl_fp8.ops import deep_gemm

        raise RuntimeError(
            "experts_gemm='deepgemm' needs BF16 activations on an SM90 GPU and vLLM's bundled DeepGEMM "
            f"({deep_gemm.available() or 'dtype ' + str(x.dtype)}); use experts_gemm='triton' or 'auto'."
        )
    return "deepgemm" if runs else "triton"


def _m_grouped(a, b_q, b_s, rows, kernel: str, out_dtype: torch.dtype) -> torch.Tensor:
    """`a`'s rows (quantized, 1x128 groups) times their experts' weight blocks, in `rows`' padded layout."""
    from trl_fp8.kernels.grouped_gemm import m_grouped_gemm

    if kernel == "deepgemm" and rows.m_pad:
        from trl_fp8.ops import deep_gemm

        return deep_gemm.m_grouped_gemm(a.q, a.scale_inv, b_q, b_s, rows.expert_of_row)
    return m_grouped_gemm(a.q, a.scale_inv, b_q, b_s, rows, out_dtype)


class _GroupedExpertsFP8Matmul(torch.autograd.Function):
    """`_ExpertsFP8Matmul` on grouped kernels: the same FP8 operands, bit for bit, in one launch per GEMM for all
    experts. `x` holds the rows sorted by expert (`rows.counts`); the quantizer reads them straight into `rows`'
    padded layout (each expert's segment a multiple of 128 rows, zero rows between), which makes one quantization of
    all rows equal each expert's own and lets WGrad's 1x128 groups along tokens stay within one expert. FProp and
    DGrad run on `kernel` (`grouped_gemm_kernel`), WGrad on `kernels.grouped_gemm.k_grouped_gemm`. `cached`: the
    layer's weight cache holds `q` and `s`, so DGrad moves them into its layout instead of re-quantizing the weight."""

    @staticmethod
    def forward(ctx, x, weight, q, s, rows, kernel: str, pow2: bool, grad_enabled: bool, add_into_grad: bool = False,
                gather=None, cached: bool = False):  # fmt: skip
        from trl_fp8.kernels import quantize_act

        wgrad = grad_enabled and ctx.needs_input_grad[1]
        source = rows.source if gather is None else gather[0]
        with _on_device(x):
            act = quantize_act(x, source_rows=source, rows=True, cols=wgrad, power_of_two_scales=pow2)
            out = rows.unpad(_m_grouped(act, q, s, rows, kernel, x.dtype))
        ctx.save_for_backward(weight, *((act.qt, act.scale_inv_t) if wgrad else ()))  # FP8 x.T, not the BF16 rows
        ctx.rows, ctx.kernel, ctx.pow2, ctx.x_dtype, ctx.add_into_grad = rows, kernel, pow2, x.dtype, add_into_grad
        ctx.slot_rows = None if gather is None else gather[1]
        ctx.dgrad_blocks = (q, s) if cached and grad_enabled and ctx.needs_input_grad[0] else None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from trl_fp8.kernels import quantize_act
        from trl_fp8.kernels.grouped_gemm import k_grouped_gemm
        from trl_fp8.kernels.weight_quant import quantize_expert_weights_t, transpose_expert_weights

        weight, *saved_x = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, pow2 = ctx.rows, ctx.pow2
        grad_x = grad_w = None
        with _on_device(grad_out):
            dy = quantize_act(grad_out, source_rows=rows.source, rows=need_x, cols=need_w, power_of_two_scales=pow2)
            if need_x:
                # Each expert's 128x128 blocks, the forward's FP8 values bit for bit, stored transposed ([E, K, N]):
                # K-major for the reduction over N. Moved from the cached blocks where the cache holds them.
                if ctx.dgrad_blocks is not None:
                    w_q, w_s = transpose_expert_weights(*ctx.dgrad_blocks)
                else:
                    w_q, w_s = quantize_expert_weights_t(weight.detach(), power_of_two_scales=pow2)
                ctx.dgrad_blocks = None
                grad_padded = _m_grouped(dy, w_q, w_s, rows, ctx.kernel, ctx.x_dtype)
                if ctx.slot_rows is None:
                    grad_x = rows.unpad(grad_padded)
                else:  # the tokens' gradient: each token's k rows summed in fp32, in slot order
                    from trl_fp8.kernels.moe_combine import combine_rows

                    grad_x = combine_rows(grad_padded, ctx.slot_rows, None, ctx.x_dtype)
            if need_w:
                into = gradient_to_add_into(weight) if ctx.add_into_grad else None
                grad_w = k_grouped_gemm(dy.qt, dy.scale_inv_t, *saved_x, rows, weight.dtype, **WGRAD_LAUNCH,
                                        accumulate_into=into)  # fmt: skip
                if into is not None:  # added to weight.grad in place: nothing for autograd to add
                    grad_w = None
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


class _CombineExperts(torch.autograd.Function):
    """`out[t] = sum_j w[t, j] * y[pos[t, j]]`: each token's k expert rows (sorted by expert), weighted and summed in
    fp32 as the eager chain does it (`kernels.moe_combine`), one pass forward and one backward."""

    @staticmethod
    def forward(ctx, y, weights, pos, out_dtype: torch.dtype):
        from trl_fp8.kernels.moe_combine import combine_rows

        with _on_device(y):
            out = combine_rows(y, pos, weights, out_dtype)
        ctx.save_for_backward(y if ctx.needs_input_grad[1] else None, weights, pos)  # y only for the weights' grad
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from trl_fp8.kernels.moe_combine import combine_rows_backward

        y, weights, pos = ctx.saved_tensors
        with _on_device(grad_out):
            dy, dw = combine_rows_backward(grad_out, y, pos, weights, ctx.needs_input_grad[1])
        return dy if ctx.needs_input_grad[0] else None, dw, None, None


# k_grouped_gemm's launch for WGrad: 64-row output tiles, 4 warps, 3 stages instead of the kernel's defaults (128 rows,
# 8 warps, 4 stages): smaller tiles leave room for two programs per SM, which ran faster at Qwen3-30B-A3B's expert
# shapes (`benchmarks/bench_grouped_gemm.py --sweep`; docs/contributing/engineering-notes.md).
WGRAD_LAUNCH: dict = dict(block_n=64, num_warps=4, num_stages=3)


_FP8_CLASSES: dict[type, type] = {}


def _fp8_class(base: type) -> type:
    """`FP8<base>`: the FP8 forward over `base` (so `isinstance(module, base)` and its other methods still hold)."""
    if issubclass(base, FP8Experts):
        return base
    if base not in _FP8_CLASSES:
        _FP8_CLASSES[base] = type(f"FP8{base.__name__}", (FP8Experts, base), {"forward": FP8Experts.forward})
    return _FP8_CLASSES[base]
