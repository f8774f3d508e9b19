import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests build every model and tokenizer locally
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an SM90 (H100/H200) GPU")
    for item in items:
        if "gpu" in item.keywords and not _sm90():
            item.add_marker(skip)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()
