"""Sibling FP8 layers (q/k/v, gate/up) that read one input run as one FP8 GEMM per pass.

transformers calls `q_proj(x)`, `k_proj(x)` and `v_proj(x)` one after another. Run as three FP8 layers, that is three
FProp GEMMs, three DGrad and three WGrad GEMMs, three output-gradient quantizations and three DGrad weight layouts,
each issued from Python, so the three layers can be bound by the host where one `qkv_proj` layer of the same GEMMs
is not (docs/contributing/benchmark-details.md measures both). Their weights' output dims are multiples of 128, so
stacking them row-wise
changes no 128x128 block and no 1x128 gradient group: one GEMM on the stacked FP8 blocks is the three layers' math.

So the first sibling called computes every sibling's output in one `_BlockwiseFP8Matmul` (FProp, DGrad, WGrad on the
stacked weight, each weight getting its rows of the WGrad result), returns its own columns and leaves the others
pending; each sibling then called with the very same input tensor takes its columns. Anything else (another input,
a second call, `torch.compile`, FSDP2 shards, a weight computed at the layer's call such as PEFT's LoRA on
`target_parameters`) runs the layer alone, so the grouping never changes what a layer computes, only how many kernels
compute it (layers found with such a weight leave their group at the next optimizer step). Modules, parameters and
`state_dict` keys stay as they are, and each layer's FP8 weight and scales (vLLM sync, export) are its rows of the
stacked ones: the same bytes as without grouping.
"""

from __future__ import annotations

import copy
import threading
import weakref

import torch
from torch import nn

from trl_fp8.config import BLOCK
from trl_fp8.distributed import is_sharded
from trl_fp8.nn.linear import FP8Linear, FP8Weight, InputEntry, _BlockwiseFP8Matmul
from trl_fp8.nn.weight_cache import cache_hit, caches_now, is_own_parameter, optimizer_steps, tensor_bytes

__all__ = ["FUSED_GROUPS", "FP8SiblingGroup", "group_fp8_siblings", "sibling_group_problem"]

# Layers transformers models call on one input, which vLLM fuses into one layer (qkv_proj, gate_up_proj).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def sibling_group_problem(members: list[nn.Module]) -> str | None:
    """Why `members` cannot run as one FP8 GEMM, or None."""
    if len(members) < 2:
        return "fewer than two layers"
    if not all(isinstance(m, FP8Linear) for m in members):
        return "not every layer is a blockwise FP8Linear"
    if any("weight" not in m._parameters for m in members):
        return "a layer's weight is parametrized (computed at each call)"
    first = members[0]
    for m in members[1:]:
        if m.fp8_config != first.fp8_config:
            return "the layers have different FP8 configurations"
        if m.in_features != first.in_features:
            return "the layers have different input dims"
        if (m.weight.dtype, m.weight.device) != (first.weight.dtype, first.weight.device):
            return "the weights differ in dtype or device"
    if any(getattr(m, "_fp8_group", None) is not None for m in members):
        return "a layer already belongs to a sibling group"
    return None


class FP8SiblingGroup:
    """FP8 layers reading one input (`members`, in output order) computed by one GEMM per pass; see the module doc."""

    def __init__(self, members: list[FP8Linear]):
        if (problem := sibling_group_problem(members)) is not None:
            raise ValueError(f"These layers cannot run as one FP8 GEMM: {problem}.")
        self._members = [weakref.ref(m) for m in members]
        self._cache: tuple[tuple, FP8Weight] | None = None
        self._local = threading.local()  # pending outputs per thread: concurrent forwards never see each other's
        self._parametrized: tuple[frozenset[int], int] | None = None  # see `forward_member`
        for index, member in enumerate(self.members):
            member._fp8_group = (self, index)

    @property
    def members(self) -> list[FP8Linear]:
        # Weak references: each member holds its group (`_fp8_group`), and references both ways would be a cycle that
        # keeps a dropped model, and its GPU memory, alive until the garbage collector runs.
        return [ref() for ref in self._members]

    def __deepcopy__(self, memo):  # a deep-copied model gets its own group over its own layers
        clone = object.__new__(FP8SiblingGroup)
        memo[id(self)] = clone
        clone._members = [weakref.ref(copy.deepcopy(m, memo)) for m in self.members]  # (memo keeps them alive)
        clone._cache, clone._local, clone._parametrized = None, threading.local(), self._parametrized
        return clone

    def __getstate__(self):  # pickling (torch.save of a whole model): no thread-local state, no cache
        return {"members": self.members, "parametrized": self._parametrized}

    def __setstate__(self, state):
        self._members, self._cache, self._local = [weakref.ref(m) for m in state["members"]], None, threading.local()
        self._parametrized = state.get("parametrized")

    def fp8_weight(self) -> FP8Weight:
        """The members' FP8 weights stacked row-wise; each member's cache then holds views of its rows."""
        members = self.members
        weights = [m.weight for m in members]
        if not all(is_own_parameter(m, "weight", w) for m, w in zip(members, weights, strict=True)):
            # A weight computed at each call is never cached (`FP8Linear._fp8_weight`). (`forward_member` stacks no
            # such weight; this is for any other caller.)
            return self._quantize_stacked(members, weights, cached=False)
        keep = all(caches_now(m.fp8_config, w) for m, w in zip(members, weights, strict=True))
        key = tuple(m._cache_key() for m in members)
        if (hit := cache_hit(self._cache, key)) is not None:
            if keep:
                return hit
            self.release_cache()  # a forward recording gradients with cache_with_grad=False: the copy's last use
            return FP8Weight.of(hit.q, hit.scale_inv, hit.ops, hit.power_of_two_scales)
        self.release_cache()  # the old stack (and the members' views of it) go before the new one is built
        stacked = self._quantize_stacked(members, weights, cached=keep)
        if keep:
            stacked.cached = True
            rows = [m.out_features for m in members]
            for member, member_key, q, s in zip(
                members, key, stacked.q.split(rows), stacked.scale_inv.split([r // BLOCK for r in rows]), strict=True
            ):
                view = FP8Weight.of(q, s, stacked.ops, stacked.power_of_two_scales)
                view.cached = True
                member._fp8_weight_cache = (member_key, view)
            self._cache = (key, stacked)
        return stacked

    @staticmethod
    def _quantize_stacked(members: list[FP8Linear], weights: list[torch.Tensor], cached: bool) -> FP8Weight:
        """The members' weights quantized into one stack: the same blocks as each weight alone (their rows are
        multiples of 128). Not cached (quantized at every forward, as under FSDP2), the weights are stacked first and
        quantized by one kernel: two launches, not one quantization and two copies per member. Cached (once per
        optimizer step), each is quantized alone and written into its rows: at most one member's copy beside the
        stack."""
        if not cached:
            return members[0]._quantize(torch.cat([w.detach() for w in weights]))
        total = sum(m.out_features for m in members)
        q = scale_inv = first = None
        row = 0
        for m, w in zip(members, weights, strict=True):
            part = m._quantize(w)
            if first is None:
                first = part
                q = part.q.new_empty((total, part.q.shape[1]))
                scale_inv = part.scale_inv.new_empty((total // BLOCK, part.scale_inv.shape[1]))
            rows = slice(row, row + m.out_features)
            # (copied as bytes: the FP8 values move unchanged, whatever dtypes `copy_` supports on the device)
            q[rows].view(torch.uint8).copy_(part.q.view(torch.uint8))
            scale_inv[row // BLOCK : rows.stop // BLOCK].copy_(part.scale_inv)
            row = rows.stop
        return FP8Weight.of(q, scale_inv, first.ops, first.power_of_two_scales)

    def cache_bytes(self) -> int:
        """Bytes of the cached stack (values and scales); 0 when none is cached."""
        return 0 if self._cache is None else tensor_bytes(self._cache[1].q, self._cache[1].scale_inv)

    def release_cache(self) -> int:
        """Let go of the stack and of every member's view of it (a view alone would keep the whole stack alive);
        returns the bytes let go."""
        released = self.cache_bytes()
        self._cache = None
        for member in self.members:
            if member is not None:
                member._fp8_weight_cache = None
        return released

    def leave(self, indices) -> None:
        """Take the members at `indices` out of the group for good: they run alone from now on, and the others form
        a group of their own if two or more remain. The stack and any outputs pending are let go."""
        members = self.members
        self.release_cache()
        if (pending := getattr(self._local, "pending", None)) is not None:
            pending.drop()
        for member in members:
            if member is not None:
                member._fp8_group = None
        rest = [m for i, m in enumerate(members) if i not in indices and m is not None]
        if sibling_group_problem(rest) is None:
            FP8SiblingGroup(rest)

    def forward_member(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member `index`'s output for `x` (without bias), or None when the member must run alone."""
        members = self.members
        if torch.compiler.is_compiling():
            return None
        # A layer whose weight is computed at each call, not its parameter, runs alone on the weight it has then.
        # PEFT's LoRA on `target_parameters` parametrizes a layer's weight as `W + BA` only while that layer's own
        # call runs, after the first sibling's call stacked the plain `W`: that layer's pending output is dropped
        # (taking it dropped the adapter). Such layers leave the group, but only after the next optimizer step:
        # gradient checkpointing recomputes a forward in its backward, and must see the layers grouped as they were.
        weights = [m._parameters.get("weight") for m in members]
        if (seen := self._parametrized) is not None and seen[1] != optimizer_steps():
            self.leave(seen[0])
            group = members[index]._fp8_group
            return group[0].forward_member(group[1], x) if group is not None else None
        if any(w is None for w in weights):
            seen = frozenset(i for i, w in enumerate(weights) if w is None) | (seen[0] if seen else frozenset())
            self._parametrized = (seen, optimizer_steps())
            return None
        if any(is_sharded(w) for w in weights):
            return None
        # (inference tensors keep no version counter; nothing writes a layer's input between its siblings' calls)
        key = (None if x.is_inference() else x._version, torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        pending = getattr(self._local, "pending", None)  # outputs computed for siblings not called yet
        if pending is not None and pending.holds(x, key):
            outputs, used = pending.value
            out, outputs[index] = outputs[index], None
            if out is not None:
                # (computed from the weight the layer has now, unless the parameter was replaced since: then alone)
                return out if used[index] is weights[index] else None
            if any(o is not None for o in outputs):
                return None  # called again on the same input while its siblings still wait for theirs: run alone
        y = _BlockwiseFP8Matmul.apply(x, weights[0], self.fp8_weight(), torch.is_grad_enabled(), *weights[1:])
        outputs = list(y.split([m.out_features for m in members], dim=-1))
        own, outputs[index] = outputs[index], None
        if pending is not None:
            pending.drop()
        self._local.pending = InputEntry(x, key, (outputs, weights))
        return own


def group_fp8_siblings(model: nn.Module, sibling_sets=FUSED_GROUPS) -> list[FP8SiblingGroup]:
    """Group, under every module, the FP8 layers named by one of `sibling_sets` (PEFT-wrapped layers included) so
    they run as one GEMM per pass. Sets with a member missing, kept in high precision or otherwise unfit stay as they
    are. Returns the groups made."""
    from trl_fp8.nn.adapters import hf_name

    fp8 = {hf_name(name): mod for name, mod in model.named_modules() if isinstance(mod, FP8Linear)}
    groups = []
    parents = {name.rpartition(".")[0] for name in fp8}
    for parent in sorted(parents):
        prefix = f"{parent}." if parent else ""
        for names in sibling_sets:
            members = [fp8.get(prefix + leaf) for leaf in names]
            if all(m is not None for m in members) and sibling_group_problem(members) is None:
                groups.append(FP8SiblingGroup(members))
    return groups
