"""One mixture-of-experts layer's expert computation at decode, as vLLM's engine runs it: BF16 against block FP8 at
Qwen3-30B-A3B's shape (hidden 2048, moe_intermediate 768, 128 experts, top-8, tensor parallel 1), each variant's time
per layer call at decode token counts, against the floor of reading the experts the tokens are routed to.

    python -m benchmarks.bench_moe_decode                            # GPU host with vLLM (an H200: ~5 min cold)
    python -m benchmarks.bench_moe_decode --variants bf16 fp8_block_triton --tokens 64 256
    python -m benchmarks.bench_moe_decode --quick --out /tmp/m.json  # CPU: the floors and the reference only

Variants (`--variants`, default all; one that cannot import or build is reported as skipped, with the reason):

- `bf16`: vLLM's unquantized Triton fused MoE, as `UnquantizedFusedMoEMethod` runs it on Hopper:
  `oracle.unquantized.make_unquantized_moe_kernel(FusedMoEQuantConfig.make(), ..., UnquantizedMoeBackend.TRITON,
  TritonExperts)`, a modular kernel (`FusedMoEKernel`) whose `apply` runs the no-DP/EP prepare step, `TritonExperts`
  (`moe_align_block_size`, the fused-MoE Triton GEMM of w13, `silu_and_mul`, the GEMM of w2 with the routing weights,
  `moe_sum`) and the finalize step, with the tuned configurations vLLM ships for this shape
  (`configs/E=128,N=768,device_name=NVIDIA_H200.json`).
- `fp8_block_triton`: vLLM's block-FP8 Triton fused MoE, as `Fp8MoEMethod` runs 128x128-block FP8 experts on Hopper at
  tensor parallel 1 (its oracle's choice there): `oracle.fp8.make_fp8_moe_quant_config(Fp8MoeBackend.TRITON, ...,
  block_shape=[128, 128])` and `make_fp8_moe_kernel(..., TritonExperts, Fp8MoeBackend.TRITON)`. Its prepare step
  quantizes the input in 1x128 groups (`per_token_group_quant_fp8`); between the GEMMs runs the fused
  `silu_and_mul_per_block_quant`; the GEMMs read FP8 weights with float32 128x128-block scales, with vLLM's
  `...,dtype=fp8_w8a8,block_shape=[128,128].json` configurations.
- `fp8_block_triton_trl_act_quant`: the same, with trl-fp8's kernel registered for the SiLU-and-mul + FP8 op
  (`trl_fp8.rollout.vllm.act_quant.install(768, decode_tokens=tokens x top-k, scale_transposed=False,
  require_faster=False)`: row-major scales, as the Triton fused MoE asks; installed only where it gives vLLM's bytes
  on the probes), uninstalled after each token count. Its output is also compared bit for bit with
  `fp8_block_triton`'s.
- `fp8_block_deepgemm`: vLLM's `DeepGemmExperts` (DeepGEMM's contiguous-layout grouped GEMM,
  `m_grouped_fp8_gemm_nt_contiguous`, between vLLM's permute and unpermute kernels), its weights prepared as the
  engine prepares them (`convert_to_fp8_moe_kernel_format(Fp8MoeBackend.DEEPGEMM, ...)`), at every token count. The
  engine's `moe_backend="deep_gemm"` runs `TritonOrDeepGemmExperts`, which falls back to Triton below DeepGEMM's
  M alignment (128 tokens): each row says which the engine would run. DeepGEMM compiles its kernels with nvcc on
  first use (minutes on a cold `DG_JIT_CACHE_DIR`); `--skip_slow` leaves it out.

The process runs with the settings of trl-fp8's FP8 engines: `VLLM_USE_DEEP_GEMM_E8M0=0` (set here: with it on, vLLM
would round scales to powers of two, requantize DeepGEMM's weights in place and take Triton's unfused activation
path), `VLLM_USE_DEEP_GEMM=1` and `VLLM_MOE_USE_DEEP_GEMM=0` unless set; the results file records them with the
kernels vLLM's own oracles choose for this layer under them.

Each token count draws one routing (random router logits, softmax, top-k, renormalized as Qwen3's
`norm_topk_prob`; float32 weights, int32 ids), the same for every variant, and one BF16 input of unit standard
deviation. Weights: `--layers` layers of 128 experts with BF16 weights of standard deviation 0.02 and their 128x128
block-FP8 quantization (float32 scales `amax / 448`), as trl-fp8 pushes them. Each variant's `--layers` calls (one per
layer, each on its own weights, so that no call finds the previous one's experts in L2) are captured in one
`torch.cuda.CUDAGraph`, replayed `--warmup` times, then timed with CUDA events over `--repeats` replays (each behind a
short GPU sleep, so the graph's launch is not timed): the median, divided by the calls, is the time per call.

Floor: the bytes of the experts the routed tokens touch, `experts hit x (2 x 768 x 2048 + 2048 x 768) x 2 bytes`
(BF16) or `x 1 byte + (12 x 16 + 16 x 6) x 4 bytes of scales` (FP8), over the HBM bandwidth of the data sheet
(`bench_rollout.HARDWARE`: 4.8 TB/s for an H200; `--hbm_tb_s` for another GPU). `experts hit` is the number of
distinct experts in that token count's routing. The activations and the buffers between the kernels are left out:
under 1% of the weights' bytes at 16 tokens; at 512, 12% (FP8) and 6% (BF16) if each were written and read once in
HBM, less where they stay in L2.

Parts (not with `--skip_parts`): the pieces of `TritonExperts.apply` called alone with the same arguments, each in its
own CUDA graph of `--layers` calls: the input quantization (FP8), `moe_align_block_size`, the GEMM of w13 (with its
floor, the w13 bytes), the activation (`silu_and_mul`; FP8: `silu_and_mul_per_block_quant`, vLLM's and, installed,
trl-fp8's), the GEMM of w2 (its floor) and `moe_sum`: whether the GEMMs or the quantizers lose.

Check: each variant's output (of the first layer, eagerly and again after the graph's replays) against float32
references: BF16 against the BF16 weights' MoE; FP8 against the same block-FP8 math (dequantized weights, the input
and the SiLU-and-mul output quantized in 1x128 groups to e4m3 as vLLM does: scale `max(amax, 1e-10) / 448`). It fails
the run (exit 1, after the table and the results file) where the largest error exceeds 2^-3 of the output's largest
magnitude for FP8, 2^-5 for BF16. FP8: beyond the roundings the reference reproduces, the kernels round GEMM1's
output to BF16 before quantizing it, which moves some intermediate values across an e4m3 rounding boundary (one ulp,
2^-3 relative, where it does), and write each expert's and the summed output in BF16. BF16: the kernels round GEMM1's
output, the SiLU-and-mul product, each expert's weighted output and the sum to BF16 (2^-9 relative each), and these
add up over the 768- and 2,048-term sums. Emulating those roundings in float32 on this data (CPU, 16 and 64 tokens)
gives 0.013-0.020 of max|ref| for FP8 and 0.004-0.005 for BF16: the bounds leave a factor of 6, and a wrong routing,
scale or layout gives errors of the output's own size. The reference is checked against a token-by-token loop over
the same experts. On CPU (no CUDA, no vLLM) only the floors and the references run; the kernels are reported as
skipped. Writes `benchmarks/results/moe_decode_<device>.json` (with `--quick`, only with `--out`).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from benchmarks.bench_decode_attention import Skipped, _reason
from benchmarks.bench_rollout import SHAPES, hbm_bandwidth
from benchmarks.common import (
    arg_parser,
    device_name,
    exit_if_checks_failed,
    floor_cell,
    format_us,
    graph_time_us,
    metadata,
    resolve_defaults,
    results_path,
    write_json,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # 1x128 activation groups, 128x128 weight blocks
GROUP_EPS = 1e-10  # vLLM's per_token_group_quant_fp8 default
WEIGHT_STD = 0.02  # Qwen3's initializer range
ERR_BOUND = {"bf16": 2.0**-5, "fp8": 2.0**-3}  # of max|ref|: see the module docstring
# trl-fp8's FP8 engines: never E8M0 (`rollout.vllm.kernels.NO_E8M0`); DeepGEMM for the linear layers, vLLM's own
# choice for the experts (`moe_kernel_env`). E8M0 is forced off; the others are defaults a user's setting overrides.
FORCED_ENV = {"VLLM_USE_DEEP_GEMM_E8M0": "0"}
DEFAULT_ENV = {"VLLM_USE_DEEP_GEMM": "1", "VLLM_MOE_USE_DEEP_GEMM": "0"}
TRL_ACT_QUANT = "fp8_block_triton_trl_act_quant"

_MOE = SHAPES["30b-a3b"]
FULL = dict(hidden=_MOE["hidden_size"], intermediate=_MOE["moe_intermediate_size"], experts=_MOE["num_experts"],
            top_k=_MOE["num_experts_per_tok"], tokens=[16, 32, 64, 128, 256, 512], layers=12, warmup=3,
            repeats=20)  # fmt: skip
QUICK = dict(hidden=256, intermediate=128, experts=16, top_k=4, tokens=[4, 8], layers=2, warmup=1, repeats=3)


@dataclass(frozen=True)
class Variant:
    label: str
    dtype: str  # "bf16" or "fp8": its weights, floor and reference


VARIANTS = {
    "bf16": Variant("vLLM's unquantized Triton fused MoE (TritonExperts), BF16 weights", "bf16"),
    "fp8_block_triton": Variant("vLLM's block-FP8 Triton fused MoE (TritonExperts), as Fp8MoEMethod runs it", "fp8"),
    TRL_ACT_QUANT: Variant("the same, trl-fp8's SiLU-and-mul + FP8 quantization kernel installed", "fp8"),
    "fp8_block_deepgemm": Variant("vLLM's DeepGemmExperts (DeepGEMM's contiguous grouped GEMM)", "fp8"),
}
PARTS = {
    "quant_in": "input quantization, 1x128 groups (per_token_group_quant_fp8)",
    "align": "routing alignment (moe_align_block_size)",
    "gemm1": "GEMM of w13, gate and up (fused_moe_kernel)",
    "act": "SiLU-and-mul (silu_and_mul)",
    "act_quant": "SiLU-and-mul + 1x128 FP8 quantization (silu_and_mul_per_block_quant)",
    "gemm2": "GEMM of w2, x routing weights (fused_moe_kernel)",
    "moe_sum": "sum over the top-k (moe_sum)",
}
PART_ORDER = {"bf16": ["align", "gemm1", "act", "gemm2", "moe_sum"],
              "fp8": ["quant_in", "align", "gemm1", "act_quant", "gemm2", "moe_sum"]}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int  # moe_intermediate_size, per expert (tensor parallel 1)
    experts: int
    top_k: int


def expert_bytes(shape: Shape, dtype: str) -> dict:
    """One expert's weights as the kernels read them: w13 `[2 x intermediate, hidden]` and w2 `[hidden,
    intermediate]`, 2 bytes an element in BF16, 1 in FP8 plus a float32 scale per 128x128 block."""
    h, i = shape.hidden, shape.intermediate
    w13, w2 = 2 * i * h, h * i
    if dtype == "bf16":
        return {"w13": 2 * w13, "w2": 2 * w2, "scales": 0, "total": 2 * (w13 + w2)}
    blocks = lambda n, k: -(-n // BLOCK) * -(-k // BLOCK)
    s13, s2 = 4 * blocks(2 * i, h), 4 * blocks(h, i)
    return {"w13": w13 + s13, "w2": w2 + s2, "scales": s13 + s2, "total": w13 + w2 + s13 + s2}


def experts_hit(topk_ids: torch.Tensor) -> int:
    """The distinct experts a routing sends tokens to: the ones whose weights a call must read."""
    return int(torch.unique(topk_ids).numel())


def floor_us(nbytes: int, hbm_bytes_per_s: float) -> float:
    return nbytes / hbm_bytes_per_s * 1e6


def route(tokens: int, shape: Shape, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(topk_weights float32, topk_ids int32)` `[tokens, top_k]` from random router logits: softmax, top-k,
    renormalized (Qwen3's `norm_topk_prob`), as vLLM's `fused_topk(..., renormalize=True)` gives them."""
    logits = torch.randn(tokens, shape.experts, generator=gen, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(shape.top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids.to(torch.int32)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., n, k]` in 128x128 blocks: e4m3 values and float32 scales `[..., n / 128, k / 128]` (`amax / 448`;
    dequantized: value x scale)."""
    *lead, n, k = w.shape
    assert n % BLOCK == 0 and k % BLOCK == 0, f"{n} x {k} is not made of 128x128 blocks"
    b = w.float().reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = b.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / FP8_MAX
    q = (b / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, n, k), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (q.float().unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK)) * scale[..., :, None, :, None]).reshape(
        q.shape
    )


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [m, k]` float32 in 1x128 groups along `k`, as vLLM's `per_token_group_quant_fp8` and
    `silu_and_mul_per_block_quant` quantize activations: scale `max(amax, 1e-10) / 448`, e4m3 values."""
    g = x.unflatten(-1, (-1, BLOCK))
    scale = g.abs().amax(dim=-1).clamp(min=GROUP_EPS) / FP8_MAX
    return (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2), scale


def quant_dequant_groups(x: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_groups(x)
    return (q.float().unflatten(-1, (-1, BLOCK)) * scale[..., None]).flatten(-2)


@dataclass
class Layer:
    """One layer's experts: BF16 weights and their block-FP8 quantization (vLLM's `w13_weight` `[E, 2I, H]`, gate
    rows then up rows, and `w2_weight` `[E, H, I]`; `*_scale` the `weight_scale_inv` block scales)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_fp8: torch.Tensor
    w13_scale: torch.Tensor
    w2_fp8: torch.Tensor
    w2_scale: torch.Tensor

    def expert(self, e: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert `e`'s `(w13, w2)` in float32, as the kernels of `dtype` read them (FP8: dequantized)."""
        if dtype == "bf16":
            return self.w13[e].float(), self.w2[e].float()
        w13 = dequantize_blocks(self.w13_fp8[e], self.w13_scale[e])
        return w13, dequantize_blocks(self.w2_fp8[e], self.w2_scale[e])


def make_layer(shape: Shape, gen: torch.Generator, device, chunk: int = 16) -> Layer:
    """Random BF16 experts (standard deviation 0.02) and their block-FP8 copies, `chunk` experts at a time."""
    e, h, i = shape.experts, shape.hidden, shape.intermediate
    w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=device)
    q13, q2 = torch.empty_like(w13, dtype=FP8), torch.empty_like(w2, dtype=FP8)
    s13 = torch.empty(e, 2 * i // BLOCK, h // BLOCK, dtype=torch.float32, device=device)
    s2 = torch.empty(e, h // BLOCK, i // BLOCK, dtype=torch.float32, device=device)
    for w, q, s in ((w13, q13, s13), (w2, q2, s2)):
        for e0 in range(0, e, chunk):
            part = w[e0 : e0 + chunk]
            part.copy_(torch.randn(part.shape, generator=gen, device=device).mul_(WEIGHT_STD))
            q[e0 : e0 + chunk], s[e0 : e0 + chunk] = quantize_blocks(part)
    return Layer(w13, w2, q13, s13, q2, s2)


def reference_moe(x, topk_weights, topk_ids, layer: Layer, dtype: str) -> torch.Tensor:
    """float32 `[tokens, hidden]`: each token's top-k experts, `silu(gate) x up` then w2, weighted and summed; for FP8
    the dequantized weights, and the input and the SiLU-and-mul output quantized in 1x128 groups (vLLM's block-FP8
    activations). Expert by expert: the tokens routed to it at once."""
    xf = x.float()
    if dtype == "fp8":
        xf = quant_dequant_groups(xf)
    out = torch.zeros_like(xf)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        w13, w2 = layer.expert(e, dtype)
        h = xf[tok] @ w13.T
        a = torch.nn.functional.silu(h[:, : w2.shape[1]]) * h[:, w2.shape[1] :]
        if dtype == "fp8":
            a = quant_dequant_groups(a)
        out.index_add_(0, tok, (a @ w2.T) * topk_weights[tok, slot, None])
    return out


def reference_self_check(x, topk_weights, topk_ids, layer: Layer, ref_bf16: torch.Tensor, tokens: int = 4) -> float:
    """`reference_moe` (BF16 weights) against a loop over the first `tokens` tokens and their top-k slots one at a
    time: the largest absolute difference (the gathers and the weighting of the expert-by-expert form)."""
    worst = 0.0
    for t in range(min(tokens, x.shape[0])):
        acc = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(topk_ids.shape[1]):
            w13, w2 = layer.expert(int(topk_ids[t, j]), "bf16")
            h = w13 @ x[t].float()
            acc += topk_weights[t, j] * (w2 @ (torch.nn.functional.silu(h[: w2.shape[1]]) * h[w2.shape[1] :]))
        worst = max(worst, (acc - ref_bf16[t]).abs().max().item())
    return worst


# --- vLLM's kernels -------------------------------------------------------------------------------------------------


def engine_env() -> dict:
    """The environment trl-fp8's FP8 engines give vLLM, set before vLLM is imported; returns what is in force."""
    os.environ.update(FORCED_ENV)
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ.get(key) for key in (*FORCED_ENV, *DEFAULT_ENV, "DG_JIT_CACHE_DIR")}


def vllm_api() -> SimpleNamespace:
    """vLLM's fused-MoE pieces this benchmark calls (the same names in vLLM 0.26 and 0.31)."""
    try:
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.fused_moe import override_config
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FusedMoEConfig,
            FusedMoEParallelConfig,
            FusedMoEQuantConfig,
            RoutingMethodType,
        )
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
        from vllm.model_executor.layers.fused_moe.oracle import fp8 as fp8_oracle
        from vllm.model_executor.layers.fused_moe.oracle import unquantized as bf16_oracle
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            kFp8Dynamic128Sym,
            kFp8Static128BlockSym,
        )
        from vllm.triton_utils import tl
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.fused_moe")  # the module
    except Exception as exc:  # noqa: BLE001 - vLLM missing, or another layout of it
        raise Skipped(f"vLLM's fused MoE: {_reason(exc)}") from exc
    return SimpleNamespace(
        mk=mk, ops=ops, fused_moe=fused_moe, MoEActivation=MoEActivation, FusedMoEConfig=FusedMoEConfig,
        FusedMoEParallelConfig=FusedMoEParallelConfig, FusedMoEQuantConfig=FusedMoEQuantConfig,
        RoutingMethodType=RoutingMethodType, TritonExperts=TritonExperts, fp8_oracle=fp8_oracle,
        bf16_oracle=bf16_oracle, per_token_group_quant_fp8=per_token_group_quant_fp8,
        kFp8Dynamic128Sym=kFp8Dynamic128Sym, kFp8Static128BlockSym=kFp8Static128BlockSym, tl=tl,
        init_workspace_manager=init_workspace_manager,
        is_workspace_manager_initialized=is_workspace_manager_initialized, override_config=override_config,
    )  # fmt: skip


class Kernels:
    """Each variant's per-layer `FusedMoEKernel`s, built once as vLLM's MoE methods build them."""

    def __init__(self, api, shape: Shape, layers: list[Layer], device, args):
        self.api, self.shape, self.layers, self.device, self.args = api, shape, layers, device, args
        self.built: dict[str, list] = {}
        self.weights: dict[str, list[tuple]] = {}  # per layer: (w1, w2) as the kernel's apply takes them
        self.moe_config = api.FusedMoEConfig(
            num_experts=shape.experts, experts_per_token=shape.top_k, hidden_dim=shape.hidden,
            intermediate_size=shape.intermediate, num_local_experts=shape.experts,
            num_logical_experts=shape.experts, activation=api.MoEActivation.SILU, device=device,
            routing_method=api.RoutingMethodType.Renormalize,
            moe_parallel_config=api.FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
        )  # fmt: skip
        if not api.is_workspace_manager_initialized():  # the model runner's, in an engine
            api.init_workspace_manager(torch.device(device))

    def oracle_choices(self) -> dict:
        """The experts vLLM's oracles pick for this layer here (the engine's choice under this environment)."""
        api, found = self.api, {}
        try:
            backend, cls = api.bf16_oracle.select_unquantized_moe_backend(moe_config=self.moe_config)
            found["bf16"] = f"{backend.name} ({getattr(cls, '__name__', cls)})"
        except Exception as exc:  # noqa: BLE001
            found["bf16"] = f"error: {_reason(exc)}"
        try:
            backend, cls = api.fp8_oracle.select_fp8_moe_backend(
                config=self.moe_config, weight_key=api.kFp8Static128BlockSym, activation_key=api.kFp8Dynamic128Sym,
                allow_vllm_cutlass=False,
            )  # fmt: skip
            found["fp8_block"] = f"{backend.name} ({getattr(cls, '__name__', cls)})"
        except Exception as exc:  # noqa: BLE001
            found["fp8_block"] = f"error: {_reason(exc)}"
        return found

    def get(self, name: str) -> list:
        if name not in self.built:
            try:
                self.built[name] = self._build(name)
            except Skipped:
                raise
            except Exception as exc:  # noqa: BLE001 - another vLLM's signatures, a backend missing here
                traceback.print_exc()
                raise Skipped(f"could not be built: {_reason(exc)}") from exc
        return self.built[name]

    def _build(self, name: str) -> list:
        api = self.api
        if name == "bf16":
            backend = api.bf16_oracle.UnquantizedMoeBackend.TRITON
            self.weights[name] = [(layer.w13, layer.w2) for layer in self.layers]
            return [
                api.bf16_oracle.make_unquantized_moe_kernel(
                    quant_config=api.FusedMoEQuantConfig.make(),
                    moe_config=self.moe_config,
                    backend=backend,
                    experts_cls=api.TritonExperts,
                )  # fmt: skip
                for _ in self.layers
            ]
        if name in ("fp8_block_triton", TRL_ACT_QUANT):
            return self._fp8(name, api.fp8_oracle.Fp8MoeBackend.TRITON, api.TritonExperts)
        return self._fp8(name, api.fp8_oracle.Fp8MoeBackend.DEEPGEMM, self._deepgemm_experts())

    def _deepgemm_experts(self):
        if self.args.skip_slow:
            raise Skipped("--skip_slow (DeepGEMM compiles its kernels with nvcc on first use)")
        try:
            from trl_fp8.rollout.vllm.kernels import deepgemm_unavailable_reason

            why = deepgemm_unavailable_reason(self.device)
        except Exception as exc:  # noqa: BLE001
            why = f"trl_fp8.rollout.vllm.kernels: {_reason(exc)}"
        if why:
            raise Skipped(why)
        try:
            from vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe import DeepGemmExperts
            from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used
        except Exception as exc:  # noqa: BLE001
            raise Skipped(f"vLLM's DeepGemmExperts: {_reason(exc)}") from exc
        if is_deep_gemm_e8m0_used():  # it would requantize the shared FP8 weights in place
            raise Skipped("vLLM uses DeepGEMM's E8M0 scales here (VLLM_USE_DEEP_GEMM_E8M0), not trl-fp8's")
        supported, why = DeepGemmExperts.is_supported_config(
            DeepGemmExperts, self.moe_config, self.api.kFp8Static128BlockSym, self.api.kFp8Dynamic128Sym,
            self.api.mk.FusedMoEActivationFormat.Standard,
        )  # fmt: skip
        if not supported:
            raise Skipped(f"vLLM's DeepGemmExperts: {why}")
        return DeepGemmExperts

    def _fp8(self, name: str, backend, experts_cls) -> list:
        api, kernels, weights = self.api, [], []
        block_layer = SimpleNamespace(weight_block_size=[BLOCK, BLOCK])  # what the conversion reads of the layer
        for layer in self.layers:
            w13, w2, s13, s2 = api.fp8_oracle.convert_to_fp8_moe_kernel_format(
                fp8_backend=backend, layer=block_layer, w13=layer.w13_fp8, w2=layer.w2_fp8,
                w13_scale=layer.w13_scale, w2_scale=layer.w2_scale, w13_input_scale=None, w2_input_scale=None,
            )  # fmt: skip
            quant_config = api.fp8_oracle.make_fp8_moe_quant_config(
                fp8_backend=backend, w1_scale=s13, w2_scale=s2, a1_scale=None, a2_scale=None,
                block_shape=[BLOCK, BLOCK],
            )  # fmt: skip
            kernels.append(
                api.fp8_oracle.make_fp8_moe_kernel(
                    moe_quant_config=quant_config,
                    moe_config=self.moe_config,
                    experts_cls=experts_cls,
                    fp8_backend=backend,
                )  # fmt: skip
            )
            weights.append((w13, w2))
        self.weights[name] = weights
        return kernels

    def calls(self, name: str, x, topk_weights, topk_ids) -> tuple[list, list]:
        """One `FusedMoEKernel.apply` per layer, as the MoE methods' `apply` makes it; `outs[i]` holds layer i's
        output after its call (the graph's own tensor once captured)."""
        kernels = self.get(name)
        outs: list = [None] * len(kernels)
        silu = self.api.MoEActivation.SILU

        def call(i: int):
            w1, w2 = self.weights[name][i]

            def run():
                outs[i] = kernels[i].apply(
                    hidden_states=x, w1=w1, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids, activation=silu,
                    global_num_experts=self.shape.experts, expert_map=None, apply_router_weight_on_input=False,
                )  # fmt: skip

            return run

        return [call(i) for i in range(len(kernels))], outs


def triton_configs(api, shape: Shape, tokens: list[int]) -> dict:
    """The tuned-configuration files vLLM looks up for this shape here, whether found, and the configuration each
    token count gets (`try_get_optimal_moe_config`, as `TritonExperts.apply` asks)."""
    fm, found = api.fused_moe, {}
    w13_shape = (shape.experts, 2 * shape.intermediate, shape.hidden)
    w2_shape = (shape.experts, shape.hidden, shape.intermediate)
    for dtype, config_dtype, block in (("bf16", None, None), ("fp8", "fp8_w8a8", [BLOCK, BLOCK])):
        try:
            name = fm.get_config_file_name(shape.experts, shape.intermediate, config_dtype, block)
            tuned = fm.get_moe_configs(shape.experts, shape.intermediate, config_dtype, *(block or (None, None)))
            found[dtype] = {
                "file": name,
                "found": tuned is not None,
                "by_tokens": {str(t): fm.try_get_optimal_moe_config(w13_shape, w2_shape, shape.top_k, config_dtype,
                                                                   t, block_shape=block) for t in tokens},
            }  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            found[dtype] = {"error": _reason(exc)}
    return found


def shipped_config(api, shape: Shape, dtype: str, tokens: int) -> dict:
    """The Triton configuration `TritonExperts.apply` takes at this token count (`try_get_optimal_moe_config`)."""
    i, h = shape.intermediate, shape.hidden
    fp8 = dtype == "fp8"
    return api.fused_moe.try_get_optimal_moe_config((shape.experts, 2 * i, h), (shape.experts, h, i), shape.top_k,
                                                    "fp8_w8a8" if fp8 else None, tokens,
                                                    block_shape=[BLOCK, BLOCK] if fp8 else None)  # fmt: skip


def part_calls(api, kernels: Kernels, dtype: str, x, topk_weights, topk_ids, hit: int, config=None) -> dict:
    """`{part: (calls, floor bytes or None)}`: the pieces of `TritonExperts.apply`, one call per layer each, with the
    configuration (`config`, default vLLM's), routing alignment and buffers `apply` gives them."""
    shape, fm = kernels.shape, api.fused_moe
    t, k, i, h = x.shape[0], shape.top_k, shape.intermediate, shape.hidden
    fp8 = dtype == "fp8"
    block = [BLOCK, BLOCK] if fp8 else None
    layers = kernels.layers
    config = config or shipped_config(api, shape, dtype, t)
    align = lambda: fm._prepare_expert_assignment(topk_ids, config, t, k, shape.experts, None, block_shape=block)
    sorted_ids, expert_ids, padded = align()
    cache1 = torch.randn(t, k, 2 * i, device=x.device).to(torch.bfloat16)  # GEMM1's output, of GEMM1's size
    cache3 = torch.empty(t, k, h, dtype=torch.bfloat16, device=x.device)
    out = torch.empty(t, h, dtype=torch.bfloat16, device=x.device)
    gemm_args = dict(compute_type=api.tl.bfloat16, use_fp8_w8a8=fp8, use_int8_w8a8=False, use_int8_w8a16=False,
                     use_int4_w4a16=False, per_channel_quant=False, block_shape=block, B_bias=None)  # fmt: skip
    if fp8:
        a1, a1_scale = api.per_token_group_quant_fp8(x, BLOCK)
        a2, a2_scale = api.ops.silu_and_mul_per_block_quant(cache1.view(-1, 2 * i), group_size=BLOCK, quant_dtype=FP8)
        w = [(layer.w13_fp8, layer.w13_scale, layer.w2_fp8, layer.w2_scale) for layer in layers]
    else:
        a1, a1_scale, a2_scale = x, None, None
        a2 = torch.empty(t * k, i, dtype=torch.bfloat16, device=x.device)
        w = [(layer.w13, None, layer.w2, None) for layer in layers]
    per_expert = expert_bytes(shape, dtype)

    def gemm1(j):
        return lambda: fm.invoke_fused_moe_triton_kernel(
            a1, w[j][0], cache1, a1_scale, w[j][1], None, sorted_ids, expert_ids, padded, False, k, config,
            **gemm_args,
        )  # fmt: skip

    def gemm2(j):
        return lambda: fm.invoke_fused_moe_triton_kernel(
            a2, w[j][2], cache3, a2_scale, w[j][3], topk_weights, sorted_ids, expert_ids, padded, True, 1, config,
            **gemm_args,
        )  # fmt: skip

    n = len(layers)
    parts = {
        "align": ([align] * n, None),
        "gemm1": ([gemm1(j) for j in range(n)], hit * per_expert["w13"]),
        "gemm2": ([gemm2(j) for j in range(n)], hit * per_expert["w2"]),
        "moe_sum": ([lambda: api.ops.moe_sum(cache3, out)] * n, None),
    }
    if fp8:
        parts["quant_in"] = ([lambda: api.per_token_group_quant_fp8(x, BLOCK)] * n, None)
        act = lambda: api.ops.silu_and_mul_per_block_quant(cache1.view(-1, 2 * i), group_size=BLOCK, quant_dtype=FP8)
        parts["act_quant"] = ([act] * n, None)
    else:
        parts["act"] = ([lambda: torch.ops._C.silu_and_mul(a2, cache1.view(-1, 2 * i))] * n, None)
    return {name: parts[name] for name in PART_ORDER[dtype]}


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item()


def spread(times: list[float]) -> dict:
    return {"us": statistics.median(times), "us_min": min(times), "us_max": max(times)}


def run_variant(name: str, kernels: Kernels, batch: dict, ref: torch.Tensor, max_ref: float, args, state) -> dict:
    """One variant at one token count: checked eagerly, timed in a graph, checked again after the replays."""
    calls, outs = kernels.calls(name, batch["x"], batch["topk_weights"], batch["topk_ids"])
    ran = state.setdefault("ran", set())
    try:
        calls[0]()  # the first call compiles (Triton's configurations, DeepGEMM's JIT)
        torch.cuda.synchronize()
    except Exception as exc:
        if name in ran:  # it ran at another token count: an error of this one
            raise
        traceback.print_exc()
        raise Skipped(f"its first call failed: {_reason(exc)}") from exc
    ran.add(name)
    bound = ERR_BOUND[VARIANTS[name].dtype]
    eager = outs[0].clone()
    err_eager = max_error(eager, ref)
    times = graph_time_us(calls, args.warmup, args.repeats, after_capture=lambda: outs[0].zero_())[0]
    err_graph = max_error(outs[0], ref)
    err = max(err_eager, err_graph)
    row = {**spread(times), "max_err": err, "max_err_eager": err_eager, "max_err_graph": err_graph,
           "check": "ok" if err <= bound * max_ref else "FAILED"}  # fmt: skip
    if name == "fp8_block_triton":
        state["fp8_block_triton_out"] = eager
    if name == TRL_ACT_QUANT and state.get("fp8_block_triton_out") is not None:
        row["bitwise_equal_to_fp8_block_triton"] = bool(torch.equal(eager, state["fp8_block_triton_out"]))
    return row


def run_trl_act_quant(kernels: Kernels, batch: dict, ref, max_ref, args, state) -> dict:
    """`run_variant` with trl-fp8's SiLU-and-mul + FP8 kernel registered for vLLM's op at this token count's rows."""
    try:
        from trl_fp8.rollout.vllm import act_quant
    except Exception as exc:  # noqa: BLE001
        raise Skipped(f"trl_fp8.rollout.vllm.act_quant: {_reason(exc)}") from exc
    shape = kernels.shape
    rows = batch["x"].shape[0] * shape.top_k
    choice = act_quant.install(shape.intermediate, kernels.device, decode_tokens=rows, scale_transposed=False,
                               require_faster=False)  # fmt: skip
    info = {"installed": choice.installed, "reason": choice.reason, "numerics": choice.numerics,
            "vllm_us": choice.vllm_us, "trl_fp8_us": choice.trl_fp8_us, "rows": rows}  # fmt: skip
    try:
        if not choice.installed:
            raise Skipped(f"trl-fp8's kernel not installed: {choice.reason}")
        row = run_variant(TRL_ACT_QUANT, kernels, batch, ref, max_ref, args, state)
        if not args.skip_parts:  # vLLM's op, now on trl-fp8's kernel, alone
            state["trl_act_quant_part"] = time_parts(kernels, "fp8", batch, args, only=("act_quant",))
    finally:
        act_quant.uninstall()
    return {**row, "act_quant_choice": info}


def time_parts(kernels: Kernels, dtype: str, batch: dict, args, only: tuple[str, ...] = ()) -> list[dict]:
    rows = []
    try:
        parts = part_calls(kernels.api, kernels, dtype, batch["x"], batch["topk_weights"], batch["topk_ids"],
                           batch["hit"])  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - recorded, the variants' rows stand
        traceback.print_exc()
        return [{"part": "all", "error": _reason(exc)}]
    for name, (calls, nbytes) in parts.items():
        if only and name not in only:
            continue
        row = {"part": name, "label": PARTS[name]}
        try:
            row.update(spread(graph_time_us(calls, args.warmup, args.repeats)[0]))
            if nbytes is not None:
                floor = floor_us(nbytes, args.hbm)
                row.update(bytes=nbytes, floor_us=floor, fraction=floor / row["us"])
        except Exception as exc:  # noqa: BLE001
            row["error"] = _reason(exc)
            traceback.print_exc()
        rows.append(row)
    return rows


# --- tuning the Triton configuration at decode token counts (`--tune`) -----------------------------------------------

TUNE_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")


def tune_candidates(shape: Shape, tokens: int, dtype: str) -> list[dict]:
    """Configurations of vLLM's fused-MoE Triton kernel worth timing at a decode token count: tiles of 16-32 rows
    (64 once the experts average 16 routed rows), 32-128 columns (a 128x128 weight block holds whole tiles: vLLM's
    own tuner's rule for block-FP8), K steps of 64 or 128, 4 warps (8 on the widest tiles), 3-5 stages in flight.
    GROUP_SIZE_M stays 1: at decode each row tile is another expert's, so grouping tiles shares no weights."""
    rows_per_expert = tokens * shape.top_k / shape.experts
    found = []
    for bm in (16, 32, 64):
        if bm == 64 and rows_per_expert < 16:
            continue
        for bn, bks, warps in ((128, (64, 128), (4, 8)), (64, (64, 128), (4,)), (32, (128,), (4,))):
            for bk in bks:
                for w in warps:
                    for stages in (3, 4, 5):
                        found.append(dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1,
                                          num_warps=w, num_stages=stages))  # fmt: skip
    return found


def _config_key(config: dict) -> tuple:
    return tuple(config.get(key) for key in TUNE_KEYS)


def tune_triton(kernels: Kernels, dtype: str, batch: dict, ref: torch.Tensor, max_ref: float, args) -> dict:
    """Time the two fused-MoE GEMMs (the same configuration serves both, as in `TritonExperts.apply`) under each
    candidate configuration, vLLM's own first; then the whole layer (`FusedMoEKernel.apply`, its quantizers and
    alignment included) under the fastest, checked against the float32 reference as the variants are. The fastest is
    kept only if it beats vLLM's by `--tune_margin`."""
    api, shape = kernels.api, kernels.shape
    tokens = batch["x"].shape[0]
    shipped = {key: value for key, value in shipped_config(api, shape, dtype, tokens).items() if key in TUNE_KEYS}
    candidates = [shipped] + [
        c for c in tune_candidates(shape, tokens, dtype) if _config_key(c) != _config_key(shipped)
    ]
    timed = []
    for config in candidates:
        row = {"config": config}
        try:
            parts = part_calls(api, kernels, dtype, batch["x"], batch["topk_weights"], batch["topk_ids"], batch["hit"],
                               config=config)  # fmt: skip
            row["gemm_us"] = {name: statistics.median(graph_time_us(parts[name][0], args.warmup, args.tune_repeats)[0])
                              for name in ("gemm1", "gemm2")}  # fmt: skip
            row["us"] = sum(row["gemm_us"].values())
        except Exception as exc:  # noqa: BLE001 - a configuration Triton cannot build here (shared memory)
            row["error"] = _reason(exc)
        timed.append(row)
    ok = [row for row in timed if "us" in row]
    if not ok:
        raise RuntimeError(f"no configuration ran: {timed[0].get('error')}")
    base = timed[0] if "us" in timed[0] else None
    best = min(ok, key=lambda row: row["us"])
    keep = base is None or best["us"] < (1 - args.tune_margin) * base["us"]
    chosen = best if keep else base
    name = "bf16" if dtype == "bf16" else "fp8_block_triton"
    calls, outs = kernels.calls(name, batch["x"], batch["topk_weights"], batch["topk_ids"])
    layer = {}
    for label, config in (("shipped", shipped), ("chosen", chosen["config"])):
        with api.override_config({**config}):
            calls[0]()
            torch.cuda.synchronize()
            times = graph_time_us(calls, args.warmup, args.repeats, after_capture=lambda: outs[0].zero_())[0]
        err = max_error(outs[0], ref)
        layer[label] = {
            **spread(times),
            "max_err": err,
            "check": "ok" if err <= ERR_BOUND[dtype] * max_ref else "FAILED",
        }
    return {
        "dtype": dtype, "tokens": tokens, "candidates": len(candidates), "failed": len(timed) - len(ok),
        "shipped": shipped, "shipped_gemm_us": base["us"] if base else None,
        "best": best["config"], "best_gemm_us": best["us"], "kept": keep, "chosen": chosen["config"],
        "layer_us_shipped": layer["shipped"]["us"], "layer_us_chosen": layer["chosen"]["us"],
        "layer": layer, "timed": timed,
    }  # fmt: skip


def write_tuned_configs(api, shape: Shape, tuning: list[dict], folder: str) -> str | None:
    """vLLM's configuration file for the block-FP8 experts of this shape on this GPU (`get_config_file_name`),
    written to `folder` for `VLLM_TUNED_CONFIG_FOLDER`: vLLM's own entries, with the kept ones of the tuning in
    place of theirs at the tuned token counts (vLLM takes the entry of the nearest count)."""
    kept = {row["tokens"]: row["chosen"] for row in tuning if row["dtype"] == "fp8" and row["kept"]}
    if not kept:
        return None
    fm = api.fused_moe
    name = fm.get_config_file_name(shape.experts, shape.intermediate, "fp8_w8a8", [BLOCK, BLOCK])
    shipped_path = os.path.join(os.path.dirname(fm.__file__), "configs", name)
    entries = {}
    if os.path.exists(shipped_path):
        with open(shipped_path) as f:
            entries = {int(k): v for k, v in json.load(f).items() if k != "triton_version"}
    entries.update(kept)
    import triton

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump({"triton_version": triton.__version__, **{str(k): entries[k] for k in sorted(entries)}}, f, indent=4)
        f.write("\n")
    return path


def engine_would_run_deepgemm(tokens: int, shape: Shape) -> str:
    """What vLLM's `TritonOrDeepGemmExperts` (the engine's `moe_backend="deep_gemm"`) runs at this token count."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.deep_gemm_moe import _valid_deep_gemm_shape

        valid = _valid_deep_gemm_shape(tokens, shape.intermediate, shape.hidden)
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({_reason(exc)})"
    return "DeepGemmExperts" if valid else "TritonExperts (DeepGEMM's fallback below its M alignment)"


# --- the table and main ---------------------------------------------------------------------------------------------


def print_table(result: dict, variants: list[str]) -> None:
    """Rows: variants; columns: token counts; cells: microseconds per layer call and the share of the floor; then the
    floors, FP8 / BF16 time ratios and the parts."""
    s, tokens = result["shapes"], result["shapes"]["tokens"]
    rows = {(r["variant"], r["tokens"]): r for r in result["results"]}
    print(f"\nMoE experts at decode: hidden {s['hidden']}, moe_intermediate {s['intermediate']}, {s['experts']} "
          f"experts, top-{s['top_k']}, TP 1; {result['device']}, HBM {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s "
          f"({result['hbm_source']})")  # fmt: skip
    failed = any(r.get("check") not in (None, "ok") for r in result["results"])
    print(f"us per layer call (share of the floor: the routed experts' weights at HBM bandwidth): {s['layers']} layers' "
          f"calls in one CUDA graph, median of {result['timing']['repeats']} replays"
          + ("; FAILED: an output's check failed (below)" if failed else ""))  # fmt: skip
    name_width, width = 31, 29
    print(f"{'variant':<{name_width}}" + "".join(f"{f'{n:,} tokens' if i == 0 else f'{n:,}':>{width}}"
                                                for i, n in enumerate(tokens)))  # fmt: skip

    def line(label: str, cells: list[str]) -> None:
        print(f"{label:<{name_width}}" + "".join(f" {c:>{width - 1}}" for c in cells))

    for name in variants:
        cells = [floor_cell(rows.get((name, n), {})) for n in tokens]
        line(name, cells)
    routing = {r["tokens"]: r for r in result["routing"]}
    line("experts hit", [str(routing[n]["experts_hit"]) if n in routing else "-" for n in tokens])
    for dtype, label in (("bf16", "floor, BF16 weights"), ("fp8", "floor, FP8 weights + scales")):
        line(label, [format_us(routing[n][f"floor_us_{dtype}"]) if n in routing else "-" for n in tokens])
    fp8_variants = [v for v in variants if VARIANTS[v].dtype == "fp8"]
    if any("time_over_bf16" in r for r in result["results"]):
        print("time / bf16's time (below 1: faster than BF16; the floors' ratio is about 0.5)")
        for name in fp8_variants:
            ratios = [rows.get((name, n), {}).get("time_over_bf16") for n in tokens]
            line(name, [f"{x:.2f}x" if x is not None else "-" for x in ratios])
    parts = result.get("parts", [])
    if parts:
        print(f"\nparts, us per call, each alone in a CUDA graph of {s['layers']} calls (GEMMs: share of their "
              "weights' floor)")  # fmt: skip
        by = {(p["variant"], p["part"], p["tokens"]): p for p in parts}
        keys = list(dict.fromkeys((p["variant"], p["part"]) for p in parts))
        for variant in dict.fromkeys(v for v, _ in keys):
            total = [0.0] * len(tokens)
            for v, part in [key for key in keys if key[0] == variant]:
                cells = []
                for j, n in enumerate(tokens):
                    p = by.get((v, part, n), {})
                    if "us" in p:
                        total[j] += p["us"]
                        share = f" ({p['fraction']:.0%})" if "fraction" in p else ""
                        cells.append(f"{format_us(p['us'])}{share}")
                    else:
                        cells.append("error" if "error" in p else "-")
                line(f"{'trl' if v == TRL_ACT_QUANT else v}: {part}", cells)
            if variant != TRL_ACT_QUANT:
                line(f"{variant}: sum of parts", [format_us(x) if x else "-" for x in total])
    print()
    checks = ", ".join(f"{r['self_check_max_diff']:.2g} ({r['max_ref_bf16']:.3g}) at {r['tokens']}"
                       for r in result["reference"])  # fmt: skip
    print(f"float32 reference vs a token-by-token loop, largest difference (max|ref|): {checks}")
    for name in variants:
        v = result["variants"][name]
        errors = [rows[(name, n)] for n in tokens if "max_err" in rows.get((name, n), {})]
        checked = ", ".join(f"{r['max_err'] / r['max_ref']:.2g}" for r in errors)
        bound = ERR_BOUND[VARIANTS[name].dtype]
        check = f"; max err / max|ref| {checked} (bound {bound:g})" if errors else ""
        print(f"{name}: {v['label']}{check}" + (f"; skipped: {v['skipped']}" if v.get("skipped") else ""))
        same = [rows[(name, n)].get("bitwise_equal_to_fp8_block_triton") for n in tokens if (name, n) in rows]
        if any(x is False for x in same):
            print("  its output differs from fp8_block_triton's (the op's probes gave the same bytes)")
        failed = [f"{r['tokens']}: {r['error']}" for n in tokens if "error" in (r := rows.get((name, n), {}))]
        if failed:
            print(f"  errors: {'; '.join(failed)}")
    if "vllm_choice" in result:
        print(f"vLLM's own choice of experts for this layer here: {result['vllm_choice']}")


def print_tuning(tuning: list[dict]) -> None:
    """Per token count: vLLM's configuration and the fastest, their two GEMMs' time, the whole layer under each."""
    print("\nTriton configuration, tuned (M, N, K tile, warps, stages): the two GEMMs' us, then the whole layer's")
    for r in tuning:
        if "error" in r:
            print(f"{r['dtype']} {r['tokens']:>5} tokens: error: {r['error']}")
            continue

        def cfg(c):
            return f"{c['BLOCK_SIZE_M']}x{c['BLOCK_SIZE_N']}x{c['BLOCK_SIZE_K']} w{c['num_warps']} s{c['num_stages']}"

        layer = r["layer"]
        print(
            f"{r['dtype']} {r['tokens']:>5} tokens: vLLM's {cfg(r['shipped'])} {format_us(r['shipped_gemm_us'] or 0)}; "
            f"fastest of {r['candidates']} {cfg(r['best'])} {format_us(r['best_gemm_us'])} "
            f"({'kept' if r['kept'] else 'not kept'}); layer {format_us(r['layer_us_shipped'])} -> "
            f"{format_us(r['layer_us_chosen'])} (check {layer['shipped']['check']}/{layer['chosen']['check']})"
        )


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__, out="benchmarks/results/moe_decode_<device>.json; with --quick, only with --out",
                        quick="smoke sizes (hidden 256, 128 per expert, 16 experts, top-4, 4 and 8 tokens, 2 layers): "
                        "on CPU, the floors and the references")  # fmt: skip
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--tokens", type=int, nargs="+", help=f"decode token counts (default {FULL['tokens']})")
    parser.add_argument("--hidden", type=int, help=f"default {FULL['hidden']} (Qwen3-30B-A3B)")
    parser.add_argument("--intermediate", type=int, help=f"moe_intermediate_size (default {FULL['intermediate']})")
    parser.add_argument("--experts", type=int, help=f"default {FULL['experts']}")
    parser.add_argument("--top_k", type=int, help=f"default {FULL['top_k']}")
    parser.add_argument("--layers", type=int, help=f"calls per CUDA graph, each on its own weights ({FULL['layers']})")
    parser.add_argument("--warmup", type=int, help=f"graph replays before timing (default {FULL['warmup']})")
    parser.add_argument("--repeats", type=int, help=f"timed graph replays; the median is kept ({FULL['repeats']})")
    parser.add_argument("--skip_slow", action="store_true", help="leave out fp8_block_deepgemm (nvcc JIT compiles)")
    parser.add_argument("--skip_parts", action="store_true", help="no per-part timings")
    parser.add_argument("--hbm_tb_s", type=float, help="HBM bandwidth for the floor (default: the data sheet's)")
    parser.add_argument("--tune", nargs="*", choices=("fp8", "bf16"),
                        help="also sweep the Triton fused-MoE configuration at each token count (`--tune`: the FP8 "
                        "experts'; `--tune fp8 bf16`: both) and time the layer under the fastest")  # fmt: skip
    parser.add_argument("--tune_out", help="write the FP8 experts' tuned configuration file here, in vLLM's format "
                        "(for VLLM_TUNED_CONFIG_FOLDER)")  # fmt: skip
    parser.add_argument(
        "--tune_margin",
        type=float,
        default=0.03,
        help="keep a tuned configuration only if its GEMMs beat vLLM's by this fraction (0.03)",
    )
    parser.add_argument("--tune_repeats", type=int, default=10, help="timed replays per candidate (10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tune is not None and not args.tune:
        args.tune = ["fp8"]
    for key, value in resolve_defaults(args, FULL, QUICK).items():
        setattr(args, key, value)
    shape = Shape(args.hidden, args.intermediate, args.experts, args.top_k)
    if shape.hidden % BLOCK or shape.intermediate % BLOCK:
        parser.error("--hidden and --intermediate must be multiples of 128 (the FP8 blocks)")
    if not 0 < shape.top_k <= shape.experts:
        parser.error("--top_k must be between 1 and --experts")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    env = engine_env() if cuda else {}
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the references in float32
    label = device_name()
    hbm, hbm_source = hbm_bandwidth(label, args.hbm_tb_s)
    args.hbm = hbm
    variants = [name for name in VARIANTS if name in args.variants]  # fp8_block_triton before the trl variant
    info = {name: {"label": VARIANTS[name].label, "dtype": VARIANTS[name].dtype,
                   "expert_bytes": expert_bytes(shape, VARIANTS[name].dtype)} for name in variants}  # fmt: skip
    result = {
        "benchmark": "one MoE layer's experts at decode as vLLM runs them, BF16 vs block FP8, against the floor of "
        "the routed experts' weights",
        **metadata(label),
        "shapes": {
            "hidden": shape.hidden,
            "intermediate": shape.intermediate,
            "experts": shape.experts,
            "top_k": shape.top_k,
            "tokens": args.tokens,
            "layers": args.layers,
            "block": BLOCK,
            "weight_std": WEIGHT_STD,
        },  # fmt: skip
        "env": env,
        "timing": {
            "calls_per_graph": args.layers,
            "warmup_replays": args.warmup,
            "repeats": args.repeats,
            "statistic": "median of the replays, per call",
        },  # fmt: skip
        "hbm_bytes_per_s": hbm,
        "hbm_source": hbm_source,
        "err_bound_of_max_ref": ERR_BOUND,
        "variants": info,
        "routing": [],
        "reference": [],
        "results": [],
    }
    try:
        from trl_fp8.rollout.vllm._compat import bundled_deepgemm_version

        found = bundled_deepgemm_version()
        result["versions"]["deep_gemm (bundled)"] = ".".join(map(str, found)) if found else None
    except Exception:  # noqa: BLE001
        result["versions"]["deep_gemm (bundled)"] = None
    out = results_path(args.out, "moe_decode", label) if not args.quick or args.out else None
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"# {args.layers} layers of {shape.experts} experts, BF16 and block FP8", file=sys.stderr, flush=True)
    layers = [make_layer(shape, gen, device) for _ in range(args.layers)]
    kernels, state = None, {}
    if not cuda:
        for name in variants:
            info[name]["skipped"] = "no CUDA device: only the floors and the float32 references run here"
    else:
        try:
            api = vllm_api()
            kernels = Kernels(api, shape, layers, device, args)
            result["vllm_choice"] = kernels.oracle_choices()
            result["triton_configs"] = triton_configs(api, shape, args.tokens)
        except Skipped as exc:
            for name in variants:
                info[name]["skipped"] = str(exc)
        if not args.skip_parts and kernels is not None:
            result["parts"] = []
        if args.tune and kernels is not None:
            result["tuning"] = []
    for tokens in args.tokens:
        print(f"# {tokens} tokens", file=sys.stderr, flush=True)
        topk_weights, topk_ids = route(tokens, shape, gen, device)
        x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(torch.bfloat16)
        hit = experts_hit(topk_ids)
        batch = {"x": x, "topk_weights": topk_weights, "topk_ids": topk_ids, "hit": hit}
        floors = {d: floor_us(hit * expert_bytes(shape, d)["total"], hbm) for d in ("bf16", "fp8")}
        load = torch.bincount(topk_ids.flatten().long(), minlength=shape.experts)
        result["routing"].append({"tokens": tokens, "experts_hit": hit, "max_expert_load": int(load.max()),
                                  "floor_us_bf16": floors["bf16"], "floor_us_fp8": floors["fp8"]})  # fmt: skip
        refs = {d: reference_moe(x, topk_weights, topk_ids, layers[0], d) for d in ("bf16", "fp8")}
        max_ref = {d: refs[d].abs().max().item() for d in refs}
        self_check = reference_self_check(x, topk_weights, topk_ids, layers[0], refs["bf16"])
        result["reference"].append({"tokens": tokens, "max_ref_bf16": max_ref["bf16"], "max_ref_fp8": max_ref["fp8"],
                                    "fp8_vs_bf16_max_diff": max_error(refs["fp8"], refs["bf16"]),
                                    "self_check_max_diff": self_check})  # fmt: skip
        if self_check > 1e-4 * max_ref["bf16"]:  # float32 sums in other orders differ by ~1e-7
            raise SystemExit(f"the float32 reference disagrees with a token-by-token loop: {self_check:.3g}")
        for name in variants:
            dtype = VARIANTS[name].dtype
            nbytes = hit * expert_bytes(shape, dtype)["total"]
            row = {"variant": name, "tokens": tokens, "experts_hit": hit, "bytes": nbytes,
                   "floor_us": floor_us(nbytes, hbm), "max_ref": max_ref[dtype],
                   "err_bound": ERR_BOUND[dtype] * max_ref[dtype]}  # fmt: skip
            if "skipped" in info[name]:
                row["skipped"] = info[name]["skipped"]
            else:
                print(f"# {tokens} tokens: {name}", file=sys.stderr, flush=True)
                if name == "fp8_block_deepgemm":
                    row["engine_deep_gemm_backend_runs"] = engine_would_run_deepgemm(tokens, shape)
                try:
                    if name == TRL_ACT_QUANT:
                        row.update(run_trl_act_quant(kernels, batch, refs[dtype], max_ref[dtype], args, state))
                    else:
                        row.update(run_variant(name, kernels, batch, refs[dtype], max_ref[dtype], args, state))
                    row["fraction"] = row["floor_us"] / row["us"]
                except Skipped as exc:
                    info[name]["skipped"] = row["skipped"] = str(exc)
                except Exception as exc:  # noqa: BLE001 - recorded, the others go on
                    row["error"] = _reason(exc)
                    traceback.print_exc()
            result["results"].append(row)
        bf16_us = next((r["us"] for r in result["results"] if r["tokens"] == tokens and r["variant"] == "bf16"
                        and "us" in r), None)  # fmt: skip
        for r in result["results"]:
            if r["tokens"] == tokens and "us" in r and bf16_us and VARIANTS[r["variant"]].dtype == "fp8":
                r["time_over_bf16"] = r["us"] / bf16_us
        if "parts" in result:
            print(f"# {tokens} tokens: parts", file=sys.stderr, flush=True)
            for dtype, variant in (("bf16", "bf16"), ("fp8", "fp8_block_triton")):
                for p in time_parts(kernels, dtype, batch, args):
                    result["parts"].append({"variant": variant, "tokens": tokens, **p})
            for p in state.pop("trl_act_quant_part", []):
                result["parts"].append({"variant": TRL_ACT_QUANT, "tokens": tokens, **p})
        for dtype in args.tune if "tuning" in result else ():
            print(f"# {tokens} tokens: tuning the {dtype} Triton configuration", file=sys.stderr, flush=True)
            try:
                result["tuning"].append(tune_triton(kernels, dtype, batch, refs[dtype], max_ref[dtype], args))
            except Exception as exc:  # noqa: BLE001 - recorded, the rest stands
                traceback.print_exc()
                result["tuning"].append({"dtype": dtype, "tokens": tokens, "error": _reason(exc)})
        state.pop("fp8_block_triton_out", None)
        del batch, refs
        if cuda:
            torch.cuda.empty_cache()
        if out is not None:  # after every token count: a crash keeps what ran
            write_json(out, result)
    print_table(result, variants)
    if result.get("tuning"):
        print_tuning(result["tuning"])
        if args.tune_out:
            path = write_tuned_configs(kernels.api, shape, [r for r in result["tuning"] if "error" not in r],
                                       args.tune_out)  # fmt: skip
            result["tuned_config_file"] = path
            print(f"wrote {path}" if path else "no tuned configuration beat vLLM's: no file written")
            if out is not None:
                write_json(out, result)
    if out is not None:
        print(f"wrote {out}")
    exit_if_checks_failed(result["results"], f"max|ref| x {ERR_BOUND}", "variant", "tokens")


if __name__ == "__main__":
    main()
