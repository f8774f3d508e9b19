"""What the trainers check before the model loads, so that a run that could not train or save stops at once, in one
line naming the fix; and the precision the start-up summary says the run trains in.

TRL's trainers find a dataset without a `prompt` column at the first step, transformers finds a Hub id it cannot
download after retrying, and a read-only `output_dir` is found by `save_model()` after the whole run.
"""

from __future__ import annotations

import inspect
from collections import Counter

from datasets import Dataset, IterableDataset

from trl_fp8.checkpoint.folder import unwritable
from trl_fp8.hub import unavailable_model

__all__ = [
    "check_datasets",
    "check_model_sources",
    "check_output_writable",
    "dataset_problem",
    "training_precision",
    "trl_arguments",
]


def trl_arguments(trl_init, *args, **kwargs) -> dict:
    """The arguments of a call of the TRL trainer's `__init__` (bound method `trl_init`), by parameter name; empty
    where they do not fit its signature (TRL's own error says how)."""
    try:
        return dict(inspect.signature(trl_init).bind(*args, **kwargs).arguments)
    except TypeError:
        return {}


def check_datasets(arguments: dict) -> None:
    """Refuse the datasets TRL would fail on at its first step (or after the model loads): `dataset_problem`."""
    if problem := dataset_problem(arguments):
        raise ValueError(problem)


def dataset_problem(arguments: dict) -> str | None:
    """Why TRL's GRPO / RLOO cannot train or evaluate on the datasets in `arguments` (the trainer's, by name), or
    None. Each row's `prompt` (a string, or a list of chat messages) is what they sample completions for; GRPO lets
    an `environment_factory` supply it. A streamed dataset whose columns are known only at its first row is left
    to TRL."""
    if arguments.get("environment_factory") is not None:
        return None  # the environment returns each prompt from reset(); TRL checks the rest
    train = arguments.get("train_dataset")
    if train is None:
        return "train_dataset is required: pass a datasets.Dataset with a 'prompt' column (the prompts to sample)."
    datasets = [("train_dataset", train)]
    evaluation = arguments.get("eval_dataset")
    if isinstance(evaluation, dict):  # DatasetDict, IterableDatasetDict or a dict of datasets: each is evaluated
        datasets += [(f"eval_dataset[{name!r}]", dataset) for name, dataset in evaluation.items()]
    elif evaluation is not None:
        datasets.append(("eval_dataset", evaluation))
    for name, dataset in datasets:
        if problem := _prompt_problem(name, dataset):
            return problem
    return None


def _prompt_problem(name: str, dataset) -> str | None:
    if isinstance(dataset, dict):
        return (
            f"{name} is a {type(dataset).__name__} of splits ({', '.join(dataset)}), not one dataset: pass one "
            f"split, e.g. dataset[{next(iter(dataset), 'train')!r}]."
        )
    if not isinstance(dataset, (Dataset, IterableDataset)):
        return None  # TRL names the types it takes
    columns = dataset.column_names
    if columns is None or "prompt" in columns:
        return None
    return (
        f"{name} has no 'prompt' column (its columns: {', '.join(columns) or 'none'}). The trainer samples "
        "completions for each row's 'prompt' (a string, or a list of chat messages): rename the column that holds "
        "them, e.g. dataset.rename_column('question', 'prompt'), or build it with dataset.map(...)."
    )


def check_output_writable(args, config_name: str) -> None:
    """Refuse an `output_dir` the run could not save into (a read-only filesystem, permissions, a path under a
    file): transformers creates it and writes the training checkpoints there, and the final save would fail only
    after the whole run. Checked by the processes that save."""
    if not args.should_save:
        return
    if problem := unwritable(args.output_dir, beside=args.save_fp8_checkpoint):
        raise ValueError(
            f"output_dir {args.output_dir} cannot be written: {problem}. The run's checkpoints and its model would "
            f"be lost; pass an output_dir on a writable filesystem ({config_name}(output_dir=...), --output_dir)."
        )


def check_model_sources(model, reward_funcs, args) -> None:
    """Refuse, before loading, a model named by path or Hub id that cannot be loaded here (`unavailable_model`): the
    policy, and the reward models TRL loads by name (with the same `model_init_kwargs`)."""
    names = [model, *(reward_funcs if isinstance(reward_funcs, list) else [reward_funcs])]
    revision = (args.model_init_kwargs or {}).get("revision")
    for name in names:
        if isinstance(name, str) and (problem := unavailable_model(name, revision)):
            raise ValueError(problem)


def training_precision(model, args) -> str:
    """The precision the model's high-precision weights train in, as the summary says it: their dtype (the model's
    own: TRL loads a model named by path in float32 unless `model_init_kwargs` sets `dtype`), and the autocast that
    `bf16` / `fp16` put around them."""
    dtypes = Counter()
    for p in model.parameters():
        if p.is_floating_point():
            dtypes[p.dtype] += p.numel()
    dtype = dtypes.most_common(1)[0][0] if dtypes else None
    said = f"{str(dtype).removeprefix('torch.')} (the model's dtype)"
    for flag, autocast in (("bf16", "bfloat16"), ("fp16", "float16")):
        if getattr(args, flag, False) and str(dtype) != f"torch.{autocast}":
            return f"{said} with {autocast} autocast ({flag}=True)"
    return said
