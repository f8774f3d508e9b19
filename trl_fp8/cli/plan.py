"""`trl-fp8 plan`: what a colocated vLLM engine holds in BF16, FP8 and FP8 + FP8 KV cache, and whether training fits.

    trl-fp8 plan MODEL [--gpu H100 | --gpu_memory_gib 80] [--vllm_gpu_memory_utilization 0.3]
                 [--prompt_len 256] [--completion_len 2048] [--generation_batch 128] [--optim adamw_bnb_8bit]
                 [--num_processes 4 --launch ddp|fsdp2] [--vllm_tensor_parallel_size 2] ...

MODEL is a model folder or a Hub id such as Qwen/Qwen3-8B (its config.json only: the Hub cache first; offline and
uncached it stops at once, naming the fix). The estimates are `trl_fp8.rollout.capacity`'s and
`trl_fp8.plan.memory`'s: KV-cache tokens as vLLM 0.26 sizes them (within a few percent of what it reported in our benchmarks), sequences of
prompt + completion tokens that decode at once, a rough account of the trainer's memory beside the engine, and the
largest share at which each flow fits (its best fit). With --num_processes N it plans one GPU of N, each with a
training process and a vLLM engine (TRL's colocate mode), the trainer replicated (DDP) or sharded (FSDP2), and says
which of the two fits; --vllm_tensor_parallel_size T plans one engine over each T of them (TRL's option of that
name), whose FP8 partitions must hold whole 128x128 blocks as trl-fp8 checks before the engine starts. The FP8 rows
apply where trl-fp8 converts some layer (`plan_fp8_conversion` on the model built on the meta device); where it
converts none, they are marked not applicable and the line below the table says why. Sequences longer than the model
can position (its max_position_embeddings, as vLLM counts them) are refused.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from trl_fp8.cli.argtypes import memory_share, non_negative_int, positive_float, positive_int
from trl_fp8.hub import first_line, load_model_config
from trl_fp8.plan.choices import HOPPER, choose_fp8_kv_cache
from trl_fp8.plan.memory import (
    FP8_CACHE_HEADROOM,
    FSDP2_OPTIM,
    LAUNCHES,
    NCCL_BUFFER_BYTES,
    OPTIMIZER_STATE_BYTES,
    PlannedRun,
    fewest_fsdp2_gpus,
    flow_row,
    trainer_peak_bytes,
)
from trl_fp8.plan.micro_batch import SPEEDS_IN_THE_DOCS, dense_hidden_size, larger_micro_batch
from trl_fp8.requirements import is_bitsandbytes_optimizer
from trl_fp8.rollout.capacity import GPU_MEMORY_BYTES, GiB, ModelShape, text_config

# (name, FP8 weights, FP8 KV cache). The BF16 flow is TRL's own GRPOTrainer, the FP8 flows trl-fp8's FP8GRPOTrainer.
FLOWS = (("BF16", False, False), ("FP8", True, False), ("FP8 + FP8 KV", True, True))
LAUNCH_NAMES = {"ddp": "DDP", "fsdp2": "FSDP2"}
BF16_ONLY = "The FP8 flows do not apply: BF16 alone is planned."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hub id, e.g. Qwen/Qwen3-8B (only its config is read)")
    gpu = parser.add_mutually_exclusive_group()
    gpu.add_argument("--gpu", choices=sorted(GPU_MEMORY_BYTES), help="GPU kind (default: this machine's GPU)")
    gpu.add_argument("--gpu_memory_gib", type=positive_float, help="GPU memory in GiB, as CUDA reports it")
    parser.add_argument("--vllm_gpu_memory_utilization", type=memory_share, default=0.3,
                        help="vLLM's share of the GPU (TRL's colocate default)")  # fmt: skip
    parser.add_argument("--prompt_len", type=non_negative_int, default=256, help="prompt tokens")
    parser.add_argument("--completion_len", type=positive_int, default=2048, help="max_completion_length")
    parser.add_argument("--generation_batch", type=positive_int, default=128,
                        help="sequences per rollout (max_num_seqs)")  # fmt: skip
    parser.add_argument("--micro_batch", type=positive_int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--optim", default="adamw_torch", choices=sorted(OPTIMIZER_STATE_BYTES), help="optimizer")
    parser.add_argument("--no_gradient_checkpointing", action="store_true")
    parser.add_argument("--lora", action="store_true", help="only adapters train: no gradients or optimizer state")
    parser.add_argument("--fp8_cache_weights", choices=("auto", "on", "off"), default="auto",
                        help="the FP8 flows' weight cache: auto plans it as FP8GRPOTrainer chooses it "
                        "(fp8_cache_weights=None: dropped where the training phase with it would pass 90%% of the "
                        "GPU); on / off as fp8_cache_weights=True / False")  # fmt: skip
    parser.add_argument("--sleep_mode", action="store_true", help="vllm_enable_sleep_mode: vLLM frees its share")
    parser.add_argument("--num_processes", type=positive_int, default=1,
                        help="GPUs, each with one training process and one colocated vLLM engine of the whole model "
                        "(TRL's colocate mode, TP=1)")  # fmt: skip
    parser.add_argument("--launch", choices=LAUNCHES, default="ddp",
                        help="with several processes: ddp replicates the model on every GPU, fsdp2 shards it as TRL's "
                        "fsdp2.yaml does (float32 masters, bf16 compute); ignored with one process")  # fmt: skip
    parser.add_argument("--vllm_tensor_parallel_size", type=positive_int, default=1,
                        help="GPUs per colocated vLLM engine (TRL's vllm_tensor_parallel_size): each GPU holds 1/T "
                        "of its weights and key/value heads, and it decodes the sequences of its T ranks; "
                        "--num_processes must be a multiple of it")  # fmt: skip
    parser.add_argument("--fsdp2_prefetch_layers", type=positive_int, default=1,
                        help="with --launch fsdp2: the layers each FP8 flow's FSDP2 unit gathers ahead "
                        "(FP8Tuning(fsdp2_prefetch_layers=...); 1 is FSDP2's own)")  # fmt: skip
    parser.add_argument("--gradient_accumulation_steps", type=positive_int, default=None,
                        help="micro-batches per optimizer step (default: --generation_batch / --micro_batch, as TRL's "
                        "steps_per_generation follows gradient_accumulation_steps)")  # fmt: skip
    parser.add_argument("--sync_each_batch", action="store_true",
                        help="with --launch fsdp2: accelerate's sync_each_batch (accelerator_config="
                        "{'gradient_accumulation_kwargs': {'sync_each_batch': True}}): every micro-batch "
                        "reduce-scatters its gradients, which then stay sharded")  # fmt: skip
    parser.add_argument("--trust_remote_code", action="store_true")


def run(args: argparse.Namespace) -> int:
    seq_len = args.prompt_len + args.completion_len
    several = args.num_processes > 1
    try:
        total = _gpu_memory(args)
        model_config = load_model_config(args.model, args.trust_remote_code)
        shape = ModelShape.from_config(model_config)
        _check_positions(args, model_config)
        _check_launch(args)
        model, fp8_layers, no_fp8_layer = _conversion_plan(args, model_config)
        split = _check_tensor_parallel(args, model, fp8_layers)
        # Without an FP8 layer the FP8 flows would only repeat BF16's numbers under FP8's name: BF16 alone is planned.
        flows = FLOWS[:1] if no_fp8_layer else FLOWS
        # Every flow's numbers first, under each launch compared: an error must come before any line of the table.
        compared = LAUNCHES if several and not args.lora else (args.launch,)
        by_launch = {launch: [flow_row(shape, total, seq_len, _planned(args), launch, fp8_weights=w, fp8_kv=kv)
                              for _, w, kv in flows] for launch in compared}  # fmt: skip
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = by_launch[args.launch]
    print(_header(args, shape, total))
    print(f"{'':<14}{'vLLM weights':>13}{'KV B/token':>11}{'KV tokens':>11}{'seqs at once':>13}{'waves':>6}"
          f"{'trainer':>9}" + (f"{'peak':>9}" if several else "") + f"{'fits':>6}")  # fmt: skip
    for (name, _, _), (cap, parts, peak, fits, _) in zip(flows, rows, strict=True):
        waves = cap.waves(_planned(args).engine_batch) if cap.sequences else "-"
        trainer = trainer_peak_bytes(parts, cache_with_grad=_planned(args).cache_with_grad)
        print(f"{name:<14}{cap.weight_bytes / GiB:>11.1f}Gi{cap.kv_bytes_per_token:>11,}{cap.kv_tokens:>11,}"
              f"{cap.sequences:>13}{waves:>6}{trainer / GiB:>7.1f}Gi"
              + (f"{peak / GiB:>7.1f}Gi" if several else "") + f"{'yes' if fits else 'no':>6}")  # fmt: skip
    for name, _, _ in (flow for flow in FLOWS if flow not in flows):
        print(f"{name:<14}  not applicable: no FP8 layer")
    if no_fp8_layer:
        print(no_fp8_layer)
    print(_columns_footnote(several))
    if split:
        print(split)
    if no_room := [name for (name, _, _), (cap, *_) in zip(flows, rows, strict=True) if not cap.sequences]:
        print(f"{' and '.join(no_room)}: vLLM's share ({args.vllm_gpu_memory_utilization * total / GiB:.1f} GiB) holds "
              f"no whole sequence of {seq_len:,} tokens beside the weights: vLLM would refuse to start the engine. "
              "Raise --vllm_gpu_memory_utilization (see Best fit) or shorten the sequences.")  # fmt: skip
    if args.fp8_cache_weights == "auto" and (
        dropped := [name for (name, w, _), (_, parts, *_) in zip(flows, rows, strict=True)
                    if w and parts.get("fp8_weight_cache") == 0 and not (several and args.launch == "fsdp2")]
    ):  # fmt: skip
        print(f"{' and '.join(dropped)}: without the FP8 weight cache ({shape.linear_params / GiB:.1f} GiB), which "
              f"FP8GRPOTrainer drops where the training phase with it would pass {FP8_CACHE_HEADROOM:.0%} of the GPU "
              "(fp8_cache_weights=None; True keeps it).")  # fmt: skip
    if not no_fp8_layer:  # the FP8 flows' own notes
        print(_default_kv_cache_line(args, model_config, total, seq_len))
        if line := _micro_batch_line(args, model_config, shape, total, seq_len):
            print(line)
    best_fits = [f"{name} {fit[0]:.2f} ({fit[1].kv_tokens:,} KV tokens, {fit[1].sequences} sequences at once)" if fit
                 else f"{name}: none (no share holds one sequence beside the trainer)"
                 for (name, _, _), (*_, fit) in zip(flows, rows, strict=True)]  # fmt: skip
    print("Best fit, the largest vLLM share that fits (steps of 0.05): " + "; ".join(best_fits) + ".")
    if args.sleep_mode:
        print(
            "Sleep mode: fits also checks the wake-up (weights + optimizer states + vLLM's whole share), assuming "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (FP8GRPOTrainer turns them on in sleep mode); without "
            "them PyTorch keeps freed training memory pinned beside vLLM, and a lower share is the most that runs "
            "(measured: the When FP8 pays page of the documentation, 'Best fit: the largest share a run can give "
            "vLLM')."
        )
    if several:
        print(_several_gpus_footnote(args))
        if "fsdp2" in by_launch and _planned(args).keeps_gradients:
            print(_sync_each_batch_line(args, shape, total, seq_len, by_launch["fsdp2"], flows))
        print(_launch_advice(args, shape, by_launch, flows))
        if "fsdp2" in by_launch and not any(row[3] for rows in by_launch.values() for row in rows):
            print(_fewest_fsdp2_gpus(args, shape, total, seq_len, by_launch["fsdp2"], flows))
    return 0


def _planned(args: argparse.Namespace) -> PlannedRun:
    """The run these options plan, as the memory account (`trl_fp8.plan.memory`) takes it."""
    return PlannedRun.from_cli(args)


def _header(args, shape, total: int) -> str:
    """The first line: the model, the GPU(s), the share and the rollout; with several processes, the launch."""
    size = f"{args.model}: {shape.params / 1e9:.2f}B parameters ({shape.linear_params / 1e9:.2f}B in linear layers)"
    rollout = f"{_planned(args).engine_batch} sequences of {args.prompt_len} + {args.completion_len} tokens"
    share = args.vllm_gpu_memory_utilization
    if args.num_processes == 1:
        return f"{size}; GPU {total / GiB:.1f} GiB, vLLM share {share:g}; {rollout}"
    tp = args.vllm_tensor_parallel_size
    engine = "a vLLM engine" if tp == 1 else f"its part of a {tp}-GPU vLLM engine"
    return (f"{size}; {args.num_processes} processes, {LAUNCH_NAMES[args.launch]}: {args.num_processes} GPUs of "
            f"{total / GiB:.1f} GiB, each with a trainer and {engine} (share {share:g}); {rollout} per engine")  # fmt: skip


def _columns_footnote(several: bool) -> str:
    """What the table's columns hold (one GPU: as it always read)."""
    if not several:
        return ("KV tokens: vLLM 0.26's sizing, estimated; trainer: BF16 masters, gradients, optimizer, one "
                "micro-batch's activations and logits, or while scoring the FP8 weight cache in their place, whichever "
                "is more (rough; with --fp8_cache_weights on the cache stays beside them); fits: trainer + vLLM's "
                "share within 97% of the GPU, and the share holds one whole sequence.")  # fmt: skip
    return ("KV tokens: vLLM 0.26's sizing, estimated; trainer: one GPU's part of the training (below), one "
            "micro-batch's activations and logits (rough); peak: the most one GPU holds at once; fits: peak within "
            "97% of each GPU, and the share holds one whole sequence.")  # fmt: skip


def _sync_each_batch_line(args, shape, total: int, seq_len: int, rows: list, flows) -> str:
    """Under FSDP2 with gradient accumulation: what the unsharded gradients cost each GPU, and the peaks and fits
    with accelerate's sync_each_batch, which reduce-scatters every micro-batch instead."""
    synced = _planned(args).replace(sync_each_batch=True)
    other = [flow_row(shape, total, seq_len, synced, "fsdp2", fetch_best=False, fp8_weights=w, fp8_kv=kv)
             for _, w, kv in flows]  # fmt: skip
    unsharded = rows[0][1].get("unsharded_gradients", 0)
    fitting = [name for (name, _, _), row in zip(flows, other, strict=True) if row[3]]
    peaks = " / ".join(f"{row[2] / GiB:.1f}" for row in other)
    return (f"FSDP2 with {_planned(args).accumulation_steps} micro-batches a step: transformers' Trainer runs all but the "
            f"last under accelerate's no_sync, so each GPU keeps the whole model's gradients unsharded in BF16 "
            f"({unsharded / GiB:.1f} GiB) until the last one reduces them. With accelerate's sync_each_batch "
            "(FP8GRPOConfig(accelerator_config={'gradient_accumulation_kwargs': {'sync_each_batch': True}}), "
            f"--sync_each_batch here) every micro-batch reduce-scatters them instead: peak per GPU {peaks} GiB "
            f"(fits: {_flow_list(fitting, flows)}), for one reduce-scatter of the model's gradients per "
            "micro-batch.")  # fmt: skip


def _check_tensor_parallel(args, model, fp8_layers: set[str] | None) -> str:
    """Refuse a tensor-parallel size that TRL or trl-fp8 refuses; return the line that says how the engine splits
    (empty with one GPU per engine). The FP8 partitions are checked by `check_tensor_parallel`, the rule the trainer
    applies before the engine starts, on `model` built on the meta device and its FP8 layers (`_conversion_plan`)."""
    tp = args.vllm_tensor_parallel_size
    if tp == 1:
        return ""
    if args.num_processes % tp:
        raise ValueError(f"--vllm_tensor_parallel_size {tp} needs --num_processes to be a multiple of it (TRL groups "
                         f"consecutive ranks into engines of {tp} GPUs); got --num_processes {args.num_processes}.")  # fmt: skip
    from trl_fp8.rollout.vllm.partitions import check_tensor_parallel

    split = check_tensor_parallel(model, fp8_layers, tp, option="--vllm_tensor_parallel_size")
    experts = ""
    if split.get("enable_expert_parallel"):
        experts = " Experts would split below whole blocks: vLLM's expert parallelism gives each GPU whole experts "
        experts += "instead (trl-fp8 sets enable_expert_parallel)."
    blocks = "every FP8 partition holds whole 128x128 blocks" if fp8_layers else "no FP8 layer to split in blocks"
    return (f"Tensor parallel: {args.num_processes // tp} engine(s) of {tp} GPUs; vLLM weights and KV B/token are one "
            f"GPU's, KV tokens and sequences the engine's, waves for its {_planned(args).engine_batch} sequences; "
            f"{blocks}.{experts}")  # fmt: skip


def _conversion_plan(args, model_config) -> tuple[object, set[str] | None, str]:
    """`(model, its FP8 layers, why it has none)`: the model built on the meta device (no weights read), the layers
    FP8GRPOTrainer converts to FP8 with its default layer choices (`plan_fp8_conversion`), and where none converts,
    the line that says why ("" otherwise). A model transformers cannot build from its config alone is planned as it is
    sized, every linear layer in FP8 (`(None, None, "")`), unless a tensor-parallel split needs its layers."""
    from trl_fp8.nn.conversion import plan_fp8_conversion

    try:
        model = _meta_model(args, model_config)
    except ValueError:
        if args.vllm_tensor_parallel_size > 1:
            raise
        return None, None, ""
    try:
        report, _ = plan_fp8_conversion(model, warn=False)
    except ValueError as exc:  # a layout trl-fp8 refuses to run in FP8 unless told to keep it in BF16
        return model, set(), f"No layer of {args.model} converts to FP8 with trl-fp8's defaults: {exc} {BF16_ONLY}"
    if report.converted:
        return model, set(report.converted), ""
    return model, set(), f"No layer of {args.model} converts to FP8: {_kept_reasons(report.kept)}. {BF16_ONLY}"


def _meta_model(args, model_config):
    """The model built on the meta device from its config (no memory, no weights); ValueError where it cannot be."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config, trust_remote_code=args.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - whatever stops transformers, the planner can only say so
        raise ValueError(f"transformers cannot build {args.model} from its config to plan its FP8 layers "
                         f"({type(exc).__name__}: {first_line(exc)}).") from exc  # fmt: skip


def _kept_reasons(kept: dict[str, str]) -> str:
    """`its linear layers all stay in high precision (reason: count; ...)`, or that it has none to convert."""
    if not kept:
        return "it has no linear or expert layer"
    counts = Counter(kept.values())
    return f"its linear layers all stay in high precision ({'; '.join(f'{r}: {n}' for r, n in counts.items())})"


def _check_positions(args, model_config) -> None:
    """Refuse sequences longer than the model can position: vLLM and transformers refuse inputs past its length, so
    the rollouts planned could not run."""
    if (positions := model_positions(model_config)) is None:
        return
    limit, counted = positions
    seq_len = args.prompt_len + args.completion_len
    if seq_len <= limit:
        return
    fix = (f"--completion_len {limit - args.prompt_len} or less" if args.prompt_len < limit
           else f"--prompt_len below {limit}")  # fmt: skip
    raise ValueError(f"--prompt_len {args.prompt_len} + --completion_len {args.completion_len} = {seq_len:,} tokens, "
                     f"past the {limit:,} positions of {args.model} ({counted}): the model cannot position them. "
                     f"Pass {fix}, or plan a model with a longer context.")  # fmt: skip


def model_positions(model_config) -> tuple[int, str] | None:
    """`(the longest sequence the model positions, how it is counted)`, as vLLM derives its default max_model_len:
    the text model's max_position_embeddings, stretched by its RoPE scaling (`_rope_scaling`). None where the config
    names no length."""
    text = text_config(model_config)
    field = "max_position_embeddings" if text is model_config else "text_config's max_position_embeddings"
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None
    if (scaling := _rope_scaling(text)) is None:
        return limit, field
    factor, original = scaling
    base, counted = (original, "YaRN's original_max_position_embeddings") if original else (limit, field)
    return int(base * factor), f"{counted} {base:,} x RoPE scaling factor {factor:g}"


def _rope_scaling(text) -> tuple[float, int | None] | None:
    """`(factor, YaRN's original_max_position_embeddings or None)` of a RoPE scaling that stretches the positions past
    max_position_embeddings, as vLLM counts it; None where none does (no scaling, or longrope, llama3 and Gemma 3
    configs, whose max_position_embeddings already counts it)."""
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if "gemma3" in str(getattr(text, "model_type", "")):
        return None
    per_layer_type = rope and all(isinstance(value, dict) for value in rope.values())  # e.g. full / sliding
    for rp in rope.values() if per_layer_type else [rope]:  # (vLLM too takes every layer type to scale alike)
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind not in ("su", "longrope", "llama3") and rp.get("factor"):
            return rp["factor"], rp.get("original_max_position_embeddings") if kind == "yarn" else None
    return None


def _check_launch(args) -> None:
    """Refuse the launch that trl-fp8 itself refuses: PEFT adapters under FSDP2 beside vLLM."""
    if args.num_processes > 1 and args.launch == "fsdp2" and args.lora:
        raise ValueError("--lora with --launch fsdp2: trl-fp8 refuses PEFT adapters under FSDP2 beside vLLM (each "
                         "adapter merges into a whole base weight, which FSDP2 shards); use --launch ddp.")  # fmt: skip
    if args.num_processes > 1 and args.launch == "fsdp2" and is_bitsandbytes_optimizer(args.optim):
        raise ValueError(f"--optim {args.optim} with --launch fsdp2: bitsandbytes' optimizers do not take FSDP2's "
                         f"sharded parameters; use --optim {FSDP2_OPTIM} (FSDP2 shards its states) or --launch "
                         "ddp.")  # fmt: skip


def _micro_batch_line(args, model_config, shape, total: int, seq_len: int) -> str:
    """Where FP8 training of this model would wait for the host at --micro_batch (`plan.micro_batch`, the note
    FP8GRPOTrainer prints at start-up): the larger micro-batch that keeps a step's sequences, and what the FP8 flows
    hold with it. Empty where the note does not apply."""
    steps = _planned(args).accumulation_steps
    sequences = args.micro_batch * steps
    hidden_size = dense_hidden_size(model_config)
    larger = larger_micro_batch(hidden_size, args.micro_batch, steps, seq_len)
    if larger is None:
        return ""
    bigger = _planned(args).replace(micro_batch=larger, gradient_accumulation_steps=sequences // larger)
    rows = [(name, flow_row(shape, total, seq_len, bigger, args.launch, fp8_weights=w, fp8_kv=kv, fetch_best=False))
            for name, w, kv in FLOWS if w]  # fmt: skip
    held = " and ".join(
        f"{name} {trainer_peak_bytes(row[1], cache_with_grad=bigger.cache_with_grad) / GiB:.1f} GiB "
        f"({'fits' if row[3] else 'does not fit'})"
        for name, row in rows
    )
    return (f"FP8 training at hidden size {hidden_size}: micro-batches of {args.micro_batch} x {seq_len:,} tokens "
            f"leave it waiting for the host. {SPEEDS_IN_THE_DOCS}. --micro_batch {larger} "
            f"--gradient_accumulation_steps {sequences // larger} keeps the {sequences} sequences of a step; trainer "
            f"there: {held}.")  # fmt: skip


def _default_kv_cache_line(args, model_config, total: int, seq_len: int) -> str:
    """The KV cache FP8GRPOTrainer chooses with `fp8_kv_cache` unset, on Hopper, colocated, with importance sampling:
    the trainer's own choice (`plan.choices.choose_fp8_kv_cache`) for these settings, its sequences of prompt +
    completion tokens (the trainer, which does not know the prompts at start-up, counts the completions alone)."""
    settings = _planned(args).trainer_settings(seq_len)
    choice = choose_fp8_kv_cache(model_config, settings, total_bytes=total, capability=HOPPER)
    return f"KV cache with fp8_kv_cache unset: {'FP8' if choice.on else 'BF16'} on Hopper, {choice.reason}."


def _several_gpus_footnote(args) -> str:
    """The assumptions behind one GPU of several, for the launch planned."""
    if args.launch == "ddp":
        trainer = ("DDP: the whole model as on one GPU, plus DDP's all-reduce buckets, a BF16 copy of the gradients "
                   "kept between steps (the FP8 rows' gradients are views of them, FP8Tuning.ddp_gradient_as_bucket_view; "
                   "TRL's BF16 GRPOTrainer keeps both)")  # fmt: skip
    else:
        trainer = ("FSDP2 (TRL's fsdp2.yaml): float32 master weights, gradients and optimizer states sharded 1/N, "
                   "two units gathered in BF16 (a decoder layer and the next, or lm_head beside one), no FP8 "
                   "weight cache")  # fmt: skip
        if _planned(args).keeps_gradients:
            trainer += ", and the whole model's gradients unsharded in BF16 between micro-batches (below)"
    if is_bitsandbytes_optimizer(args.optim) and args.launch == "ddp":
        trainer += (f"; the FSDP2 comparison below with --optim {FSDP2_OPTIM} (bitsandbytes' optimizers do not take "
                    "FSDP2's shards)")  # fmt: skip
    held = "the NCCL buffers and DDP's buckets" if args.launch == "ddp" else "the NCCL buffers"
    wake_up = f" The wake-up of sleep mode also holds {held}." if args.sleep_mode else ""
    tp = args.vllm_tensor_parallel_size
    engines = ("Each engine holds the whole model (TP=1) and --generation_batch sequences" if tp == 1 else
               f"Each engine spans {tp} GPUs and decodes {tp} x --generation_batch sequences")  # fmt: skip
    return (f"Per GPU, trainer and peak: {trainer}; {NCCL_BUFFER_BYTES / GiB:g} GiB of NCCL buffers (assumed). "
            f"{engines}.{wake_up}")  # fmt: skip


def _launch_advice(args, shape, by_launch: dict, flows) -> str:
    """One line: the flows that DDP and FSDP2 each fit on every GPU, their peaks, and the launch that fits more."""
    where = f"DDP vs FSDP2 at {shape.params / 1e9:.1f}B on {args.num_processes} GPUs"
    if "fsdp2" not in by_launch:
        return f"{where}: FSDP2 is no option with --lora (trl-fp8 refuses PEFT adapters under FSDP2 beside vLLM)."
    fitting = {launch: [name for (name, _, _), row in zip(flows, rows, strict=True) if row[3]]
               for launch, rows in by_launch.items()}  # fmt: skip
    peaks = {launch: " / ".join(f"{row[2] / GiB:.1f}" for row in rows) for launch, rows in by_launch.items()}
    ddp, fsdp2 = len(fitting["ddp"]), len(fitting["fsdp2"])
    if ddp == fsdp2:
        advice = "both fit; DDP spares FSDP2's all-gathers" if ddp else "neither fits at this share (see Best fit)"
    else:
        better = "ddp" if ddp > fsdp2 else "fsdp2"
        advice = f"{'keep' if better == args.launch else 'use'} --launch {better}"
    names = " / ".join(name for name, _, _ in flows)
    return (f"{where}: DDP fits {_flow_list(fitting['ddp'], flows)} (peak per GPU {peaks['ddp']} GiB for {names}), "
            f"FSDP2 {_flow_list(fitting['fsdp2'], flows)} ({peaks['fsdp2']} GiB): {advice}.")  # fmt: skip


def _fewest_fsdp2_gpus(args, shape, total: int, seq_len: int, rows: list, flows, most: int = 64) -> str:
    """Where no flow fits: the fewest GPUs (doubling, up to `most`) over which FSDP2 fits each flow at this share,
    since each GPU then holds a smaller part of FSDP2's float32 masters, gradients and optimizer states. An engine
    that holds no sequence (`rows`, the flows' rows under FSDP2) stays so on any number of GPUs."""
    found = []
    for (name, fp8_weights, fp8_kv), (cap, *_) in zip(flows, rows, strict=True):
        if not cap.sequences:
            found.append(f"{name} on none (its engine holds no sequence: split it with --vllm_tensor_parallel_size)")
            continue
        fewest = fewest_fsdp2_gpus(shape, total, seq_len, _planned(args), most, fp8_weights=fp8_weights, fp8_kv=fp8_kv)
        text = f"{name} from {fewest} GPUs" if fewest else f"{name} not within {most} GPUs"
        if _planned(args).keeps_gradients:  # whole gradients on every GPU: more GPUs shrink only the rest
            synced = _planned(args).replace(sync_each_batch=True)
            if (with_sync := fewest_fsdp2_gpus(shape, total, seq_len, synced, most, fp8_weights=fp8_weights,
                                          fp8_kv=fp8_kv)) != fewest:  # fmt: skip
                text += f" ({with_sync} with sync_each_batch)" if with_sync else ""
        found.append(text)
    unsharded = "; the unsharded gradients stay whole, see sync_each_batch" if _planned(args).keeps_gradients else ""
    return (f"More GPUs under FSDP2 (each holds 1/N of the float32 masters, gradients and optimizer states{unsharded}),"
            f" at this share and these sequences: {', '.join(found)}.")  # fmt: skip


def _flow_list(names: list[str], flows) -> str:
    """The names of `names`, or "every flow" (of several `flows` planned) / "no flow"."""
    if len(names) == len(flows) > 1:
        return "every flow"
    return " and ".join(names) or "no flow"


def _gpu_memory(args) -> int:
    if args.gpu_memory_gib:
        return int(args.gpu_memory_gib * GiB)
    if args.gpu:
        return GPU_MEMORY_BYTES[args.gpu]
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"no GPU here: pass --gpu ({' or '.join(sorted(GPU_MEMORY_BYTES))}) or --gpu_memory_gib.")
    return torch.cuda.mem_get_info()[1]
