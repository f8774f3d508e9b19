"""Which vLLM kernel runs the rollout engine's block-FP8 linear layers, and the settings that keep our values.

vLLM 0.26 can multiply block-FP8 weights with DeepGEMM, its Cutlass block-scaled kernel or Triton. All three read the
float8_e4m3fn weights and float32 `weight_scale_inv` that the trainer pushes, as long as vLLM's E8M0 option is off
(with it on, DeepGEMM rounds every scale up to a power of two and requantizes the weight: vLLM's model would no longer
be ours). DeepGEMM is the fastest on Hopper (the documentation's benchmarks) but it
compiles its kernels just in time with nvcc; the compiled kernels go to a persistent cache directory, and vLLM's
DeepGEMM warm-up compiles every GEMM size the engine can meet at start-up, so no compile stalls a rollout.

With an FP8 KV cache, the q/k/v scales change at every sync: `rollout.vllm.attention` chooses the attention kernel
that reads them (FlashInfer's XQA through trl-fp8's backend, or FlashAttention-3; both FP8 on Hopper only).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trl_fp8.config import VLLM_FP8_BACKENDS, check_vllm_fp8_moe_backend
from trl_fp8.rollout.vllm._compat import bundled_deepgemm_dir, deepgemm_min_nvcc

logger = logging.getLogger(__name__)

__all__ = [
    "FP8_KV_ATTENTION_BACKEND",
    "VLLM_FP8_BACKENDS",
    "RolloutKernel",
    "check_fp8_kv_attention",
    "deepgemm_unavailable_reason",
    "default_jit_cache_dir",
    "forget_cached_deepgemm_decisions",
    "rollout_kernel",
    "server_command",
    "server_kernel",
    "with_moe_backend",
]

# `--linear-backend` / `LLM(linear_backend=...)` names; an explicit name makes vLLM fail loudly if that kernel cannot
# take a layer instead of silently picking another one.
VLLM_LINEAR_BACKEND = {"deepgemm": "deep_gemm", "cutlass": "cutlass", "triton": "triton"}
# `LLM(moe_backend=...)` names of `vllm_fp8_moe_backend`'s choices ("auto" passes nothing: vLLM chooses).
VLLM_MOE_BACKEND = {"triton": "triton", "deepgemm": "deep_gemm", "flashinfer_cutlass": "flashinfer_cutlass"}
# Never E8M0: it changes our scales (weights) and rounds vLLM's activation scales up to powers of two.
NO_E8M0 = {"VLLM_USE_DEEP_GEMM_E8M0": "0"}


def moe_kernel_env() -> dict[str, str]:
    """Experts of a mixture of experts on vLLM's own choice of block-FP8 MoE kernel (Triton on Hopper at TP 1), not
    DeepGEMM's grouped GEMM, which `VLLM_USE_DEEP_GEMM=1` would otherwise force: its full warm-up compiles thousands
    of grouped kernels, minutes even for a small test model. A user's own
    `VLLM_MOE_USE_DEEP_GEMM` wins. Dense models are unaffected."""
    return {"VLLM_MOE_USE_DEEP_GEMM": os.environ.get("VLLM_MOE_USE_DEEP_GEMM", "0")}


# vLLM's FlashAttention-3 backend, which takes new FP8 KV-cache scales at every sync: the fallback of
# `rollout.vllm.attention` (which names every backend that takes them).
FP8_KV_ATTENTION_BACKEND = "FLASH_ATTN"


@dataclass(frozen=True)
class RolloutKernel:
    """A resolved choice: `backend` ("deepgemm", "cutlass" or "triton"), why it was chosen, the environment variables
    vLLM must see before it builds its layers, and the `LLM(...)` arguments."""

    backend: str
    reason: str
    env: dict[str, str] = field(default_factory=dict)
    llm_kwargs: dict[str, str] = field(default_factory=dict)


def forget_cached_deepgemm_decisions() -> None:
    """Make vLLM re-read `VLLM_USE_DEEP_GEMM*` the next time it asks.

    vLLM caches (`functools.cache`) whether DeepGEMM is usable and whether it takes E8M0 scales the first time anything
    asks, from the environment of that moment. The trainer's own DeepGEMM GEMMs (`fp8_backend="deepgemm"`) may ask
    before the engine's settings are assigned; with `VLLM_USE_DEEP_GEMM=0` then, the engine later refused DeepGEMM
    ("only Hopper and Blackwell GPUs are supported"). Nothing is imported here: a vLLM not yet loaded has no cache.
    """
    deep_gemm = sys.modules.get("vllm.utils.deep_gemm")
    if deep_gemm is None:
        return
    for name in ("is_deep_gemm_supported", "is_deep_gemm_e8m0_used"):
        cache_clear = getattr(getattr(deep_gemm, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    scale_format = getattr(deep_gemm, "DeepGemmQuantScaleFMT", None)
    if scale_format is not None and getattr(scale_format, "_oracle_cache", None) is not None:
        scale_format._oracle_cache = None  # its E8M0-or-float32 answer, derived from the same settings


def default_jit_cache_dir() -> Path:
    """DeepGEMM's compiled-kernel cache: `DG_JIT_CACHE_DIR` if set, else vLLM's own default,
    `$VLLM_CACHE_ROOT/deep_gemm` (`~/.cache/vllm/deep_gemm`), which outlives the run."""
    if os.environ.get("DG_JIT_CACHE_DIR"):
        return Path(os.environ["DG_JIT_CACHE_DIR"])
    root = os.environ.get("VLLM_CACHE_ROOT")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")
    return Path(root) / "deep_gemm"


def _find_nvcc() -> str | None:
    # Where DeepGEMM looks for it: DG_JIT_NVCC_COMPILER (2.8), then CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda.
    if os.environ.get("DG_JIT_NVCC_COMPILER"):
        return os.environ["DG_JIT_NVCC_COMPILER"] if Path(os.environ["DG_JIT_NVCC_COMPILER"]).exists() else None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home:
            return str(Path(home) / "bin" / "nvcc") if (Path(home) / "bin" / "nvcc").exists() else None
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None


def nvcc_release(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) of `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88"), or None."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def deepgemm_unavailable_reason(device: torch.device | int | None = None) -> str | None:
    """Why DeepGEMM cannot run the trainer's FP8 rollouts here, or None when it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        # Blackwell's DeepGEMM takes E8M0 (power-of-two) scales only, which are not the trainer's.
        return f"DeepGEMM with float32 block scales runs on SM90 (Hopper); this GPU is sm_{major}{minor}"
    if bundled_deepgemm_dir() is None:
        return "this vLLM build has no bundled DeepGEMM (vllm/third_party/deep_gemm)"
    nvcc = _find_nvcc()
    if nvcc is None:
        return (
            "DeepGEMM compiles its kernels at run time with nvcc, which was not found (install the CUDA toolkit, "
            "then set CUDA_HOME or put nvcc on PATH)"
        )
    needed, found = deepgemm_min_nvcc(), nvcc_release(nvcc)
    if found is None or found < needed:
        have = "an nvcc whose version could not be read" if found is None else f"nvcc {found[0]}.{found[1]}"
        return (
            f"vLLM's DeepGEMM compiles its kernels with nvcc >= {needed[0]}.{needed[1]}, and {nvcc} is {have} "
            "(install a newer CUDA toolkit and set CUDA_HOME, or DG_JIT_NVCC_COMPILER to its nvcc)"
        )
    return None


def check_fp8_kv_attention(device: torch.device | int | None = None) -> None:
    """Raise naming the fix when this GPU cannot run an FP8 KV cache with per-step scales (FlashInfer's XQA or
    FlashAttention-3's FP8 attention, SM90 only). Without a CUDA GPU nothing is checked: vLLM itself refuses."""
    if not torch.cuda.is_available():
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        raise ValueError(
            f"fp8_kv_cache=True needs an FP8 attention that reads the q/k/v scales of every step (XQA or "
            f"FlashAttention-3), which runs on Hopper (SM90) only; this GPU is sm_{major}{minor}. vLLM's other FP8 "
            "attention keeps the first step's scales in its CUDA graphs. Set fp8_kv_cache=False."
        )


def rollout_kernel(
    backend: str = "auto",
    *,
    moe_backend: str = "auto",
    jit_cache_dir: str | Path | None = None,
    device: torch.device | int | None = None,
) -> RolloutKernel:
    """Resolve `backend` ("auto", "deepgemm", "cutlass", "triton") for this machine, and with it `moe_backend`, the
    kernel of the experts of a mixture of experts (`with_moe_backend`).

    "auto" takes DeepGEMM when `deepgemm_unavailable_reason` finds nothing against it, else Cutlass, and says why
    in `reason` (the caller logs it). An explicit "deepgemm" that cannot run raises, naming the fix.
    """
    if backend not in VLLM_FP8_BACKENDS:
        raise ValueError(f"vllm_fp8_backend={backend!r} is unknown; use one of {VLLM_FP8_BACKENDS}.")
    return with_moe_backend(_linear_kernel(backend, jit_cache_dir, device), moe_backend)


def with_moe_backend(kernel: RolloutKernel, moe_backend: str) -> RolloutKernel:
    """`kernel` with vLLM's MoE kernel `moe_backend` for block-FP8 experts: "auto" leaves vLLM's own choice; the
    others pass `moe_backend` to `LLM(...)`, "deepgemm" (DeepGEMM's grouped GEMM, with its warm-up) only where the
    linear layers run on DeepGEMM too. Every one runs on the FP8 experts the trainer pushes (the sync checks the
    engine's tensors against them, `rollout.vllm.experts`)."""
    check_vllm_fp8_moe_backend(moe_backend)
    if moe_backend == "auto":
        return kernel
    env = dict(kernel.env)
    if moe_backend == "deepgemm":
        if kernel.backend != "deepgemm":
            raise ValueError(
                f"vllm_fp8_moe_backend='deepgemm' runs the experts on DeepGEMM, which this engine does not use: its "
                f"linear layers run on {kernel.backend} ({kernel.reason}). Use vllm_fp8_backend='deepgemm' where "
                "DeepGEMM runs, or another vllm_fp8_moe_backend."
            )
        # `moe_backend` picks the kernel; this switch also has vLLM's warm-up compile the grouped kernels at start-up
        # (one at a time: minutes on a cold cache) instead of in the middle of the first rollout
        env["VLLM_MOE_USE_DEEP_GEMM"] = "1"
    reason = f"{kernel.reason}; experts on {moe_backend} (requested)"
    if moe_backend == "flashinfer_cutlass":
        # Said before the wait: the engine logs nothing while it lasts.
        reason += (", whose engine may take many minutes to start, logging nothing after vLLM's torch.compile "
                   "(FlashInfer compiles its MoE kernels at first use, the likely wait; the documentation's Mixture "
                   "of experts page, 'Which MoE kernel vLLM runs')")  # fmt: skip
    return RolloutKernel(kernel.backend, reason, env,
                         {**kernel.llm_kwargs, "moe_backend": VLLM_MOE_BACKEND[moe_backend]})  # fmt: skip


def _linear_kernel(backend: str, jit_cache_dir, device) -> RolloutKernel:
    if backend in ("auto", "deepgemm"):
        why_not = deepgemm_unavailable_reason(device)
        if why_not is None:
            cache = Path(jit_cache_dir) if jit_cache_dir else default_jit_cache_dir()
            env = {
                "VLLM_USE_DEEP_GEMM": "1",
                **NO_E8M0,
                "DG_JIT_CACHE_DIR": str(cache),
                # "full": vLLM compiles the GEMMs of every token count up to max_num_batched_tokens at engine start,
                # so none compiles in the middle of a rollout. A user's own setting wins (it changes no values).
                "VLLM_DEEP_GEMM_WARMUP": os.environ.get("VLLM_DEEP_GEMM_WARMUP", "full"),
                **moe_kernel_env(),
            }
            reason = "requested" if backend == "deepgemm" else "fastest block-FP8 kernel on Hopper"
            return RolloutKernel("deepgemm", f"{reason}; JIT cache {cache}", env, {"linear_backend": "deep_gemm"})
        if backend == "deepgemm":
            raise ValueError(
                f"vllm_fp8_backend='deepgemm' cannot run here: {why_not}. Use vllm_fp8_backend='cutlass' (same "
                "values, slower at small batches) or 'auto'."
            )
        return RolloutKernel(
            "cutlass",
            f"DeepGEMM unavailable ({why_not})",
            {"VLLM_USE_DEEP_GEMM": "0", **NO_E8M0},
            {"linear_backend": "cutlass"},
        )
    return RolloutKernel(
        backend, "requested", {"VLLM_USE_DEEP_GEMM": "0", **NO_E8M0}, {"linear_backend": VLLM_LINEAR_BACKEND[backend]}
    )


def server_kernel(backend: str = "deepgemm") -> RolloutKernel:
    """The settings a `trl vllm-serve` server needs for `backend` ("auto" meaning DeepGEMM, the server being on a
    Hopper GPU with nvcc); nothing is checked here, the server runs elsewhere."""
    if backend not in VLLM_FP8_BACKENDS:
        raise ValueError(f"vllm_fp8_backend={backend!r} is unknown; use one of {VLLM_FP8_BACKENDS}.")
    backend = "deepgemm" if backend == "auto" else backend
    env = {"VLLM_USE_DEEP_GEMM": "1" if backend == "deepgemm" else "0", **NO_E8M0}
    if backend == "deepgemm":
        env.update(moe_kernel_env())
    return RolloutKernel(backend, "server", env, {"linear_backend": VLLM_LINEAR_BACKEND[backend]})


def server_command(kernel: RolloutKernel | None = None, model: str = "<fp8_dir>") -> str:
    """The `trl vllm-serve` command line that serves an FP8 checkpoint with `kernel` (DeepGEMM when None)."""
    kernel = kernel or server_kernel("deepgemm")
    env = " ".join(f"{k}={v}" for k, v in kernel.env.items() if k.startswith(("VLLM_USE_DEEP_GEMM", "VLLM_MOE")))
    return f"{env} trl vllm-serve --model {model} --linear-backend {kernel.llm_kwargs['linear_backend']}"
