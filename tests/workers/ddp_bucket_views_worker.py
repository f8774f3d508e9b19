"""One rank of the check that gradients stay views of DDP's buckets through gradient accumulation, launched by
tests/test_multiprocess.py:

    torchrun --nproc_per_node 2 tests/workers/ddp_bucket_views_worker.py OUT_DIR

For a DDP model with `gradient_as_bucket_view`, as transformers drives it (`model.zero_grad()` after each optimizer
step, then micro-batches under `no_sync` and a last one synced), records whether every gradient during the
accumulation is a view of a bucket: with `zero_grads_in_buckets` applied, and without. And, with unused parameters
allowed, whether AdamW moves a layer in each step where no rank used it, one rank used it, or both did: plain DDP
(its gradient None, so AdamW skips it) against ours. Writes OUT_DIR/rank<r>.json.
"""

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1])]


def accumulation_keeps_views(patch: bool) -> list[bool]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from trl_fp8.distributed import zero_grads_in_buckets

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if patch:
        assert zero_grads_in_buckets(ddp)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 128)
    views, kept = None, []
    for _step in range(3):
        for micro in range(3):  # two micro-batches under no_sync, then the synced one
            if micro < 2:
                with ddp.no_sync():
                    ddp(x).square().mean().backward()
            else:
                ddp(x).square().mean().backward()
            pointers = [p.grad.data_ptr() for p in model.parameters()]
            if views is not None:
                kept.append(pointers == views)
        views = [p.grad.data_ptr() for p in model.parameters()]  # after a synced backward: the bucket views
        optimizer.step()
        ddp.zero_grad()  # as transformers' training loop does
    return kept


def steps_moving_a_sometimes_unused_layer(patch: bool, rank: int) -> list[bool]:
    """Per step, whether AdamW (momentum, weight decay) moved layer `b`: used by both ranks in step 1, by rank 0 alone
    in step 2, by neither in step 3 (DDP's `find_unused_parameters`, as transformers sets it without gradient
    checkpointing)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from trl_fp8.distributed import drop_grads_of_unused_parameters, zero_grads_in_buckets

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(128, 128), torch.nn.Linear(128, 128)

        def forward(self, x, use_b: bool):
            return self.b(self.a(x)) if use_b else self.a(x)

    torch.manual_seed(0)
    model = TwoLayers()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, find_unused_parameters=True)
    if patch:
        assert zero_grads_in_buckets(ddp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    x, moved = torch.randn(4, 128), []
    for use_b in (True, rank == 0, False):
        ddp(x, use_b).square().mean().backward()
        if patch:
            drop_grads_of_unused_parameters(ddp)  # the trainer's training_step, after the synced backward
        before = model.b.weight.detach().clone()
        optimizer.step()
        moved.append(not torch.equal(before, model.b.weight))
        ddp.zero_grad()  # as transformers' training loop does
    return moved


def main():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    # Without first: the patch is set on the DDP instance, so the two models do not share it.
    record = {"without": accumulation_keeps_views(False), "with": accumulation_keeps_views(True),
              "plain_unused": steps_moving_a_sometimes_unused_layer(False, dist.get_rank()),
              "ours_unused": steps_moving_a_sometimes_unused_layer(True, dist.get_rank())}  # fmt: skip
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    # every rank done before any closes its connections (a rank tearing down gloo beside a peer's last
    # exchange aborted natively, rarely, in CI)
    dist.barrier()
    dist.destroy_process_group()
    # Then leave without the interpreter's teardown, where a rank still aborted natively, rarely, in CI ("terminate
    # called without an active exception", no Python frame) after its results were written and the ranks had met.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
