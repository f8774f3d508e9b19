"""Where an in-process vLLM engine's decode steps spend their host time, by clock: the engine's own steps timed
around each call (`HostTimers`), with none of a profiler's cost per scope (about 20 us under `torch.profiler`) and
none of a stack sampler's bias (`host_sampling.StackSampler` sees the thread only where it lets go of the interpreter).

vLLM's engine core with async scheduling runs, on the host thread, one step as: `schedule` the next batch,
`execute_model` (prepare its inputs, launch its CUDA graph), `sample_tokens` (launch the sampler), then wait for the
oldest batch in flight (`AsyncOutput.get_output`: its copy event, the GPU's own time where the host is ahead), then
`update_from_output` (the scheduler's bookkeeping) and, in the front end, `process_outputs` (each request's new tokens
handed out) and the statistics. The wait says who bounds the step: near zero, the host; most of the step, the GPU.
"""

from __future__ import annotations

import time

__all__ = ["HostTimers"]


class HostTimers:
    """Seconds and calls of each of an engine's per-step host calls while active: `with HostTimers(llm) as timers:`,
    then `timers.summary()`: milliseconds per engine step of each, the rest of the step (the loop's own Python)
    and the GPU wait's share. A call vLLM does not have on this version is left out, said so in `missing`."""

    def __init__(self, llm):
        self.llm = llm
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.parts: dict[str, str] = {}  # name -> its part (`_targets`)
        self.missing: list[str] = []
        self._restore: list = []

    def _targets(self):
        """(part, name, owner, attribute): `part` says how a call adds up: "step" (the whole step, and the engine
        core's share of it), "in_step" (the calls one after the other in a step: the step's rest is what they leave),
        "in_executor" (the model runner's own calls inside `execute_model` and `sample_tokens`) or "anywhere" (every
        wait on a CUDA event, the GPU wait included). Instance attributes, or vLLM classes whose every instance is
        timed."""
        engine = self.llm.llm_engine
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
        scheduler = getattr(core, "scheduler", None)
        executor = getattr(core, "model_executor", None)
        yield "step", "llm_engine.step", engine, "step"
        yield "step", "engine_core.step", core, "step_fn"
        yield "in_step", "scheduler.schedule", scheduler, "schedule"
        yield "in_step", "executor.execute_model", executor, "execute_model"
        yield "in_step", "executor.sample_tokens", executor, "sample_tokens"
        yield "in_step", "scheduler.update_from_output", scheduler, "update_from_output"
        yield (
            "in_step",
            "output_processor.process_outputs",
            getattr(engine, "output_processor", None),
            "process_outputs",
        )
        yield "in_step", "stats.record", getattr(engine, "logger_manager", None), "record"
        try:
            from vllm.v1.worker.gpu.async_utils import AsyncOutput
        except ImportError:
            AsyncOutput = None
        yield "in_step", GPU_WAIT, AsyncOutput, "get_output"
        runner = getattr(getattr(getattr(executor, "driver_worker", None), "worker", None), "model_runner", None)
        for attr in (
            "add_requests",
            "update_requests",
            "prepare_inputs",
            "prepare_attn",
            "sample",
        ):  # vLLM's V2 runner
            yield "in_executor", f"runner.{attr}", runner, attr
        yield (
            "in_executor",
            "runner.sampler.apply_staged_writes",
            getattr(runner, "sampler", None),
            "apply_staged_writes",
        )
        cudagraphs = getattr(runner, "cudagraph_manager", None)
        yield "in_executor", "runner.cudagraph_manager.run_fullgraph", cudagraphs, "run_fullgraph"
        yield "in_executor", "runner.model.compute_logits", getattr(runner, "model", None), "compute_logits"
        import torch

        yield "anywhere", "cuda event waits", torch.cuda.Event, "synchronize"

    def _wrap(self, name, call):
        clock, seconds, calls = time.perf_counter, self.seconds, self.calls

        def timed(*args, **kwargs):
            start = clock()
            try:
                return call(*args, **kwargs)
            finally:
                seconds[name] += clock() - start
                calls[name] += 1

        return timed

    def __enter__(self) -> HostTimers:
        for part, name, owner, attr in self._targets():
            call = getattr(owner, attr, None) if owner is not None else None
            if call is None:
                self.missing.append(name)
                continue
            if isinstance(owner, type):  # a class: every instance (AsyncOutput is made anew at every step)
                previous = owner.__dict__.get(attr, _ABSENT)
                setattr(owner, attr, self._wrap(name, call))
            else:
                instance_dict = getattr(owner, "__dict__", None)
                if instance_dict is None:  # (slots: nothing to put the timed call in)
                    self.missing.append(name)
                    continue
                previous = instance_dict.get(attr, _ABSENT)
                instance_dict[attr] = self._wrap(name, call)
            self._restore.append((owner, attr, previous))
            self.seconds[name], self.calls[name], self.parts[name] = 0.0, 0, part
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, previous in reversed(self._restore):
            if isinstance(owner, type):
                if previous is _ABSENT:  # inherited: the subclass's own attribute goes
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, previous)
            elif previous is _ABSENT:
                owner.__dict__.pop(attr, None)
            else:
                owner.__dict__[attr] = previous
        self._restore.clear()

    def summary(self) -> dict:
        """Milliseconds per engine step of the step and of each call in it one after the other, the step's rest
        (`llm_engine.step` less those calls: the loop's own Python), the model runner's calls inside the executor's,
        every CUDA event wait, and the GPU wait's share of the step."""
        steps = self.calls.get("llm_engine.step") or 1
        per_step = {name: 1e3 * s / steps for name, s in self.seconds.items()}

        def of(part):
            return {name: ms for name, ms in per_step.items() if self.parts[name] == part}

        in_step = of("step") | of("in_step")
        if "llm_engine.step" in in_step:
            in_step["rest of the step"] = in_step["llm_engine.step"] - sum(of("in_step").values())
        total, wait = in_step.get("llm_engine.step"), in_step.get(GPU_WAIT)
        return {
            "ms_per_step": in_step,
            "in_executor_ms_per_step": of("in_executor"),
            "anywhere_ms_per_step": of("anywhere"),
            "calls": dict(self.calls),
            "steps": steps,
            "gpu_wait_share": wait / total if total and wait is not None else None,
            "missing": self.missing,
        }


_ABSENT = object()
GPU_WAIT = "gpu_wait (AsyncOutput.get_output)"
