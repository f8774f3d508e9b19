"""`memory_breakdown`: each kind of training memory counted once, from the tensors themselves (gradients that are
views of DDP's buckets count as buckets)."""

import pytest
import torch
import torch.distributed as dist

from trl_fp8 import FP8LinearConfig, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.linear import FP8Linear
from trl_fp8.trainer.memory import memory_breakdown

from conftest import free_port


def n_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_live_gradients_optimizer_states_and_the_fp8_cache_once_made():
    """Parameters; gradients only where they are live; optimizer state tensors (AdamW: two per parameter, plus its
    step counter); an FP8 weight cache once a forward made it."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    FP8Linear.convert_(model[0], FP8LinearConfig(backend="emulated"))
    optimizer = torch.optim.AdamW(model.parameters())
    weight = 256 * 128 * 4
    expected = {"parameters": weight, "gradients": 0, "ddp_buckets": 0, "optimizer_states": 0, "fp8_weight_cache": 0}
    assert memory_breakdown(model, optimizer) == expected
    model(torch.randn(4, 256)).square().sum().backward()
    optimizer.step()
    out = memory_breakdown(model, optimizer)
    assert out["gradients"] == weight and out["fp8_weight_cache"] > 0
    assert weight * 2 <= out["optimizer_states"] <= weight * 2 + 64  # exp_avg, exp_avg_sq and a step counter
    optimizer.zero_grad()  # set to None: nothing live
    assert memory_breakdown(model, optimizer)["gradients"] == 0


@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_buckets_and_the_gradients_that_are_their_views(bucket_view, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = tiny_qwen3(vocab_size=128)
        convert_to_fp8(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        ids = torch.randint(0, 128, (2, 16))
        ddp(ids, labels=ids).loss.backward()
        out = memory_breakdown(model, None, ddp)
        grads = n_bytes(p.grad for p in model.parameters())
        assert out["ddp_buckets"] == grads  # one bucket slot per gradient
        assert out["gradients"] == (0 if bucket_view else grads)
        assert out["parameters"] == n_bytes(model.parameters())
    finally:
        dist.destroy_process_group()
