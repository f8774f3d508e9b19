"""Single-token paged decode attention on the FP8 KV cache, kernel by kernel, as vLLM's decode steps run it: each
kernel's time per call and its share of the KV-read floor (the bytes of K and V it must read, over HBM bandwidth).

    python -m benchmarks.bench_decode_attention                      # GPU host with vLLM (and FlashInfer for XQA)
    python -m benchmarks.bench_decode_attention --kernels xqa_fp8 xqa_fp8_tensor_scales xqa_fp8_live_scales
    python -m benchmarks.bench_decode_attention --quick --out /tmp/d.json   # CPU: reference and floors only

Kernels (`--kernels`, default all; one that cannot import or build is reported as skipped, with the reason):

- `fa3_bf16`, `fa3_fp8`: vLLM's FlashAttention-3 (`vllm.vllm_flash_attn.flash_attn_varlen_func`, `fa_version=3`)
  called as `FlashAttentionImpl.forward` calls it: paged K and V views `[num_blocks, block_size, kv_heads,
  head_dim]`, `block_table`, `seqused_k`, `cu_seqlens_q`, `max_seqlen_q=1`, `causal=True`, and the scheduler
  metadata and `num_splits` its metadata builder gives a decode batch under full CUDA graphs (`get_scheduler_metadata`
  with `num_splits=32`, vLLM's `flash_attn_max_num_splits_for_cuda_graph`; `--fa3_num_splits 0
  --fa3_no_scheduler_metadata` leaves both to the library's heuristics). On the FP8 cache the query is FP8 too (vLLM's
  attention layer quantizes it with the static `q_scale` before the kernel; done here once, outside the timing) and
  `q/k/v_descale` are the layer's 0-dim scales expanded to `[num_seqs, kv_heads]`. The BF16 cache holds the FP8
  cache's values dequantized, so both read the same numbers.
- `triton_fp8`: vLLM's Triton unified attention (`vllm.v1.attention.ops.triton_unified_attention.unified_attention`)
  as `TritonAttentionImpl.forward` calls it on an FP8 cache: FP8 query, `q_descale` the 0-dim `q_scale`, `k/v_descale`
  expanded, `kv_quant_mode=FP8_PER_TENSOR`, and the 3D-kernel threshold and softmax-segment buffers of its metadata
  builder (the 2D kernel above `128 // kv_heads` sequences, snapped to a CUDA-graph capture size).
- `xqa_fp8`: FlashInfer's XQA (TensorRT-LLM's decode kernel) as vLLM's `FlashInferImpl.forward` calls it on Hopper
  with an FP8 cache (`decode_with_xqa`): `flashinfer.decode.xqa_batch_decode_with_kv_cache` (or, where that is
  missing, `trtllm_batch_decode_with_kv_cache(..., backend="xqa")`, vLLM 0.26's route), BF16 query, `kv_layout="NHD"`
  (vLLM's default on Hopper), a zeroed 394 MiB workspace, `bmm1_scale = sm_scale * k_scale` and `bmm2_scale = v_scale`
  as Python floats (a CUDA graph keeps them from its capture).
- `xqa_fp8_tensor_scales`: the same with `bmm1_scale` and `bmm2_scale` as 0-dim float32 CUDA tensors computed inside
  the graph (`k_scale_tensor * sm_scale`, `v_scale_tensor`), as a backend reading live scales would: the cost of
  tensor scales in a captured graph (FlashInfer then derives XQA's own scales with a few more tensor ops).
- `xqa_fp8_live_scales`: the same kernel as trl-fp8's backend runs it (`rollout/vllm/xqa_backend.py`): XQA's own
  `q_scale` and `kv_scale` as 0-dim float32 CUDA tensors precomputed from each layer's scale tensors outside the graph
  (`xqa_scales.LiveXQAScales`, refreshed at the eager call, a no-op while capturing), handed through the backend's
  wrapper (`_compat.route_xqa_scales`) straight to `flashinfer.xqa.xqa`: no scale arithmetic inside the graph (a call
  that would leave that path fails the kernel).

The cache is laid out as vLLM 0.26 and 0.31 lay it out on Hopper (`--kv_layout packed`: one tensor per layer,
`[num_blocks, block_size, kv_heads, 2 * head_dim]`, K and V side by side in the last dimension, the kernels given
strided views; `separate`: one contiguous tensor each), filled with random FP8 values (K and V of unit standard
deviation once dequantized by `--k_scale` and `--v_scale`); each sequence's pages are taken from a shuffled pool, so
the gather is not contiguous (`--max_model_len`: block tables as wide as vLLM's for that length, the unused entries
0). Each of `--layers` calls (one per layer) reads a cache of its own, so no call finds the previous one's pages in L2.
Each kernel's calls are captured in one `torch.cuda.CUDAGraph`, replayed `--warmup` times, then timed with CUDA events
over `--repeats` replays (each behind a short GPU sleep, so the graph's launch is not timed): the median, divided by
the calls, is the time per call.

Floor: the bytes a call must move, `seqs x context x kv_heads x head_dim x 2 (K and V) x bytes per element` plus the
query read and the BF16 output written, over the HBM bandwidth of the data sheet (`bench_rollout.HARDWARE`: 4.8 TB/s
for an H200, 3.35 for an H100; `--hbm_tb_s` for another GPU). Check: each kernel's output (of the first layer,
eagerly and again after the graph's replays) against a float32 PyTorch attention over the dequantized cache, gathered
through the block table; it fails the run (exit 1, after the table and the results file) where the largest error
exceeds 2^-3 of the output's largest magnitude: the FP8 kernels round twice to e4m3 beyond the cache (the query, and
the softmax probabilities before the P.V product), each by at most 2^-4 relative (half an ulp of e4m3's 3-bit
mantissa). On CPU (no CUDA, no vLLM) only the reference runs, checked against `scaled_dot_product_attention` on the
same tokens gathered one by one, with the floors; the kernels are reported as skipped. Writes
`benchmarks/results/decode_attention_<device>.json` (with `--quick`, only with `--out`).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import traceback
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch

from benchmarks.bench_rollout import hbm_bandwidth
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
# Two e4m3 roundings beyond the cache (the query, the probabilities), each at most half an ulp of a 3-bit mantissa.
ERR_BOUND = 2 * 2.0**-4
XQA_WORKSPACE_BYTES = 394 * 1024 * 1024  # vLLM's VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE default (0.26 and 0.31)
FA3_CUDA_GRAPH_SPLITS = 32  # vLLM's AttentionConfig.flash_attn_max_num_splits_for_cuda_graph default
MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS = 128, 16  # vLLM triton_attn.py's constants (imported where found)
MAX_CUDAGRAPH_CAPTURE_SIZE = 512  # vLLM's default largest capture size
FLASHINFER_PACKAGES = ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache")

FULL = dict(seqs=128, context=[256, 1024, 2048], q_heads=32, kv_heads=8, head_dim=128, block_size=16, layers=20,
            warmup=3, repeats=20)  # fmt: skip
QUICK = dict(seqs=4, context=[48, 80], q_heads=8, kv_heads=2, head_dim=64, block_size=16, layers=2, warmup=1,
             repeats=3)  # fmt: skip


@dataclass(frozen=True)
class Kernel:
    label: str
    kv_bytes: int  # per cached element read
    q_bytes: int  # per query element read


KERNELS = {
    "fa3_bf16": Kernel("FlashAttention-3 (vLLM's), BF16 cache", 2, 2),
    "fa3_fp8": Kernel("FlashAttention-3 (vLLM's), FP8 cache, FP8 query", 1, 1),
    "triton_fp8": Kernel("vLLM's Triton unified attention, FP8 cache, FP8 query", 1, 1),
    "xqa_fp8": Kernel("FlashInfer's XQA, FP8 cache, BF16 query, float scales", 1, 2),
    "xqa_fp8_tensor_scales": Kernel("FlashInfer's XQA, FP8 cache, BF16 query, tensor scales", 1, 2),
    "xqa_fp8_live_scales": Kernel(
        "FlashInfer's XQA, FP8 cache, BF16 query, precomputed tensor scales (trl-fp8's)", 1, 2
    ),
}


@dataclass(frozen=True)
class Shape:
    seqs: int
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int


def decode_bytes(shape: Shape, context: int, kv_bytes: int, q_bytes: int, out_bytes: int = 2) -> dict:
    """What one decode call must move: every sequence's K and V over `context` tokens, its query read and its output
    written (the block table and sequence lengths, under 0.1% here, are left out)."""
    kv = shape.seqs * context * shape.kv_heads * shape.head_dim * 2 * kv_bytes
    query_output = shape.seqs * shape.q_heads * shape.head_dim * (q_bytes + out_bytes)
    return {"kv": kv, "query_output": query_output, "total": kv + query_output}


def floor_us(nbytes: int, hbm_bytes_per_s: float) -> float:
    return nbytes / hbm_bytes_per_s * 1e6


def cudagraph_capture_sizes(max_size: int = MAX_CUDAGRAPH_CAPTURE_SIZE) -> list[int]:
    """vLLM's default CUDA-graph capture sizes."""
    return [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))


def triton_seq_threshold_3d(kv_heads: int, min_grid: int = MIN_LAUNCH_GRID_SIZE_2D) -> int:
    """The batch size above which vLLM's Triton backend runs the 2D kernel (`TritonAttentionMetadataBuilder`: the 2D
    grid's minimum size over the KV heads, snapped to the nearest capture size under full CUDA graphs)."""
    target = min_grid // kv_heads
    return min(cudagraph_capture_sizes(), key=lambda size: abs(size - target))


def quantize_query(q: torch.Tensor, q_scale: float) -> torch.Tensor:
    """vLLM's static per-tensor query quantization (`QuantFP8.forward_native`)."""
    return (q.float() * (1.0 / q_scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def new_cache(shape: Shape, num_blocks: int, dtype: torch.dtype, layout: str, device) -> tuple:
    """One layer's cache as `(storage, k, v)`: `k` and `v` are `[num_blocks, block_size, kv_heads, head_dim]` views,
    of one `[..., 2 * head_dim]` tensor (vLLM's layout, `packed`) or of one tensor each (`separate`)."""
    dims = (num_blocks, shape.block_size, shape.kv_heads)
    d = shape.head_dim
    if layout == "packed":
        storage = torch.empty(*dims, 2 * d, dtype=dtype, device=device)
        return storage, storage[..., :d], storage[..., d:]
    k, v = torch.empty(*dims, d, dtype=dtype, device=device), torch.empty(*dims, d, dtype=dtype, device=device)
    return (k, v), k, v


def _block_chunks(view: torch.Tensor, elements: int = 1 << 26):
    step = max(1, elements // max(1, view[0].numel()))
    return [slice(i, i + step) for i in range(0, view.shape[0], step)]


def fill_fp8_(view: torch.Tensor, scale: float, gen: torch.Generator) -> None:
    """Random FP8 values whose dequantized values (`x scale`) have unit standard deviation."""
    for chunk in _block_chunks(view):
        part = view[chunk]
        x = torch.randn(part.shape, generator=gen, device=view.device, dtype=torch.float32)
        part.copy_(x.mul_(1.0 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8))


def dequantize_into_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    for chunk in _block_chunks(src):
        dst[chunk].copy_((src[chunk].float() * scale).to(dst.dtype))


@dataclass
class DecodeBatch:
    """One decode step's inputs at one context length: the query, `layers` FP8 caches (and BF16 copies) sharing one
    block table, as vLLM's layers share theirs."""

    shape: Shape
    context: int
    q: torch.Tensor  # [seqs, q_heads, head_dim] BF16
    q_fp8: torch.Tensor
    fp8: list[tuple]  # per layer: (storage, k view, v view)
    block_table: torch.Tensor  # [seqs, table width] int32: each sequence's pages, from a shuffled pool
    seq_lens: torch.Tensor  # [seqs] int32
    cu_seqlens_q: torch.Tensor  # [seqs + 1] int32
    num_blocks: int
    layout: str
    bf16: list[tuple] | None = None

    def ensure_bf16(self, k_scale: float, v_scale: float) -> None:
        if self.bf16 is not None:
            return
        self.bf16 = []
        for _, k8, v8 in self.fp8:
            cache = new_cache(self.shape, self.num_blocks, torch.bfloat16, self.layout, k8.device)
            dequantize_into_(cache[1], k8, k_scale)
            dequantize_into_(cache[2], v8, v_scale)
            self.bf16.append(cache)


def make_batch(
    shape: Shape, context: int, layers: int, scales: dict, layout: str, seed: int, device, table_pages: int = 0
) -> DecodeBatch:
    """`table_pages`: the block table's width (vLLM's is `max_model_len / block_size`; the entries past a sequence's
    pages are 0, as vLLM leaves them); 0: as wide as `context` needs."""
    gen = torch.Generator(device=device).manual_seed(seed + context)
    pages = -(-context // shape.block_size)
    num_blocks = shape.seqs * pages
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_table = torch.zeros(shape.seqs, max(pages, table_pages), dtype=torch.int32, device=device)
    block_table[:, :pages] = perm.view(shape.seqs, pages)
    q = torch.randn(shape.seqs, shape.q_heads, shape.head_dim, generator=gen, device=device).to(torch.bfloat16)
    caches = []
    for _ in range(layers):
        cache = new_cache(shape, num_blocks, FP8, layout, device)
        fill_fp8_(cache[1], scales["k"], gen)
        fill_fp8_(cache[2], scales["v"], gen)
        caches.append(cache)
    return DecodeBatch(
        shape=shape, context=context, q=q, q_fp8=quantize_query(q, scales["q"]), fp8=caches,
        block_table=block_table, seq_lens=torch.full((shape.seqs,), context, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(shape.seqs + 1, dtype=torch.int32, device=device), num_blocks=num_blocks,
        layout=layout,
    )  # fmt: skip


def reference_attention(
    q, k_cache, v_cache, block_table, context: int, k_scale: float, v_scale: float
) -> torch.Tensor:
    """float32 single-token attention of each sequence's query over its first `context` cached tokens, the pages
    gathered through the block table and dequantized; query head h reads KV head h // (q_heads / kv_heads)."""
    seqs, q_heads, d = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    pages = -(-context // block_size)
    out = torch.empty(seqs, q_heads, d, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 26) // (context * kv_heads * d))  # float32 K and V of 256 MiB each at most
    for s0 in range(0, seqs, chunk):
        table = block_table[s0 : s0 + chunk, :pages].long()
        k = k_cache[table].flatten(1, 2)[:, :context].float() * k_scale  # [c, context, kv_heads, d]
        v = v_cache[table].flatten(1, 2)[:, :context].float() * v_scale
        qq = q[s0 : s0 + chunk].float().view(-1, kv_heads, group, d)
        p = torch.softmax(torch.einsum("ckgd,cnkd->ckgn", qq, k) * d**-0.5, dim=-1)
        out[s0 : s0 + chunk] = torch.einsum("ckgn,cnkd->ckgd", p, v).reshape(-1, q_heads, d)
    return out


def reference_self_check(batch: DecodeBatch, ref: torch.Tensor, scales: dict, seqs: int = 4) -> float:
    """The reference against `scaled_dot_product_attention` on the same tokens gathered one at a time (token t of
    sequence s: page `block_table[s, t // block_size]`, slot `t % block_size`): largest absolute difference."""
    import torch.nn.functional as F

    _, k8, v8 = batch.fp8[0]
    t = torch.arange(batch.context, device=k8.device)
    worst = 0.0
    for s in range(min(seqs, batch.shape.seqs)):
        page, slot = batch.block_table[s, t // batch.shape.block_size].long(), t % batch.shape.block_size
        k = (k8[page, slot].float() * scales["k"]).transpose(0, 1)[None]  # [1, kv_heads, context, d]
        v = (v8[page, slot].float() * scales["v"]).transpose(0, 1)[None]
        q = batch.q[s].float()[None, :, None]  # [1, q_heads, 1, d]
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[0, :, 0]
        worst = max(worst, (o - ref[s]).abs().max().item())
    return worst


class Skipped(Exception):
    """A kernel that cannot run here (not installed, not built): reported with its reason, the run goes on."""


def _reason(exc: BaseException) -> str:
    """An exception in one line: its first line, and its last where the message runs over several (a build log)."""
    lines = [line.strip() for text in traceback.format_exception_only(type(exc), exc) for line in text.splitlines()]
    lines = [line for line in lines if line] or [type(exc).__name__]
    return (lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}")[:500]


def _flash_attn():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata
        from vllm.vllm_flash_attn.flash_attn_interface import fa_version_unsupported_reason, is_fa_version_supported
    except Exception as exc:  # noqa: BLE001 - vLLM missing, or built without its FlashAttention
        raise Skipped(f"vllm.vllm_flash_attn: {_reason(exc)}") from exc
    if not is_fa_version_supported(3):
        raise Skipped(f"FlashAttention 3 unsupported here: {fa_version_unsupported_reason(3)}")
    return flash_attn_varlen_func, get_scheduler_metadata


def fa3_calls(batch: DecodeBatch, fp8: bool, args, scales_t: dict) -> tuple[list, list, str]:
    """One `flash_attn_varlen_func` call per layer, as `FlashAttentionImpl.forward` makes it at decode."""
    flash_attn_varlen_func, get_scheduler_metadata = _flash_attn()
    shape = batch.shape
    if not fp8:
        batch.ensure_bf16(args.k_scale, args.v_scale)
    caches = batch.fp8 if fp8 else batch.bf16
    q = batch.q_fp8 if fp8 else batch.q
    scheduler_metadata = None
    if not args.fa3_no_scheduler_metadata:  # the builder's AOT schedule (`_get_scheduler_metadata`)
        scheduler_metadata = get_scheduler_metadata(
            batch_size=shape.seqs, max_seqlen_q=1, max_seqlen_k=batch.context, num_heads_q=shape.q_heads,
            num_heads_kv=shape.kv_heads, headdim=shape.head_dim, cache_seqlens=batch.seq_lens,
            qkv_dtype=FP8 if fp8 else torch.bfloat16, cu_seqlens_q=batch.cu_seqlens_q, page_size=shape.block_size,
            causal=True, window_size=(-1, -1), num_splits=args.fa3_num_splits,
        )  # fmt: skip
    descale_shape = (shape.seqs, shape.kv_heads)
    descales = (
        {f"{x}_descale": scales_t[x].expand(descale_shape) for x in ("q", "k", "v")}
        if fp8
        else {"q_descale": None, "k_descale": None, "v_descale": None}
    )
    outs = [torch.empty(shape.seqs, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device=q.device)
            for _ in caches]  # fmt: skip

    def call(layer: int):
        _, k, v = caches[layer]
        return lambda: flash_attn_varlen_func(
            q=q, k=k, v=v, out=outs[layer], cu_seqlens_q=batch.cu_seqlens_q, max_seqlen_q=1,
            seqused_k=batch.seq_lens, max_seqlen_k=batch.context, softmax_scale=shape.head_dim**-0.5, causal=True,
            alibi_slopes=None, window_size=[-1, -1], block_table=batch.block_table, softcap=0,
            scheduler_metadata=scheduler_metadata, fa_version=3, num_splits=args.fa3_num_splits, s_aux=None,
            **descales,
        )  # fmt: skip

    metadata_arg = "None" if scheduler_metadata is None else "get_scheduler_metadata(...)"
    api = (f"vllm.vllm_flash_attn.flash_attn_varlen_func(fa_version=3, num_splits={args.fa3_num_splits}, "
           f"scheduler_metadata={metadata_arg})")  # fmt: skip
    return [call(i) for i in range(len(caches))], outs, api


def triton_calls(batch: DecodeBatch, args, scales_t: dict) -> tuple[list, list, str]:
    """One `unified_attention` call per layer, as `TritonAttentionImpl.forward` makes it on an FP8 cache."""
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
        from vllm.v1.kv_cache_interface import KVQuantMode
    except Exception as exc:  # noqa: BLE001
        raise Skipped(f"vLLM's Triton unified attention: {_reason(exc)}") from exc
    min_grid, segments = MIN_LAUNCH_GRID_SIZE_2D, NUM_PAR_SOFTMAX_SEGMENTS
    try:  # the backend's own constants, where its module imports (vLLM 0.26 and 0.31 have the ones above)
        from vllm.v1.attention.backends import triton_attn

        min_grid, segments = triton_attn.MIN_LAUNCH_GRID_SIZE_2D, triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
    except Exception:  # noqa: BLE001
        pass
    shape, device = batch.shape, batch.q.device
    threshold = triton_seq_threshold_3d(shape.kv_heads, min_grid)
    head_padded = 1 << (shape.head_dim - 1).bit_length()
    segm_output = torch.empty(threshold, shape.q_heads, segments, head_padded, dtype=torch.float32, device=device)
    segm_max = torch.empty(threshold, shape.q_heads, segments, dtype=torch.float32, device=device)
    segm_expsum = torch.empty(threshold, shape.q_heads, segments, dtype=torch.float32, device=device)
    descale_shape = (shape.seqs, shape.kv_heads)
    outs = [torch.empty(shape.seqs, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
            for _ in batch.fp8]  # fmt: skip

    def call(layer: int):
        _, k, v = batch.fp8[layer]
        return lambda: unified_attention(
            q=batch.q_fp8, k=k, v=v, out=outs[layer], cu_seqlens_q=batch.cu_seqlens_q, max_seqlen_q=1,
            seqused_k=batch.seq_lens, max_seqlen_k=batch.context, softmax_scale=shape.head_dim**-0.5, causal=True,
            window_size=(-1, -1), block_table=batch.block_table, softcap=0, q_descale=scales_t["q"],
            k_descale=scales_t["k"].expand(descale_shape), v_descale=scales_t["v"].expand(descale_shape),
            seq_threshold_3D=threshold, num_par_softmax_segments=segments, softmax_segm_output=segm_output,
            softmax_segm_max=segm_max, softmax_segm_expsum=segm_expsum, alibi_slopes=None, sinks=None,
            output_scale=None, kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
        )  # fmt: skip

    kernel = "2D" if shape.seqs > threshold else "3D"
    api = (f"vllm.v1.attention.ops.triton_unified_attention.unified_attention ({kernel} kernel, "
           f"seq_threshold_3D={threshold})")  # fmt: skip
    return [call(i) for i in range(len(batch.fp8))], outs, api


def _ninja_on_path() -> str | None:
    """FlashInfer's JIT runs the `ninja` executable: the `ninja` wheel's, where none is on PATH."""
    if shutil.which("ninja") is None:
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass
    return shutil.which("ninja")


def xqa_calls(batch: DecodeBatch, scales: str, args, scales_t: dict, state: dict) -> tuple[list, list, str]:
    """One XQA decode call per layer, as `FlashInferImpl.forward` makes it in its `decode_with_xqa` branch (`scales`:
    "floats", "tensors"), or as trl-fp8's backend makes it ("precomputed")."""
    try:
        import flashinfer.decode as fi_decode
    except Exception as exc:  # noqa: BLE001
        raise Skipped(f"flashinfer: {_reason(exc)}") from exc
    state.setdefault("ninja", _ninja_on_path())
    xqa = getattr(fi_decode, "xqa_batch_decode_with_kv_cache", None)
    if xqa is not None:
        entry, extra = "flashinfer.decode.xqa_batch_decode_with_kv_cache", {}
    else:  # older FlashInfer: vLLM 0.26's route to the same kernel
        xqa = fi_decode.trtllm_batch_decode_with_kv_cache
        entry, extra = "flashinfer.decode.trtllm_batch_decode_with_kv_cache", {"backend": "xqa"}
    shape, device = batch.shape, batch.q.device
    if "workspace" not in state:  # one zeroed buffer for every layer, as vLLM's `_get_trtllm_workspace_buffer`
        state["workspace"] = torch.zeros(XQA_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    workspace = state["workspace"]
    sm_scale = shape.head_dim**-0.5
    outs = [torch.empty(shape.seqs, shape.q_heads, shape.head_dim, dtype=torch.bfloat16, device=device)
            for _ in batch.fp8]  # fmt: skip
    if scales == "precomputed":
        return _live_scale_xqa_calls(batch, scales_t, workspace, outs)

    def call(layer: int):
        _, k, v = batch.fp8[layer]

        def run():
            if scales == "tensors":  # computed inside the graph: a later scale would reach every replay
                bmm1, bmm2 = scales_t["k"] * sm_scale, scales_t["v"]
            else:  # vLLM's get_xqa_bmm1_scale (BF16 query: no q_scale) and bmm2_scale, host floats
                bmm1, bmm2 = sm_scale * args.k_scale, args.v_scale
            xqa(
                query=batch.q, kv_cache=(k, v), workspace_buffer=workspace, block_tables=batch.block_table,
                seq_lens=batch.seq_lens, max_seq_len=batch.context, bmm1_scale=bmm1, bmm2_scale=bmm2,
                window_left=-1, out=outs[layer], sinks=None, kv_layout="NHD", q_len_per_req=1, **extra,
            )  # fmt: skip

        return run

    backend = "backend='xqa', " if extra else ""
    scales_as = "0-dim CUDA tensors" if scales == "tensors" else "floats"
    api = f"{entry}({backend}kv_layout='NHD', bmm1_scale and bmm2_scale as {scales_as})"
    return [call(i) for i in range(len(batch.fp8))], outs, api


def _live_scale_xqa_calls(batch: DecodeBatch, scales_t: dict, workspace, outs) -> tuple[list, list, str]:
    """trl-fp8's backend's XQA decode: each layer's scale tensors (its own, as vLLM's layers hold theirs), XQA's
    q_scale precomputed from them at the eager call, the marker through the backend's wrapper to
    `flashinfer.xqa.xqa`."""
    try:
        from trl_fp8.rollout.vllm._compat import flashinfer_xqa_kernel_missing, route_xqa_scales
        from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales
    except Exception as exc:  # noqa: BLE001
        raise Skipped(f"trl_fp8's XQA scales: {_reason(exc)}") from exc
    if missing := flashinfer_xqa_kernel_missing():
        raise Skipped(missing)

    def not_direct(*_, **__):
        raise RuntimeError("the call left the direct path for FlashInfer's wrapper")

    decode = route_xqa_scales(not_direct)
    shape = batch.shape

    def call(index: int):
        _, k, v = batch.fp8[index]
        layer = torch.nn.Module()
        layer._k_scale, layer._v_scale = scales_t["k"].clone(), scales_t["v"].clone()
        live = LiveXQAScales(shape.head_dim**-0.5, shape.head_dim)

        def run():
            live.refresh(layer)  # as the backend's forward: at the eager call; a no-op while capturing
            decode(
                query=batch.q, kv_cache=(k, v), workspace_buffer=workspace, block_tables=batch.block_table,
                seq_lens=batch.seq_lens, max_seq_len=batch.context, bmm1_scale=live.scales,
                bmm2_scale=layer._v_scale, window_left=-1, out=outs[index], sinks=None, kv_layout="NHD",
                q_len_per_req=1,
            )  # fmt: skip

        return run

    api = ("trl_fp8.rollout.vllm._compat.route_xqa_scales -> flashinfer.xqa.xqa(kv_layout='NHD', q_scale and "
           "kv_scale as 0-dim CUDA tensors precomputed outside the graph)")  # fmt: skip
    return [call(i) for i in range(len(batch.fp8))], outs, api


def build_calls(name: str, batch: DecodeBatch, args, scales_t: dict, state: dict) -> tuple[list, list, str]:
    if name in ("fa3_bf16", "fa3_fp8"):
        return fa3_calls(batch, name == "fa3_fp8", args, scales_t)
    if name == "triton_fp8":
        return triton_calls(batch, args, scales_t)
    scales = {"xqa_fp8": "floats", "xqa_fp8_tensor_scales": "tensors", "xqa_fp8_live_scales": "precomputed"}[name]
    return xqa_calls(batch, scales, args, scales_t, state)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item()


def run_kernel(name: str, batch: DecodeBatch, ref: torch.Tensor, max_ref: float, args, scales_t, state) -> dict:
    """One kernel at one context: checked eagerly, timed in a graph, checked again after the replays."""
    calls, outs, api = build_calls(name, batch, args, scales_t, state)
    state.setdefault("api", {})[name] = api
    ran = state.setdefault("ran", set())
    try:
        calls[0]()  # the first call builds or compiles (XQA's JIT, Triton)
        torch.cuda.synchronize()
    except Exception as exc:
        if name in ran:  # it ran at another context: an error of this one
            raise
        traceback.print_exc()  # the whole of it (a JIT build's log) in the run's log
        raise Skipped(f"its first call failed: {_reason(exc)}") from exc
    ran.add(name)
    err_eager = max_error(outs[0], ref)
    outs[0].zero_()
    times, graph = graph_time_us(calls, args.warmup, args.repeats)
    err_graph = max_error(outs[0], ref)
    del graph
    us = statistics.median(times)
    err = max(err_eager, err_graph)
    return {"us": us, "us_min": min(times), "us_max": max(times), "max_err": err, "max_err_eager": err_eager,
            "max_err_graph": err_graph, "check": "ok" if err <= ERR_BOUND * max_ref else "FAILED"}  # fmt: skip


def package_versions() -> dict:
    found = {}
    for name in FLASHINFER_PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def print_table(result: dict, kernels: list[str]) -> None:
    """Rows: kernels; columns: contexts; cells: microseconds per call and the share of the floor."""
    contexts = result["shapes"]["contexts"]
    rows = {(r["kernel"], r["context"]): r for r in result["results"]}
    s = result["shapes"]
    shape = Shape(s["seqs"], s["q_heads"], s["kv_heads"], s["head_dim"], s["block_size"])
    print(f"\nDecode attention, {s['seqs']} sequences x {s['q_heads']} query / {s['kv_heads']} KV heads, head dim "
          f"{s['head_dim']}, pages of {s['block_size']} ({s['kv_layout']} cache), {result['device']}, HBM "
          f"{result['hbm_bytes_per_s'] / 1e12:.2f} TB/s ({result['hbm_source']})")  # fmt: skip
    failed = any(r.get("check") not in (None, "ok") for r in result["results"])
    print(f"us per call (share of the KV-read floor): {s['layers']} layers' calls in one CUDA graph, median of "
          f"{result['timing']['repeats']} replays" + ("; FAILED: the output's check failed (below)" if failed else ""))  # fmt: skip
    name_width, width = 26, 30
    header = "".join(f"{f'{n:,} tokens' if i == 0 else f'{n:,}':>{width}}" for i, n in enumerate(contexts))
    print(f"{'kernel':<{name_width}}{header}")
    for name in kernels:
        cells = [floor_cell(rows.get((name, n), {})) for n in contexts]
        print(f"{name:<{name_width}}" + "".join(f" {c:>{width - 1}}" for c in cells))
    for kv_bytes, q_bytes, label in ((1, 1, "FP8 cache, FP8 q"), (1, 2, "FP8 cache, BF16 q"), (2, 2, "BF16 cache")):
        floors = [floor_us(decode_bytes(shape, n, kv_bytes, q_bytes)["total"], result["hbm_bytes_per_s"])
                  for n in contexts]  # fmt: skip
        print(f"{'floor, ' + label:<{name_width}}" + "".join(f"{format_us(f):>{width}}" for f in floors))
    print()
    checks = ", ".join(f"{r['self_check_max_diff']:.2g} ({r['max_ref']:.3g}) at {r['context']:,}"
                       for r in result["reference"])  # fmt: skip
    print(f"float32 reference vs scaled_dot_product_attention, largest difference (max|ref|): {checks}")
    for name in kernels:
        k = result["kernels"][name]
        errors = [rows[(name, n)] for n in contexts if "max_err" in rows.get((name, n), {})]
        checked = ", ".join(f"{r['max_err'] / r['max_ref']:.2g}" for r in errors)
        check = f"; max err / max|ref| {checked} (bound {ERR_BOUND:g})" if errors else ""
        print(f"{name}: {k['label']}{check}" + (f"; skipped: {k['skipped']}" if k.get("skipped") else ""))
        failed = [f"{r['context']}: {r['error']}" for n in contexts if "error" in (r := rows.get((name, n), {}))]
        if failed:
            print(f"  errors: {'; '.join(failed)}")


def main(argv: list[str] | None = None) -> None:
    parser = arg_parser(__doc__, out="benchmarks/results/decode_attention_<device>.json; with --quick, only with "
                        "--out",
                        quick="smoke sizes (4 sequences, contexts 48 and 80, 2 layers): on CPU, the reference and "
                        "the floors")  # fmt: skip
    parser.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=list(KERNELS))
    parser.add_argument("--seqs", type=int, help=f"sequences decoding at once (default {FULL['seqs']})")
    parser.add_argument("--context", type=int, nargs="+", help=f"tokens in each sequence's cache ({FULL['context']})")
    parser.add_argument("--q_heads", type=int, help=f"default {FULL['q_heads']} (Qwen3-8B)")
    parser.add_argument("--kv_heads", type=int, help=f"default {FULL['kv_heads']}")
    parser.add_argument("--head_dim", type=int, help=f"default {FULL['head_dim']}")
    parser.add_argument("--block_size", type=int, help=f"tokens per page (default {FULL['block_size']})")
    parser.add_argument("--layers", type=int, help=f"calls per CUDA graph, each on its own cache ({FULL['layers']})")
    parser.add_argument("--warmup", type=int, help=f"graph replays before timing (default {FULL['warmup']})")
    parser.add_argument("--repeats", type=int, help=f"timed graph replays; the median is kept ({FULL['repeats']})")
    parser.add_argument("--q_scale", type=float, default=0.02, help="the static query scale (FP8-query kernels)")
    parser.add_argument("--k_scale", type=float, default=0.02)
    parser.add_argument("--v_scale", type=float, default=0.015)
    parser.add_argument("--kv_layout", choices=["packed", "separate"], default="packed",
                        help="packed: vLLM's [..., 2 * head_dim] cache, K and V side by side; separate: a tensor "
                        "each")  # fmt: skip
    parser.add_argument("--fa3_num_splits", type=int, default=FA3_CUDA_GRAPH_SPLITS,
                        help="FA3's num_splits (vLLM under full CUDA graphs: 32; 0: the library's "
                        "heuristic)")  # fmt: skip
    parser.add_argument("--fa3_no_scheduler_metadata", action="store_true",
                        help="no AOT scheduler metadata for FA3 (vLLM computes it for every FA3 batch)")  # fmt: skip
    parser.add_argument("--max_model_len", type=int, default=0,
                        help="block tables as wide as vLLM's for this max_model_len (0: as wide as the "
                        "context)")  # fmt: skip
    parser.add_argument("--hbm_tb_s", type=float, help="HBM bandwidth for the floor (default: the data sheet's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings = resolve_defaults(args, FULL, QUICK)
    for key, value in settings.items():
        setattr(args, key, value)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference in float32
    label = device_name()
    hbm, hbm_source = hbm_bandwidth(label, args.hbm_tb_s)
    shape = Shape(args.seqs, args.q_heads, args.kv_heads, args.head_dim, args.block_size)
    if shape.q_heads % shape.kv_heads:
        parser.error("--q_heads must be a multiple of --kv_heads")
    scales = {"q": args.q_scale, "k": args.k_scale, "v": args.v_scale}
    scales_t = {x: torch.tensor(value, dtype=torch.float32, device=device) for x, value in scales.items()}
    kernels = list(dict.fromkeys(args.kernels))
    info = {name: {"label": KERNELS[name].label, "kv_bytes": KERNELS[name].kv_bytes,
                   "q_bytes": KERNELS[name].q_bytes} for name in kernels}  # fmt: skip
    if not cuda:
        for name in kernels:
            info[name]["skipped"] = "no CUDA device: only the float32 reference and the floors run here"
    result = {
        "benchmark": "paged single-token decode attention on the FP8 KV cache, per kernel, against the KV-read floor",
        **metadata(label),
        "shapes": {
            "seqs": shape.seqs,
            "contexts": args.context,
            "q_heads": shape.q_heads,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "block_size": shape.block_size,
            "layers": args.layers,
            "kv_layout": args.kv_layout,
            "max_model_len": args.max_model_len,  # block tables as wide as vLLM makes them for it (0: the context)
        },
        "scales": scales,
        "fa3": {"num_splits": args.fa3_num_splits, "scheduler_metadata": not args.fa3_no_scheduler_metadata},
        "timing": {
            "calls_per_graph": args.layers,
            "warmup_replays": args.warmup,
            "repeats": args.repeats,
            "statistic": "median of the replays, per call",
        },
        "hbm_bytes_per_s": hbm,
        "hbm_source": hbm_source,
        "err_bound_of_max_ref": ERR_BOUND,
        "kernels": info,
        "reference": [],
        "results": [],
    }
    result["versions"].update(package_versions())
    out = results_path(args.out, "decode_attention", label) if not args.quick or args.out else None
    state: dict = {}
    for context in args.context:
        print(f"# context {context}: {args.layers} layers' caches", file=sys.stderr, flush=True)
        table_pages = -(-args.max_model_len // shape.block_size) if args.max_model_len else 0
        batch = make_batch(shape, context, args.layers, scales, args.kv_layout, args.seed, device, table_pages)
        _, k8, v8 = batch.fp8[0]
        ref = reference_attention(batch.q, k8, v8, batch.block_table, context, args.k_scale, args.v_scale)
        max_ref = ref.abs().max().item()
        self_check = reference_self_check(batch, ref, scales)
        result["reference"].append({"context": context, "max_ref": max_ref, "self_check_max_diff": self_check})
        if self_check > 1e-3 * max_ref:  # float32 sums in other orders differ by ~1e-7
            raise SystemExit(f"the float32 reference disagrees with scaled_dot_product_attention: {self_check:.3g}")
        for name in kernels:
            spec = KERNELS[name]
            nbytes = decode_bytes(shape, context, spec.kv_bytes, spec.q_bytes)
            row = {"kernel": name, "context": context, "bytes": nbytes["total"], "kv_bytes": nbytes["kv"],
                   "floor_us": floor_us(nbytes["total"], hbm), "max_ref": max_ref,
                   "err_bound": ERR_BOUND * max_ref}  # fmt: skip
            if "skipped" in info[name]:
                row["skipped"] = info[name]["skipped"]
            else:
                print(f"# context {context}: {name}", file=sys.stderr, flush=True)
                try:
                    row.update(run_kernel(name, batch, ref, max_ref, args, scales_t, state))
                    row["fraction"] = row["floor_us"] / row["us"]
                except Skipped as exc:
                    info[name]["skipped"] = row["skipped"] = str(exc)
                except Exception as exc:  # noqa: BLE001 - recorded, the others go on
                    row["error"] = _reason(exc)
                    traceback.print_exc()
                info[name].setdefault("api", state.get("api", {}).get(name))
                if name == "fa3_bf16":
                    batch.bf16 = None  # its 2-byte caches are no longer needed
            result["results"].append(row)
        del batch, ref
        if cuda:
            torch.cuda.empty_cache()
        if "ninja" in state:
            result["ninja"] = state["ninja"]  # the executable FlashInfer's JIT ran
        if out is not None:  # after every context: a crash keeps what ran
            write_json(out, result)
    print_table(result, kernels)
    if out is not None:
        print(f"wrote {out}")
    exit_if_checks_failed(result["results"], f"{ERR_BOUND:g} x max|ref|", "kernel", "context")


if __name__ == "__main__":
    main()
