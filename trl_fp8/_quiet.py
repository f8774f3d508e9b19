"""Log lines that importing the stack prints and that no user can act on, dropped where they are logged.

Only these exact messages are dropped; every other warning of torch and torchao still shows:
- torchao's prebuilt CUDA extensions (`torchao/_C*.so`: MX formats, CUTLASS kernels trl-fp8 does not use) fail to
  load into a CPU-only torch or another torch build, one line each at import;
- torchao registers its enums as pytree constants, which torch >= 2.12 calls deprecated, one line per enum.
"""

from __future__ import annotations

import logging
import re

_NOISE = {
    "torchao": re.compile(r"Failed to load .*torchao[/\\]_C\w*\.[\w.-]*so\b"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
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
