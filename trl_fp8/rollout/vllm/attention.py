"""Which kernel attends over the rollout engine's FP8 KV cache, and how the scales of every sync reach it.

With an FP8 KV cache the trainer pushes new q/k/v scales at every weight sync (`rollout.kv_scales`). vLLM writes them
in place into each attention layer's `_q_scale`, `_k_scale` and `_v_scale` tensors, and into Python floats beside
them. Two kernels can take them:

- FlashAttention-3 (vLLM's `FLASH_ATTN` backend) reads the tensors on every call, CUDA graphs included. On the FP8
  cache it runs a 128-row query tile for 4 real rows of a grouped-query head, and reaches about half of its KV-read
  floor at 1-2k tokens (the documentation's "Benchmarks" page).
- XQA, TensorRT-LLM's decode kernel in FlashInfer, tiles the KV tokens instead and reaches 77-83% of the same
  floor, with a BF16 query. vLLM's `FLASHINFER` backend runs it for decode on Hopper, but hands it the KV scales as
  the Python floats, which a CUDA graph keeps from its capture: the scales pushed later never reach decode.
  trl-fp8's backend (`xqa_backend.LiveScaleFlashInferBackend`, vLLM's `CUSTOM` backend, registered in every vLLM
  process by the package's `vllm.general_plugins` entry point) is vLLM's FlashInfer backend with those scales read
  from tensors: the layer's `_v_scale` and a `q_scale` precomputed from the layer's scales outside the graphs
  (`xqa_scales`). Prefill keeps FlashInfer's own FP8 kernel, which runs outside the CUDA graphs and reads the floats
  vLLM refreshes at every sync.

On Hopper FlashInfer builds XQA from its own sources with nvcc and `ninja` (seconds, cached on disk), so nothing is
downloaded; vLLM only runs it when told its kernels are there (`VLLM_HAS_FLASHINFER_CUBIN`), which the backend says
for its own process. Before a colocated engine starts, `choose_kv_attention` builds XQA and checks, on this GPU, that
a decode captured in a CUDA graph follows scales changed after the capture; where anything fails the engine keeps
FlashAttention-3 and the returned reason says why.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

import torch

from trl_fp8.config import VLLM_FP8_KV_ATTENTIONS as FP8_KV_ATTENTIONS
from trl_fp8.quantization import FP8_DTYPE, FP8_MAX
from trl_fp8.rollout.vllm.kernels import FP8_KV_ATTENTION_BACKEND, _find_nvcc

__all__ = [
    "FP8_KV_ATTENTIONS",
    "KVAttention",
    "attention_heads",
    "choose_kv_attention",
    "decode_follows_live_scales",
    "ninja_dir",
    "xqa_env",
    "xqa_unavailable_reason",
]

# vLLM's `attention_backend` name for each kernel ("CUSTOM": the backend `plugin.register` installs): the backends
# that take the FP8 KV cache's scales of every sync, colocated or in a server.
VLLM_ATTENTION_BACKEND = {"xqa": "CUSTOM", "flash_attn": FP8_KV_ATTENTION_BACKEND}
PAGE_SIZE = 16  # vLLM's default KV-cache block size; XQA takes 16, 32, 64 or 128


@dataclass(frozen=True)
class KVAttention:
    """A resolved choice: `kernel` ("xqa" or "flash_attn"), vLLM's `attention_backend` for it, why, and the
    environment variables the engine's process needs."""

    kernel: str
    reason: str
    env: dict[str, str] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        return VLLM_ATTENTION_BACKEND[self.kernel]


def attention_heads(config) -> dict[str, int]:
    """`head_dim`, `q_heads` and `kv_heads` of a transformers config's decoder attention (its text model's)."""
    from trl_fp8.rollout.capacity import text_config

    text = text_config(config)
    q_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // q_heads
    return {
        "head_dim": head_dim,
        "q_heads": q_heads,
        "kv_heads": getattr(text, "num_key_value_heads", None) or q_heads,
    }


def ninja_dir() -> str | None:
    """A folder holding the `ninja` executable FlashInfer's JIT build runs: PATH's, else the `ninja` wheel's."""
    found = shutil.which("ninja")
    if found:
        return os.path.dirname(found)
    try:
        import ninja
    except ImportError:
        return None
    return ninja.BIN_DIR if os.path.exists(os.path.join(ninja.BIN_DIR, "ninja")) else None


def xqa_env(environ=os.environ) -> dict[str, str]:
    """Settings under which vLLM runs XQA offline on Hopper: its kernels are built here, not downloaded
    (`VLLM_HAS_FLASHINFER_CUBIN`), and the build finds `ninja`."""
    env = {"VLLM_HAS_FLASHINFER_CUBIN": "1"}
    folder = ninja_dir()
    path = environ.get("PATH", "")
    if folder and folder not in path.split(os.pathsep):
        env["PATH"] = folder + (os.pathsep + path if path else "")
    return env


def xqa_unavailable_reason(
    device: torch.device | int | None = None, *, head_dim: int = 128, q_heads: int = 32, kv_heads: int = 8
) -> str | None:
    """Why trl-fp8's XQA backend cannot run decode on the FP8 KV cache of a model with these heads here, or None.
    Checks the GPU, the packages and the shape, then builds XQA and runs `decode_follows_live_scales`."""
    from trl_fp8.rollout.vllm._compat import (
        flashinfer_xqa_decode,
        flashinfer_xqa_kernel_missing,
        live_scale_backend_missing,
    )

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"XQA's FP8 decode runs on Hopper (SM90) here, this GPU is sm_{major}{minor}"
    if head_dim % 16 or not 16 <= head_dim <= 256 or q_heads % kv_heads:
        return f"XQA takes head dims 16-256 in steps of 16 and whole query groups ({q_heads}/{kv_heads}x{head_dim})"
    if missing := live_scale_backend_missing():
        return missing
    if flashinfer_xqa_decode() is None:
        return "this FlashInfer has no XQA decode (flashinfer.decode.xqa_batch_decode_with_kv_cache)"
    if missing := flashinfer_xqa_kernel_missing():
        return missing
    if _find_nvcc() is None:
        return "FlashInfer builds XQA with nvcc, which is not here (set CUDA_HOME)"
    if ninja_dir() is None:
        return "FlashInfer builds XQA with ninja, which is not here (pip install ninja)"
    env = xqa_env()
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the build's ninja; kept only where the engine runs XQA (`KVAttention.env`)
    try:
        return decode_follows_live_scales(device, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads)
    except Exception as exc:  # a build or launch failure of a third-party kernel: keep FlashAttention-3
        return f"XQA did not build or run here ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _reference_decode(q, k, v, seq_lens, sm_scale):
    """Float32 attention of one query token per sequence over its first `seq_lens[i]` keys and values."""
    out = []
    group = q.shape[1] // k.shape[2]
    for i, n in enumerate(seq_lens.tolist()):
        ki = k[i, :n].float().repeat_interleave(group, dim=1)  # [n, q_heads, d]
        vi = v[i, :n].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("hd,nhd->hn", q[i].float(), ki) * sm_scale
        out.append(torch.einsum("hn,nhd->hd", logits.softmax(-1), vi))
    return torch.stack(out)


def decode_follows_live_scales(
    device: torch.device | int | None = None,
    *,
    head_dim: int = 128,
    q_heads: int = 32,
    kv_heads: int = 8,
    float_scales: bool = False,
    refresh: bool = True,
) -> str | None:
    """Capture XQA's decode over an FP8 paged cache in a CUDA graph, its scales handed over as
    `LiveScaleFlashInferImpl` hands them (`xqa_scales.LiveXQAScales` refreshed at each eager call, the marker it
    gives vLLM's forward, FlashInfer's XQA decode wrapped by `_compat.route_xqa_scales`, which then calls XQA
    directly), change the layer's scale tensors, refresh (as a reload and an eager forward do), replay, and compare
    each replay with a float32 attention over the cache dequantized at the new scales. Returns why it failed, or
    None.

    `float_scales=True` passes the scales as Python floats, as vLLM's own FlashInfer backend does; `refresh=False`
    changes the tensors but leaves the precomputed `q_scale` as computed before the capture. The check then fails
    either way (the graph keeps what it captured), which is what it exists to catch."""
    from trl_fp8.rollout.vllm._compat import flashinfer_xqa_decode, route_xqa_scales
    from trl_fp8.rollout.vllm.xqa_scales import LiveXQAScales

    wrapper = flashinfer_xqa_decode()
    wrapper_calls = []

    def flashinfer_wrapper(*args, **kwargs):  # where any call the direct path does not take goes
        wrapper_calls.append(kwargs.get("bmm1_scale"))
        return wrapper(*args, **kwargs)

    decode = route_xqa_scales(flashinfer_wrapper)
    device = torch.device("cuda", torch.cuda.current_device() if device is None else torch.device(device).index or 0)
    gen = torch.Generator(device=device).manual_seed(0)
    seqs, pages_per_seq = 4, 5
    seq_lens = torch.tensor([80, 33, 1, 57], dtype=torch.int32, device=device)
    pages = torch.randperm(seqs * pages_per_seq, generator=gen, device=device).view(seqs, pages_per_seq)
    shape = (seqs * pages_per_seq, PAGE_SIZE, kv_heads, head_dim)
    # Clamped to FP8's range before the cast: torch 2.11's CUDA cast turns an overflow into NaN (2.13's saturates),
    # and one NaN in the cache would fail the check on every replay.
    k_cache, v_cache = (
        torch.randn(shape, generator=gen, device=device).mul(100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        for _ in range(2)
    )
    q = torch.randn(seqs, q_heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty_like(q)
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    sm_scale = head_dim**-0.5
    layer = torch.nn.Module()  # the attention layer's scales, as vLLM holds them (float32, 0-dim)
    layer._k_scale = torch.tensor(0.004, device=device)
    layer._v_scale = torch.tensor(0.006, device=device)
    live = LiveXQAScales(sm_scale, head_dim)

    captured_floats = (sm_scale * layer._k_scale.item(), layer._v_scale.item())  # what vLLM's backend would pass

    def run():
        if float_scales:
            bmm1, bmm2 = captured_floats
        else:  # as LiveScaleFlashInferImpl.forward and get_xqa_bmm1_scale do
            live.refresh(layer)  # a no-op while capturing
            bmm1, bmm2 = live.scales, layer._v_scale
        decode(
            query=q, kv_cache=(k_cache, v_cache), workspace_buffer=workspace, block_tables=pages.int(),
            seq_lens=seq_lens, max_seq_len=pages_per_seq * PAGE_SIZE, bmm1_scale=bmm1, bmm2_scale=bmm2,
            window_left=-1, out=out, sinks=None, kv_layout="NHD", q_len_per_req=1, mask=None,
        )  # fmt: skip

    # vLLM runs its forwards (the first makes q_scale) and captures in inference mode, its reload outside it
    with torch.inference_mode():
        run()  # builds XQA (cached on disk) and warms it up outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    if not float_scales and wrapper_calls:
        return "XQA's decode with precomputed scales went through FlashInfer's wrapper, not the direct call"
    # each sequence's keys and values in order, [seqs, pages * 16, kv_heads, d] (gathered as bytes)
    k_seq, v_seq = (c.view(torch.uint8)[pages].flatten(1, 2).view(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    for i, (ks, vs) in enumerate(((0.004, 0.006), (0.002, 0.012), (0.008, 0.003))):
        layer._k_scale.fill_(ks)
        layer._v_scale.fill_(vs)
        if refresh and not float_scales and i % 2:
            live.refresh()  # as after a reload: the layer, kept weakly
        elif refresh and not float_scales:
            with torch.inference_mode():
                live.refresh(layer)  # as an eager forward
        graph.replay()
        torch.cuda.synchronize(device)
        want = _reference_decode(q, k_seq.float() * ks, v_seq.float() * vs, seq_lens, sm_scale)
        err = (out.float() - want).abs().max().item()
        # XQA reads the BF16 query, accumulates in float32 and rounds P to FP8 for P @ V: errors of a few FP8 steps
        # (2^-4 relative) of the output's magnitude; a stale scale is off by the ratio of the scales (2-4x here).
        bound = 2**-3 * want.abs().max().item()
        if not err <= bound:
            return (
                f"XQA's captured decode does not follow the KV scales changed after capture (k_scale={ks}, "
                f"v_scale={vs}: max error {err:.3g} > {bound:.3g})"
            )
    return None


def choose_kv_attention(
    choice: str = "auto",
    device: torch.device | int | None = None,
    *,
    head_dim: int = 128,
    q_heads: int = 32,
    kv_heads: int = 8,
) -> KVAttention:
    """Resolve `choice` ("auto", "xqa", "flash_attn"; `FP8Tuning.vllm_fp8_kv_attention`) for an engine on `device`
    serving a model with these attention heads. "auto" takes XQA where `xqa_unavailable_reason` finds nothing against
    it, else FlashAttention-3, and says why; an explicit "xqa" that cannot run raises, naming the fix."""
    if choice not in FP8_KV_ATTENTIONS:
        raise ValueError(f"FP8Tuning(vllm_fp8_kv_attention={choice!r}) is unknown; use one of {FP8_KV_ATTENTIONS}.")
    if choice == "flash_attn":
        return KVAttention("flash_attn", "FlashAttention-3, as asked (FP8Tuning(vllm_fp8_kv_attention='flash_attn'))")
    why_not = xqa_unavailable_reason(device, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads)
    if why_not is None:
        return KVAttention(
            "xqa", "FlashInfer's XQA for decode, with the scales of every sync (checked on this GPU)", xqa_env()
        )
    if choice == "xqa":
        raise ValueError(
            f"FP8Tuning(vllm_fp8_kv_attention='xqa') but XQA cannot run here: {why_not}. Use 'auto' or 'flash_attn'."
        )
    return KVAttention("flash_attn", f"FlashAttention-3 (XQA cannot run here: {why_not})")
