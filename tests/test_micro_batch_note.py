"""The start-up note where blockwise FP8 training of a narrow model would wait for the host (`plan.micro_batch`):
said for the measured host-bound case, silent where it was measured to pay or was not measured."""

import types

import pytest

from trl_fp8.plan.micro_batch import dense_hidden_size, small_micro_batch_note


def options(**overrides):
    return types.SimpleNamespace(**{"fp8_recipe": "blockwise", "per_device_train_batch_size": 8,
                                    "gradient_accumulation_steps": 8, "vllm_max_model_length": None,
                                    "max_completion_length": 1152, **overrides})  # fmt: skip


def test_the_measured_host_bound_case_gets_the_note_with_the_micro_batch_that_paid():
    note = small_micro_batch_note(2048, options())
    assert "at most 8 x 1152 tokens" in note and "hidden size 2048" in note
    # 16 x 1152 tokens: the measured break-even; 64 sequences a step in 4 micro-batches of 16 instead of 8 of 8
    assert "per_device_train_batch_size=16 with gradient_accumulation_steps=4" in note and "--micro_batch 16" in note
    # the measured speeds stay in the documentation; the note names the page and section that hold them
    assert "the Benchmarks page of the documentation, 'The training phase alone'" in note


@pytest.mark.parametrize(
    "micro_batch, steps, seq_len, suggested, remaining",
    [
        (4, 8, 256, 32, 1),  # 72 sequences would reach it: the whole step of 32 in one micro-batch
        (8, 24, 512, 48, 4),  # 36 would: the smallest divisor of 192 from there is 48
        (6, 10, 1152, 20, 3),  # 16 would: 20 divides the step's 60 sequences, 16 does not
    ],
)
def test_the_suggestion_keeps_the_steps_sequences(micro_batch, steps, seq_len, suggested, remaining):
    note = small_micro_batch_note(
        1024, options(per_device_train_batch_size=micro_batch, gradient_accumulation_steps=steps,
                      max_completion_length=seq_len)
    )  # fmt: skip
    assert f"per_device_train_batch_size={suggested} with gradient_accumulation_steps={remaining} " in note
    assert f"keeps the {micro_batch * steps} sequences" in note


def test_the_engine_length_bounds_the_sequences_where_it_is_set():
    assert small_micro_batch_note(2048, options(vllm_max_model_length=4096)) is None  # 8 x 4096 tokens: enough
    assert "at most 8 x 2048 tokens" in small_micro_batch_note(2048, options(vllm_max_model_length=2048))


@pytest.mark.parametrize(
    "hidden_size, overrides",
    [
        (4096, {}),  # 8B's width: FP8 trained 1.16x BF16 at 8 x 1152
        (2560, {}),  # not measured
        (2048, {"per_device_train_batch_size": 16}),  # the measured break-even
        (2048, {"fp8_recipe": None}),  # BF16 training
        (2048, {"fp8_recipe": "tensorwise"}),  # torchao's recipes: not measured here
        (None, {}),  # a config without a hidden size
        (2048, {"max_completion_length": None}),  # no length to bound the micro-batch with
        (2048, {"gradient_accumulation_steps": 1}),  # one micro-batch a step: no larger one keeps the step
    ],
)
def test_no_note_where_fp8_training_was_measured_to_pay_or_was_not_measured(hidden_size, overrides):
    assert small_micro_batch_note(hidden_size, options(**overrides)) is None


@pytest.mark.parametrize("process_index, said", [(0, True), (1, False)])
def test_the_trainer_says_it_once_on_a_gpu(capsys, process_index, said):
    """On a GPU the plan holds the note, said by the first process only."""
    from trl_fp8.config import LayerSelection
    from trl_fp8.plan import Choice, FP8RunPlan, RolloutSettings

    off = Choice(False, "")
    plan = FP8RunPlan(layers=LayerSelection(), rollout=RolloutSettings(), liger_kernels=off, fp8_kv_cache=off,
                      fp8_weight_cache=None, fsdp2_gradient_sync=None, cuda=True,
                      micro_batch_note=small_micro_batch_note(2048, options()))  # fmt: skip
    plan.say_start_up(options(process_index=process_index, use_vllm=False))
    out = capsys.readouterr().out
    assert ("[trl-fp8] micro-batches of at most 8 x 1152 tokens" in out) == said


def test_off_a_gpu_the_plan_has_no_note(tmp_path):
    from transformers import Qwen3Config

    from trl_fp8 import FP8GRPOConfig
    from trl_fp8.plan import FP8RunPlan

    args = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8,
                         gradient_accumulation_steps=8, max_completion_length=1152, num_generations=8)  # fmt: skip
    assert FP8RunPlan.build(args, Qwen3Config(hidden_size=2048)).micro_batch_note is None


def test_mixture_of_experts_models_get_no_hidden_size_to_judge_by():
    from transformers import Qwen3Config, Qwen3MoeConfig

    assert dense_hidden_size(Qwen3Config(hidden_size=2048)) == 2048
    assert dense_hidden_size(Qwen3MoeConfig(hidden_size=2048, num_experts=128)) is None
    assert dense_hidden_size(None) is None


QWEN3_1_7B = {"model_type": "qwen3", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
              "tie_word_embeddings": True}  # fmt: skip


def plan(tmp_path, capsys, config: dict, *argv: str) -> str:
    import json

    from trl_fp8.cli.main import main as cli

    folder = tmp_path / config["model_type"]
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    assert cli(["plan", str(folder), "--gpu", "H100", "--prompt_len", "128", "--completion_len", "1024", *argv]) == 0
    return capsys.readouterr().out


def test_the_planner_names_the_larger_micro_batch_and_plans_it(tmp_path, capsys):
    out = plan(tmp_path, capsys, QWEN3_1_7B, "--generation_batch", "64")
    line = next(line for line in out.splitlines() if line.startswith("FP8 training at hidden size 2048"))
    assert "micro-batches of 8 x 1,152 tokens" in line
    assert "--micro_batch 16 --gradient_accumulation_steps 4 keeps the 64 sequences of a step" in line
    assert "the Benchmarks page of the documentation, 'The training phase alone'" in line
    # what it says the FP8 rows hold there is the planner's own table for that micro-batch
    table = plan(tmp_path, capsys, QWEN3_1_7B, "--generation_batch", "64", "--micro_batch", "16",
                 "--gradient_accumulation_steps", "4")  # fmt: skip
    fp8_trainer = next(row.split()[-2] for row in table.splitlines() if row.startswith("FP8  "))
    assert f"FP8 {fp8_trainer[:-2]} GiB (fits)" in line
    assert "FP8 training at hidden size" not in table  # 16 x 1,152 tokens: the measured break-even


def test_the_planner_says_nothing_where_the_note_does_not_apply(tmp_path, capsys):
    wide = {**QWEN3_1_7B, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32}
    assert "FP8 training at hidden size" not in plan(tmp_path, capsys, wide, "--generation_batch", "64")
    one_step = plan(tmp_path, capsys, QWEN3_1_7B, "--generation_batch", "8")  # one micro-batch a step
    assert "FP8 training at hidden size" not in one_step
