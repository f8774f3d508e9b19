"""Where a process's host thread spends a phase, without a native profiler: its Python stack sampled from a second
thread every few milliseconds (`StackSampler`), and the garbage collector's pauses (`GcPauses`).

A colocated vLLM engine runs in the trainer's process, on its main thread: between two decode steps that thread
schedules, prepares the next step's inputs, waits for the sampled tokens and hands out the outputs. Where the GPU sits
idle during a rollout, the samples say on what: a stack ending in a wait on the GPU (an event, a copy) means the GPU
bounds the step; one ending in the scheduler's or the model runner's Python means the host does. The sampler sees
Python frames only: time inside a C function is charged to the Python frame that called it. A sample is taken when
the sampled thread lets go of the interpreter (at a blocking call, or at the interpreter's switch interval, 5 ms by default), which costs it a
hand-over per sample: a few percent at a 2 ms interval. A thread running Python is so sampled less often than one
waiting, so each sample stands for the time since the one before it, not for one interval.
"""

from __future__ import annotations

import collections
import gc
import sys
import threading
import time

__all__ = ["GcPauses", "StackSampler", "frame_key"]


def _path_roots() -> list[str]:
    return sorted({p.rstrip("/") + "/" for p in sys.path if p}, key=len, reverse=True)


def frame_key(filename: str, function: str, roots: list[str] | None = None) -> str:
    """`package/module.py:function`, the file named from the import root it was found under."""
    for root in roots if roots is not None else _path_roots():
        if filename.startswith(root):
            filename = filename[len(root) :]
            break
    return f"{filename}:{function}"


TRUNK_SHARE = 0.98  # a frame on the stack in this share of the time is the trunk (the phase's own call chain)


class StackSampler:
    """Samples the stack of one thread (default: the one that makes the sampler) every `interval_s` seconds while
    active (`with StackSampler() as sampler:`); `summary()` gives the frames most often on the stack (inclusive) and
    at its top (leaf), each as a share of the samples and the milliseconds it stands for, and where the process's
    other threads were meanwhile."""

    def __init__(self, interval_s: float = 0.002, thread_id: int | None = None):
        self.interval_s = interval_s
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.samples: list[tuple[tuple, float]] = []  # each: (the stack's code objects innermost first, seconds)
        # the process's other threads (a library's poller, a monitor): where each was, for how long
        self.others: collections.Counter[tuple[int, object]] = collections.Counter()
        self.thread_names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seconds = 0.0

    def _run(self) -> None:
        current_frames, clock, me = sys._current_frames, time.perf_counter, threading.get_ident()
        last = self._start
        while not self._stop.wait(self.interval_s):
            now = clock()  # (once this thread holds the interpreter again: the wait for it included)
            frames = current_frames()
            frame = frames.pop(self.thread_id, None)
            stack = []
            while frame is not None:
                stack.append(frame.f_code)
                frame = frame.f_back
            if stack:
                self.samples.append((tuple(stack), now - last))
            for ident, other in frames.items():
                if ident != me:
                    self.others[ident, other.f_code] += now - last
                    if ident not in self.thread_names:
                        self.thread_names.update((t.ident, t.name) for t in threading.enumerate())
            last = now

    def __enter__(self) -> StackSampler:
        self._start = time.perf_counter()  # (before the thread starts: it reads it)
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._start

    def summary(self, top: int = 25) -> dict:
        """{"samples", "seconds", "inclusive": [{"frame", "share", "ms"}...], "leaf": [...]}, heaviest first: a frame's
        ms is the time its samples stand for, its share that time over all the samples'."""
        roots = _path_roots()
        names: dict = {}

        def name(code) -> str:
            if code not in names:
                names[code] = frame_key(code.co_filename, code.co_name, roots)
            return names[code]

        inclusive: collections.Counter[str] = collections.Counter()
        leaf: collections.Counter[str] = collections.Counter()
        for stack, seconds in self.samples:
            keys = [name(code) for code in stack]
            leaf[keys[0]] += seconds
            for key in set(keys):  # a recursive frame counted once per sample
                inclusive[key] += seconds
        total = sum(seconds for _, seconds in self.samples)

        def rows(counter: collections.Counter, trunk: bool = True) -> list[dict]:
            return [
                {"frame": frame, "share": seconds / total, "ms": 1e3 * seconds}
                for frame, seconds in counter.most_common()
                if trunk or seconds < TRUNK_SHARE * total  # the calls every sample passes through say nothing
            ][:top]

        others = [
            {"thread": self.thread_names.get(ident, str(ident)), "frame": name(code), "ms": 1e3 * seconds}
            for (ident, code), seconds in self.others.most_common(top)
        ]
        return {
            "samples": len(self.samples),
            "interval_ms": 1e3 * self.interval_s,
            "seconds": self.seconds,
            "inclusive": rows(inclusive, trunk=False) if total else [],  # the trunk left out
            "trunk": sum(seconds >= TRUNK_SHARE * total for seconds in inclusive.values()) if total else 0,
            "leaf": rows(leaf) if total else [],
            "other_threads": others,  # each thread's top frame: a waiting thread shows its wait
        }


class GcPauses:
    """The garbage collector's collections and the time they took while active (`with GcPauses() as pauses:`); the
    part that fell outside spans the caller marks as timed (`timing = True`) is `outside_seconds`."""

    def __init__(self):
        self.count, self.seconds, self.outside_seconds, self.timing, self._start = 0, 0.0, 0.0, False, 0.0
        self.by_generation = [0, 0, 0]

    def __call__(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.count += 1
        self.by_generation[min(int(info.get("generation", 0)), 2)] += 1
        pause = time.perf_counter() - self._start
        self.seconds += pause
        if not self.timing:
            self.outside_seconds += pause

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)

    def record(self) -> dict:
        return {"collections": self.count, "seconds": self.seconds, "by_generation": list(self.by_generation)}
