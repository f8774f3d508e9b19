"""Checkpoint tensors streamed into safetensors shards, as `save_pretrained` lays them out: `model.safetensors`, or
`model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["write_shards"]


def write_shards(
    pairs: Iterable[tuple[str, torch.Tensor]],
    folder: Path,
    *,
    max_shard_size: int,
    dtype: torch.dtype | None,
    progress: bool = True,
) -> None:
    """Write `(name, tensor)` pairs to `folder` one shard at a time (at most one shard is held in memory), each shard
    at most `max_shard_size` bytes unless one tensor is larger. `dtype` casts the high-precision tensors (FP8
    weights and their `weight_scale_inv` are written as they are)."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    shards: list[list[str]] = []  # tensor names per written shard, in order
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush(tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(folder / f"part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        shards.append(list(tensors))

    for name, t in tqdm(pairs, desc="Writing FP8 checkpoint", unit="tensor", disable=not progress):
        is_fp8_part = t.dtype == torch.float8_e4m3fn or name.endswith(".weight_scale_inv")
        if dtype is not None and t.is_floating_point() and not is_fp8_part:
            t = t.to(dtype)
        t = t.to("cpu").contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # a view of a larger buffer (stacked sibling weights): safetensors writes whole storages
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_size:
            flush(shard)
            shard, shard_bytes = {}, 0
        shard[name] = t
        shard_bytes += nbytes
        total_bytes += nbytes
    flush(shard)
    del shard
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for i, fname in enumerate(files):
        (folder / f"part-{i:05d}.safetensors").rename(folder / fname)
    if n > 1:
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": {name: f for f, names in zip(files, shards, strict=True) for name in names},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
