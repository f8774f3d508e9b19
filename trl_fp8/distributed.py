"""Several processes: which sharding a launch applies, whether a tensor is a shard, and how a shard's FP8 weight is
gathered.

Every rule about sharding lives here, so a new launch kind (HSDP, ZeRO stages, tensor parallel training) has one
place to land. FSDP2 gives each FP8 layer its whole weight inside forward and backward, in the dtype of its
`MixedPrecisionPolicy` (BF16 under accelerate's `mixed_precision: bf16`, over fp32 masters). Between steps a weight is
a DTensor shard; the vLLM sync and the export then need the FP8 values the forward multiplies, so
`gather_quantized` quantizes each rank's shard from that same compute dtype and all-gathers the FP8 data and scales
(1 byte a weight plus a scale per 128x128 block), one tensor at a time, never the whole model on one rank.
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections.abc import Callable

import torch
from torch import nn

from trl_fp8.config import BLOCK

__all__ = [
    "check_no_weight_sharding",
    "check_sharding_supports",
    "compute_dtype",
    "drop_grads_of_unused_parameters",
    "fp8_shards_align",
    "gather_quantized",
    "gather_whole",
    "grads_in_ddp_buckets",
    "is_sharded",
    "prefetch_fsdp2_units",
    "reduce_over_ranks",
    "record_fsdp2_compute_dtypes",
    "shard_rows_align",
    "weight_sharding",
    "zero_grads_in_buckets",
]

# id(sharded parameter) -> (a weak reference to it, the dtype FSDP2 all-gathers it in for forward and backward),
# filled from the FSDP2 states. (Not a WeakKeyDictionary: it compares keys with ==, elementwise for tensors.)
_COMPUTE_DTYPES: dict[int, tuple[weakref.ref, torch.dtype]] = {}


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
            f"trl-fp8's trainers do not support {sharding}: their FP8 layers, the vLLM sync and the FP8 export need "
            f"whole weights, which {sharding} does not give them. Shard with FSDP2 (TRL's accelerate_configs/"
            "fsdp2.yaml, or fsdp_config={'version': 2}), or replicate with DDP (multi_gpu.yaml) or DeepSpeed ZeRO-1/2 "
            "(zero2.yaml); or, for plain BF16 GRPO, set fp8_recipe=None, use_vllm=False and save_fp8_checkpoint=False."
        )


def check_sharding_supports(args, peft_config=None, model=None) -> None:
    """Refuse, before the model loads and the engine starts, what fails under FSDP2.

    PEFT adapters: the vLLM sync and the FP8 export merge the adapters into each base weight; under FSDP2 the base
    weight is a shard and PEFT's merge is local to it, so neither could send the merged FP8 weight. bitsandbytes'
    optimizers: their update is a custom op that takes plain tensors, not FSDP2's DTensor shards (8-bit AdamW raises
    at the first optimizer step)."""
    from trl_fp8.requirements import is_bitsandbytes_optimizer

    if weight_sharding(args) != "FSDP2":
        return
    if is_bitsandbytes_optimizer(args.optim):
        raise NotImplementedError(
            f"optim={getattr(args.optim, 'value', args.optim)!r} under FSDP2: bitsandbytes' optimizers update "
            "through custom ops that take plain tensors, not FSDP2's sharded parameters (8-bit AdamW raises at the "
            "first optimizer step). FSDP2 already shards the optimizer states over the GPUs: use "
            "optim='adamw_torch_fused', or DDP (TRL's accelerate_configs/multi_gpu.yaml) for 8-bit AdamW."
        )
    is_peft = peft_config is not None or hasattr(model, "peft_config")
    if is_peft and (args.use_vllm or args.save_fp8_checkpoint):
        raise NotImplementedError(
            "PEFT adapters with FSDP2: the vLLM sync and the FP8 export merge each adapter into its whole base weight, "
            "which FSDP2 shards across ranks. Train the adapters with DDP (TRL's accelerate_configs/multi_gpu.yaml: a "
            "LoRA run's frozen base weights are replicated cheaply), or shard a full fine-tune (no peft_config) with "
            "FSDP2."
        )


def record_fsdp2_compute_dtypes(model: nn.Module) -> int:
    """Remember, for every FSDP2-sharded parameter of `model`, the dtype its forward sees (the policy's `param_dtype`,
    or its own dtype without mixed precision). Returns how many were recorded. The sync and the export call it before
    they gather; it reads FSDP2's per-module state, which no public API exposes."""
    if not torch.distributed.is_available():
        return 0
    from torch.distributed.fsdp import FSDPModule

    for key in [k for k, (ref, _) in _COMPUTE_DTYPES.items() if ref() is None]:
        del _COMPUTE_DTYPES[key]
    recorded = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            param = fsdp_param.sharded_param
            # The group's policy (torch 2.11's FSDPParam has no `param_dtype`); FSDP2 casts floating tensors only.
            cast = group.mp_policy.param_dtype if param.is_floating_point() else None
            _COMPUTE_DTYPES[id(param)] = (weakref.ref(param), cast or param.dtype)
            recorded += 1
    return recorded


def prefetch_fsdp2_units(model: nn.Module, ahead: int) -> int:
    """Have each FSDP2 unit of `model` below the root (as accelerate wraps a causal LM: the input embedding, each
    decoder layer, the final norm with lm_head) all-gather the weights of the `ahead` units after it in forward, and
    of the `ahead` units before it in backward, as soon as its own gather is done. FSDP2's own prefetch is one unit,
    issued when the host reaches it: FP8 layers compute a layer in less time than BF16 ones, so a host that runs
    little ahead of the GPU leaves more of each gather exposed. Each unit of lead holds one more layer's gathered
    weights. Returns how many units were set (0: not FSDP2)."""
    if ahead < 1:
        raise ValueError(f"FP8Tuning(fsdp2_prefetch_layers={ahead}): give 1 or more layers (None: FSDP2's own).")
    if not torch.distributed.is_available():
        return 0
    from torch.distributed.fsdp import FSDPModule

    units, states = [], {id(model._get_fsdp_state())} if isinstance(model, FSDPModule) else set()
    for module in model.modules():  # in forward order; modules sharded together (accelerate's tail) share one state
        if isinstance(module, FSDPModule) and id(state := module._get_fsdp_state()) not in states:
            states.add(id(state))
            units.append(module)
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + ahead])
        unit.set_modules_to_backward_prefetch(units[max(0, i - ahead) : i][::-1])
    return len(units)


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype FSDP2 hands the forward for the sharded `param` (`record_fsdp2_compute_dtypes` must have seen it)."""
    ref, dtype = _COMPUTE_DTYPES.get(id(param), (None, None))
    if ref is None or ref() is not param:
        raise RuntimeError(
            "This FSDP2 shard's compute dtype is unknown: call trl_fp8.distributed.record_fsdp2_compute_dtypes(model) "
            "after fully_shard (save_fp8_checkpoint and the vLLM sync do it themselves), so its FP8 weight is "
            "quantized from the values the forward multiplies."
        )
    return dtype


def fp8_shards_align(weight: torch.Tensor, rows_per_block: int = BLOCK) -> bool:
    """Whether each rank's shard of `weight` holds whole FP8 blocks along dim 0, so quantizing the shards gives the
    whole weight's blocks bit for bit: sharded on dim 0 only (over one mesh dimension; others replicate) in chunks
    of `ceil(rows / ranks)`, a multiple of `rows_per_block` (128 for a linear weight's rows; 1 for stacked experts,
    sharded by expert). Qwen3-8B's smallest weights (k/v, 1024 rows) align up to 8 ranks, gate/up (12288 rows) up to 32."""
    if not is_sharded(weight):
        return True
    shard_dims = [i for i, p in enumerate(weight.placements) if not p.is_replicate()]
    if len(shard_dims) != 1 or not weight.placements[shard_dims[0]].is_shard(0):
        return False
    return shard_rows_align(weight.shape[0], weight.device_mesh.size(shard_dims[0]), rows_per_block)


def shard_rows_align(rows: int, ranks: int, rows_per_block: int = BLOCK) -> bool:
    """Whether FSDP2's dim-0 chunks of a `rows`-row weight over `ranks` ranks (`ceil(rows / ranks)` each, as
    `torch.chunk` cuts) start and end on FP8 block boundaries."""
    return math.ceil(rows / ranks) % rows_per_block == 0


def gather_whole(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard, cast to `dtype` before the all-gather (2 bytes a value for BF16, not 4)."""
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.full_tensor()


def gather_quantized(
    weight: torch.Tensor,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    rows_per_block: int = BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` applied to the whole of the FSDP2-sharded `weight` in its compute dtype: `(q, scale_inv)` on every
    rank, as the forward would quantize the all-gathered weight. A collective: every rank calls it, in the same order.

    Where the shards hold whole blocks (`fp8_shards_align`), each rank quantizes its own shard and the FP8 data and
    the scales are all-gathered; otherwise the weight is gathered whole in the compute dtype and quantized."""
    from torch.distributed.tensor import DTensor

    dtype = compute_dtype(weight)
    if not fp8_shards_align(weight, rows_per_block):
        return quantize(gather_whole(weight, dtype))
    local = weight.to_local().detach().to(dtype)
    if local.shape[0] == 0:  # a rank past the last chunk: its share of the result is empty
        q1, s1 = quantize(local.new_zeros((rows_per_block, *local.shape[1:])))
        q, s = q1[:0], s1[:0]
    else:
        q, s = quantize(local)
    mesh, placements = weight.device_mesh, weight.placements
    scale_rows = math.ceil(weight.shape[0] / rows_per_block) if rows_per_block > 1 else weight.shape[0]
    parts = []
    for local_part, rows in ((q.view(torch.uint8), weight.shape[0]), (s, scale_rows)):
        shape = (rows, *local_part.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        parts.append(
            DTensor.from_local(local_part, mesh, placements, run_check=False, shape=shape, stride=stride).full_tensor()
        )
    return parts[0].view(q.dtype), parts[1]


_REDUCE_OPS = {"max": "MAX", "min": "MIN", "sum": "SUM"}


def reduce_over_ranks(values: dict[str, float], how: dict[str, str], device) -> dict[str, float]:
    """`values` (the same keys on every rank) reduced over all ranks, each by `how[key]` ("max", "min" or "sum";
    "max" if absent), so every rank logs the same numbers. A collective: every rank calls it with the same keys."""
    dist = torch.distributed
    if not values or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(values)
    out = {}
    for op, name in _REDUCE_OPS.items():
        keys = sorted(k for k in values if how.get(k, "max") == op)
        if keys:
            t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            out.update(zip(keys, t.tolist(), strict=True))
    return {k: out[k] for k in values}


def grads_in_ddp_buckets(accelerator) -> None:
    """Have DDP keep each gradient as a view of its all-reduce bucket (`gradient_as_bucket_view`) rather than a second
    copy: the model is wrapped in DDP at `train()`, with the arguments of the accelerator's DDP handler."""
    from accelerate.utils import DistributedDataParallelKwargs

    if accelerator.ddp_handler is None:
        accelerator.ddp_handler = DistributedDataParallelKwargs()
    accelerator.ddp_handler.gradient_as_bucket_view = True


def zero_grads_in_buckets(wrapped) -> bool:
    """Make `wrapped.zero_grad()` zero a DDP model's gradients in place when they are views of its buckets; returns
    whether it did (once is enough).

    transformers calls `model.zero_grad()` after each optimizer step, which sets gradients to None. The micro-batches
    of the next step run under `no_sync` (gradient accumulation), where DDP's reducer does not run: autograd then
    accumulates into new tensors, a second copy of every gradient beside the buckets until the last micro-batch
    copies them in (15 GiB at the 8B shape: what ran a DDP rank out of memory). Zeroed in place they stay views.

    A gradient kept as zeros would reach the optimizer for a parameter no rank used in a step (where plain DDP leaves
    it None and the optimizer skips it): where DDP allows unused parameters, the parameters used in each step are
    recorded, and `drop_grads_of_unused_parameters` gives the others None again before the optimizer runs."""
    if not isinstance(wrapped, nn.parallel.DistributedDataParallel) or not wrapped.gradient_as_bucket_view:
        return False
    if "zero_grad" not in vars(wrapped):  # an instance attribute, set once, shadows Module.zero_grad
        object.__setattr__(wrapped, "zero_grad", functools.partial(nn.Module.zero_grad, wrapped, False))
        if wrapped.find_unused_parameters or getattr(wrapped, "static_graph", False):
            object.__setattr__(wrapped, "_trl_fp8_used_parameters", _UsedParameters(wrapped.module))
    return True


class _UsedParameters:
    """The trainable parameters of a module that got a gradient on this process since the last `take`."""

    def __init__(self, module: nn.Module):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.used = [False] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._mark, i))

    def _mark(self, index: int, _param) -> None:
        self.used[index] = True

    def take(self) -> list[bool]:
        used, self.used = self.used, [False] * len(self.params)
        return used


def drop_grads_of_unused_parameters(wrapped) -> int:
    """After a step's gradient reduction: set to None the gradients of the parameters that no process used in the
    step (DDP left their zeroed bucket views untouched), as plain DDP leaves them; returns how many. One all-reduce
    of a flag per parameter, where `zero_grads_in_buckets` records usage (DDP with unused parameters allowed)."""
    tracker = vars(wrapped).get("_trl_fp8_used_parameters") if isinstance(wrapped, nn.Module) else None
    if tracker is None:
        return 0
    used = tracker.take()
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        flags = torch.tensor(used, dtype=torch.int32, device=tracker.params[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=wrapped.process_group)
        used = [bool(f) for f in flags.tolist()]
    dropped = 0
    for param, was_used in zip(tracker.params, used, strict=True):
        if not was_used and param.grad is not None:
            param.grad = None
            dropped += 1
    return dropped
