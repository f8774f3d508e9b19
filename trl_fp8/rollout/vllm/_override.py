"""What trl-fp8's replacements of a vLLM op's CUDA kernel share (`act_quant`: SiLU-and-mul + FP8 groups; `norm_quant`:
RMSNorm + FP8 groups): the check that gives the op trl-fp8's kernel, and the registration's lifetime.

`check_and_install` registers trl-fp8's kernel for the op through `torch.library` (so every caller, compiled graphs
and their CUDA graphs included, runs it) only after checking on this GPU, before the engine starts, that

1. trl-fp8's kernel writes the bytes of vLLM's on the op's probe inputs, with one of its numerics (which also
   compiles the Triton variants the probes select before vLLM captures its CUDA graphs); and
2. it takes less GPU time at the engine's shape (both timed inside a CUDA graph, as vLLM's decode steps run them),
   unless the engine asked for it whatever its speed;

and, once registered, the probes give vLLM's bytes again through the op itself (the dispatcher passes a Python
kernel its arguments its own way). Otherwise, or where a check fails to run, vLLM's kernel stays, and the returned
choice says why.

The registration covers the op in the whole process, so `Installation` keeps the decision per engine: an engine of
other settings (the op's `InstallKey`) is checked anew against vLLM's own kernel; an engine of the same settings
shares the decision in force; `uninstall` gives vLLM its kernel back, which also happens once no live engine uses
ours (`in_force`: whether an engine's choice still holds).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

__all__ = [
    "Installation",
    "KernelChoice",
    "OpCheck",
    "check_and_install",
    "count_differences",
    "first_difference",
    "graph_time_us",
    "on_device",
]


@dataclass(frozen=True)
class KernelChoice:
    """What an installation decided: whether trl-fp8's kernel now runs the op, with which numerics, and why."""

    installed: bool
    reason: str
    numerics: str | None = None
    vllm_us: float | None = None
    trl_fp8_us: float | None = None


def graph_time_us(fn, reps: int = 20) -> float:
    """GPU time of one `fn()` call as a decode step runs it: `reps` calls captured in one CUDA graph and replayed
    (an eager loop would time the host's launches, which vLLM's CUDA graphs do not pay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiled and loaded before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (5 * reps)


def on_device(device):
    """The CUDA device context of `device` (nothing for another device)."""
    return torch.cuda.device(device) if torch.device(device).type == "cuda" else contextlib.nullcontext()


def failure(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def count_differences(outputs, references, names: Sequence[str]) -> str | None:
    """None when each of `outputs` holds the bytes of its `references` tensor, else how many elements differ in each
    (`names[i]` for the i-th: "1 of 2 scales")."""
    counts = []
    for out, ref, name in zip(outputs, references, names, strict=True):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[out.element_size()]
        counts.append(((out.view(bits) != ref.view(bits)).sum().item(), out.numel(), name))
    if not any(bad for bad, _, _ in counts):
        return None
    parts = [f"{bad} of {n} {name}" for bad, n, name in counts]
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


class Installation:
    """One op's kernel registration in this process: the `torch.library.Library` holding trl-fp8's kernel, the
    choice and `InstallKey` it was checked for, and the engines that keep it (a `weakref.finalize` each; `held`: a
    caller without an engine keeps it until `uninstall`)."""

    def __init__(self):
        self._state: dict = {}

    def installed(self) -> KernelChoice | None:
        """The kernel choice in force in this process, or None when vLLM's kernel runs the op."""
        choice = self._state.get("choice")
        return choice if choice is not None and choice.installed else None

    def current(self, key, owner: object | None) -> KernelChoice | None:
        """The choice in force when it was checked for `key` (then `owner` keeps it too), else None."""
        if self.installed() is None or self._state.get("key") != key:
            return None
        self._keep_for(owner)
        return self._state["choice"]

    def in_force(self, choice: KernelChoice | None) -> KernelChoice | None:
        """`choice` (an engine's installation) as it holds now: an installation no longer in force (vLLM's kernel
        back, or another engine's check in its place) says so, with what its check measured."""
        now = self.installed()
        if choice is None or not choice.installed or now is choice:
            return choice
        why = (
            "vLLM's kernel runs the op again" if now is None else "another engine checked it at its own settings since"
        )
        return replace(choice, installed=False, reason=f"no longer in force: {why}; this engine's check had found: "
                       f"{choice.reason}")  # fmt: skip

    def uninstall(self) -> None:
        """Give the op its vLLM kernel back (destroying our registration restores the one it covered), whatever
        engines use ours."""
        library = self._state.pop("library", None)
        for finalizer in self._state.pop("owners", ()):
            finalizer.detach()
        for name in ("choice", "key", "held"):
            self._state.pop(name, None)
        if library is not None:
            library._destroy()

    def keep(self, library, choice: KernelChoice, key, owner: object | None) -> None:
        """`library` (trl-fp8's kernel registered) is now in force for `key`, kept by `owner`."""
        self._state.update(library=library, choice=choice, key=key, owners=[], held=False)
        self._keep_for(owner)

    def _keep_for(self, owner: object | None) -> None:
        """Keep the kernel in force while `owner` lives (None: until `uninstall`)."""
        if owner is None:
            self._state["held"] = True
        else:
            self._state["owners"].append(weakref.finalize(owner, self._release, self._state["library"]))

    def _release(self, library) -> None:
        """An engine using `library`'s kernel is gone: vLLM's kernel back if it was the last (and none without an
        engine holds ours). A `library` no longer in force (replaced since) is left alone."""
        state = self._state
        if state.get("library") is library and not state["held"] and not any(f.alive for f in state["owners"]):
            self.uninstall()


@dataclass(frozen=True)
class OpCheck:
    """How to check one op: its name, trl-fp8's kernel for each numerics, the probe cases, how a case runs and
    compares, and what to time."""

    namespace: str
    op_name: str
    numerics: Callable  # () -> trl-fp8's kernel's variants, tried in this order (imports Triton)
    kernel: Callable  # numerics -> a kernel with the op's signature
    cases: Callable  # () -> the probe cases (on the current device)
    run: Callable  # (op, case) -> the tensors the op wrote
    compare: Callable  # (outputs, references, case) -> None when equal, else what differs, and where
    timed: Callable  # (vllm_op, ours) -> (a call of vLLM's, a call of ours) at the engine's shape
    timer: Callable  # fn -> microseconds
    at: str  # the timed shape, said in the reason ("256 x 6144")
    detail: str  # what the timing ran with, said in the reason ("column-major scales")


def first_difference(run: Callable, compare: Callable, op, cases, references) -> str | None:
    """None when `op` writes the bytes of `references` (`run` results, one per case) on every case, else what
    differs first (`compare`'s words)."""
    for case, reference in zip(cases, references, strict=True):
        why = compare(run(op, case), reference, case)
        if why is not None:
            return why
    return None


def check_and_install(
    installation: Installation,
    check: OpCheck,
    vllm_op,
    device,
    key,
    *,
    require_faster: bool,
    owner: object | None,
    choice_type: type[KernelChoice] = KernelChoice,
) -> KernelChoice:
    """Register trl-fp8's kernel for `check`'s op where it writes `vllm_op`'s bytes on every probe on `device` and,
    with `require_faster`, takes less time (see the module docstring); the choice, installed or not, and why."""
    try:
        with on_device(device):
            cases = check.cases()
            references = [check.run(vllm_op, case) for case in cases]
            numerics, differences = None, {}
            for candidate in check.numerics():
                ours = check.kernel(candidate)
                differences[candidate] = first_difference(check.run, check.compare, ours, cases, references)
                if differences[candidate] is None:
                    numerics = candidate
                    break
            if numerics is None:
                return choice_type(
                    False,
                    "trl-fp8's kernel does not reproduce vLLM's bits on this GPU, so vLLM's stays ("
                    + "; ".join(f"{k} numerics: {v}" for k, v in differences.items())
                    + ")",
                )
            vllm_call, our_call = check.timed(vllm_op, ours)
            vllm_us = check.timer(vllm_call)
            ours_us = check.timer(our_call)
    except Exception as exc:  # noqa: BLE001 - any failure to check it (a GPU our Triton kernel cannot compile for, a
        # vLLM whose op takes other arguments) leaves vLLM's own kernel in place, which is always correct
        return choice_type(False, f"trl-fp8's kernel could not be checked here, so vLLM's stays ({failure(exc)})")
    if ours_us >= vllm_us and require_faster:
        return choice_type(
            False, f"same bits, but not faster here: {ours_us:.1f} us against vLLM's {vllm_us:.1f} us at {check.at}",
            numerics, vllm_us, ours_us,
        )  # fmt: skip
    library = torch.library.Library(check.namespace, "IMPL")  # noqa: TOR901 (an implementation of vLLM's op)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")  # torch says that it replaces vLLM's kernel
            library.impl(check.op_name, ours, torch.device(device).type.upper())
    except Exception as exc:  # noqa: BLE001 - torch refuses a second Python kernel for the op (another library's)
        library._destroy()
        return choice_type(
            False, f"trl-fp8's kernel could not be registered for vLLM's op, so vLLM's stays ({failure(exc)})",
            numerics, vllm_us, ours_us,
        )  # fmt: skip
    # The engine calls the op through torch's dispatcher, which hands our Python kernel its arguments its own way
    # (trailing defaults left out): the probes again, through the op now, against vLLM's bytes.
    try:
        with on_device(device):
            why = first_difference(check.run, check.compare, vllm_op, cases, references)
    except Exception as exc:  # noqa: BLE001 - as above: vLLM's kernel back, and why
        why = failure(exc)
    if why is not None:
        library._destroy()
        return choice_type(
            False, f"trl-fp8's kernel failed the check through vLLM's op, so vLLM's stays ({why})", numerics, vllm_us,
            ours_us,
        )  # fmt: skip
    asked = "" if require_faster else "; asked for whatever its speed"
    choice = choice_type(
        True, f"trl-fp8's Triton kernel, vLLM's bits on every probe ({numerics} numerics), {ours_us:.1f} us against "
        f"vLLM's {vllm_us:.1f} us at {check.at} ({check.detail}{asked})", numerics, vllm_us, ours_us,
    )  # fmt: skip
    installation.keep(library, choice, key, owner)
    return choice
