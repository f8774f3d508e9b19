"""The rollout-capacity arithmetic (`trl_fp8.rollout.capacity`) and `trl-fp8 plan`: parameter counts against real models, KV
tokens against what vLLM reported in the committed benchmark rows, and the command's output and errors."""

import json
from pathlib import Path

import pytest
import torch

from trl_fp8.cli.main import main as cli
from trl_fp8.plan.memory import trainer_memory_bytes
from trl_fp8.rollout.capacity import (
    GPU_MEMORY_BYTES,
    GiB,
    ModelShape,
    kv_bytes_per_token,
    rollout_capacity,
    weight_bytes,
)

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def tiny_configs():
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=256, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=128)  # fmt: skip
    return {
        "dense": Qwen3Config(intermediate_size=512, **common),
        "tied": Qwen3Config(intermediate_size=512, tie_word_embeddings=True, **common),
        "moe": Qwen3MoeConfig(
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            **common,
        ),  # fmt: skip
    }


@pytest.mark.parametrize("kind", ["dense", "tied", "moe"])
def test_parameter_counts_are_the_models_own(kind):
    from transformers import AutoModelForCausalLM

    config = tiny_configs()[kind]
    model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    kept = ("embed", "lm_head", "norm")
    high_precision = sum(p.numel() for n, p in model.named_parameters()
                         if any(k in n for k in kept) or n.endswith("mlp.gate.weight"))  # fmt: skip
    assert shape.other_params == high_precision  # what FP8 leaves in 16 bits: embeddings, head, norms, routers
    assert weight_bytes(shape, fp8=False) == 2 * shape.params
    assert weight_bytes(shape, fp8=True) < weight_bytes(shape, fp8=False)
    assert kv_bytes_per_token(shape, fp8_kv=False) == 3 * 2 * 1 * 128 * 2 == 2 * kv_bytes_per_token(shape, fp8_kv=True)


def measured_rows():
    """(device, shape, share, max_num_seqs, engine, vLLM's KV tokens) of every committed bench_rollout row."""
    from benchmarks.bench_rollout import SHAPES

    rows = []
    for path in sorted(RESULTS.glob("rollout*_NVIDIA_*.json")):
        data = json.loads(path.read_text())
        for row in data["results"]:
            if not row.get("kv_cache_tokens"):
                continue
            seqs = max([p["seqs"] for p in row["points"]] + [row.get("profile", {}).get("seqs", 0)])
            seqs = row.get("max_num_seqs", seqs)  # recorded in newer rows
            device = next(k for k in GPU_MEMORY_BYTES if k in data["device"])
            # (what the row ran, from its own fields: engines of earlier benchmark versions keep their names there)
            precision, fp8_kv = row["rollout_precision"], row["fp8_kv_cache"]
            shape = ModelShape.from_config({**SHAPES[data["shape"]["name"]], "head_dim": 128})
            total = row.get("gpu_total_bytes", GPU_MEMORY_BYTES[device])  # recorded in newer rows
            rows.append((path.name, total, shape, row.get("gpu_memory_utilization", data["gpu_memory_utilization"]),
                         seqs, precision != "bf16", fp8_kv, row["kv_cache_tokens"]))  # fmt: skip
    return rows


def test_kv_tokens_land_within_3_percent_of_what_vllm_reported():
    rows = measured_rows()
    assert len(rows) >= 8
    for name, total, shape, share, seqs, fp8_weights, fp8_kv, measured in rows:
        estimate = rollout_capacity(shape, total, share, fp8_weights=fp8_weights, fp8_kv=fp8_kv, seq_len=2048,
                                    max_num_seqs=seqs).kv_tokens  # fmt: skip
        assert abs(estimate / measured - 1) < 0.03, (name, share, fp8_weights, fp8_kv, estimate, measured)


def test_fp8_holds_more_sequences_at_matched_memory():
    config = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}  # fmt: skip
    shape = ModelShape.from_config(config)  # the Qwen3-8B shape at TRL's colocate share of an H100
    caps = [rollout_capacity(shape, GPU_MEMORY_BYTES["H100"], 0.3, fp8_weights=w, fp8_kv=k, seq_len=2304,
                             max_num_seqs=256) for w, k in ((False, False), (True, False), (True, True))]  # fmt: skip
    assert [c.sequences for c in caps] == [22, 42, 85]  # vLLM held 22, 42 and 85 in the research measurement
    assert caps[0].waves(256) == 12 and caps[2].waves(256) == 4
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        rollout_capacity(
            shape, GPU_MEMORY_BYTES["H100"], 1.3, fp8_weights=True, fp8_kv=False, seq_len=1, max_num_seqs=1
        )
    memory = trainer_memory_bytes(shape, optim="adamw_bnb_8bit")
    # two 1-byte moments, the input embedding's in float32 (transformers' override): bench_grpo measured 18.95 GiB
    assert memory["optimizer"] == 2 * shape.params + 6 * shape.vocab_size * shape.hidden_size
    assert memory["optimizer"] / GiB == pytest.approx(18.95, rel=0.02)
    assert memory["fp8_weight_cache"] == shape.linear_params
    assert trainer_memory_bytes(shape, optim="adamw_torch")["optimizer"] == 4 * shape.params
    assert trainer_memory_bytes(shape, lora=True)["gradients"] == 0


def test_plan_prints_the_three_flows(tmp_path, capsys):
    path = tmp_path / "tiny"
    tiny_configs()["moe"].save_pretrained(path)
    assert cli(["plan", str(path), "--gpu_memory_gib", "1", "--prompt_len", "16", "--completion_len", "48",
                "--generation_batch", "64", "--vllm_gpu_memory_utilization", "0.9"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    lines = {line.split()[0] + (" KV" if "FP8 KV" in line else ""): line for line in out.splitlines()[2:5]}
    assert set(lines) == {"BF16", "FP8", "FP8 KV"}, out
    tokens = {k: int(v.split()[-5].replace(",", "")) for k, v in lines.items()}  # columns from the right
    assert tokens["FP8 KV"] > tokens["FP8"] > tokens["BF16"] > 0
    assert "vLLM share 0.9" in out
    # the trainer's own KV choice with fp8_kv_cache unset (`choose_fp8_kv_cache`): BF16 where the FP8 row's BF16 cache
    # holds the rollout,
    assert "KV cache with fp8_kv_cache unset: BF16 on Hopper, by the planner's account vLLM's 90% of the GPU" in out
    assert "every sequence fits, so an FP8 cache would add mismatch for little speed" in out
    # FP8 where it does not
    assert cli(["plan", str(path), "--gpu_memory_gib", "1", "--prompt_len", "16", "--completion_len", "48",
                "--generation_batch", "4096", "--vllm_gpu_memory_utilization", "0.9"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    held = int(out.splitlines()[3].split()[-4])
    assert held < 4096
    assert (
        f"KV cache with fp8_kv_cache unset: FP8 on Hopper, by the planner's account vLLM's 90% of the GPU has room "
        f"for {held} of a rollout's 4096 sequences of 64 tokens at once with a BF16 KV cache" in out
    )


def test_plan_with_sleep_mode_checks_the_wake_up_as_measured(tmp_path, capsys):
    """The Qwen3-8B shape on an H100 with 8-bit AdamW and sleep mode: GRPO steps ran at vLLM shares 0.45 (both
    flows, expandable segments); waking a 0.6 share beside 34 GiB of weights and optimizer states cannot fit."""
    path = tmp_path / "qwen3-8b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(
        {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}))  # fmt: skip
    fits = {}
    for share in ("0.45", "0.6"):
        assert cli(["plan", str(path), "--gpu", "H100", "--vllm_gpu_memory_utilization", share, "--sleep_mode",
                    "--optim", "adamw_bnb_8bit", "--prompt_len", "128"]) == 0  # fmt: skip
        out = capsys.readouterr().out
        fits[share] = [line.split()[-1] for line in out.splitlines()[2:5]]
    assert fits == {"0.45": ["yes"] * 3, "0.6": ["no"] * 3}
    assert "expandable_segments:True" in out
    best = out.split("Best fit, the largest vLLM share that fits (steps of 0.05): ")[1].splitlines()[0]
    assert best.startswith("BF16 0.50 (") and "; FP8 0.50 (" in best and "; FP8 + FP8 KV 0.50 (" in best
    # the trainer column beside the training-phase device peaks measured there (BF16 61.3 GiB; FP8 69.5 GiB, its
    # weight cache kept through the micro-batches: `on`). The default cache, held for scoring only, plans BF16's.
    trainer = [float(line.split()[-2].removesuffix("Gi")) for line in out.splitlines()[2:5]]
    assert trainer[0] == pytest.approx(61.3, rel=0.1) and trainer[1] == trainer[0]
    assert cli(["plan", str(path), "--gpu", "H100", "--vllm_gpu_memory_utilization", "0.45", "--sleep_mode",
                "--optim", "adamw_bnb_8bit", "--prompt_len", "128", "--fp8_cache_weights", "on"]) == 0  # fmt: skip
    kept = [float(line.split()[-2].removesuffix("Gi")) for line in capsys.readouterr().out.splitlines()[2:5]]
    assert kept[1] == pytest.approx(69.5, rel=0.1)
    # Awake beside training (no sleep mode), no share both holds a sequence and leaves the 8B trainer room
    assert cli(["plan", str(path), "--gpu", "H100", "--optim", "adamw_bnb_8bit", "--prompt_len", "128"]) == 0
    assert "BF16: none (no share holds one sequence beside the trainer)" in capsys.readouterr().out


def test_plan_errors_name_the_problem(tmp_path, capsys):
    assert cli(["plan", str(tmp_path / "missing"), "--gpu", "H100"]) == 2
    assert f"no model folder at {tmp_path / 'missing'}" in capsys.readouterr().err
    mla = tmp_path / "mla"
    mla.mkdir()
    (mla / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512}))
    assert cli(["plan", str(mla), "--gpu", "H100"]) == 2
    assert "multi-head latent attention" in capsys.readouterr().err
    if not torch.cuda.is_available():
        dense = tmp_path / "dense"
        tiny_configs()["dense"].save_pretrained(dense)
        assert cli(["plan", str(dense)]) == 2
        assert "no GPU here: pass --gpu" in capsys.readouterr().err


QWEN3_8B_CONFIG = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}  # fmt: skip


def test_plan_takes_a_hub_id_from_the_cache_and_fails_at_once_offline_uncached(tmp_path, monkeypatch, capsys):
    """The README's `trl-fp8 plan Qwen/Qwen3-8B ...`: a Hub id is read from the Hugging Face cache first (no request);
    uncached and offline, one line names HF_HUB_OFFLINE and the folder alternative, well within 5 s."""
    import time

    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--Qwen--Qwen3-8B" / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    (cache / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (cache / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert cli(["plan", "Qwen/Qwen3-8B", "--gpu", "H100", "--optim", "adamw_bnb_8bit", "--sleep_mode"]) == 0
    assert capsys.readouterr().out.startswith("Qwen/Qwen3-8B: 8.19B parameters")
    start = time.perf_counter()
    assert cli(["plan", "Qwen/Qwen3-4B", "--gpu", "H100"]) == 2
    assert time.perf_counter() - start < 5
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "not in the Hugging Face cache" in captured.err and "HF_HUB_OFFLINE" in captured.err
    assert "local model folder" in captured.err
    # Not offline, but no Hub to reach (a closed local port): one request, no retries, the same one line.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    start = time.perf_counter()
    assert cli(["plan", "Qwen/Qwen3-4B", "--gpu", "H100"]) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be reached" in err and "set HF_HUB_OFFLINE=1" in err
    assert cli(["plan", "Qwen3-8B", "--gpu", "H100"]) == 2  # neither a folder nor org/name: no Hub request at all
    assert "not a Hub id 'org/name' (e.g. Qwen/Qwen3-8B)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--completion_len", "-5", "-5 is not a positive integer"),
        ("--prompt_len", "-1", "-1 is negative"),
        ("--generation_batch", "0", "0 is not a positive integer"),
        ("--micro_batch", "two", "'two' is not a whole number"),
        ("--vllm_gpu_memory_utilization", "1.5", "1.5 is not a share of GPU memory in (0, 1]"),
        ("--vllm_gpu_memory_utilization", "0", "0.0 is not a share of GPU memory"),
        ("--gpu_memory_gib", "-80", "-80.0 is not a positive number"),
    ],
)
def test_plan_refuses_bad_numbers_before_printing_anything(tmp_path, capsys, option, value, message):
    path = tmp_path / "tiny"
    tiny_configs()["dense"].save_pretrained(path)
    with pytest.raises(SystemExit) as exit_info:
        cli(["plan", str(path), "--gpu", "H100", option, value])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_plan_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        cli(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 0.3)", "(default: 256)", "(default: 2048)", "(default: 128)", "(default: adamw_torch)"):
        assert default in out
    assert "(default: None)" not in out
