"""GRPO from a pre-trained convergence model in one precision setting; same seeds and steps for every setting.

    python -m benchmarks.convergence.run_grpo --model /tmp/arith-base --setting fp8_tis     # GPU host with vLLM
    python -m benchmarks.convergence.run_grpo --model /tmp/arith-base --setting all
    python -m benchmarks.convergence.run_grpo --task chain --model /tmp/chain-base --setting all   # long completions

Settings (all through `FP8GRPOTrainer`, vLLM colocated, so every run logs the same trainer-vs-rollout mismatch):

| setting | training | rollout | correction |
|---|---|---|---|
| `bf16` | BF16 | BF16 | none |
| `bf16_fp8rollout` | BF16 | vLLM online FP8 (`fp8_online`) | none |
| `bf16_fp8rollout_tis` | BF16 | vLLM online FP8 | token TIS (cap 2) |
| `fp8` | blockwise FP8 | the trainer's own FP8 weights | none |
| `fp8_tis` | blockwise FP8 | the trainer's own FP8 weights | token TIS (cap 2) |
| `fp8_tis_fp8kv` | blockwise FP8 | the same, with an FP8 KV cache | token TIS (cap 2) |
| `fp8_exact` | blockwise FP8, on the engine's kernels | the same, vLLM batch-invariant (`exact_on_policy`) | token TIS |
| `fp8_exact_fp8kv` | the same | the same, with an FP8 KV cache | token TIS |

`all` is the study's first six; the exact settings check exactness on a trained model (`--setting fp8_exact
fp8_exact_fp8kv --steps 3 --completion_len 512 --ignore_eos --context 640`: every completion 512 tokens).

Per step: reward and mismatch (mean |delta logp|, KL k3); every `--eval_every` steps: held-out greedy accuracy.
Writes `benchmarks/results/convergence[_<task>]/grpo_<setting>_<device>.json` after every logged step and evaluation
(a run cut off keeps what it measured). `--max_minutes` bounds the training time: parallel runs then stop at the
step the first one reached at the deadline (a run already past it, where it is), and evaluate; `--stop_at` (a
wall-clock time: a lease's end) bounds it the same way whatever the start-ups took. `--no_vllm` runs without vLLM
(CPU smoke).
`--setting all --parallel` runs the six settings at once on one GPU (the model is small, a run alone leaves the GPU
mostly idle): they build their trainers and vLLM engines one at a time, then train together. Results are the same
kind; the logged step times are then not a speed measure. `--seeds 0 1` with it runs every setting for both seeds
at once (twelve runs); `--gpus 0 1` then puts each seed's six runs on a GPU of its own. Seed n > 0 writes to
`<results_dir>_seed<n>` whether or not seed 0 runs beside it. Several settings named (`--setting bf16 fp8_tis
fp8_tis_fp8kv --parallel`) run as `all` does, those alone.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import arg_parser, device_name, metadata, module_command, write_json
from benchmarks.convergence.pretrain import TASKS, load_task, results_folder

SETTINGS = {  # setting: (fp8_recipe, rollout_precision, tis, fp8_kv_cache)
    "bf16": ("none", "bf16", "off", False),
    "bf16_fp8rollout": ("none", "fp8_online", "off", False),
    "bf16_fp8rollout_tis": ("none", "fp8_online", "token", False),
    "fp8": ("blockwise", "fp8", "off", False),
    "fp8_tis": ("blockwise", "fp8", "token", False),
    "fp8_tis_fp8kv": ("blockwise", "fp8", "token", True),  # the FP8 KV cache's cost, next to fp8_tis
}
STUDY = list(SETTINGS)  # `--setting all`: the accuracy study's six
# Exact on-policy mode (`exact_on_policy=True`): vLLM batch-invariant, the trainer on the engine's kernels; TIS stays
# on so its clipped fraction shows exactness (nothing to clip). Run by name only, e.g. with --ignore_eos --context.
EXACT = {"fp8_exact": ("blockwise", "fp8", "token", False), "fp8_exact_fp8kv": ("blockwise", "fp8", "token", True)}
SETTINGS |= EXACT
METRICS = ("reward", "fp8/mismatch/abs_logp_diff_mean", "fp8/mismatch/abs_logp_diff_max", "fp8/mismatch/kl_k3",
           "fp8/mismatch/is_ratio_clipped_frac", "fp8/weight_sync_ms", "step_time", "completions/mean_length")  # fmt: skip


@contextlib.contextmanager
def start_turn(sync_dir: Path | None):
    """Parallel runs start one at a time: vLLM sizes its KV cache from the GPU memory it sees free while it profiles,
    and another run starting or training in that window would skew it (or trip vLLM's profiling check)."""
    if sync_dir is None:
        yield
        return
    # one turn per GPU: runs on another GPU (`--gpus`) do not skew this one's profiling
    with open(sync_dir / f"lock.gpu{os.environ.get('CUDA_VISIBLE_DEVICES', '')}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def wait_for_all(sync_dir: Path | None, setting: str, count: int, timeout_s: float = 1800) -> None:
    """Train only once every parallel run has started (see `start_turn`) or failed (the parent marks those): the
    others train without it rather than lose the lease's results (one start-up failure once stopped all ten)."""
    if sync_dir is None:
        return
    (sync_dir / f"{setting}.ready").touch()
    deadline = time.time() + timeout_s
    while True:
        ready, failed = ({p.stem for p in sync_dir.glob(f"*.{state}")} for state in ("ready", "failed"))
        if len(ready | failed) >= count:  # a run may fail after it was ready: count it once
            break
        if time.time() > deadline:
            raise SystemExit(f"{setting}: {count - len(ready | failed)} parallel runs never started; not training")
        time.sleep(1)
    if failed:
        print(f"{setting}: training without {sorted(failed)}, which failed", flush=True)


class Deadline:
    """`--max_minutes` of training, or until `--stop_at`, whichever is sooner. The first run past it writes its step
    to `<sync_dir>/stop` and every parallel run stops at that step (one already past it, at its next check: the
    2026-11-24 lease stopped two runs at steps 79 and 80), so the settings end level or nearly; a run lagging further
    than `grace_s` behind stops where it is. Runs that reach `max_steps` first are not held back."""

    def __init__(
        self, minutes: float | None, sync_dir: Path | None, grace_s: float = 120, stop_at: float | None = None
    ):
        self.minutes, self.grace_s, self.stop_at = minutes, grace_s, stop_at
        self.stop_file = sync_dir / "stop" if sync_dir else None
        self.end: float | None = None
        self.stopped_at: int | None = None

    def start(self) -> None:
        """Training starts: the deadline is `minutes` from now, or `stop_at` (a wall-clock time) if that is sooner."""
        ends = (time.time() + 60 * self.minutes if self.minutes else None, self.stop_at)
        self.end = min((end for end in ends if end), default=None)

    def reached(self, step: int) -> bool:
        if self.end is None:
            return False
        now = time.time()
        if self.stop_file is not None and self.stop_file.exists():
            stop = step >= int(self.stop_file.read_text()) or now > self.end + self.grace_s
        elif now > self.end:
            stop = True
            if self.stop_file is not None:  # link, not write: atomic, and the first run past the deadline wins
                tmp = self.stop_file.with_name(f"stop.{os.getpid()}")
                tmp.write_text(str(step))
                with contextlib.suppress(FileExistsError):
                    os.link(tmp, self.stop_file)
                tmp.unlink()
                stop = step >= int(self.stop_file.read_text())
        else:
            stop = False
        if stop:
            self.stopped_at = step
        return stop


def grpo_config(args, setting: str, task, cuda: bool):
    """The `FP8GRPOConfig` of one setting: every setting runs the same GRPO, only precision and correction differ."""
    from trl_fp8 import FP8GRPOConfig

    recipe, precision, tis, fp8_kv = SETTINGS[setting]
    micro_batch = args.micro_batch or args.batch_size
    if args.batch_size % micro_batch:
        raise SystemExit(f"--batch_size {args.batch_size} must be a multiple of --micro_batch {micro_batch}")
    return FP8GRPOConfig(
        output_dir=str(Path(args.workdir) / f"{setting}_seed{args.seed}"), max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", per_device_train_batch_size=micro_batch, num_generations=args.num_generations,
        gradient_accumulation_steps=args.batch_size // micro_batch,
        max_completion_length=args.completion_len or task.max_completion_length(), temperature=1.0, beta=0.0, logging_steps=1,
        save_strategy="no", report_to="none", seed=args.seed, bf16=cuda, use_cpu=not cuda,
        gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"}, fp8_recipe=recipe,
        tis=None if args.no_vllm else tis,  # without vLLM the policy samples its own rollouts: nothing to correct
        use_vllm=not args.no_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory,
        # without vLLM the rollout settings are refused (nothing would use them); the kernel choice is for our
        # block-FP8 rollouts only (BF16 and vLLM's online FP8 refuse it)
        rollout_precision=None if args.no_vllm else precision, save_fp8_checkpoint=False,
        fp8_kv_cache=fp8_kv and not args.no_vllm,
        vllm_fp8_backend=args.vllm_fp8_backend if precision == "fp8" and not args.no_vllm else "auto",
        use_liger_kernel=False,  # the settings compared are precisions, on the same layer kernels as earlier studies
        exact_on_policy=setting in EXACT,
        generation_kwargs={"ignore_eos": True} if args.ignore_eos else None,
    )  # fmt: skip


def with_context(model: str, positions: int | None, workdir: Path) -> str:
    """The model folder, or a copy of it whose config allows `positions` tokens (the weights linked, not copied): a
    RoPE model has no learned positions, so the same trained weights run longer sequences, beyond what they learned."""
    if positions is None:
        return model
    config = json.loads((Path(model) / "config.json").read_text())
    if positions <= config.get("max_position_embeddings", 0):
        return model
    out = workdir / f"{Path(model).name}_context{positions}"
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model).iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    (out / "config.json").write_text(json.dumps(config | {"max_position_embeddings": positions}, indent=2))
    return str(out)


def run(args, setting: str) -> Path:
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    from trl_fp8 import FP8GRPOTrainer

    launched = time.time()
    recipe, precision, tis, fp8_kv = SETTINGS[setting]
    task = load_task(args.task)
    args.model = with_context(args.model, args.context, Path(args.workdir))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    held_out = task.problems(args.eval_problems, seed=20_000)
    cuda = torch.cuda.is_available()
    config = grpo_config(args, setting, task, cuda)
    evals: list[dict] = []
    sync_dir = Path(args.sync_dir) if args.sync_dir else None
    deadline = Deadline(args.max_minutes, sync_dir, stop_at=args.stop_at)
    device = device_name()
    out = Path(args.results_dir) / f"grpo_{setting}_{device.replace(' ', '_')}.json"

    def held_out_accuracy(model, step: int) -> None:
        batch = {"batch_size": args.eval_batch} if args.eval_batch else {}  # else the task's own default
        accuracy = task.greedy_accuracy(model, tokenizer, held_out, **batch)
        evals.append({"step": step, "held_out_accuracy": accuracy})
        print(json.dumps({"setting": setting, **evals[-1]}), flush=True)

    def write(trainer) -> None:
        steps = [  # the metrics, and the mismatch per bucket of completion positions (does it grow along a completion?)
            {
                "step": log["step"],
                **{m: v for m, v in log.items() if m in METRICS or m.startswith("fp8/mismatch/pos_")},
            }
            for log in trainer.state.log_history
            if "reward" in log
        ]
        result = {
            "run": f"GRPO on {args.task} ({task.__name__}), setting {setting}",
            "setting": {
                "name": setting,
                "fp8_recipe": recipe,
                "rollout_precision": precision,
                "tis": tis,
                "fp8_kv_cache": fp8_kv,
            },
            **metadata(device),
            "args": {
                **{k: v for k, v in vars(args).items() if k not in ("setting", "sync_dir", "sync_count", "sync_name")},
                "parallel": sync_dir is not None,
            },  # fmt: skip
            "stopped_by_deadline": deadline.stopped_at,
            "steps": steps,
            "held_out": evals,
        }
        write_json(out, result, indent=1)

    class HeldOut(TrainerCallback):
        def on_train_begin(self, _args, state, control, **kwargs):
            deadline.start()

        def on_step_end(self, _args, state, control, model=None, **kwargs):
            stop = deadline.reached(state.global_step)
            control.should_training_stop |= stop
            if state.global_step % args.eval_every == 0 or state.global_step == args.steps or stop:
                held_out_accuracy(model, state.global_step)
                write(trainer)  # after every evaluation: a run cut off (a lease running out) keeps what it measured

        def on_log(self, _args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:  # and every step's metrics: hosts have been taken back between evaluations
                write(trainer)

    with start_turn(sync_dir):
        turn = time.time()
        trainer = FP8GRPOTrainer(
            args.model, task.exact_answer_reward, config,
            train_dataset=task.grpo_dataset(args.steps * args.batch_size, seed=1), processing_class=tokenizer,
            callbacks=[HeldOut()],
        )  # fmt: skip
    # where a start-up's minutes go: waiting for the turn, or building the trainer and its engine
    print(json.dumps({"setting": setting, "waited_for_turn_s": round(turn - launched, 1),
                      "built_trainer_s": round(time.time() - turn, 1)}), flush=True)  # fmt: skip
    wait_for_all(sync_dir, args.sync_name or setting, args.sync_count)
    held_out_accuracy(trainer.model, 0)  # outside the start-up turn: parallel runs evaluate at once
    trainer.train()
    write(trainer)
    return out


def main():
    parser = arg_parser(__doc__, workdir="/tmp/trl_fp8_convergence")
    parser.add_argument("--model", required=True, help="the pre-trained model folder (pretrain.py --out)")
    parser.add_argument("--task", choices=list(TASKS), default="addition", help="the task the model was trained on")
    parser.add_argument("--setting", choices=[*SETTINGS, "all"], nargs="+", default=["all"],
                        help="one setting, several (run as `all` runs them), or the study's six")  # fmt: skip
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch_size", type=int, default=128, help="completions per optimizer step")
    parser.add_argument("--micro_batch", type=int, default=None, help="completions per forward/backward (long tasks)")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="recompute activations (long tasks)")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--completion_len", type=int, default=None, help="max_completion_length (the task's own)")
    parser.add_argument("--ignore_eos", action="store_true",
                        help="every completion runs --completion_len tokens (vLLM's ignore_eos): exactness over long "
                        "completions on a model trained on short ones")  # fmt: skip
    parser.add_argument("--context", type=int, default=None,
                        help="run the model with this many positions (its config's max_position_embeddings raised, "
                        "weights as trained) so --completion_len fits")  # fmt: skip
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--eval_every", type=int, default=10)
    parser.add_argument("--eval_problems", type=int, default=2048)
    parser.add_argument("--eval_batch", type=int, default=None,
                        help="problems per greedy-decoding batch (the task's default; its KV cache grows with it: "
                        "keep it small for many parallel runs)")  # fmt: skip
    parser.add_argument(
        "--max_minutes",
        type=float,
        default=None,
        help="stop training after this long (then evaluate and write); parallel runs stop level",
    )
    parser.add_argument(
        "--stop_at",
        type=float,
        default=None,
        help="stop training by this wall-clock time (Unix seconds) at the latest, like --max_minutes: a lease's end "
        "less the final evaluation, whatever the start-ups took",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="with --parallel: every chosen setting for each of these seeds, all at once; "
                        "the first writes to --results_dir, each later seed N to <results_dir>_seedN")  # fmt: skip
    parser.add_argument("--no_vllm", action="store_true")
    parser.add_argument("--vllm_memory", type=float, default=None, help="vLLM's GPU share (0.3; 0.12 with --parallel)")
    parser.add_argument("--vllm_fp8_backend", default="auto",
                        help="the block-FP8 rollout kernel (`cutlass` spares a fresh host DeepGEMM's minutes of JIT "
                        "compilation for a new model shape; same values)")  # fmt: skip
    parser.add_argument(
        "--parallel", action="store_true", help="with several settings: all at once (one GPU, or --gpus)"
    )
    parser.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        default=None,
        help="with --parallel: spread the seeds over these GPUs (seed i on gpus[i %% n])",
    )
    parser.add_argument("--results_dir", default=None, help="default results/convergence[_<task>]")
    parser.add_argument("--sync_dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sync_count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sync_name", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.results_dir is None:
        args.results_dir = str(results_folder(args.task))
    if args.vllm_memory is None:
        args.vllm_memory = 0.12 if args.parallel else 0.3
    settings = chosen_settings(args.setting)
    if len(settings) == 1:
        print(f"wrote {run(args, settings[0])}")
        return
    # One process per setting: a colocated vLLM engine does not give its GPU memory back within a process.
    argv = strip_option([a for a in sys.argv[1:] if a != "--parallel"], "--setting")
    argv += ["--vllm_memory", str(args.vllm_memory)]
    if args.seeds and not args.parallel:
        raise SystemExit("--seeds runs the seeds at once: add --parallel (or run one --seed at a time)")
    if not args.parallel:
        failed = [
            s for s in settings if subprocess.run([*module_command(__spec__.name), *argv, "--setting", s]).returncode
        ]
    else:
        failed = run_parallel(strip_option(strip_option(argv, "--seeds"), "--gpus"), Path(args.workdir),
                              args.seeds or [args.seed], args.results_dir, args.gpus, settings)  # fmt: skip
    if failed:
        raise SystemExit(f"failed settings: {failed}")


def chosen_settings(names: list[str]) -> list[str]:
    """`--setting`'s values -> the settings to run, in the order named, each once (`all`: the study's six)."""
    return STUDY if "all" in names else list(dict.fromkeys(names))


def strip_option(argv: list[str], option: str) -> list[str]:
    """`argv` without `option` and the values that follow it (up to the next `--flag`)."""
    out, skipping = [], False
    for arg in argv:
        if arg == option:
            skipping = True
        elif skipping and not arg.startswith("--"):
            continue
        else:
            skipping = False
            out.append(arg)
    return out


def gpu_of_seed(seeds: list[int], gpus: list[int] | None) -> dict[int, str | None]:
    """Seed -> the CUDA_VISIBLE_DEVICES of its runs: the i-th seed on `gpus[i % n]`, all six settings of a seed on
    one GPU (so a seed's settings compare on one device); None leaves the device as it is."""
    return {seed: None if not gpus else str(gpus[i % len(gpus)]) for i, seed in enumerate(seeds)}


def seed_results_dir(results_dir: str, seed: int) -> str:
    """Seed 0 writes to `results_dir`, seed n to `<results_dir>_seed<n>`, whichever seeds run together: the seeds of
    one study may run in separate leases (`--seeds 0`, later `--seeds 1`) and still land in their own folders."""
    return results_dir if seed == 0 else f"{results_dir}_seed{seed}"


def run_env(index: int, gpu: str | None) -> dict[str, str]:
    """What the `index`-th parallel run adds to the environment. The trainers share the host's cores. Each colocated
    engine is a one-process world with a rendezvous port of its own: left to TRL's free-port pick (29500 first), the
    start-up queues of two GPUs took the same port at once (EADDRINUSE, 2026-11-23)."""
    env = {"OMP_NUM_THREADS": "2", "MASTER_PORT": str(29600 + index)}
    return env if gpu is None else env | {"CUDA_VISIBLE_DEVICES": gpu}


def run_parallel(
    argv: list[str],
    workdir: Path,
    seeds: list[int],
    results_dir: str,
    gpus: list[int] | None = None,
    settings: list[str] | None = None,
) -> list[str]:
    """Every setting for every seed at once, each logging to `<workdir>/<setting>_seed<n>.log`; returns the runs that
    failed. They start one at a time per GPU (`start_turn`) and train together (`wait_for_all`)."""
    sync_dir = workdir / "parallel_sync"
    shutil.rmtree(sync_dir, ignore_errors=True)
    sync_dir.mkdir(parents=True)
    runs = [(setting, seed) for seed in seeds for setting in settings or STUDY]
    gpu = gpu_of_seed(seeds, gpus)
    procs = {}
    for setting, seed in runs:
        name = f"{setting}_seed{seed}"
        results = seed_results_dir(results_dir, seed)
        cmd = [*module_command(__spec__.name), *strip_option(strip_option(argv, "--seed"), "--results_dir"),
               "--setting", setting, "--seed", str(seed), "--results_dir", results, "--sync_dir", str(sync_dir),
               "--sync_count", str(len(runs)), "--sync_name", name]  # fmt: skip
        log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        env = os.environ | run_env(len(procs), gpu[seed])
        procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
    print(f"started {list(procs)}; logs in {workdir}/<setting>_seed<n>.log", flush=True)
    failed = []
    while procs:
        for name, (proc, log) in list(procs.items()):
            if proc.poll() is None:
                continue
            log.close()
            del procs[name]
            print(f"{name} exited {proc.returncode}", flush=True)
            if proc.returncode:
                failed.append(name)
                (sync_dir / f"{name}.failed").touch()  # runs waiting to train go on without it
        time.sleep(2)
    return failed


if __name__ == "__main__":
    main()
