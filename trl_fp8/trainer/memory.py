"""What holds a trainer's GPU memory: parameters, gradients, DDP's buckets, optimizer states, the FP8 weight cache,
and what the allocator and the device report beside them.

PyTorch's own counters cannot tell these apart, and they count more than the GPU holds when vLLM sleeps: vLLM's
sleep-mode pool allocates through PyTorch's allocator and unmaps its memory while asleep, so `memory_allocated` keeps
counting it. The device's own figure (`mem_get_info`) is what a run can run out of.
"""

from __future__ import annotations

import torch
from torch import nn

from trl_fp8.nn.weight_cache import fp8_weight_cache_bytes

__all__ = ["memory_breakdown"]


def _storages(tensors) -> dict[int, int]:
    """Bytes of each distinct storage under `tensors` (a DTensor counts its local shard), by storage address."""
    out = {}
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _ddp_bucket_bytes(wrapped: nn.Module) -> int:
    """Bytes of DDP's all-reduce buckets (0 when `wrapped` is not a DistributedDataParallel module)."""
    if not isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return 0
    sizes = str(wrapped._get_ddp_logging_data().get("bucket_sizes", "") or "")
    return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)


def memory_breakdown(model: nn.Module, optimizer=None, wrapped: nn.Module | None = None) -> dict[str, int]:
    """Bytes held by `model`'s parameters, its live gradients (those that are not views of DDP's buckets), DDP's
    buckets (`wrapped`: the DDP module, if any), `optimizer`'s states and the FP8 weight cache; and, on a GPU, what
    PyTorch's allocator counts as allocated and reserved and what the device has in use (every process on it)."""
    params = _storages(model.parameters())
    buckets = _ddp_bucket_bytes(wrapped) if wrapped is not None else 0
    grads = _storages(p.grad for p in model.parameters())
    # With gradient_as_bucket_view the gradients are views of the buckets: counted once, as buckets.
    in_buckets = bool(buckets) and getattr(wrapped, "gradient_as_bucket_view", False)
    states = {}
    if optimizer is not None:
        states = _storages(t for state in optimizer.state.values() for t in state.values())
    out = {
        "parameters": sum(params.values()),
        "gradients": 0 if in_buckets else sum(n for ptr, n in grads.items() if ptr not in params),
        "ddp_buckets": buckets,
        "optimizer_states": sum(n for ptr, n in states.items() if ptr not in params),
        "fp8_weight_cache": fp8_weight_cache_bytes(model),
    }
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out.update(allocated=torch.cuda.memory_allocated(device), reserved=torch.cuda.memory_reserved(device),
                   device_used=total - free)  # fmt: skip
    return out
