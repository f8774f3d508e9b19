"""`trl-fp8 quantize` (and its first name `trl-fp8-quantize`): it never destroys a model the user has, checks its
options, keeps vLLM's fused layers consistent, and exports custom-code models with their code."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trl_fp8.cli.main import main as cli
from trl_fp8.cli.quantize import main as quantize_alias
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3

from conftest import HANG_GUARD_S, clean_subprocess_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "bf16"
    tiny_qwen3(vocab_size=128).save_pretrained(path)
    tiny_char_tokenizer().save_pretrained(path)
    return path


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def quant_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def test_output_folder_that_is_the_input_or_holds_a_model_is_refused(model_dir, tmp_path, capsys):
    original = files(model_dir)
    assert cli(["quantize", str(model_dir), str(model_dir)]) == 2
    assert "the input model's own folder" in capsys.readouterr().err and files(model_dir) == original
    assert quantize_alias([str(model_dir), str(model_dir) + "/"]) == 2  # the same folder, spelt otherwise
    other = tmp_path / "other"
    tiny_qwen3(seed=1, vocab_size=128).save_pretrained(other)
    theirs = files(other)
    assert cli(["quantize", str(model_dir), str(other)]) == 2
    assert "already holds a model" in capsys.readouterr().err and files(other) == theirs
    # On purpose: --overwrite replaces the model (here the input itself: it was read in full before the swap).
    assert cli(["quantize", str(model_dir), str(model_dir), "--overwrite"]) == 0
    assert quant_config(model_dir)["quant_method"] == "fp8" and not list(model_dir.parent.glob(".bf16.*"))
    # An empty folder, or one with only logs, is fine.
    (tmp_path / "logs_only" / "runs").mkdir(parents=True)
    assert cli(["quantize", str(other), str(tmp_path / "logs_only")]) == 0


def test_dtype_is_a_checked_choice_and_auto_keeps_the_models(model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["quantize", str(model_dir), str(tmp_path / "x"), "--dtype", "fp32"])
    assert exit_info.value.code == 2 and "invalid choice: 'fp32'" in capsys.readouterr().err
    assert cli(["quantize", str(model_dir), str(tmp_path / "auto"), "--dtype", "auto"]) == 0
    with safe_open(tmp_path / "auto" / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float32  # the saved model is float32
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float8_e4m3fn


def test_keep_in_bf16_and_fused_groups(model_dir, tmp_path):
    out = tmp_path / "fp8"
    assert cli(["quantize", str(model_dir), str(out), "--keep_in_bf16", r"layers\.1\.mlp\.up_proj$"]) == 0
    kept = set(quant_config(out)["modules_to_not_convert"])
    # gate_proj is fused with up_proj in vLLM: kept with it.
    assert kept == {"lm_head", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.gate_proj"}
    assert cli(["quantize", str(model_dir), str(tmp_path / "bad"), "--keep_in_bf16", "("]) == 2

    gqa = tmp_path / "gqa"  # k/v projections 64 wide: q, k, v all stay BF16 and the checkpoint loads
    tiny_qwen3(vocab_size=128, head_dim=64).save_pretrained(gqa)
    with pytest.warns(UserWarning, match="not multiples of 128"):
        assert cli(["quantize", str(gqa), str(tmp_path / "gqa_fp8")]) == 0
    kept = set(quant_config(tmp_path / "gqa_fp8")["modules_to_not_convert"])
    assert {f"model.layers.0.self_attn.{p}_proj" for p in "qkv"} <= kept
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "gqa_fp8")


def test_one_command_with_subcommands_and_the_old_name(model_dir, tmp_path):
    env = {**clean_subprocess_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "trl_fp8", "quantize", str(model_dir), str(tmp_path / "a")],
                          capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 0 and "Wrote the block-FP8 checkpoint" in proc.stdout, proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "trl_fp8"], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S
    )
    assert proc.returncode == 2 and "quantize" in proc.stderr
    assert quantize_alias([str(model_dir), str(tmp_path / "b")]) == 0
    assert files(tmp_path / "a")["model.safetensors"] == files(tmp_path / "b")["model.safetensors"]


CUSTOM_CONFIG = """from transformers import Qwen3Config


class TinyCustomConfig(Qwen3Config):
    model_type = "tinycustom"
"""
CUSTOM_MODEL = """from transformers import Qwen3ForCausalLM

from .configuration_tinycustom import TinyCustomConfig


class TinyCustomForCausalLM(Qwen3ForCausalLM):
    config_class = TinyCustomConfig
"""


def custom_code_model(folder: Path) -> Path:
    """A `trust_remote_code` model: its config and model classes live in .py files of the folder."""
    folder.mkdir(parents=True)
    tiny_qwen3(vocab_size=128).save_pretrained(folder)
    (folder / "configuration_tinycustom.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_tinycustom.py").write_text(CUSTOM_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tinycustom", architectures=["TinyCustomForCausalLM"], auto_map={
        "AutoConfig": "configuration_tinycustom.TinyCustomConfig",
        "AutoModelForCausalLM": "modeling_tinycustom.TinyCustomForCausalLM"})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_custom_code_models_export_their_code(tmp_path):
    source = custom_code_model(tmp_path / "custom")
    out = tmp_path / "custom_fp8"
    assert cli(["quantize", str(source), str(out), "--trust_remote_code"]) == 0
    assert (out / "modeling_tinycustom.py").exists() and (out / "configuration_tinycustom.py").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].endswith("modeling_tinycustom.TinyCustomForCausalLM")
    # Reloaded elsewhere (a fresh process, its own module cache): the code comes from the checkpoint itself.
    env = {**clean_subprocess_env(), "PYTHONPATH": str(ROOT), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    code = ("import sys; from transformers import AutoModelForCausalLM as A; "
            "m = A.from_pretrained(sys.argv[1], trust_remote_code=True); print(type(m).__name__)")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env,
                          timeout=HANG_GUARD_S, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and "TinyCustomForCausalLM" in proc.stdout, proc.stderr[-2000:]
    os.remove(out / "modeling_tinycustom.py")  # and without it, that load fails: the test can tell
    proc = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, env=env,
                          timeout=HANG_GUARD_S, cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0


def test_version_names_the_stack(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("trl-fp8 ") and "torch " in out and "trl " in out and "transformers " in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_warmup_without_a_gpu_says_so_in_one_line(model_dir, capsys):
    assert cli(["warmup", str(model_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: DeepGEMM cannot run here (no CUDA GPU)")


def test_quantize_refuses_a_folder_inside_the_models(model_dir, capsys):
    before = files(model_dir)
    assert cli(["quantize", str(model_dir), str(model_dir / "fp8")]) == 2
    assert "inside the input model's folder" in capsys.readouterr().err
    assert files(model_dir) == before and not (model_dir / "fp8").exists()


def test_importing_the_stack_prints_nothing_a_user_cannot_act_on():
    """torchao's CUDA extensions that cannot load into this torch, and its enum registrations that torch calls
    deprecated, are one log line each at import: dropped where they are logged, everything else kept."""
    code = (
        "import logging, trl_fp8, trl, torchao, torchao.prototype.mx_formats.config\n"
        "from trl_fp8 import FP8GRPOConfig\n"
        "FP8GRPOConfig(output_dir='x', use_cpu=True, bf16=False)\n"
        "logging.getLogger('torchao').warning('a torchao warning that stays')\n"
    )
    proc = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True,
                          env={**clean_subprocess_env(), "PYTHONPATH": str(ROOT)}, timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "a torchao warning that stays", proc.stderr


def weightless(model_dir: Path, folder: Path) -> Path:
    """A copy of the model's folder without its weights: config.json (and the tokenizer) only."""
    folder.mkdir()
    for name, data in files(model_dir).items():
        if not name.endswith(".safetensors"):
            (folder / name).write_bytes(data)
    return folder


def cut_short(model_dir: Path, folder: Path, keep: int | None = None) -> Path:
    """A copy of the model's folder whose model.safetensors stops after `keep` bytes (default: half of it)."""
    weightless(model_dir, folder)
    data = files(model_dir)["model.safetensors"]
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2 if keep is None else keep])
    return folder


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.err.startswith("error: ") and "Wrote" not in captured.out
    return captured.err


def test_quantize_of_a_folder_without_weights_is_a_one_line_error(model_dir, tmp_path, capsys):
    source = weightless(model_dir, tmp_path / "config_only")
    assert cli(["quantize", str(source), str(tmp_path / "out")]) == 2
    err = one_line_error(capsys)
    assert f"{source} has config.json but no weights" in err and "model.safetensors" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [None, 100], ids=["data", "header"])
def test_quantize_of_a_truncated_checkpoint_is_a_one_line_error(model_dir, tmp_path, capsys, keep):
    source = cut_short(model_dir, tmp_path / "cut", keep)
    assert cli(["quantize", str(source), str(tmp_path / "out")]) == 2
    err = one_line_error(capsys)
    assert f"cannot load the weights of {source}" in err and "SafetensorError" in err
    assert "cut short or damaged" in err and "download or copy the model again" in err
    assert not (tmp_path / "out").exists()


def test_quantize_of_a_truncated_checkpoint_prints_no_traceback_from_the_shell(model_dir, tmp_path):
    source = cut_short(model_dir, tmp_path / "cut")
    env = {**clean_subprocess_env(), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "trl_fp8", "quantize", str(source), str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == proc.stderr.splitlines()[-1:]


def read_only_mount_command(folder: Path, *cmd) -> list[str] | None:
    """`cmd` run where `folder` is mounted read-only, in a private mount namespace: every write there fails with
    EROFS, root's too, as on a read-only filesystem (chmod does not stop root). None where this machine gives no
    unprivileged user namespaces."""
    import shutil

    unshare = shutil.which("unshare")
    namespace = [unshare, "--user", "--map-root-user", "--mount"]
    if unshare is None or subprocess.run([*namespace, "true"], capture_output=True).returncode != 0:
        return None
    mount_read_only = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return [*namespace, "sh", "-c", mount_read_only, str(folder), *cmd]


def test_quantize_into_a_folder_it_cannot_create_is_a_one_line_error(model_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    assert cli(["quantize", str(model_dir), str(tmp_path / "a_file" / "fp8")]) == 2
    err = one_line_error(capsys)
    assert f"{tmp_path / 'a_file' / 'fp8'} cannot be written" in err and "a_file is a file" in err


def test_quantize_onto_a_read_only_filesystem_is_a_one_line_error(model_dir, tmp_path):
    mount = tmp_path / "mnt"
    mount.mkdir()
    env = {**clean_subprocess_env(), "PYTHONPATH": str(ROOT)}
    quantize = [sys.executable, "-m", "trl_fp8", "quantize", str(model_dir), str(mount / "fp8")]
    cmd = read_only_mount_command(mount, *quantize)
    if cmd is None:
        pytest.skip("no unprivileged user namespaces here to mount a folder read-only")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == proc.stderr.splitlines()[-1:], proc.stderr
    assert f"{mount / 'fp8'} cannot be written" in errors[0] and "Read-only file system" in errors[0]
    assert "Wrote" not in proc.stdout and not list(mount.iterdir())
