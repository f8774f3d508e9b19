"""Saving never loses or mixes a model: the new checkpoint is written beside the output folder and swapped in whole,
what the folder holds beside its checkpoint is kept, and saves killed at any point leave the old checkpoint or the
new one (`trl_fp8.checkpoint.folder`)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trl_fp8.checkpoint.folder as checkpoint_folder
from trl_fp8 import convert_to_fp8, save_fp8_checkpoint
from trl_fp8.checkpoint.folder import drop_checkpoint_entries, holds_a_model, remove_leftovers, replace_checkpoint
from trl_fp8.demo.tiny_model import tiny_qwen3

from conftest import HANG_GUARD_S, WORKERS, clean_subprocess_env

WORKER = WORKERS / "save_fault_worker.py"
ROOT = Path(__file__).resolve().parents[1]


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative path -> sha256)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def run_worker(out: Path, seed: int, point: str) -> int:
    env = {**clean_subprocess_env(), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(WORKER), str(out), str(seed), point], env=env, timeout=HANG_GUARD_S
    ).returncode


@pytest.fixture(scope="module")
def old_and_new(tmp_path_factory):
    """A folder holding an FP8 checkpoint (seed 0) beside a training checkpoint, logs and notes; and the same folder
    after a complete save of another model (seed 1)."""
    root = tmp_path_factory.mktemp("saves")
    old = root / "old" / "model"
    assert run_worker(old, 0, "none") == 0
    (old / "checkpoint-2").mkdir()
    for name in ("model.safetensors", "optimizer.pt", "trainer_state.json"):
        (old / "checkpoint-2" / name).write_bytes(os.urandom(64))
    (old / "runs").mkdir()
    (old / "runs" / "events.out").write_text("log")
    (old / "notes.txt").write_text("mine")
    new = root / "new" / "model"
    shutil.copytree(old, new)
    assert run_worker(new, 1, "none") == 0
    return old, new


@pytest.mark.parametrize(
    "point", ["shard", "carry", "before_exchange", "after_exchange", "fallback_between", "fallback_after"]
)
def test_a_save_killed_anywhere_leaves_the_old_checkpoint_or_the_new_one(old_and_new, tmp_path, point):
    old, new = old_and_new
    old_state, new_state = digest(old), digest(new)
    assert old_state != new_state and {"notes.txt", "runs/events.out", "checkpoint-2/optimizer.pt"} <= set(new_state)
    out = tmp_path / "model"
    shutil.copytree(old, out)
    assert run_worker(out, 1, point) == -9  # SIGKILL: no cleanup ran
    if point == "fallback_between":
        # Without an atomic exchange, the old folder was renamed aside and the kill came before the new one moved in.
        assert not out.exists()
    else:
        assert digest(out) in (old_state, new_state), point
    remove_leftovers(out)  # what the next save does first
    assert digest(out) in (old_state, new_state)
    assert siblings(out) == [], siblings(out)  # no staging folder, old folder or lock file left
    if point in ("shard", "carry", "before_exchange", "fallback_between"):
        assert digest(out) == old_state
    else:
        assert digest(out) == new_state


def test_a_save_replaces_the_whole_checkpoint_and_keeps_everything_else(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    # An earlier save's files that the new one does not write, as a Hub push from a LoRA checkpoint leaves them.
    for name in ("adapter_config.json", "adapter_model.safetensors", "pytorch_model.bin", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "modeling_old.py"):  # fmt: skip
        (out / name).write_text("stale")
    (out / "config.json").write_text(json.dumps({"auto_map": {"AutoModel": "modeling_old.Old"}}))
    (out / "bf16_master").mkdir()
    (out / "bf16_master" / "model.safetensors").write_text("stale")
    (out / ".tmp-fp8-save-12345").mkdir()  # what trl-fp8 0.1 left inside the folder when killed
    (out / ".tmp-fp8-save-12345" / "part-00000.safetensors").write_text("partial")
    (out / "README.md").write_text("my card")
    (out / "checkpoint-5").mkdir()
    (out / "checkpoint-5" / "trainer_state.json").write_text("{}")
    out.chmod(0o755)
    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model)
    save_fp8_checkpoint(model, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "checkpoint-5", "config.json", "generation_config.json", "model.safetensors"]  # fmt: skip
    assert (out / "README.md").read_text() == "my card" and (out / "checkpoint-5" / "trainer_state.json").exists()
    assert out.stat().st_mode & 0o777 == 0o755 and siblings(out) == []
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # one model, no adapter applied on top


def test_a_failed_save_leaves_the_folder_untouched(tmp_path):
    out = tmp_path / "model"
    model = tiny_qwen3(vocab_size=128)
    convert_to_fp8(model)
    save_fp8_checkpoint(model, out, progress=False)
    before = digest(out)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight holds NaN or Inf"):
        save_fp8_checkpoint(model, out, progress=False)
    assert digest(out) == before and siblings(out) == []
    with pytest.raises(RuntimeError, match="boom"), replace_checkpoint(out) as staging:
        (staging / "config.json").write_text("{}")
        raise RuntimeError("boom")
    assert digest(out) == before and siblings(out) == []


def test_without_an_atomic_exchange_the_folder_is_renamed_aside_and_back(tmp_path, monkeypatch):
    out = tmp_path / "model"
    save_fp8_checkpoint(tiny_qwen3(vocab_size=128), out, progress=False)
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(checkpoint_folder, "_exchange", lambda a, b: False)  # NFS, macOS
    save_fp8_checkpoint(tiny_qwen3(seed=1, vocab_size=128), out, progress=False)
    assert (out / "notes.txt").read_text() == "mine" and siblings(out) == []
    # A mount point cannot be renamed: files are then replaced one by one, config.json last, with a warning.
    real_rename = os.rename

    def rename(src, dst):
        if Path(src) == out:
            raise OSError(16, "Device or resource busy")
        return real_rename(src, dst)

    monkeypatch.setattr(checkpoint_folder.os, "rename", rename)
    (out / "adapter_config.json").write_text("stale")
    save_fp8_checkpoint(tiny_qwen3(seed=2, vocab_size=128), out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "notes.txt"]  # fmt: skip
    reference = tmp_path / "reference"
    save_fp8_checkpoint(tiny_qwen3(seed=2, vocab_size=128), reference, progress=False)
    assert digest(reference) == {k: v for k, v in digest(out).items() if k != "notes.txt"}


def test_saves_in_flight_elsewhere_are_left_alone(tmp_path):
    """Leftovers are removed only when their save's lock is free: a save running in another process keeps its
    staging folder."""
    import fcntl

    out = tmp_path / "model"
    stem = tmp_path / ".model.trl-fp8-999-live"
    (stem.parent / (stem.name + ".new")).mkdir()
    lock = os.open(stem.parent / (stem.name + ".lock"), os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    # Another process's lock: flock locks belong to the open file, so a second open here stands for it.
    dead = tmp_path / ".model.trl-fp8-998-dead.new"
    dead.mkdir()
    try:
        remove_leftovers(out)
        assert (stem.parent / (stem.name + ".new")).exists() and not dead.exists()
    finally:
        os.close(lock)
    remove_leftovers(out)
    assert siblings(out) == []


def test_drop_and_holds_a_model(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    assert not holds_a_model(out)
    (out / "training_args.bin").write_bytes(b"x")
    (out / "runs").mkdir()
    assert not holds_a_model(out)
    (out / "adapter_model.safetensors").write_bytes(b"x")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"x")
    assert holds_a_model(out)
    assert drop_checkpoint_entries(out, keep={"model-00001-of-00002.safetensors"}) == [
        "adapter_model.safetensors", "training_args.bin"]  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["model-00001-of-00002.safetensors", "runs"]


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="Pass a folder path"), replace_checkpoint(tmp_path / "f"):
        pass
