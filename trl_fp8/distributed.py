"""Several processes: which sharding a launch applies, and whether a tensor is a shard.

Every rule about sharding lives here, so a new launch kind (HSDP, ZeRO stages, tensor parallel training) has one
place to land. FSDP2 gives each FP8 layer its whole weight inside forward and backward; between steps a weight is a
DTensor shard, which the sync and the export gather one tensor at a time.
"""

from __future__ import annotations

import os

import torch

__all__ = ["check_no_weight_sharding", "is_sharded", "weight_sharding"]


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor shard (FSDP2 outside its forward/backward); inside them FSDP2 hands the layer the whole weight."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def weight_sharding(args) -> str | None:
    """The weight sharding of the launch: "FSDP2", "FSDP1", "DeepSpeed ZeRO-3", or None (whole weights on every rank).

    FSDP comes from the training arguments (`fsdp=...`, `fsdp_config={"version": 2}`, transformers' default 2) or
    from `accelerate launch --config_file fsdp*.yaml` (its `FSDP_VERSION`, accelerate's default 1).
    """
    env = os.environ
    if args.fsdp:
        return f"FSDP{int((args.fsdp_config or {}).get('version', 2))}"
    if env.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true"):
        return f"FSDP{int(env.get('FSDP_VERSION', '1'))}"
    ds_config = getattr(args, "hf_deepspeed_config", None)
    if ds_config is not None and ds_config.is_zero3():
        return "DeepSpeed ZeRO-3"
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true") and (
        env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3"
    ):
        return "DeepSpeed ZeRO-3"
    return None


def check_no_weight_sharding(args) -> None:
    """Refuse, at start-up rather than after training, the sharding FP8 cannot follow.

    FSDP2 works: its forward and backward hand each layer the whole weight, and the sync and the export gather one
    tensor at a time (`FP8Linear.quantized_weight`). FSDP1 flattens parameters and ZeRO-3 partitions them outside
    the module, so neither gives a layer, the sync or the exporter whole 128x128 blocks.
    """
    sharding = weight_sharding(args)
    needs_whole_weights = args.fp8_recipe is not None or args.use_vllm or args.save_fp8_checkpoint
    if sharding not in (None, "FSDP2") and needs_whole_weights:
        raise NotImplementedError(
            f"FP8GRPOTrainer does not support {sharding}: its layers, the vLLM sync and the FP8 export need whole "
            "weights, which it does not give them. Shard with FSDP2 (TRL's accelerate_configs/fsdp2.yaml, or "
            "fsdp_config={'version': 2}), or replicate with DDP (multi_gpu.yaml) or DeepSpeed ZeRO-1/2 "
            "(zero2.yaml); or, for plain BF16 GRPO, set fp8_recipe=None, use_vllm=False and save_fp8_checkpoint=False."
        )
