"""The MoE colocate test's body, run in a process of its own by `tests/gpu/test_vllm_gpu.py` (argument: a scratch
folder).

Trains a 2-layer Qwen3-MoE (layer 0: 4 experts of 128, top-2; layer 1: dense) with FP8GRPOTrainer and vLLM colocated
for 3 steps, then checks that the engine's FusedMoE holds the trainer's FP8 expert blocks and scales bit for bit, in
the layout of the MoE kernel vLLM chose (vLLM's own conversion for that backend, applied to the trainer's tensors),
and that the in-place expert sync (`trl_fp8.rollout.vllm.experts`) writes what vLLM's reload of the same weights gives.
The engine runs trl-fp8's SiLU-and-mul quantization kernel between the expert GEMMs (`FP8Tuning(vllm_act_quant_kernel="trl_fp8")`).
"""

import sys
from pathlib import Path

import torch


def tiny_moe_dir(root: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trl_fp8.demo.tiny_model import tiny_char_tokenizer

    tokenizer = tiny_char_tokenizer()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=128, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        mlp_only_layers=[1], eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
    )  # fmt: skip
    model_dir = root / "moe"
    Qwen3MoeForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


def main(root: Path) -> None:
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, convert_to_fp8_moe_kernel_format

    from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, FP8Tuning
    from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward

    args = FP8GRPOConfig(
        **GRPO_SETTINGS, output_dir=str(root / "out"), max_steps=3, logging_steps=1, bf16=True,
        disable_tqdm=True, model_init_kwargs={"dtype": "bfloat16"}, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25, tis="token",
    )  # fmt: skip
    # trl-fp8's SiLU-and-mul kernel whatever its speed at this tiny width: vLLM's fused MoE calls it in every forward
    # of the engine (profiling, CUDA graphs, decode), as it does where "auto" picks it at real widths
    tuning = FP8Tuning(vllm_act_quant_kernel="trl_fp8")
    trainer = FP8GRPOTrainer(str(tiny_moe_dir(root)), say_letter_reward, args, train_dataset=say_letter_dataset(256),
                             tuning=tuning)  # fmt: skip
    assert trainer.fp8_report.experts == ["model.layers.0.mlp.experts"]
    experts = trainer.model.model.layers[0].mlp.experts
    before = experts.gate_up_proj.detach().clone()
    trainer.train()
    assert not torch.equal(before, experts.gate_up_proj)  # the experts trained
    logs = [log for log in trainer.state.log_history if "fp8/mismatch/abs_logp_diff_mean" in log]
    mismatch = [log["fp8/mismatch/abs_logp_diff_mean"] for log in logs]
    print(f"[moe] mean |dlogp| rollout vs training per step: {[round(m, 4) for m in mismatch]}", flush=True)
    assert len(logs) == 3 and all(0 <= m < 0.5 for m in mismatch)

    generation = trainer.vllm_generation
    choice = generation.report.act_quant_choice
    print(f"[moe] vLLM SiLU-and-mul + FP8 quantization: {choice.reason}", flush=True)
    assert choice.installed, choice.reason
    vmodel = generation.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    routed = [m for n, m in vmodel.named_modules() if "layers.0." in n and hasattr(m, "w13_weight")]
    assert len(routed) == 1, [type(m).__name__ for m in routed]
    vexperts = routed[0]
    # After the first sync proved it, the later ones wrote the experts in place (`vllm_experts`): what that writes
    # must be what vLLM's own reload of the same weights gives.
    generation.sync_weights()
    assert generation.engine_experts, "FP8 experts went through the reload (see the 'FP8 experts sync' warning)"
    names = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
    in_place = {name: getattr(vexperts, name).clone() for name in names}
    generation.engine_experts = None  # the next sync takes the reload path again (and proves the in-place one anew)
    generation.sync_weights()
    for name in names:
        reloaded = getattr(vexperts, name)
        assert torch.equal(in_place[name].contiguous().view(torch.uint8), reloaded.contiguous().view(torch.uint8)), (
            name
        )
    assert generation.engine_experts
    print(f"[moe] experts sync: in place, {len(generation.engine_experts.pairs)} MoE layer(s), the reload's bits",
          flush=True)  # fmt: skip
    method = vexperts.quant_method
    backend = method.fp8_backend
    print(f"[moe] vLLM: {type(method).__name__}, MoE backend {backend.value}", flush=True)
    assert backend in (Fp8MoeBackend.TRITON, Fp8MoeBackend.DEEPGEMM), f"the layout of {backend} is not checked here"
    w13, s13 = experts.quantized_expert_weight("gate_up_proj")  # [E, 2I, H]: gate rows then up rows, as vLLM's w13
    w2, s2 = experts.quantized_expert_weight("down_proj")
    w13, w2, s13, s2 = convert_to_fp8_moe_kernel_format(
        fp8_backend=backend, layer=vexperts, w13=w13.clone(), w2=w2.clone(), w13_scale=s13.clone().float(),
        w2_scale=s2.clone().float(), w13_input_scale=None, w2_input_scale=None,
    )  # fmt: skip
    for name, ours in (("w13_weight", w13), ("w2_weight", w2)):
        theirs = getattr(vexperts, name)
        assert theirs.dtype == torch.float8_e4m3fn and theirs.shape == ours.shape, (name, theirs.shape, ours.shape)
        assert torch.equal(theirs.view(torch.uint8), ours.view(torch.uint8)), name
    for name, ours in (("w13_weight_scale_inv", s13), ("w2_weight_scale_inv", s2)):
        theirs = getattr(vexperts, name)
        assert theirs.shape == ours.shape and torch.equal(theirs.float(), ours.float()), name
    router = dict(vmodel.named_parameters())["model.layers.0.mlp.gate.weight"]  # high precision on both sides
    assert router.dtype == torch.bfloat16
    assert torch.equal(router, trainer.model.model.layers[0].mlp.gate.weight.to(router.dtype))
    print(f"[moe] identity: {len(experts.gate_up_proj)} experts' FP8 blocks and scales, bit for bit", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(Path(sys.argv[1]))
