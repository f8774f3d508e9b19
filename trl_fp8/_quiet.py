"""Log lines that importing the stack prints and that no user can act on, dropped where they are logged.

Only these exact messages are dropped; every other warning of torch, torchao and DeepSpeed still shows:
- torchao's prebuilt CUDA extensions (`torchao/_C*.so`: MX formats, CUTLASS kernels trl-fp8 does not use) fail to
  load into a CPU-only torch or another torch build, one line each at import;
- torchao registers its enums as pytree constants, which torch >= 2.12 calls deprecated, one line per enum;
- where DeepSpeed is installed (the test extra), accelerate imports it to unwrap a model at every `save_pretrained`,
  and DeepSpeed says, on every machine without a GPU, that it set its accelerator to CPU: true there, and nothing
  to act on.
"""

from __future__ import annotations

import logging
import re

_NOISE = {
    "torchao": re.compile(r"Failed to load .*torchao[/\\]_C\w*\.[\w.-]*so\b"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
    "DeepSpeed": re.compile(r"^Setting accelerator to CPU\. If you have GPU or other accelerator, we were unable to"),
}


class _DropMessage(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def drop_import_noise() -> None:
    """Install the filters once (importing this package twice adds none)."""
    for name, pattern in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(pattern))
