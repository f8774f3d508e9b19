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
    then `timers.summary(steps)`: milliseconds per engine step of each, the rest of the step (the loop's own Python)
    and the GPU wait's share. A call vLLM does not have on this version is left out, said so in `missing`."""

    def __init__(self, llm):
        self.llm = llm
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.missing: list[str] = []
        self._restore: list = []

    def _targets(self):
        """(name, owner, attribute): instance attributes first, then vLLM classes whose every instance is timed."""
        engine = self.llm.llm_engine
        core = getattr(getattr(engine, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
        scheduler = getattr(core, "scheduler", None)
        executor = getattr(core, "model_executor", None)
        yield "llm_engine.step", engine, "step"
        yield "engine_core.step", core, "step_fn"
        yield "scheduler.schedule", scheduler, "schedule"
        yield "executor.execute_model", executor, "execute_model"
        yield "executor.sample_tokens", executor, "sample_tokens"
        yield "scheduler.update_from_output", scheduler, "update_from_output"
        yield "output_processor.process_outputs", getattr(engine, "output_processor", None), "process_outputs"
        yield "stats.record", getattr(engine, "logger_manager", None), "record"
        try:
            from vllm.v1.worker.gpu.async_utils import AsyncOutput
        except ImportError:
            AsyncOutput = None
        yield "gpu_wait (AsyncOutput.get_output)", AsyncOutput, "get_output"
        # Inside the model runner's two calls (vLLM's V2 runner; NESTED: not added to the step's rest)
        runner = getattr(getattr(getattr(executor, "driver_worker", None), "worker", None), "model_runner", None)
        for attr in ("add_requests", "update_requests", "prepare_inputs", "prepare_attn", "sample"):
            yield f"{NESTED}runner.{attr}", runner, attr
        yield f"{NESTED}runner.sampler.apply_staged_writes", getattr(runner, "sampler", None), "apply_staged_writes"
        yield (
            f"{NESTED}runner.cudagraph_manager.run_fullgraph",
            getattr(runner, "cudagraph_manager", None),
            "run_fullgraph",
        )
        yield f"{NESTED}runner.model.compute_logits", getattr(runner, "model", None), "compute_logits"
        import torch

        yield OVERLAPPING, torch.cuda.Event, "synchronize"  # every wait on an event, the one above included

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
        for name, owner, attr in self._targets():
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
            self.seconds[name], self.calls[name] = 0.0, 0
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

    def summary(self, steps: int | None = None) -> dict:
        """Milliseconds per step of each timed call (`steps`: decode steps to divide by; default the engine's steps),
        the loop's rest (`llm_engine.step` less the calls inside it) and the GPU wait's share of the step."""
        steps = steps or self.calls.get("llm_engine.step") or 1
        per_step = {name: 1e3 * s / steps for name, s in self.seconds.items()}
        inner = [n for n in per_step if n not in ("llm_engine.step", "engine_core.step", OVERLAPPING)
                 and not n.startswith(NESTED)]  # fmt: skip
        if "llm_engine.step" in per_step:
            per_step["rest of the step"] = per_step["llm_engine.step"] - sum(per_step[n] for n in inner)
        total = per_step.get("llm_engine.step")
        wait = per_step.get("gpu_wait (AsyncOutput.get_output)")
        return {
            "ms_per_step": per_step,
            "calls": dict(self.calls),
            "steps": steps,
            "gpu_wait_share": wait / total if total and wait is not None else None,
            "missing": self.missing,
        }


_ABSENT = object()
OVERLAPPING = "cuda event waits (anywhere, overlapping the above)"
NESTED = "  in executor: "  # calls inside `execute_model` and `sample_tokens`, timed apart
