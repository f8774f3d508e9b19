"""DeepGEMM's kernels for the rollout engine, compiled side by side in worker processes before vLLM starts.

DeepGEMM compiles each GEMM kernel just in time with nvcc, one at a time, and vLLM's start-up warm-up runs every
GEMM size the engine can meet so that no compile stalls a rollout: on a cold host, minutes for an 8B block-FP8
engine (one CPU core busy, the GPU idle). A kernel depends only on the layer's (N, K), the tile
configuration DeepGEMM picks for the token count and the GPU, and DeepGEMM keeps what it compiled in a persistent
cache directory (`DG_JIT_CACHE_DIR`, written by an atomic rename). So worker processes, each running vLLM's own
`fp8_gemm_nt` over a share of vLLM's own list of warm-up token counts, compile the kernels in parallel into that
cache; vLLM's warm-up then finds each one on disk. Nothing here changes a value: a kernel a worker missed is compiled
by vLLM's warm-up as before.

    trl-fp8 warmup ./Qwen3-8B-FP8            # before `trl vllm-serve`: the kernels that server will use
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from trl_fp8.config import BLOCK  # DeepGEMM's block-FP8 GEMMs take layers whose N and K are multiples of it
from trl_fp8.nn.adapters import unwrap_model
from trl_fp8.nn.sibling_gemms import FUSED_GROUPS
from trl_fp8.rollout.vllm.partitions import head_dim_of, partition_shape

logger = logging.getLogger(__name__)

__all__ = [
    "PrecompileResult",
    "default_workers",
    "engine_gemm_shapes",
    "precompile_deepgemm",
    "precompile_engine_kernels",
]

MARKER = "trl_fp8_precompiled.json"  # in the cache directory: what was compiled there, so a warm start skips it


@dataclass
class PrecompileResult:
    """What `precompile_deepgemm` did: seconds, workers, GEMM shapes, token counts run, kernels in the cache before
    and after, and the workers that failed (their last lines of output)."""

    seconds: float = 0.0
    workers: int = 0
    shapes: list[tuple[int, int]] = field(default_factory=list)
    token_counts: int = 0
    kernels_before: int = 0
    kernels_after: int = 0
    skipped: str | None = None
    failures: list[str] = field(default_factory=list)


def engine_gemm_shapes(model: nn.Module, fp8_modules: set[str], tensor_parallel: int = 1) -> list[tuple[int, int]]:
    """The (N, K) of every block-FP8 GEMM the engine runs for `model`'s FP8 layers: vLLM fuses q/k/v and gate/up
    (`sibling_gemms.FUSED_GROUPS`) into one layer each, so their N add up; with `tensor_parallel` ranks, one rank's
    partition of each (`partitions.partition_shape`). Layers whose N or K is not a multiple of 128 are left out, as
    vLLM does not run them on DeepGEMM, and so are experts (vLLM's fused-MoE kernels)."""
    hf_model = unwrap_model(model)
    modules = dict(hf_model.named_modules())
    head_dim = head_dim_of(getattr(hf_model, "config", None))
    shapes, seen = set(), set()
    for name in sorted(fp8_modules):
        parent, _, leaf = name.rpartition(".")
        group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
        members = tuple(n for n in (f"{parent}.{m}" if parent else m for m in group) if n in fp8_modules)
        if members in seen or any(m not in modules for m in members):
            continue
        seen.add(members)
        layers = [getattr(modules[m], "base_layer", modules[m]) for m in members]
        if any(getattr(layer, "weight", None) is None or layer.weight.dim() != 2 for layer in layers):
            continue  # experts (stacked 3-D weights) run vLLM's fused-MoE kernels, not the dense GEMMs compiled here
        parts = [
            partition_shape(m.rpartition(".")[2], *layer.weight.shape, tensor_parallel, head_dim)
            for m, layer in zip(members, layers, strict=True)
        ]
        n, k = sum(p[0] for p in parts), parts[0][1]
        if n % BLOCK == 0 and k % BLOCK == 0:
            shapes.add((int(n), int(k)))
    return sorted(shapes)


def default_workers() -> int:
    """One nvcc per CPU core this process may use, at most 16 (each worker also holds a CUDA context, ~0.5 GiB)."""
    return max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def warmup_token_counts(n: int, max_tokens: int, device: int, full: bool = False) -> list[int]:
    """vLLM's own warm-up token counts for a layer of N outputs: with `VLLM_DEEP_GEMM_WARMUP=relax` (vLLM's
    default), counts that reach every tile configuration DeepGEMM can pick; `full`: every count up to `max_tokens`."""
    if full:
        return list(range(1, max_tokens + 1))
    from trl_fp8.rollout.vllm._compat import deepgemm_warmup_token_counts

    return deepgemm_warmup_token_counts(max_tokens, n, torch.device("cuda", device))


def split_tasks(shapes, counts: dict, workers: int) -> list[list[tuple[int, int, list[int]]]]:
    """Each worker's (n, k, token counts): every shape's counts cut into `workers` contiguous runs (neighbouring counts
    mostly share a kernel, so few kernels are compiled twice), worker w taking run w of every shape, shapes rotated
    so that workers start on different layers. No more workers than the longest list has counts."""
    workers = max(1, min(workers, max((len(ms) for ms in counts.values()), default=1)))
    plans = []
    for w in range(workers):
        plan = []
        for i in range(len(shapes)):
            n, k = shapes[(i + w) % len(shapes)]
            ms = counts[(n, k)]
            lo, hi = len(ms) * w // workers, len(ms) * (w + 1) // workers
            if hi > lo:
                plan.append((n, k, ms[lo:hi]))
        if plan:
            plans.append(plan)
    return plans


def count_kernels(cache_dir: Path) -> int:
    return sum(1 for _ in cache_dir.rglob("kernel.cubin")) if cache_dir.is_dir() else 0


def _marker_keys(shapes, max_tokens: int, full: bool, device: int) -> list[str]:
    import vllm

    props = torch.cuda.get_device_properties(device)
    gpu = f"{props.name}/{props.multi_processor_count}SM/vllm{vllm.__version__}/{'full' if full else 'relax'}"
    return [f"{gpu}/{n}x{k}/{max_tokens}" for n, k in shapes]


def precompile_deepgemm(
    shapes: list[tuple[int, int]],
    max_tokens: int,
    *,
    workers: int | None = None,
    device: int | None = None,
    full: bool = False,
    force: bool = False,
    progress: bool = True,
) -> PrecompileResult:
    """Compile the DeepGEMM kernels of `shapes` ((N, K) pairs, see `engine_gemm_shapes`) for token counts up to
    `max_tokens` (the engine's `max_num_batched_tokens`) in `workers` processes, into `DG_JIT_CACHE_DIR`.

    The DeepGEMM settings (`VLLM_USE_DEEP_GEMM=1`, `VLLM_USE_DEEP_GEMM_E8M0=0`, `DG_JIT_CACHE_DIR`) must be in
    `os.environ` already (`vllm_sync.apply_engine_env`): the workers inherit them, so they compile the kernels the
    engine will ask for. A cache that holds a completed run for the same shapes, GPU and vLLM is skipped unless
    `force`. A failed worker is reported, not raised: vLLM's warm-up compiles whatever is missing, one by one.
    """
    if os.environ.get("VLLM_USE_DEEP_GEMM") != "1" or not os.environ.get("DG_JIT_CACHE_DIR"):
        raise RuntimeError(
            "precompile_deepgemm needs the engine's DeepGEMM settings in the environment (VLLM_USE_DEEP_GEMM=1 and "
            "DG_JIT_CACHE_DIR; trl_fp8.rollout.vllm.generation.apply_engine_env assigns them)."
        )
    device = torch.cuda.current_device() if device is None else device
    workers = workers or default_workers()
    cache = Path(os.environ["DG_JIT_CACHE_DIR"])
    result = PrecompileResult(workers=workers, shapes=list(shapes), kernels_before=count_kernels(cache))
    keys = _marker_keys(shapes, max_tokens, full, device)
    marker = cache / MARKER
    done = set(json.loads(marker.read_text())) if marker.is_file() else set()
    if not shapes or (not force and set(keys) <= done):
        result.skipped = "no DeepGEMM layer" if not shapes else f"already compiled in {cache}"
        result.kernels_after = result.kernels_before
        return result

    start = time.perf_counter()
    counts = {(n, k): warmup_token_counts(n, max_tokens, device, full) for n, k in shapes}
    plans = split_tasks(shapes, counts, workers)
    result.workers = len(plans)
    result.token_counts = sum(len(ms) for ms in counts.values())
    logger.info(
        "Compiling DeepGEMM kernels for %d GEMM shapes in %d processes into %s (once per machine).",
        len(shapes), len(plans), cache,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", __name__, "--worker", json.dumps(plan), "--device", str(device)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for plan in plans
    ]
    events: queue.Queue = queue.Queue()  # True: a worker ran one more GEMM; False: a worker's output ended
    tails = [[] for _ in procs]  # each worker's last lines other than progress, for the failure report

    def read(i, proc):
        for line in proc.stdout:
            if line.startswith("ran "):
                events.put(True)
            else:
                tails[i] = (tails[i] + [line.rstrip()])[-5:]
        events.put(False)

    for i, proc in enumerate(procs):
        threading.Thread(target=read, args=(i, proc), daemon=True).start()
    from tqdm.auto import tqdm

    with tqdm(
        total=result.token_counts, desc="Compiling DeepGEMM kernels (cold cache, once per machine)", unit="GEMM",
        disable=not progress,
    ) as bar:  # fmt: skip
        finished = 0
        while finished < len(procs):
            if events.get():
                bar.update(1)
            else:
                finished += 1
    for i, proc in enumerate(procs):
        if proc.wait() != 0:
            result.failures.append(f"worker {i} exited with {proc.returncode}: " + " | ".join(tails[i]))
    result.seconds = time.perf_counter() - start
    result.kernels_after = count_kernels(cache)
    if result.failures:
        logger.warning(
            "DeepGEMM pre-compilation: %d of %d workers failed; vLLM's warm-up compiles what they missed, one at a "
            "time. %s", len(result.failures), len(procs), result.failures[0],
        )  # fmt: skip
    else:
        try:  # a read-only or shared cache still works; the next start just runs the workers again
            marker.write_text(json.dumps(sorted(done | set(keys))))
        except OSError as exc:
            logger.info("DeepGEMM pre-compilation: could not record the run in %s (%s)", marker, exc)
    logger.info(
        "DeepGEMM pre-compilation: %d kernels in the cache (%d new) after %.0f s.",
        result.kernels_after, result.kernels_after - result.kernels_before, result.seconds,
    )  # fmt: skip
    return result


def precompile_engine_kernels(
    kernel,
    model: nn.Module,
    fp8_modules: set[str],
    max_tokens: int,
    *,
    workers: int | None = None,
    device: int | None = None,
    tensor_parallel: int = 1,
) -> PrecompileResult | None:
    """`precompile_deepgemm` for the engine of `model` whose FP8 layers are `fp8_modules` (one rank's partitions of
    them with `tensor_parallel` ranks), when its rollout `kernel` (`vllm_kernels.RolloutKernel`, None for a BF16
    engine) is DeepGEMM and `workers` is not 0; else None."""
    if kernel is None or kernel.backend != "deepgemm" or workers == 0:
        return None
    shapes = engine_gemm_shapes(model, fp8_modules, tensor_parallel)
    return precompile_deepgemm(shapes, max_tokens, workers=workers, device=device)


def _package_root() -> str:
    """The folder holding `trl_fp8`, so workers import this package as the parent does (never a folder inside it:
    `trl_fp8/rollout` on the path would make its `vllm` subpackage shadow vLLM)."""
    import trl_fp8

    return str(Path(trl_fp8.__file__).resolve().parents[1])


def _run_worker(plan: list, device: int) -> None:
    """Run vLLM's `fp8_gemm_nt` the way its warm-up does (zero FP8 inputs, float32 block scales) for each
    (n, k, token counts) of `plan`; DeepGEMM compiles each new kernel on the way."""
    torch.cuda.set_device(device)
    from vllm.utils.deep_gemm import fp8_gemm_nt

    for n, k, ms in plan:
        top = max(ms)
        a = torch.zeros((top, k), device="cuda", dtype=torch.float8_e4m3fn)
        a_scale = torch.ones((top, k // BLOCK), device="cuda", dtype=torch.float32)
        w = torch.zeros((n, k), device="cuda", dtype=torch.float8_e4m3fn)
        w_scale = torch.ones((n // BLOCK, k // BLOCK), device="cuda", dtype=torch.float32)
        out = torch.empty((top, n), device="cuda", dtype=torch.bfloat16)
        for m in ms:
            fp8_gemm_nt((a[:m], a_scale[:m]), (w, w_scale), out[:m])
            print(f"ran {n} {k} {m}", flush=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    worker = argparse.ArgumentParser()
    worker.add_argument("--worker", required=True)
    worker.add_argument("--device", type=int, required=True)
    opts = worker.parse_args()
    _run_worker(json.loads(opts.worker), opts.device)
