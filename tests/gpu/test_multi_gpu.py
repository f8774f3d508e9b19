"""FP8 GRPO on two GPUs of one host: DDP and FSDP2 through accelerate, vLLM colocated on each rank (TP=1), and DDP
with one vLLM engine across both GPUs (TP=2, in sleep mode).

Needs two SM90 GPUs of one machine (the first two of the session's GPUs); skipped elsewhere. Per launch config:
the ranks agree on their logs (timings aside), their parameters and the FP8 tensors for vLLM; each engine holds its
trainer's FP8 weights bit for bit; the export written by rank 0 equals a one-process export of the trained master weights.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import WORKERS, clean_subprocess_env, free_port, launch_failure, run_child, session_gpus

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "fp8/weight_sync_ms"}


@pytest.mark.gpus(2)
# FSDP2 with the FP8 KV cache: its scales are measured by the run's first forward, which must enter FSDP2's root unit.
# "levers": FSDP2 with the options aimed at its exposed gathers (logprob_batch_size=32 and FP8Tuning(
# fsdp2_prefetch_layers=2, fuse_sibling_gemms=True)), which must leave the pushed and exported FP8 bits as they are.
@pytest.mark.parametrize(
    "launch,vllm_tp,fp8_kv,levers",
    [
        ("multi_gpu", 1, False, False),
        ("fsdp2", 1, True, False),
        ("fsdp2", 1, True, True),
        ("multi_gpu", 2, False, False),
    ],
)
def test_two_gpu_grpo_with_colocated_engines(tmp_path, launch, vllm_tp, fp8_kv, levers):
    pytest.importorskip("vllm")
    import trl
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trl_fp8 import convert_to_fp8, save_fp8_checkpoint
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3

    tokenizer = tiny_char_tokenizer()
    model_dir = tmp_path / "model"
    tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    config = Path(trl.__file__).parent / "accelerate_configs" / f"{launch}.yaml"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(WORKERS / "multi_gpu_worker.py"),
           str(model_dir), str(tmp_path / "out"), str(vllm_tp), "fp8_kv" if fp8_kv else "bf16_kv",
           "levers" if levers else "plain"]  # fmt: skip
    gpus = session_gpus()[:2]
    env = {**clean_subprocess_env(), "CUDA_VISIBLE_DEVICES": ",".join(gpus)}  # the NVLink multicast settings stay
    proc = run_child(cmd, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, launch_failure(proc.stdout)
    r0, r1 = (json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1))
    print(
        f"{launch}, vLLM TP={vllm_tp}: {r0['distributed_type']}, sharded={r0['sharded']}, last step {r0['log_history'][-2]}"
    )
    assert r0["sharded"] == (launch == "fsdp2")
    assert r0["prefetch_set"] is levers
    assert r0["grads_in_ddp_buckets"] is (True if launch == "multi_gpu" else None)
    assert r0["zeroed_in_buckets"] is (launch == "multi_gpu")
    for a, b in zip(r0["log_history"], r1["log_history"], strict=True):
        assert {k: v for k, v in a.items() if k not in TIMINGS} == {k: v for k, v in b.items() if k not in TIMINGS}
    assert r0["params"] == r1["params"] and r0["pushed_fp8"] == r1["pushed_fp8"]
    # One engine over both GPUs sleeps between rollouts, on expandable segments, so its custom all-reduce is off
    # (vLLM cannot share that memory between processes).
    assert r0["engine"] == r1["engine"]
    if vllm_tp == 2:
        assert r0["engine"] == {"tensor_parallel_size": 2, "disable_custom_all_reduce": True, "sleep_mode": True,
                                "expandable_segments": True}  # fmt: skip
    else:
        assert r0["engine"]["tensor_parallel_size"] == 1 and not r0["engine"]["sleep_mode"]

    master = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "fp8" / "bf16_master", dtype=torch.bfloat16)
    convert_to_fp8(master)
    save_fp8_checkpoint(master, tmp_path / "one", progress=False)
    ours, one = (load_file(p / "model.safetensors") for p in (tmp_path / "out" / "fp8", tmp_path / "one"))
    assert ours.keys() == one.keys()
    for name, t in ours.items():
        assert torch.equal(t.view(torch.uint8), one[name].view(torch.uint8)), name
    assert os.path.exists(tmp_path / "out" / "fp8" / "config.json")
