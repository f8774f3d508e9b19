"""Server mode: `trl vllm-serve` serves our FP8 checkpoint (made by `trl-fp8 quantize`) and the trainer pushes its
FP8 weights and scales through TRL's client. The push needs a second GPU (NCCL joins no two ranks on one GPU): the
trainer runs in the test process on the session's first GPU, the server on its second.

With one GPU the server shares it (a small memory share, Cutlass kernel: nothing to compile) and only the checks a
trainer makes before joining the server run against it; the weight-push test is skipped.
"""

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import WORKERS, artifacts_dir, clean_subprocess_env, free_port, launch_failure, run_child, session_gpus
from workers.vllm_weight_digest import tensor_digest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _wait_healthy(proc, url, log: Path, timeout=420):
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm-serve exited with {proc.returncode}; the end of its log:\n{log.read_text()[-6000:]}"
            )
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return time.time() - start
        except OSError:
            time.sleep(2)
    raise TimeoutError("vllm-serve did not come up")


@contextlib.contextmanager
def serve_fp8(root: Path, gpus: str, *, port: int, tensor_parallel: int = 1, memory: float = 0.3,
              kernel_name: str = "deepgemm", warm: bool = False, extra_args: tuple = (), eager: bool = True):  # fmt: skip
    """`trl vllm-serve` of a tiny Qwen3's FP8 checkpoint (made by `trl-fp8 quantize` in `root`) on `gpus`, as the
    documented command runs it, plus a worker extension that lets a test read digests of the engine's weights.
    `warm`: the model after the demo's warm start (`test_vllm_gpu.save_warm_model`); yields its expected reward then."""
    from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3

    before = None
    if warm:
        from test_vllm_gpu import save_warm_model

        before = save_warm_model(root / "model")
    else:
        tokenizer = tiny_char_tokenizer()
        tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0).save_pretrained(root / "model")
        tokenizer.save_pretrained(root / "model")
    subprocess.run([sys.executable, "-m", "trl_fp8", "quantize", str(root / "model"), str(root / "fp8")], check=True)
    log = open(root / "server.log", "w")
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    serve = ScriptArguments(model=str(root / "fp8"), port=port, gpu_memory_utilization=memory, enforce_eager=eager,
                            tensor_parallel_size=tensor_parallel)  # fmt: skip
    # The documented command (`vllm_kernels.server_command()`): DeepGEMM with E8M0 off.
    from trl_fp8.rollout.vllm.kernels import default_jit_cache_dir, server_kernel

    kernel = server_kernel(kernel_name)
    cmd = build_command(serve, ["--linear-backend", kernel.llm_kwargs["linear_backend"],
                                "--worker-extension-cls", "vllm_weight_digest.WeightDigest", *extra_args])  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(WORKERS), os.environ.get("PYTHONPATH")]))
    # No DeepGEMM warm-up: for this tiny model it compiled 605 kernels (3 minutes on a cold cache) of which the test
    # uses a handful, which compile on first use; the values are the same either way.
    env = {**clean_subprocess_env(), **kernel.env, "DG_JIT_CACHE_DIR": str(default_jit_cache_dir()),
           "VLLM_DEEP_GEMM_WARMUP": "skip", "CUDA_VISIBLE_DEVICES": gpus, "VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": pythonpath}  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        up_s = _wait_healthy(proc, f"http://localhost:{port}/health", root / "server.log")
        print(f"vllm-serve (TP={tensor_parallel}) up in {up_s:.0f} s")
        yield before
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if artifacts := artifacts_dir():
            Path(artifacts, f"server_tp{tensor_parallel}.log").write_text((root / "server.log").read_text()[-20000:])


@pytest.fixture(scope="module")
def fp8_server(tmp_path_factory):
    pytest.importorskip("vllm")
    gpus = session_gpus()
    two_gpus = len(gpus) >= 2
    root, port = tmp_path_factory.mktemp("server"), free_port()
    if not two_gpus:  # the server takes a share of this GPU: hand back what earlier tests' engines left cached
        import gc

        gc.collect()
        torch.cuda.empty_cache()
    server_gpu, kernel = (gpus[1], "deepgemm") if two_gpus else (gpus[0], "cutlass")
    with serve_fp8(
        root, server_gpu, memory=0.3 if two_gpus else 0.1, kernel_name=kernel, port=port, warm=True
    ) as before:
        yield SimpleNamespace(root=root, two_gpus=two_gpus, port=port, expected_reward=before)


def _config(tmp_path, port, **kwargs):
    from trl_fp8 import FP8GRPOConfig
    from trl_fp8.demo.toy_task import GRPO_SETTINGS

    return FP8GRPOConfig(
        **{**GRPO_SETTINGS, **kwargs}, output_dir=str(tmp_path / "out"), logging_steps=1, bf16=True, disable_tqdm=True,
        model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="server", vllm_server_port=port,
        vllm_server_timeout=30, tis="token",
    )  # fmt: skip


def test_server_refuses_a_trainer_whose_weights_it_cannot_take(fp8_server, tmp_path):
    from trl_fp8 import FP8GRPOTrainer
    from trl_fp8.demo.toy_task import say_letter_dataset, say_letter_reward

    model = str(fp8_server.root / "model")
    args = _config(tmp_path, fp8_server.port, max_steps=1, rollout_precision="bf16")
    with pytest.raises(ValueError, match="quantization"):
        FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64))
    # vLLM says quantization="fp8" for online FP8 too: the served checkpoint's own layers must match the trainer's.
    args = _config(tmp_path, fp8_server.port, max_steps=1, num_first_layers_in_bf16=1)
    with pytest.raises(ValueError, match="keeps other layers in high precision than the trainer"):
        FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64))
    args = _config(tmp_path, fp8_server.port, max_steps=1, rollout_precision="fp8_online", fp8_recipe=None)
    with pytest.raises(ValueError, match="pushes BF16 weights for vLLM to quantize"):
        FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64))


def _rpc(port: int, method: str, *args):
    request = urllib.request.Request(
        f"http://localhost:{port}/collective_rpc", data=json.dumps({"method": method, "args": list(args)}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    return json.loads(urllib.request.urlopen(request, timeout=60).read())["results"]


def test_server_with_an_fp8_kv_cache_runs_trl_fp8s_xqa_backend(tmp_path_factory):
    """The documented server command for an FP8 KV cache (`--kv_cache_dtype fp8 --attention-backend CUSTOM`, CUDA
    graphs on): the server finds trl-fp8's backend through the package's vLLM plugin, its engine runs XQA decode on
    the layers' scale tensors, it generates, and a trainer with `fp8_kv_cache=True` accepts it."""
    pytest.importorskip("vllm")
    import gc

    from trl.generation.vllm_client import VLLMClient

    from trl_fp8 import convert_to_fp8
    from trl_fp8.rollout.vllm.server import check_server_config

    gc.collect()
    torch.cuda.empty_cache()
    root, port = tmp_path_factory.mktemp("server_kv"), free_port()
    with serve_fp8(root, session_gpus()[0], memory=0.1, kernel_name="cutlass", port=port, eager=False,
                   extra_args=("--kv_cache_dtype", "fp8", "--attention-backend", "CUSTOM")):  # fmt: skip
        assert _rpc(port, "trl_fp8_attention_impls") == [["LiveScaleFlashInferImpl"]]
        client = VLLMClient(base_url=f"http://localhost:{port}")
        out = client.generate([[3, 4, 5, 6]], max_tokens=8, temperature=1.0)
        assert len(out["completion_ids"][0]) > 0
        response = client.session.get(f"{client.base_url}/server_info", params={"config_format": "json"})
        info = response.json()
        # /server_info writes an enum by its value, and CUSTOM's is None (as for no --attention-backend): the RPC
        # above is what tells the backends apart.
        assert info["vllm_config"]["attention_config"]["backend"] in (None, "CUSTOM", "AttentionBackendEnum.CUSTOM")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(root / "model")
        convert_to_fp8(model)
        check_server_config(info["vllm_config"], model, "fp8", fp8_kv_cache=True, server_env=info.get("vllm_env"),
                            fp8_backend="cutlass")  # fmt: skip


@pytest.mark.gpus(2)
def test_server_mode_grpo_with_fp8_weight_push(fp8_server, tmp_path):
    from test_trainer_gpu import assert_learned
    from trl.generation.vllm_client import VLLMClient
    from vllm.model_executor.layers.quantization.utils.fp8_utils import deepgemm_post_process_fp8_weight_block

    from trl_fp8 import FP8GRPOTrainer
    from trl_fp8.demo.toy_task import DEMO_GRPO_SETTINGS, say_letter_dataset, say_letter_reward

    info = VLLMClient(base_url=f"http://localhost:{fp8_server.port}").get_server_info()
    if artifacts := artifacts_dir():
        Path(artifacts, "server_info.json").write_text(json.dumps(info, indent=1, default=str))
    args = _config(tmp_path, fp8_server.port, max_steps=20, **DEMO_GRPO_SETTINGS)
    trainer = FP8GRPOTrainer(
        str(fp8_server.root / "model"), say_letter_reward, args, train_dataset=say_letter_dataset(2048)
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "reward" in log]
    rewards = [log["reward"] for log in logs]
    mismatch = [log["fp8/mismatch/abs_logp_diff_mean"] for log in logs]
    sync_ms = [log["fp8/weight_sync_ms"] for log in logs if "fp8/weight_sync_ms" in log]
    print(
        f"server fp8: reward {sum(rewards[:5]) / 5:.3f} -> {sum(rewards[-5:]) / 5:.3f}; mean|dlogp| median "
        f"{sorted(mismatch)[len(mismatch) // 2]:.4f} max {max(mismatch):.4f}; sync median "
        f"{sorted(sync_ms)[len(sync_ms) // 2]:.1f} ms"
    )
    assert len(sync_ms) == len(logs)
    assert all(0 <= m < 0.5 for m in mismatch)

    # Identity: after a sync, the server's fused layers hold exactly the trainer's FP8 bits and scales.
    trainer.vllm_generation.sync_weights()
    layer = trainer.model.model.layers[1]
    fused = {
        "model.layers.1.self_attn.qkv_proj": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
        "model.layers.1.mlp.gate_up_proj": [layer.mlp.gate_proj, layer.mlp.up_proj],
    }
    ours = {}
    for name, parts in fused.items():
        quantized = [p.quantized_weight() for p in parts]
        weight, scale = torch.cat([q for q, _ in quantized]), torch.cat([s for _, s in quantized])
        # DeepGEMM keeps the scales in its own layout (values unchanged with E8M0 off): compare against that.
        _, scale = deepgemm_post_process_fp8_weight_block(weight.clone(), scale.clone(), (128, 128), use_e8m0=False)
        ours[f"{name}.weight"] = tensor_digest(weight)
        ours[f"{name}.weight_scale_inv"] = tensor_digest(scale)
    request = urllib.request.Request(
        f"http://localhost:{fp8_server.port}/collective_rpc",
        data=json.dumps({"method": "trl_fp8_weight_digest", "args": [json.dumps(sorted(ours))]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    (served,) = json.loads(urllib.request.urlopen(request, timeout=60).read())["results"]
    print(f"server identity: {len(ours)} tensors, digests equal: {served == ours}")
    assert served == ours, {k: (served.get(k, "")[:12], v[:12]) for k, v in ours.items()}
    assert_learned(trainer, fp8_server.expected_reward, "server fp8")


@pytest.mark.gpus(4)
def test_two_trainer_ranks_push_fp8_to_a_two_gpu_server(tmp_path_factory):
    """Server mode at scale: two DDP trainer ranks (the session's first two GPUs) and `trl vllm-serve
    --tensor_parallel_size 2` (the next two). The reward rises, and after a sync every server worker holds its partition of the trainer's FP8 bits and
    scales."""
    pytest.importorskip("vllm")
    import trl

    root, port, gpus = tmp_path_factory.mktemp("server_tp2"), free_port(), session_gpus()
    with serve_fp8(root, ",".join(gpus[2:4]), tensor_parallel=2, port=port):
        config = Path(trl.__file__).parent / "accelerate_configs" / "multi_gpu.yaml"
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
               "2", "--main_process_port", str(free_port()), str(WORKERS / "server_trainer_worker.py"),
               str(root / "model"), str(root / "out"), str(port)]  # fmt: skip
        env = {**clean_subprocess_env(), "CUDA_VISIBLE_DEVICES": ",".join(gpus[:2])}
        proc = run_child(cmd, env=env, cwd=ROOT, timeout=900)
        assert proc.returncode == 0, launch_failure(proc.stdout)
    record = json.loads((root / "out" / "rank0.json").read_text())
    rewards = [log["reward"] for log in record["log_history"] if "reward" in log]
    print(
        f"server TP=2, 2 trainer ranks: reward {rewards[:3]} -> {rewards[-3:]}, worker ranks {record['served_ranks']}"
    )
    assert sorted(record["served_ranks"]) == [0, 1]
    for rank, served in zip(record["served_ranks"], record["served"], strict=True):
        assert served == record["expected"][str(rank)], rank
    assert sum(rewards[-3:]) > sum(rewards[:3])
