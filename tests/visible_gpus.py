"""The GPUs a test session may use, read the same way by `conftest.py` and `gpu/run_suite.py` (no torch import:
it runs before torch reads CUDA_VISIBLE_DEVICES)."""

import os
import subprocess


def visible_gpus() -> list[str]:
    """CUDA_VISIBLE_DEVICES's entries where it is set, else every GPU `nvidia-smi -L` lists (none without it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(ln for ln in listing.splitlines() if ln.startswith("GPU "))]
