"""Write a block-FP8 checkpoint of a high-precision model, for serving or for starting a vLLM server.

    python -m trl_fp8.quantize MODEL OUT [--num_first_layers_in_bf16 N] [--num_last_layers_in_bf16 N]
    trl-fp8-quantize MODEL OUT ...

MODEL is a local folder or a Hub id (with network access). The FP8 values come from the same quantizer the FP8
training forward uses, so a policy trained with `FP8GRPOTrainer` and a model quantized here agree bit for bit.
"""

from __future__ import annotations

import argparse
import sys

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

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .conversion import plan_fp8_conversion
    from .export import save_fp8_checkpoint

    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
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
    report, _ = plan_fp8_conversion(
        model,
        num_first_layers_in_bf16=args.num_first_layers_in_bf16,
        num_last_layers_in_bf16=args.num_last_layers_in_bf16,
    )
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


if __name__ == "__main__":
    sys.exit(main())
