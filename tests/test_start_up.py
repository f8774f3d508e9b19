"""What the trainers refuse at start-up, before the model loads: a dataset without TRL's `prompt` column, an
`output_dir` the run could not save into, a Hub id that cannot be loaded here; and the log lines no user can act on."""

import errno
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict, IterableDataset

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8RLOOConfig, FP8RLOOTrainer
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward

from conftest import HANG_GUARD_S, clean_subprocess_env

ROOT = Path(__file__).resolve().parents[1]


def make_args(tmp_path, config=FP8GRPOConfig, **kw):
    settings = GRPO_SETTINGS if config is FP8GRPOConfig else {}
    defaults = dict(settings, output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=16,
                    use_cpu=True, bf16=False, disable_tqdm=True, report_to="none")  # fmt: skip
    return config(**{**defaults, **kw})


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: every refusal here comes before one."""
    import trl_fp8.trainer.mixin as mixin

    monkeypatch.setattr(mixin, "create_model_from_path", lambda *a, **k: pytest.fail("loaded the model"))


# --- the dataset's `prompt` column (TRL's GRPO and RLOO read `x["prompt"]` of every row at the first step) ------------


def questions(n: int = 16) -> Dataset:
    return Dataset.from_dict({"question": [f"say {c}:" for c in "ab" * (n // 2)], "letter": list("ab" * (n // 2))})


def test_a_dataset_without_a_prompt_column_is_refused_before_the_model_loads(model_dir, tmp_path, no_model_load):
    with pytest.raises(
        ValueError, match=r"train_dataset has no 'prompt' column \(its columns: question, letter\)"
    ) as e:
        FP8GRPOTrainer(model_dir, say_letter_reward, make_args(tmp_path), train_dataset=questions())
    assert "rename_column" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"eval_dataset\['hard'\] has no 'prompt' column"):
        # positional, as TRL's signature takes them
        FP8GRPOTrainer(model_dir, say_letter_reward, make_args(tmp_path), say_letter_dataset(16),
                       {"easy": say_letter_dataset(16), "hard": questions()})  # fmt: skip
    with pytest.raises(ValueError, match=r"eval_dataset has no 'prompt' column"):
        FP8GRPOTrainer(model_dir, say_letter_reward, make_args(tmp_path), train_dataset=say_letter_dataset(16),
                       eval_dataset=questions())  # fmt: skip
    with pytest.raises(ValueError, match=r"train_dataset is a DatasetDict of splits \(train, test\).*\['train'\]"):
        FP8GRPOTrainer(model_dir, say_letter_reward, make_args(tmp_path),
                       train_dataset=DatasetDict(train=say_letter_dataset(16), test=say_letter_dataset(16)))  # fmt: skip
    with pytest.raises(ValueError, match=r"train_dataset has no 'prompt' column"):  # RLOO reads it the same way
        FP8RLOOTrainer(model_dir, say_letter_reward, make_args(tmp_path, FP8RLOOConfig), train_dataset=questions())


def test_datasets_whose_columns_are_unknown_or_that_an_environment_fills_are_left_to_trl():
    from trl_fp8.trainer.start_up import dataset_problem

    def rows():
        yield {"question": "say a:"}

    streamed = IterableDataset.from_generator(rows)
    assert streamed.column_names is None
    assert dataset_problem({"train_dataset": streamed}) is None  # its columns are known at the first row only
    assert dataset_problem({"train_dataset": say_letter_dataset(4).to_iterable_dataset()}) is None
    assert "no 'prompt' column" in dataset_problem({"train_dataset": questions().to_iterable_dataset()})
    # TRL's GRPO defaults the prompt where an environment returns it from reset()
    assert dataset_problem({"train_dataset": questions(), "environment_factory": object}) is None
    assert dataset_problem({"train_dataset": say_letter_dataset(4), "eval_dataset": None}) is None


# --- an output_dir the run could not save into (found today by save_model, after the whole run) --------------------


def test_an_output_dir_that_cannot_be_created_is_refused_before_the_model_loads(model_dir, tmp_path, no_model_load):
    (tmp_path / "a_file").write_text("")
    output_dir = tmp_path / "a_file" / "run"  # a real OS error (ENOTDIR), root or not
    with pytest.raises(ValueError, match=rf"output_dir {output_dir} cannot be written: .*a_file is a file") as e:
        FP8GRPOTrainer(model_dir, say_letter_reward, make_args(tmp_path, output_dir=str(output_dir)),
                       train_dataset=say_letter_dataset(16))  # fmt: skip
    assert "FP8GRPOConfig(output_dir=...)" in str(e.value)


def read_only(monkeypatch, *folders: Path) -> None:
    """The probe's file creation in `folders` fails as on a read-only mount (EROFS; as root, chmod would not stop
    it). A real read-only mount: test_cli.py's quantize test."""
    real_mkstemp = tempfile.mkstemp
    folders = {str(f.resolve()) for f in folders}

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and str(Path(dir).resolve()) in folders:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


def test_a_read_only_output_dir_is_refused_and_its_files_stay(model_dir, tmp_path, monkeypatch, no_model_load):
    mount = tmp_path / "mnt"
    (mount / "run").mkdir(parents=True)
    (mount / "run" / "notes.txt").write_text("mine")
    read_only(monkeypatch, mount, mount / "run")
    for output_dir in (mount / "run", mount / "new" / "run"):  # there already, or created by the run
        with pytest.raises(ValueError, match=rf"output_dir {output_dir} cannot be written: .*Read-only file system"):
            FP8GRPOTrainer(model_dir, say_letter_reward, make_args(tmp_path, output_dir=str(output_dir)),
                           train_dataset=say_letter_dataset(16))  # fmt: skip
    assert sorted(p.name for p in mount.rglob("*")) == ["notes.txt", "run"]


def test_the_fp8_checkpoint_is_written_beside_output_dir_so_its_parent_must_take_files(tmp_path, monkeypatch):
    from trl_fp8.checkpoint.folder import unwritable

    (tmp_path / "mnt" / "run").mkdir(parents=True)  # a writable folder in a read-only one (a mount point)
    read_only(monkeypatch, tmp_path / "mnt")
    assert unwritable(tmp_path / "mnt" / "run", beside=False) is None  # transformers' own save writes inside it
    problem = unwritable(tmp_path / "mnt" / "run", beside=True)
    assert "written beside it" in problem and "Read-only file system" in problem
    assert not [p for p in (tmp_path / "mnt" / "run").iterdir()]  # the probe leaves nothing behind


def test_only_the_process_that_saves_checks_output_dir(tmp_path, monkeypatch):
    from trl_fp8.trainer.start_up import check_output_writable

    (tmp_path / "a_file").write_text("")
    args = make_args(tmp_path, output_dir=str(tmp_path / "a_file" / "run"))
    with pytest.raises(ValueError, match="cannot be written"):
        check_output_writable(args, "FP8GRPOConfig")
    monkeypatch.setattr(type(args), "should_save", property(lambda self: False))
    check_output_writable(args, "FP8GRPOConfig")


# --- a model the trainer could not load: a Hub id offline and not cached, a folder without config.json -------------


def test_a_hub_id_offline_and_not_cached_is_one_line_before_loading(model_dir, tmp_path, monkeypatch, no_model_load):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match=r"trl-fp8-tests/tiny is not in the Hugging Face cache, and HF_HUB_OFFLINE "
                                         r"is set") as e:  # fmt: skip
        FP8GRPOTrainer("trl-fp8-tests/tiny", say_letter_reward, make_args(tmp_path),
                       train_dataset=say_letter_dataset(16))  # fmt: skip
    assert "hf download trl-fp8-tests/tiny" in str(e.value) and "\n" not in str(e.value)
    # `trl-fp8 plan` caches config.json alone: that does not make the model loadable offline
    snapshot = tmp_path / "hub" / "models--trl-fp8-tests--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    with pytest.raises(ValueError, match=r"trl-fp8-tests/tiny's config is in the Hugging Face cache but not its "
                                         r"weights"):  # fmt: skip
        FP8GRPOTrainer("trl-fp8-tests/tiny", say_letter_reward, make_args(tmp_path),
                       train_dataset=say_letter_dataset(16))  # fmt: skip
    (snapshot / "model.safetensors").write_text("")
    from trl_fp8.hub import unavailable_model

    assert unavailable_model("trl-fp8-tests/tiny") is None  # cached: transformers loads it offline
    # a reward model named by Hub id is loaded by TRL the same way
    with pytest.raises(ValueError, match=r"trl-fp8-tests/reward is not in the Hugging Face cache"):
        FP8GRPOTrainer(model_dir, "trl-fp8-tests/reward", make_args(tmp_path),
                       train_dataset=say_letter_dataset(16))  # fmt: skip


def test_a_folder_without_config_json_says_what_a_model_folder_holds(tmp_path, no_model_load):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ValueError, match=r"is a folder without config.json: a model folder holds config.json and "
                                         r"the weights") as e:  # fmt: skip
        FP8GRPOTrainer(str(tmp_path / "weights"), say_letter_reward, make_args(tmp_path),
                       train_dataset=say_letter_dataset(16))  # fmt: skip
    assert "save_pretrained" in str(e.value)


# --- log lines no user can act on --------------------------------------------------------------------------------


def test_deepspeeds_cpu_accelerator_line_is_dropped_and_its_other_lines_kept():
    """accelerate imports DeepSpeed (where installed) to unwrap a model at every save_pretrained; DeepSpeed then says,
    on every machine without a GPU, that it set its accelerator to CPU."""
    if not _deepspeed_installed():
        pytest.skip("DeepSpeed is not installed")
    code = (
        "import logging, trl_fp8\n"
        "from accelerate.utils import extract_model_from_parallel\n"
        "import torch\n"
        "extract_model_from_parallel(torch.nn.Linear(1, 1))\n"
        "logging.getLogger('DeepSpeed').warning('a DeepSpeed warning that stays')\n"
    )
    env = {**clean_subprocess_env(), "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    output = proc.stdout + proc.stderr
    assert "Setting accelerator to CPU" not in output and "a DeepSpeed warning that stays" in output, output


def _deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def test_the_deepspeed_filter_drops_that_line_only():
    import trl_fp8  # noqa: F401 - installs the filters

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("DeepSpeed")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning(
            "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
        )
        logger.warning("Setting accelerator to CPU for ZeRO offload")  # not the line: kept
    finally:
        logger.removeHandler(handler)
    assert records == ["Setting accelerator to CPU for ZeRO offload"]
