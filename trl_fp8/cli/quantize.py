"""`trl-fp8 quantize`: write a block-FP8 checkpoint of a high-precision model, for serving or for a vLLM server.

    trl-fp8 quantize MODEL OUT [--num_first_layers_in_bf16 N] [--num_last_layers_in_bf16 N] [--keep_in_bf16 REGEX]
    trl-fp8-quantize MODEL OUT ...        (the same command under its first name)

MODEL is a local folder or a Hub id (the Hub cache first, then the Hub). The FP8 values come from the same quantizer the FP8
training forward uses, so a policy trained with `FP8GRPOTrainer` and a model quantized here agree bit for bit, and
the layers kept in BF16 are chosen by the same rules (pass the trainer's own layer choices for a server it syncs).
OUT must not be MODEL's folder (or inside it) or hold another model unless `--overwrite` is given; the checkpoint is swapped in whole.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from trl_fp8.cli.argtypes import non_negative_int
from trl_fp8.hub import first_line, load_model_config, missing_local_model

DTYPES = ("bfloat16", "float16", "float32", "auto")
WEIGHT_FILE_TYPES = ("safetensors", "bin")  # what transformers loads a causal LM's weights from


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hub id (BF16/FP32 weights)")
    parser.add_argument("output_dir", help="where to write the FP8 checkpoint")
    parser.add_argument(
        "--num_first_layers_in_bf16", type=non_negative_int, default=0, help="decoder layers kept BF16 at the input"
    )
    parser.add_argument(
        "--num_last_layers_in_bf16", type=non_negative_int, default=0, help="decoder layers kept BF16 at the output"
    )
    parser.add_argument(
        "--keep_in_bf16", action="append", default=[], metavar="REGEX",
        help="keep the linear layers whose name matches REGEX (re.search) in BF16; repeatable",
    )  # fmt: skip
    parser.add_argument("--power_of_two_scales", action="store_true", help="round scales down to powers of two")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16",
        help="dtype of the tensors kept in high precision ('auto': the model's own)",
    )  # fmt: skip
    parser.add_argument("--trust_remote_code", action="store_true")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a model already in OUTPUT_DIR (even MODEL's own folder)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _quantize(args)
    except ValueError as exc:  # every refusal and load failure below, as one line naming the fix
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _quantize(args: argparse.Namespace) -> int:
    """Check the input and the output first (before torch loads), then read, plan and write; raises ValueError."""
    if problem := missing_local_model(args.model) or _missing_weights(args.model):
        raise ValueError(problem)
    if problem := _output_problem(args.model, args.output_dir, args.overwrite):
        raise ValueError(problem)
    patterns = _bf16_patterns(args.keep_in_bf16)

    from trl_fp8.checkpoint.save import save_fp8_checkpoint
    from trl_fp8.nn.conversion import plan_fp8_conversion

    config = load_model_config(args.model, args.trust_remote_code)
    if getattr(config, "quantization_config", None):
        method = dict(config.quantization_config).get("quant_method")
        raise ValueError(f"{args.model} is already quantized ({method}); pass the BF16 model.")
    model, dtype = _load_model(args)
    report, _ = plan_fp8_conversion(
        model,
        num_first_layers_in_bf16=args.num_first_layers_in_bf16,
        num_last_layers_in_bf16=args.num_last_layers_in_bf16,
        module_filter_fn=(lambda mod, name: not any(p.search(name) for p in patterns)) if patterns else None,
    )
    if not report.converted:
        raise ValueError(f"no linear layer of {args.model} can be stored in FP8.\n{report.summary()}")
    try:
        out = save_fp8_checkpoint(
            model,
            args.output_dir,
            _load_tokenizer(args),
            fp8_modules=set(report.converted),
            dtype=dtype,
            power_of_two_scales=args.power_of_two_scales,
        )
    except OSError as exc:  # found while writing (a full disk): the folder was left as it was
        raise ValueError(f"cannot write the FP8 checkpoint to {args.output_dir}: {first_line(exc)}") from exc
    print(report.summary())
    print(f"Wrote the block-FP8 checkpoint to {out}")
    return 0


def _bf16_patterns(expressions: list[str]) -> list[re.Pattern]:
    try:
        return [re.compile(p) for p in expressions]
    except re.error as exc:
        raise ValueError(f"--keep_in_bf16 {exc.pattern!r} is not a regular expression: {exc}.") from None


def _load_model(args: argparse.Namespace):
    """`(model, dtype to save its high-precision tensors in: None keeps the model's own)`. A weight file that does
    not load (cut short by an interrupted download or copy, damaged, a shard missing) raises ValueError naming it."""
    import pickle

    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype or "auto", trust_remote_code=args.trust_remote_code
        )
    except (OSError, SafetensorError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ValueError(
            f"cannot load the weights of {args.model} ({type(exc).__name__}: {first_line(exc)}): a weight file is "
            "missing, cut short or damaged (an interrupted download or copy?); download or copy the model again."
        ) from exc
    return model, dtype


def _load_tokenizer(args: argparse.Namespace):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError):
        return None  # a model without tokenizer files still quantizes


def _missing_weights(model: str) -> str | None:
    """Why the local folder `model` holds no weights to quantize (a config downloaded alone), or None. A Hub id is
    left to the load."""
    path = Path(model).expanduser()
    if not path.is_dir() or any(f.suffix[1:] in WEIGHT_FILE_TYPES for f in path.iterdir()):
        return None
    return (
        f"{model} has config.json but no weights (no model.safetensors, pytorch_model.bin or their shards): pass the "
        "folder that holds the model's weights, or download them into it (e.g. hf download ORG/NAME --local-dir "
        f"{model})."
    )


def main(argv: list[str] | None = None) -> int:
    """`trl-fp8-quantize`, the command's first name: the same as `trl-fp8 quantize`."""
    parser = argparse.ArgumentParser(prog="trl-fp8-quantize", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _output_problem(model: str, output_dir: str, overwrite: bool) -> str | None:
    """Why writing to `output_dir` would destroy a model the user has (unless `overwrite`), or None."""
    from trl_fp8.checkpoint.folder import holds_a_model, output_overwrites_model, unwritable

    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        return f"{output_dir} is a file; pass a folder for the FP8 checkpoint."
    if problem := unwritable(out, beside=True):
        return f"{output_dir} cannot be written: {problem}. Pass a folder on a writable filesystem."
    if overwrite:
        return None
    if problem := output_overwrites_model(model, output_dir):
        return f"{problem} Write the FP8 checkpoint to another folder (or pass --overwrite to do this on purpose)."
    if holds_a_model(out):
        return (
            f"{output_dir} already holds a model, which the FP8 checkpoint would replace. Pick an empty or new "
            "folder (or pass --overwrite to replace it)."
        )
    return None


if __name__ == "__main__":
    sys.exit(main())
