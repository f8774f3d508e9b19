"""`memory_breakdown`: each kind of training memory counted once, from the tensors themselves (gradients that are
views of DDP's buckets count as buckets)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from trl_fp8 import FP8LinearConfig, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_qwen3
from trl_fp8.nn.linear import FP8Linear
from trl_fp8.trainer.memory import memory_breakdown

from conftest import free_port


def n_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_live_gradients_optimizer_states_and_the_fp8_cache_once_made():
    """Parameters; gradients only where they are live; optimizer state tensors (AdamW: two per parameter, plus its
    step counter); an FP8 weight cache once a forward made it."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    FP8Linear.convert_(model[0], FP8LinearConfig(backend="emulated"))
    optimizer = torch.optim.AdamW(model.parameters())
    weight = 256 * 128 * 4
    expected = {"parameters": weight, "gradients": 0, "ddp_buckets": 0, "optimizer_states": 0, "fp8_weight_cache": 0}
    assert memory_breakdown(model, optimizer) == expected
    model(torch.randn(4, 256)).square().sum().backward()
    optimizer.step()
    out = memory_breakdown(model, optimizer)
    assert out["gradients"] == weight and out["fp8_weight_cache"] > 0
    assert weight * 2 <= out["optimizer_states"] <= weight * 2 + 64  # exp_avg, exp_avg_sq and a step counter
    optimizer.zero_grad()  # set to None: nothing live
    assert memory_breakdown(model, optimizer)["gradients"] == 0


@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_buckets_and_the_gradients_that_are_their_views(bucket_view, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    ddp = None
    try:
        model = tiny_qwen3(vocab_size=128)
        convert_to_fp8(model)
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        ids = torch.randint(0, 128, (2, 16))
        ddp(ids, labels=ids).loss.backward()
        out = memory_breakdown(model, None, ddp)
        grads = n_bytes(p.grad for p in model.parameters())
        assert out["ddp_buckets"] == grads  # one bucket slot per gradient
        assert out["gradients"] == (0 if bucket_view else grads)
        assert out["parameters"] == n_bytes(model.parameters())
    finally:
        # DDP's reducer holds the process group: let it go first. Freed after destroy_process_group, the reducer
        # dropped the group's last reference and gloo's destructor joined its threads holding the GIL: a CI run hung
        # there for good.
        del ddp
        dist.destroy_process_group()


def qwen3_8b_config() -> dict:
    from benchmarks.bench_rollout import SHAPES

    return dict(SHAPES["8b"], head_dim=128, tie_word_embeddings=False, model_type="qwen3")


def run_args(tmp_path, world_size=1, optim="adamw_bnb_8bit", **kw):
    """An FP8GRPOConfig's fields as the trainer reads them, at TRL's colocate defaults for an 8B model on an 80 GB GPU
    (128 x 2048 per GPU, sleep mode, 8-bit AdamW), with `world_size` processes."""
    from types import SimpleNamespace

    from trl_fp8 import FP8GRPOConfig

    kw = {"per_device_train_batch_size": 8, **kw}
    config = FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, generation_batch_size=128,
                           max_completion_length=2048, num_generations=8, gradient_checkpointing=True,
                           **kw)  # fmt: skip
    fields = {name: getattr(config, name) for name in dir(config) if not name.startswith("_")}
    # (set here: this machine may have neither vLLM nor bitsandbytes, which the config checks for)
    vllm = {
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_enable_sleep_mode": True,
        "vllm_gpu_memory_utilization": 0.3,
    }
    return SimpleNamespace(
        **{**fields, **vllm, "optim": optim, "world_size": world_size, "generation_batch_size": 128 * world_size}
    )


H100_BYTES = 85_017_493_504


def planner_phases(args) -> tuple[float, float]:
    """`(micro-batches, scoring)`: the bytes one GPU holds in the planner's account (vLLM asleep) while training on
    micro-batches without the FP8 weight cache, and while scoring rollouts with it (no gradients, no activations)."""
    from trl_fp8.plan.memory import trainer_memory_per_gpu
    from trl_fp8.rollout.capacity import ModelShape, vllm_overhead_bytes

    shape = ModelShape.from_config(qwen3_8b_config())
    parts = trainer_memory_per_gpu(shape, num_processes=args.world_size, optim=args.optim, fp8_weight_cache=True,
                                   micro_batch=args.per_device_train_batch_size, seq_len=2048)  # fmt: skip
    asleep = vllm_overhead_bytes(shape, 128)
    micro_batches = sum(v for k, v in parts.items() if k != "fp8_weight_cache") + asleep
    scoring = sum(v for k, v in parts.items() if k not in ("gradients", "activations")) + asleep
    return micro_batches, scoring


@pytest.mark.parametrize("world_size,micro_batch,total_bytes,expected", [
    (1, 8, H100_BYTES, True), (2, 16, H100_BYTES, True),  # 80 GB GPUs: scoring with the cache fits
    (1, 1, 48 * 2**30, True),  # one process: the gradients freed between steps leave scoring the room
    (2, 1, 48 * 2**30, False),  # DDP's buckets stay, tiny micro-batches: scoring with the cache would set the peak
])  # fmt: skip
def test_weight_cache_is_dropped_where_the_planner_says_scoring_with_it_would_crowd_the_gpu(
    tmp_path, world_size, micro_batch, total_bytes, expected
):
    """At the 8B shape (2048-token completions, sleep mode, 8-bit AdamW) the default cache is held while the rollouts
    are scored and let go in the micro-batches: it is kept where scoring with it stays under 90% of the GPU or under
    the micro-batches' own peak, so that it never raises a crowded GPU's peak. Micro-batches of 16, which put the
    cache above 90% of an 80 GB GPU when it stayed through them, keep it now: their peak holds none of it."""
    from trl_fp8.plan.choices import choose_fp8_weight_cache
    from trl_fp8.plan.memory import FP8_CACHE_HEADROOM

    args = run_args(tmp_path, world_size, per_device_train_batch_size=micro_batch)
    choice = choose_fp8_weight_cache(qwen3_8b_config(), args, total_bytes=total_bytes)
    assert choice.automatic and choice.value.cache is expected, choice.reason
    micro_batches, scoring = planner_phases(args)
    assert (scoring <= max(FP8_CACHE_HEADROOM * total_bytes, micro_batches)) is expected
    assert "held while scoring the rollouts and let go in the micro-batches" in choice.reason
    assert "fp8_cache_weights=True" in choice.reason
    if world_size == 1:  # gradients are freed between steps: scoring with the cache is the lighter phase
        assert scoring < micro_batches


def test_weight_cache_set_by_the_user_or_off_under_fsdp2_or_on_without_a_gpu(tmp_path, monkeypatch):
    from trl_fp8.plan.choices import choose_fp8_weight_cache

    ddp = run_args(tmp_path, 2, fp8_cache_weights=True)
    choice = choose_fp8_weight_cache(qwen3_8b_config(), ddp, total_bytes=H100_BYTES)
    assert (choice.value.cache, choice.automatic) == (True, False)
    assert (
        choose_fp8_weight_cache(qwen3_8b_config(), run_args(tmp_path)).reason
        == "training on cpu, no GPU memory to keep"
    )
    # a model the planner cannot size keeps the cache, and says why
    mla = {**qwen3_8b_config(), "kv_lora_rank": 512}
    assert "cannot size" in choose_fp8_weight_cache(mla, run_args(tmp_path), total_bytes=H100_BYTES).reason
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert not choose_fp8_weight_cache(qwen3_8b_config(), run_args(tmp_path, 2), total_bytes=H100_BYTES).value.cache


def engine_args(tmp_path, world_size=1, **fields):
    """`run_args` with the FP8 rollouts its vLLM settings imply, and `fields` set as the trainer would read them."""
    return SimpleNamespace(**{**vars(run_args(tmp_path, world_size)), "rollout_precision": "fp8", **fields})


def test_fp8_kv_cache_where_a_bf16_cache_would_not_hold_the_rollout(tmp_path):
    """`fp8_kv_cache=None`: FP8 where the planner puts a rollout's sequences beyond what a BF16 KV cache holds at once
    (TRL's colocate defaults at 8B: 128 sequences of 2,048 tokens at 0.3 of an 80 GB GPU), BF16 where they fit."""
    from trl_fp8.plan.choices import choose_fp8_kv_cache
    from trl_fp8.rollout.capacity import ModelShape, rollout_capacity

    hopper = {"total_bytes": H100_BYTES, "capability": (9, 0)}
    shape = ModelShape.from_config(qwen3_8b_config())

    def room(args, fp8_kv):
        return rollout_capacity(shape, H100_BYTES, 0.3, fp8_weights=True, fp8_kv=fp8_kv, seq_len=2048,
                                max_num_seqs=args.generation_batch_size // args.world_size).sequences  # fmt: skip

    for world_size in (1, 2):  # each rank's engine decodes its own 128
        args = engine_args(tmp_path, world_size)
        choice = choose_fp8_kv_cache(qwen3_8b_config(), args, **hopper)
        assert choice.on and choice.automatic, choice.reason
        assert room(args, False) < 128 and 2 * room(args, False) <= room(args, True) <= 2 * room(args, False) + 1
        assert f"room for {room(args, False)} of a rollout's 128 sequences of 2,048 tokens" in choice.reason
        assert f"{room(args, True)} with an FP8 one" in choice.reason and "fp8_kv_cache=False" in choice.reason
    # 16 sequences a rollout fit the BF16 cache: kept BF16
    choice = choose_fp8_kv_cache(qwen3_8b_config(), engine_args(tmp_path, generation_batch_size=16), **hopper)
    assert not choice.on and "every sequence fits" in choice.reason


def test_fp8_kv_cache_kept_bf16_outside_the_colocated_fp8_flow_on_hopper(tmp_path):
    from trl_fp8.plan.choices import choose_fp8_kv_cache

    hopper = {"total_bytes": H100_BYTES, "capability": (9, 0)}
    args = engine_args(tmp_path)
    binds = choose_fp8_kv_cache(qwen3_8b_config(), args, **hopper)
    assert binds.on
    for change, says in (
        ({"fp8_kv_cache": False}, "set by fp8_kv_cache"),
        ({"use_vllm": False}, "no vLLM rollouts"),
        ({"fp8_recipe": None}, "BF16 baseline"),
        ({"vllm_mode": "server"}, "--kv_cache_dtype fp8 and set fp8_kv_cache=True"),
        ({"vllm_importance_sampling_correction": False}, "no importance-sampling correction"),
    ):
        choice = choose_fp8_kv_cache(qwen3_8b_config(), engine_args(tmp_path, **change), **hopper)
        assert not choice.on and says in choice.reason, (change, choice.reason)
    ampere = choose_fp8_kv_cache(qwen3_8b_config(), args, total_bytes=H100_BYTES, capability=(8, 0))
    assert not ampere.on and "sm80" in ampere.reason
    assert "training on cpu" in choose_fp8_kv_cache(qwen3_8b_config(), args).reason
    mla = {**qwen3_8b_config(), "kv_lora_rank": 512}
    assert "cannot size" in choose_fp8_kv_cache(mla, args, **hopper).reason
    user = choose_fp8_kv_cache(qwen3_8b_config(), engine_args(tmp_path, fp8_kv_cache=True), **hopper)
    assert (user.on, user.automatic) == (True, False)
