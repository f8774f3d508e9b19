"""Write a block-FP8 checkpoint of a high-precision model, for serving or for starting a vLLM server.

    python -m trl_fp8.quantize MODEL OUT [--num_first_layers_in_bf16 N] [--num_last_layers_in_bf16 N]
    trl-fp8-quantize MODEL OUT ...

MODEL is a local folder or a Hub id (with network access). The FP8 values come from the same quantizer the FP8
training forward uses, so a policy trained with `FP8GRPOTrainer` and a model quantized here agree bit for bit.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-fp8-quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="model folder or Hub id (BF16/FP32 weights)")
    parser.add_argument("output_dir", help="where to write the FP8 checkpoint")
    parser.add_argument("--num_first_layers_in_bf16", type=int, default=0)
    parser.add_argument("--num_last_layers_in_bf16", type=int, default=0)
    parser.add_argument("--power_of_two_scales", action="store_true", help="round scales down to powers of two")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the tensors kept in high precision")
    parser.add_argument("--trust_remote_code", action="store_true")
    args = parser.parse_args(argv)

    problem = _missing_local_model(args.model)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .conversion import plan_fp8_conversion
    from .export import save_fp8_checkpoint

    try:
        config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"error: cannot load a model config from {args.model!r}: {first_line}", file=sys.stderr)
        return 2
    if getattr(config, "quantization_config", None):
        method = dict(config.quantization_config).get("quant_method")
        print(f"error: {args.model} is already quantized ({method}); pass the BF16 model.", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
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
        dtype=dtype,
        power_of_two_scales=args.power_of_two_scales,
    )
    print(report.summary())
    print(f"Wrote the block-FP8 checkpoint to {out}")
    return 0


def _missing_local_model(name: str) -> str | None:
    """Why `name` is neither a local model folder nor something the Hub could serve, or None.

    Anything that reads as a path (absolute, `./`, `~`, more than one `/`, or a bare word without an organisation)
    must exist here: asking the Hub for it would only wait for a network timeout before failing.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"{name} is a folder without config.json."
    # `org/name` reads as a Hub id unless `org` is a folder here (then it is a local path that does not exist).
    hub_like = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None and not Path(name).parent.is_dir()
    if not hub_like:
        return f"no model folder at {name} (and it is not a Hub id 'org/name'). Pass a folder with config.json."
    return None  # a Hub id: from the local cache, or downloaded where the Hub is reachable


if __name__ == "__main__":
    sys.exit(main())
