"""Save a block-FP8 checkpoint of a tiny model to OUT and SIGKILL this process at a chosen point (for
tests/test_checkpoint_folder.py): `python save_fault_worker.py OUT SEED POINT`.

POINT: `none` (a complete save), `shard` (writing the third weight shard), `carry` (hard-linking the old folder's
other entries), `before_exchange` / `after_exchange` (around the atomic swap), `fallback_between` /
`fallback_after` (no atomic exchange: between moving the old folder aside and the new one in, or after both).
"""

import os
import signal
import sys


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(out: str, seed: int, point: str) -> None:
    import safetensors.torch

    import trl_fp8.checkpoint.folder as folder
    from trl_fp8 import convert_to_fp8, save_fp8_checkpoint
    from trl_fp8.demo.tiny_model import tiny_qwen3

    calls = {"save_file": 0, "link": 0}
    real_save_file, real_link, real_exchange, real_rename = (
        safetensors.torch.save_file, os.link, folder._exchange, os.rename,
    )  # fmt: skip

    def save_file(*args, **kwargs):
        calls["save_file"] += 1
        if point == "shard" and calls["save_file"] == 3:
            die()
        return real_save_file(*args, **kwargs)

    def link(src, dst, *args, **kwargs):  # os.link's own signature: filelock passes follow_symlinks=False
        real_link(src, dst, *args, **kwargs)
        if not os.path.realpath(os.fspath(dst)).startswith(os.path.dirname(os.path.realpath(out)) + os.sep):
            return  # not the save's (filelock's lock files, say)
        calls["link"] += 1
        if point == "carry" and calls["link"] == 2:
            die()

    def exchange(a, b):
        if point == "before_exchange":
            die()
        if point.startswith("fallback"):
            return False  # as on NFS
        done = real_exchange(a, b)
        if point == "after_exchange":
            die()
        return done

    def rename(src, dst, *args, **kwargs):
        if point == "fallback_between" and str(src).endswith(".new"):
            die()
        real_rename(src, dst, *args, **kwargs)
        if point == "fallback_after" and str(src).endswith(".new"):
            die()

    safetensors.torch.save_file, os.link, folder._exchange, os.rename = save_file, link, exchange, rename
    model = tiny_qwen3(seed=seed, vocab_size=128)
    convert_to_fp8(model)
    save_fp8_checkpoint(model, out, progress=False, max_shard_size=2**20)  # several shards


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
