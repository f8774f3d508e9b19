"""`trl-fp8`: the command line, one subcommand per task.

    trl-fp8 quantize MODEL OUT [...]    write a block-FP8 checkpoint of a BF16 model (see `trl_fp8.cli.quantize`)
    trl-fp8 plan MODEL [...]            rollout capacity in BF16 / FP8 / FP8 + FP8 KV, and the trainer's memory
    trl-fp8 warmup MODEL [...]          compile the engine's DeepGEMM kernels in parallel (see `trl_fp8.cli.warmup`)

`python -m trl_fp8` runs the same command.
"""

from __future__ import annotations

import argparse
import sys

from trl_fp8 import __version__
from trl_fp8.cli import plan, quantize, warmup

# name: (module with add_arguments(parser) and run(args) -> exit code, one-line help)
SUBCOMMANDS = {
    "quantize": (quantize, "write a block-FP8 checkpoint of a high-precision model (for vLLM and transformers)"),
    "plan": (plan, "how many sequences vLLM decodes at once in BF16 / FP8 / FP8 + FP8 KV, and whether training fits"),
    "warmup": (
        warmup,
        "compile the DeepGEMM kernels of a model's FP8 engine in parallel, before vLLM starts",
    ),
}


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except the unset (None) and off (False) ones, whose help says what they mean."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class _PrintVersion(argparse.Action):
    """`--version`: `version_line()` as written (argparse's own version action would reflow its lines)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-fp8", description="FP8 reinforcement learning on Hugging Face TRL.")
    parser.add_argument("--version", action=_PrintVersion, help="print the versions a bug report needs and exit")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=module.__doc__.split("\n\n")[0],
                                    formatter_class=_DefaultsHelpFormatter)  # fmt: skip
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def version_line() -> str:
    """`trl-fp8 X (torch ..., transformers ..., ...)`: the versions a bug report needs, then the tested releases and
    any installed package outside them (`trl_fp8.stack`)."""
    from trl_fp8.stack import TESTED, TESTED_ON, installed_versions, outside_tested_stack

    packages = ("torch", "transformers", "trl", "torchao", "vllm")
    found = installed_versions(packages)
    stack = [f"{package} {found.get(package, 'not installed')}" for package in packages]
    tested = ", ".join(f"{name} {' / '.join(releases)}" for name, releases in TESTED.items())
    lines = [f"trl-fp8 {__version__} ({', '.join(stack)})", f"Tested on: {tested} ({TESTED_ON})."]
    if outside := outside_tested_stack():
        lines.append(f"Outside the tested releases: {'; '.join(outside)}: trl-fp8 may not work with them; "
                     "pip install -e '.[vllm]' installs the tested vLLM and torch.")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
