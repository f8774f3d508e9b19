"""`trl-fp8 plan --num_processes N --launch ddp|fsdp2`: one GPU of several, each with a training process and a
colocated vLLM engine. The expected bytes are worked out here from the Qwen3-8B shape's parameter counts, not taken
from a run of the planner."""

import json

import pytest

from trl_fp8.cli.main import main as cli
from trl_fp8.plan.memory import NCCL_BUFFER_BYTES, fsdp2_gathered_params, trainer_memory_bytes, trainer_memory_per_gpu
from trl_fp8.rollout.capacity import GiB, ModelShape

QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False}  # fmt: skip
PRINT_STEP = 0.1 * GiB  # the table prints GiB with one decimal: two rounded figures differ by at most this much


def counts(c=QWEN3_8B) -> dict[str, int]:
    """Parameters of the shape, counted from its config: a decoder layer (attention, MLP, 4 norms), the linear
    layers of all of them, the whole model (untied embedding and lm_head, final norm)."""
    h, hd = c["hidden_size"], c["head_dim"]
    attention = h * hd * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    mlp = 3 * h * c["intermediate_size"]
    layer = attention + mlp + 2 * h + 2 * hd
    embedding = c["vocab_size"] * h
    return {"layer": layer, "linear": c["num_hidden_layers"] * (attention + mlp), "embedding": embedding,
            "params": c["num_hidden_layers"] * layer + 2 * embedding + h}  # fmt: skip


@pytest.fixture
def qwen3_8b(tmp_path):
    path = tmp_path / "qwen3-8b"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN3_8B))
    return str(path)


def plan(capsys, *argv: str) -> str:
    assert cli(["plan", *argv]) == 0
    return capsys.readouterr().out


def table(out: str) -> dict[str, tuple[float, float, str]]:
    """Flow -> (trainer GiB, peak GiB, fits) of a several-GPU table, read from the right."""
    rows = {}
    for line in out.splitlines()[2:5]:
        columns = line[14:].split()
        rows[line[:14].strip()] = (float(columns[-3][:-2]), float(columns[-2][:-2]), columns[-1])
    assert set(rows) == {"BF16", "FP8", "FP8 + FP8 KV"}, out
    return rows


def test_ddp_peaks_above_fsdp2_by_what_fsdp2_shards(qwen3_8b, capsys):
    """At N=4 with AdamW: DDP holds BF16 weights (2 bytes a parameter), DDP's gradient buckets (2), AdamW's BF16
    moments (4) and, in the FP8 rows, the FP8 weight cache (1 byte a linear parameter); FSDP2 a quarter of the
    float32 masters (4), gradients (4) and float32 moments (8), plus two gathered units in BF16. Activations,
    logits, NCCL buffers and vLLM's share are the same under both. FSDP2 with accelerate's sync_each_batch: its
    gradients stay sharded between micro-batches (the next test has them whole). The FP8 cache is kept through the
    micro-batches here (`--fp8_cache_weights on`), so it is in DDP's peak."""
    n = counts()
    p, gathered = n["params"], 2 * (n["layer"] + max(n["layer"], n["embedding"] + QWEN3_8B["hidden_size"]))
    fsdp2 = (4 + 4 + 8) * p / 4 + gathered
    expected = {"FP8": (2 + 2 + 4) * p + n["linear"] - fsdp2}
    expected["FP8 + FP8 KV"] = expected["FP8"]
    expected["BF16"] = (2 + 2 + 2 + 4) * p - fsdp2  # its own gradients beside the buckets, no FP8 cache
    common = [qwen3_8b, "--gpu", "H200", "--num_processes", "4", "--optim", "adamw_torch", "--fp8_cache_weights", "on"]
    ddp = table(plan(capsys, *common, "--launch", "ddp"))
    sharded = table(plan(capsys, *common, "--launch", "fsdp2", "--sync_each_batch"))
    assert n["params"] == ModelShape.from_config(QWEN3_8B).params
    for flow, difference in expected.items():
        assert difference > 30 * GiB  # tens of GiB a GPU: what sharding is for
        assert (ddp[flow][1] - sharded[flow][1]) * GiB == pytest.approx(difference, abs=PRINT_STEP)


def test_fsdp2_keeps_the_whole_models_bf16_gradients_between_micro_batches_unless_each_one_syncs(qwen3_8b, capsys):
    """transformers' Trainer runs every micro-batch of a step but the last under accelerate's no_sync, which FSDP2
    carries out by keeping each gradient unsharded in BF16 (2 bytes a parameter of the whole model, on every GPU);
    accelerate's sync_each_batch, or one micro-batch a step, reduce-scatters at once. The planner says so and what
    sync_each_batch would fit."""
    n = counts()
    common = [qwen3_8b, "--gpu", "H100", "--num_processes", "4", "--launch", "fsdp2", "--optim", "adamw_torch_fused",
              "--micro_batch", "4", "--sleep_mode"]  # fmt: skip
    kept_out = plan(capsys, *common)  # 128 / 4: 32 micro-batches a step
    kept, synced = table(kept_out), table(plan(capsys, *common, "--sync_each_batch"))
    assert table(plan(capsys, *common, "--gradient_accumulation_steps", "1")) == synced
    assert table(plan(capsys, *common, "--gradient_accumulation_steps", "2")) == kept
    for flow in kept:
        assert (kept[flow][0] - synced[flow][0]) * GiB == pytest.approx(2 * n["params"], abs=PRINT_STEP)
    line = next(line for line in kept_out.splitlines() if line.startswith("FSDP2 with 32 micro-batches a step"))
    assert f"unsharded in BF16 ({2 * n['params'] / GiB:.1f} GiB)" in line and "'sync_each_batch': True" in line
    assert f"peak per GPU {' / '.join(f'{row[1]:.1f}' for row in synced.values())} GiB" in line


def test_fsdp2_training_memory_per_gpu_falls_with_the_gpus(qwen3_8b, capsys):
    """Each doubling of N halves the shards: float32 masters, gradients and AdamW's float32 moments (4 + 4 + 8 bytes
    a parameter); the rest of a GPU's training memory stays."""
    n = counts()
    sharded = (4 + 4 + 8) * n["params"]
    trainer = {}
    for gpus in (2, 4, 8):
        out = plan(capsys, qwen3_8b, "--gpu", "H100", "--num_processes", str(gpus), "--launch", "fsdp2",
                   "--optim", "adamw_torch_fused")  # fmt: skip
        assert f"{gpus} processes, FSDP2: {gpus} GPUs of 79.2 GiB" in out.splitlines()[0]
        trainer[gpus] = {flow: row[0] for flow, row in table(out).items()}
    for flow in trainer[2]:
        assert trainer[2][flow] > trainer[4][flow] > trainer[8][flow]
        assert (trainer[2][flow] - trainer[4][flow]) * GiB == pytest.approx(sharded / 4, abs=PRINT_STEP)
        assert (trainer[4][flow] - trainer[8][flow]) * GiB == pytest.approx(sharded / 8, abs=PRINT_STEP)
    # no FP8 weight cache and no DDP buckets: TRL's BF16 trainer and trl-fp8's FP8 one hold the same per GPU
    assert len({trainer[8][flow] for flow in trainer[8]}) == 1


def test_fsdp2_prefetch_layers_holds_more_gathered_layers_in_the_fp8_rows(qwen3_8b, capsys):
    """`--fsdp2_prefetch_layers 3` (trl-fp8's fsdp2_prefetch_layers): each FP8 rank holds two more decoder layers
    gathered in BF16 than with FSDP2's own one-ahead prefetch; TRL's BF16 row keeps FSDP2's own."""
    layer = counts()["layer"]
    common = [qwen3_8b, "--gpu", "H100", "--num_processes", "4", "--launch", "fsdp2", "--optim", "adamw_torch_fused"]
    own, ahead = (table(plan(capsys, *common, *extra)) for extra in ((), ("--fsdp2_prefetch_layers", "3")))
    for flow in own:
        grown = (ahead[flow][0] - own[flow][0]) * GiB
        assert grown == pytest.approx(0 if flow == "BF16" else 2 * 2 * layer, abs=PRINT_STEP)


def test_the_bf16_ddp_row_counts_the_bucket_copy_and_the_fp8_rows_do_not(qwen3_8b, capsys):
    n = counts()
    shape = ModelShape.from_config(QWEN3_8B)
    # TRL's BF16 GRPOTrainer: gradients beside DDP's buckets. trl-fp8: gradients are views of the buckets.
    bf16 = trainer_memory_per_gpu(shape, num_processes=2, launch="ddp", grads_in_ddp_buckets=False, fp8_training=False)
    fp8 = trainer_memory_per_gpu(shape, num_processes=2, launch="ddp", grads_in_ddp_buckets=True, fp8_training=True)
    assert bf16["gradients"] == bf16["ddp_buckets"] == fp8["ddp_buckets"] == 2 * n["params"]
    assert fp8["gradients"] == 0 and fp8["fp8_weight_cache"] == n["linear"]
    assert bf16["nccl_buffers"] == fp8["nccl_buffers"] == NCCL_BUFFER_BYTES
    one_gpu = trainer_memory_bytes(shape, fp8_training=True)
    assert sum(fp8.values()) == sum(one_gpu.values()) + NCCL_BUFFER_BYTES  # the buckets hold the same gradients
    # The printed table: on one GPU BF16 is the FP8 row less its weight cache; with DDP the bucket copy comes on top.
    trainer = {}
    for gpus in ("1", "2"):
        rows = plan(capsys, qwen3_8b, "--gpu", "H100", "--num_processes", gpus, "--fp8_cache_weights", "on")
        rows = rows.splitlines()[2:5]
        trainer[gpus] = {line[:14].strip(): float(line.split()[-2 if gpus == "1" else -3][:-2]) for line in rows}
    assert (trainer["1"]["BF16"] - trainer["1"]["FP8"]) * GiB == pytest.approx(-n["linear"], abs=PRINT_STEP)
    assert (trainer["2"]["BF16"] - trainer["2"]["FP8"]) * GiB == pytest.approx(2 * n["params"] - n["linear"],
                                                                               abs=PRINT_STEP)  # fmt: skip
    assert trainer["2"]["FP8"] == trainer["2"]["FP8 + FP8 KV"]


def test_the_output_names_the_launch_and_says_which_fits(qwen3_8b, capsys):
    """The 8B shape with 8-bit AdamW and sleep mode on four H100s: DDP's BF16 row cannot fit (its own gradients
    beside the buckets), FSDP2's rows all do (with fused AdamW, as bitsandbytes' optimizers do not take its shards);
    on two, FSDP2's float32 masters and moments (16 bytes a parameter, halved) do not fit and DDP is kept."""
    common = [qwen3_8b, "--gpu", "H100", "--num_processes", "4", "--optim", "adamw_bnb_8bit", "--sleep_mode"]
    out = plan(capsys, *common)  # DDP by default
    assert "4 processes, DDP: 4 GPUs of 79.2 GiB" in out.splitlines()[0]
    assert table(out)["BF16"][2] == "no" and table(out)["FP8"][2] == "yes"
    advice = out.splitlines()[-1]
    assert advice.startswith("DDP vs FSDP2 at 8.2B on 4 GPUs: DDP fits FP8 and FP8 + FP8 KV (")
    assert ", FSDP2 every flow (" in advice and advice.endswith(": use --launch fsdp2.")
    assert "NCCL buffers (assumed)" in out and "ddp_gradient_as_bucket_view" in out
    fsdp2 = [qwen3_8b, "--gpu", "H100", "--num_processes", "4", "--optim", "adamw_torch_fused", "--sleep_mode"]
    out = plan(capsys, *fsdp2, "--launch", "fsdp2")
    assert "4 processes, FSDP2" in out.splitlines()[0] and [row[2] for row in table(out).values()] == ["yes"] * 3
    assert out.splitlines()[-1].endswith(": keep --launch fsdp2.") and "float32 master weights" in out
    out = plan(capsys, *common[:4], "2", *common[5:])
    assert "FSDP2 no flow" in out.splitlines()[-1] and out.splitlines()[-1].endswith(": keep --launch ddp.")


def test_one_process_prints_what_it_printed_before(qwen3_8b, capsys):
    for extra in ([], ["--sleep_mode", "--optim", "adamw_bnb_8bit"], ["--lora", "--vllm_gpu_memory_utilization", "0.5"]):  # fmt: skip
        before = plan(capsys, qwen3_8b, "--gpu", "H100", *extra)
        assert plan(capsys, qwen3_8b, "--gpu", "H100", *extra, "--num_processes", "1") == before
        assert plan(capsys, qwen3_8b, "--gpu", "H100", *extra, "--num_processes", "1", "--launch", "fsdp2") == before
        assert "DDP" not in before and "peak" not in before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_processes", "0"], "argument --num_processes: 0 is not a positive integer"),
        (["--num_processes", "-2"], "argument --num_processes: -2 is not a positive integer"),
        (["--num_processes", "two"], "argument --num_processes: 'two' is not a whole number"),
        (["--launch", "zero3"], "argument --launch: invalid choice: 'zero3'"),
    ],
)
def test_bad_values_fail_in_argparse_before_anything_prints(qwen3_8b, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli(["plan", qwen3_8b, "--gpu", "H100", *argv])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err


def test_lora_under_fsdp2_is_refused_as_trl_fp8_refuses_it(qwen3_8b, capsys):
    assert cli(["plan", qwen3_8b, "--gpu", "H100", "--num_processes", "2", "--launch", "fsdp2", "--lora"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--lora with --launch fsdp2" in captured.err and "--launch ddp" in captured.err
    out = plan(capsys, qwen3_8b, "--gpu", "H100", "--num_processes", "2", "--lora")
    assert "FSDP2 is no option with --lora" in out.splitlines()[-1]


def test_bitsandbytes_optimizers_under_fsdp2_are_refused_and_compared_with_fused_adamw(qwen3_8b, capsys):
    """trl-fp8 refuses bitsandbytes' optimizers under FSDP2 (their update ops do not take DTensor shards), naming
    adamw_torch_fused: --launch fsdp2 with one is an error, and DDP's comparison plans FSDP2 with adamw_torch_fused."""
    common = [qwen3_8b, "--gpu", "H100", "--num_processes", "2"]
    assert cli(["plan", *common, "--launch", "fsdp2", "--optim", "adamw_bnb_8bit"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--optim adamw_torch_fused" in captured.err
    compared = plan(capsys, *common, "--launch", "ddp", "--optim", "adamw_bnb_8bit").splitlines()
    fused = plan(capsys, *common, "--launch", "fsdp2", "--optim", "adamw_torch_fused").splitlines()
    footnote = next(line for line in compared if line.startswith("Per GPU"))
    advice = next(line for line in compared if line.startswith("DDP vs FSDP2"))
    assert "FSDP2 comparison below with --optim adamw_torch_fused" in footnote
    fsdp2_peaks = advice.rsplit("FSDP2 ", 1)[1].split("(")[1].split(" GiB")[0]  # "a / b / c"
    assert fsdp2_peaks == " / ".join(f"{peak:.1f}" for _, peak, _ in table("\n".join(fused)).values())


def test_help_shows_the_new_defaults(capsys):
    with pytest.raises(SystemExit):
        cli(["plan", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--num_processes NUM_PROCESSES" in out and "(default: 1)" in out
    assert "{ddp,fsdp2}" in out and "(default: ddp)" in out and "fsdp2.yaml" in out


@pytest.mark.parametrize("kind", ["dense", "tied", "moe"])
def test_the_largest_layer_and_what_fsdp2_gathers_are_the_models_own(kind):
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=256, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=128, intermediate_size=512)  # fmt: skip
    config = {
        "dense": Qwen3Config(**common),
        "tied": Qwen3Config(tie_word_embeddings=True, **common),
        "moe": Qwen3MoeConfig(
            moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], **common
        ),
    }[kind]
    model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert shape.largest_layer_params == max(layers) and shape.tied_embeddings == (kind == "tied")
    tail = sum(p.numel() for p in model.lm_head.parameters()) + sum(p.numel() for p in model.model.norm.parameters())
    if kind == "tied":  # one unit with the input embedding, gathered through forward and backward
        assert fsdp2_gathered_params(shape) == tail + 2 * max(layers)
        assert fsdp2_gathered_params(shape, prefetch_layers=2) == tail + 3 * max(layers)
    else:
        assert fsdp2_gathered_params(shape) == max(layers) + max(max(layers), tail)
        # fsdp2_prefetch_layers=2: one more layer in flight
        assert fsdp2_gathered_params(shape, prefetch_layers=2) == 2 * max(layers) + max(max(layers), tail)


def test_the_fp8_rows_plan_the_weight_cache_as_the_trainer_chooses_it(qwen3_8b, capsys):
    """`--fp8_cache_weights auto` (the default) plans the cache as FP8GRPOTrainer holds it: while scoring, not in the
    micro-batches. On one GPU the gradients are freed between steps, so scoring with it is the lighter phase and the
    FP8 rows' trainer holds what BF16's does; `on` adds the cache to the micro-batches, `off` never has it. Under DDP
    with tiny micro-batches on a small GPU, scoring with the cache would pass 90% of it: auto drops it, and says so."""
    common = ("--optim", "adamw_bnb_8bit", "--sleep_mode", "--completion_len", "2048")

    def trainer(*argv):
        out = plan(capsys, qwen3_8b, *common, *argv)
        rows = {line[:14].strip(): float(line.split()[-2 if "--num_processes" not in argv else -3][:-2])
                for line in out.splitlines()[2:5]}  # fmt: skip
        return rows, "without the FP8 weight cache" in out

    cache = counts()["linear"]
    for micro_batch in ("8", "16"):
        rows, said = trainer("--gpu", "H100", "--micro_batch", micro_batch)
        assert not said and rows["FP8"] == rows["FP8 + FP8 KV"] == rows["BF16"]
        rows_on, said_on = trainer("--gpu", "H100", "--micro_batch", micro_batch, "--fp8_cache_weights", "on")
        assert not said_on and (rows_on["FP8"] - rows["FP8"]) * GiB == pytest.approx(cache, abs=PRINT_STEP)
        rows_off, _ = trainer("--gpu", "H100", "--micro_batch", micro_batch, "--fp8_cache_weights", "off")
        assert rows_off["FP8"] == rows_off["BF16"]
    small = ("--gpu_memory_gib", "48", "--num_processes", "2", "--micro_batch", "1")
    rows, said = trainer(*small)
    rows_off, said_off = trainer(*small, "--fp8_cache_weights", "off")
    assert said and not said_off and rows["FP8"] == rows_off["FP8"]


def test_a_flow_whose_engine_holds_no_sequence_does_not_fit(tmp_path, capsys):
    """The Qwen3-14B shape's BF16 weights (2 bytes x 14.8B = 27.5 GiB) exceed vLLM's 0.3 of an H100 (23.8 GiB): vLLM
    would refuse to start the BF16 engine, so that row cannot fit, whatever the trainer needs; the FP8 weights (1 byte
    each) leave room for sequences. At 0.4 the BF16 engine starts too. (With gradients reduce-scattered at every
    micro-batch: kept whole between them, the 14B trainer fits no flow on 4 GPUs.)"""
    config = {**QWEN3_8B, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
              "num_attention_heads": 40}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    common = [str(tmp_path), "--gpu", "H100", "--num_processes", "4", "--launch", "fsdp2", "--sleep_mode",
              "--optim", "adamw_torch_fused", "--micro_batch", "4", "--sync_each_batch"]  # fmt: skip
    assert 2 * counts(config)["params"] > 0.3 * 79.2 * GiB  # BF16 weights alone exceed the share
    out = plan(capsys, *common)
    rows = table(out)
    assert rows["BF16"][2] == "no" and rows["FP8"][2] == rows["FP8 + FP8 KV"][2] == "yes"
    assert "BF16: vLLM's share (23.8 GiB) holds no whole sequence of 2,304 tokens" in out
    assert "FSDP2 FP8 and FP8 + FP8 KV (" in out.splitlines()[-1]
    out = plan(capsys, *common, "--vllm_gpu_memory_utilization", "0.4")
    assert [row[2] for row in table(out).values()] == ["yes"] * 3 and "holds no whole sequence" not in out
    assert [row[2] for row in table(plan(capsys, *common[:-1])).values()] == ["no"] * 3


def test_a_tensor_parallel_engine_holds_its_part_of_the_weights_and_heads_on_each_gpu(qwen3_8b, capsys):
    """`--vllm_tensor_parallel_size 2`: each GPU of an engine holds half of the linear layers, of the embedding and
    lm_head (vocabulary-parallel) and of the key/value heads, the norms whole; the engine decodes its two ranks'
    sequences. The trainer's memory per GPU does not change."""
    c = counts()
    norms = c["params"] - c["linear"] - 2 * c["embedding"]
    common = [qwen3_8b, "--gpu", "H100", "--num_processes", "2", "--micro_batch", "4", "--sleep_mode"]
    one, two = (plan(capsys, *common, "--vllm_tensor_parallel_size", tp) for tp in ("1", "2"))
    expected = {"BF16": c["linear"] + 2 * c["embedding"] + 2 * norms,  # 2 bytes a weight, halved: linear, vocab
                "FP8": c["linear"] / 2 + 4 * c["linear"] / 128**2 / 2 + 2 * c["embedding"] + 2 * norms}  # fmt: skip
    for line in two.splitlines()[2:4]:
        name, weights, per_token = line[:14].strip(), float(line[14:].split()[0][:-2]), line[14:].split()[1]
        assert abs(weights - expected[name] / GiB) <= PRINT_STEP, line
        assert per_token == f"{36 * 2 * (8 // 2) * 128 * 2:,}"  # 4 of the 8 key/value heads on each GPU
    assert "256 sequences of 256 + 2048 tokens per engine" in two.splitlines()[0]
    assert "Tensor parallel: 1 engine(s) of 2 GPUs" in two and "Tensor parallel" not in one
    for (name, a), b in zip(table(one).items(), table(two).values(), strict=True):
        assert a[0] == b[0], name  # the trainer's part of one GPU
    # more KV tokens per engine than one GPU's engine holds: half the weights and half of each token's bytes per GPU
    kv = {tp: [int(line[14:].split()[2].replace(",", "")) for line in out.splitlines()[2:5]]
          for tp, out in ((1, one), (2, two))}  # fmt: skip
    assert all(b > 2 * a for a, b in zip(kv[1], kv[2], strict=True))


def test_tensor_parallel_past_the_key_value_heads_replicates_them(qwen3_8b, capsys):
    """16 GPUs per engine over 8 key/value heads: vLLM keeps one whole head on each GPU."""
    out = plan(capsys, qwen3_8b, "--gpu", "H100", "--num_processes", "16", "--vllm_tensor_parallel_size", "16")
    assert out.splitlines()[2][14:].split()[1] == f"{36 * 2 * 1 * 128 * 2:,}"


def test_tensor_parallel_sizes_trl_fp8_or_trl_refuse_are_refused_by_the_planner(tmp_path, qwen3_8b, capsys):
    """A split whose FP8 partitions hold no whole 128x128 blocks (down_proj's 384 inputs over 2 GPUs: 192) is refused
    with the sizes that work, as the trainer refuses it before the engine starts; so is a process count that TRL
    cannot group into engines."""
    config = {**QWEN3_8B, "hidden_size": 768, "intermediate_size": 384, "num_hidden_layers": 2,
              "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 1024}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert (
        cli(["plan", str(tmp_path), "--gpu", "H100", "--num_processes", "2", "--vllm_tensor_parallel_size", "2"]) == 2
    )
    err = capsys.readouterr()
    assert err.out == "" and "down_proj (inputs 384) into parts of 192" in err.err and "in [1, 3]" in err.err
    assert cli(["plan", qwen3_8b, "--gpu", "H100", "--num_processes", "3", "--vllm_tensor_parallel_size", "2"]) == 2
    assert "needs --num_processes to be a multiple of it" in capsys.readouterr().err


def test_a_moe_model_that_fits_no_gpu_count_planned_says_how_many_would(tmp_path, capsys):
    """Qwen3-30B-A3B under FSDP2 on 4 H100s: its float32 masters, gradients and AdamW states alone (16 bytes a
    parameter, a quarter per GPU: 114 GiB) exceed a GPU, whatever the engine. Split over the 4 GPUs, the engine's
    experts (768 intermediate, 192 per GPU) take vLLM's expert parallelism; the planner names 8 GPUs for FSDP2 with
    the gradients reduce-scattered at every micro-batch (64 with them kept whole between micro-batches, 57 GiB on
    every GPU), and without the split no engine holds a sequence at 0.3, on any number of GPUs."""
    config = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
              "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    common = [str(tmp_path), "--gpu", "H100", "--num_processes", "4", "--launch", "fsdp2", "--sleep_mode",
              "--optim", "adamw_torch_fused", "--micro_batch", "4", "--completion_len", "1024"]  # fmt: skip
    split = plan(capsys, *common, "--vllm_tensor_parallel_size", "4")
    assert [row[2] for row in table(split).values()] == ["no"] * 3
    assert all(row[0] > 79.2 for row in table(split).values())  # the trainer alone
    assert "vLLM's expert parallelism gives each GPU whole experts" in split
    assert split.splitlines()[-1].endswith(
        "BF16 from 64 GPUs (8 with sync_each_batch), FP8 from 64 GPUs (8 with sync_each_batch), FP8 + FP8 KV from 64 "
        "GPUs (8 with sync_each_batch)."
    )
    synced = plan(capsys, *common, "--vllm_tensor_parallel_size", "4", "--sync_each_batch")
    assert synced.splitlines()[-1].endswith("BF16 from 8 GPUs, FP8 from 8 GPUs, FP8 + FP8 KV from 8 GPUs.")
    whole = plan(capsys, *common)
    assert "FP8 + FP8 KV on none (its engine holds no sequence" in whole.splitlines()[-1]
