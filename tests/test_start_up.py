"""What the trainers refuse at start-up, before the model loads: a dataset without TRL's `prompt` column, a Hub id
that cannot be loaded here."""

import pytest
from datasets import Dataset, DatasetDict, IterableDataset

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8RLOOConfig, FP8RLOOTrainer
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward


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
