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
from trl_fp8.cli.hub import load_model_config, missing_local_model

DTYPES = ("bfloat16", "float16", "float32", "auto")


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
    problem = missing_local_model(args.model) or _output_problem(args.model, args.output_dir, args.overwrite)
    if problem is None:
        try:
            patterns = [re.compile(p) for p in args.keep_in_bf16]
        except re.error as exc:
            problem = f"--keep_in_bf16 {exc.pattern!r} is not a regular expression: {exc}."
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_fp8.checkpoint.save import save_fp8_checkpoint
    from trl_fp8.nn.conversion import plan_fp8_conversion

    try:
        config = load_model_config(args.model, args.trust_remote_code)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if getattr(config, "quantization_config", None):
        method = dict(config.quantization_config).get("quant_method")
        print(f"error: {args.model} is already quantized ({method}); pass the BF16 model.", file=sys.stderr)
        return 2
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, trust_remote_code=args.trust_remote_code)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError):
        tokenizer = None  # a model without tokenizer files still quantizes
    try:
        report, _ = plan_fp8_conversion(
            model,
            num_first_layers_in_bf16=args.num_first_layers_in_bf16,
            num_last_layers_in_bf16=args.num_last_layers_in_bf16,
            module_filter_fn=(lambda mod, name: not any(p.search(name) for p in patterns)) if patterns else None,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not report.converted:
        print(f"error: no linear layer of {args.model} can be stored in FP8.\n{report.summary()}", file=sys.stderr)
        return 2
    out = save_fp8_checkpoint(
        model,
        args.output_dir,
        tokenizer,
        fp8_modules=set(report.converted),
        dtype=None if dtype == "auto" else dtype,
        power_of_two_scales=args.power_of_two_scales,
    )
    print(report.summary())
    print(f"Wrote the block-FP8 checkpoint to {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`trl-fp8-quantize`, the command's first name: the same as `trl-fp8 quantize`."""
    parser = argparse.ArgumentParser(prog="trl-fp8-quantize", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _output_problem(model: str, output_dir: str, overwrite: bool) -> str | None:
    """Why writing to `output_dir` would destroy a model the user has (unless `overwrite`), or None."""
    from trl_fp8.checkpoint.folder import holds_a_model, output_overwrites_model

    out = Path(output_dir).expanduser()
    if out.exists() and not out.is_dir():
        return f"{output_dir} is a file; pass a folder for the FP8 checkpoint."
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
