"""`memory_breakdown`: each kind of training memory counted once (gradients that are views of DDP's buckets count as
buckets), from the tensors themselves."""

import pytest
import torch
import torch.distributed as dist

from trl_fp8 import convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.trainer.memory import GIB, memory_breakdown

from conftest import free_port


def n_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_parameters_gradients_optimizer_and_fp8_cache():
    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    out = memory_breakdown(model, opt)
    params = list(model.parameters())
    assert out["parameters"] == pytest.approx(n_bytes(params) / GIB)
    assert out["gradients"] == pytest.approx(n_bytes(p.grad for p in params) / GIB)
    # AdamW: two fp32 moments per parameter, and a step count per parameter
    assert out["optimizer_states"] == pytest.approx(2 * n_bytes(params) / GIB, rel=1e-3)
    assert out["ddp_buckets"] == 0 and out["fp8_weight_cache"] > 0  # the forward cached the FP8 weights


@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_buckets_and_the_gradients_that_are_their_views(bucket_view, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = tiny_qwen3(vocab_size=128)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        ids = torch.randint(0, 128, (2, 16))
        ddp(ids, labels=ids).loss.backward()
        out = memory_breakdown(model, None, ddp)
        grads = n_bytes(p.grad for p in model.parameters())
        assert out["ddp_buckets"] == pytest.approx(grads / GIB)  # one bucket slot per gradient
        assert out["gradients"] == (0 if bucket_view else pytest.approx(grads / GIB))
    finally:
        dist.destroy_process_group()
