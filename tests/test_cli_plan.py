"""`trl-fp8 plan` on models it must not plan as it plans the others: one with no layer that converts to FP8 (its
FP8 rows do not apply), and sequences longer than the model can position (refused in one line, naming the fix)."""

from transformers import GptOssConfig, Qwen2_5_VLConfig

from trl_fp8.cli.main import main as cli
from trl_fp8.demo.tiny_model import tiny_qwen3_config

ROLLOUT = ["--gpu", "H100", "--prompt_len", "16", "--completion_len", "112"]


def saved(config, folder) -> str:
    config.save_pretrained(folder)
    return str(folder)


def plan(capsys, *argv: str) -> str:
    assert cli(["plan", *argv]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def rows(out: str) -> dict[str, str]:
    """The table's three rows, after its column names, by flow."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "vLLM weights" in line) + 1
    return {line[:14].strip(): line[14:] for line in lines[start : start + 3]}


def test_a_model_whose_dims_fit_no_fp8_block_says_no_layer_converts(tmp_path, capsys):
    """Dims of 192 and 320 fit no 128x128 block: every linear layer stays BF16, as the converter decides, so the
    FP8 flows do not apply and the planner says so instead of printing FP8 rows that fit."""
    odd = saved(tiny_qwen3_config(hidden_size=192, intermediate_size=320, head_dim=96), tmp_path / "odd")
    out = plan(capsys, odd, *ROLLOUT)
    assert f"No layer of {odd} converts to FP8" in out and "dims not multiples of 128" in out
    table = rows(out)
    assert table["FP8"].split() == table["FP8 + FP8 KV"].split() == ["not", "applicable:", "no", "FP8", "layer"]
    assert table["BF16"].split()[-1] == "yes"
    assert "BF16 0.95" in out and "; FP8" not in out  # the best fit: BF16 alone
    assert "fp8_kv_cache unset" not in out and "FP8 training at hidden size" not in out  # the FP8 flows' own notes
    several = plan(capsys, odd, *ROLLOUT, "--num_processes", "2")
    assert "No layer of" in several and "FP8 + FP8 KV (" not in several and "DDP fits BF16" in several


def test_a_model_the_converter_refuses_says_why_no_layer_converts(tmp_path, capsys):
    """GPT-OSS's experts (transposed, with biases) are a layout trl-fp8 refuses to run in FP8 by default: the
    planner names the refusal, and plans BF16 alone."""
    config = GptOssConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_local_experts=4,
                          num_experts_per_tok=2)  # fmt: skip
    out = plan(capsys, saved(config, tmp_path / "gpt_oss"), *ROLLOUT)
    assert "converts to FP8 with trl-fp8's defaults: model.layers.0.mlp.experts: GptOssExperts holds" in out
    assert "keep_experts_in_bf16=True" in out
    assert "not applicable: no FP8 layer" in rows(out)["FP8"]


def test_a_model_that_converts_plans_its_fp8_rows(tmp_path, capsys):
    out = plan(capsys, saved(tiny_qwen3_config(), tmp_path / "tiny"), *ROLLOUT)
    assert "converts to FP8" not in out and "not applicable" not in out
    assert all(row.split()[-1] == "yes" for row in rows(out).values())


def test_sequences_longer_than_the_model_positions_are_refused_in_one_line(tmp_path, capsys):
    """The tiny model positions 512 tokens: 16 + 512 is refused, naming both numbers and the fix."""
    tiny = saved(tiny_qwen3_config(), tmp_path / "tiny")
    assert cli(["plan", tiny, "--gpu", "H100", "--prompt_len", "16", "--completion_len", "512"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "Traceback" not in captured.err
    err = captured.err
    assert err.startswith("error: --prompt_len 16 + --completion_len 512 = 528 tokens") and "512" in err
    assert "max_position_embeddings" in err and "--completion_len 496 or less" in err
    assert cli(["plan", tiny, "--gpu", "H100", "--prompt_len", "16", "--completion_len", "496"]) == 0


def test_rope_scaling_stretches_the_positions_as_vllm_counts_them(tmp_path, capsys):
    """YaRN over 256 original positions with factor 4 positions 1,024 tokens (vLLM's max_model_len), whatever
    max_position_embeddings says; past them the error names the stretched length."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    yarn = saved(tiny_qwen3_config(max_position_embeddings=256, rope_parameters=rope), tmp_path / "yarn")
    plan(capsys, yarn, "--gpu", "H100", "--prompt_len", "24", "--completion_len", "1000")
    assert cli(["plan", yarn, "--gpu", "H100", "--prompt_len", "25", "--completion_len", "1000"]) == 2
    err = capsys.readouterr().err
    assert "1,024 positions" in err and "(YaRN's original_max_position_embeddings 256 x RoPE scaling factor 4)" in err


def test_a_multimodal_model_is_positioned_by_its_text_config(tmp_path, capsys):
    text = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    vl = saved(Qwen2_5_VLConfig(text_config=text), tmp_path / "vl")
    assert cli(["plan", vl, "--gpu", "H100", "--prompt_len", "16", "--completion_len", "600"]) == 2
    err = capsys.readouterr().err
    assert "past the 512 positions" in err and "(text_config's max_position_embeddings)" in err
