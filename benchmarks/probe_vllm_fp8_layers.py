"""Diagnose trainer-vs-vLLM FP8 differences layer by layer (GPU host with vLLM).

    python benchmarks/probe_vllm_fp8_layers.py

Loads our block-FP8 checkpoint of a random Qwen3 in vLLM (in-process) and compares, for decoder layer 0:
1. the FP8 weights and scales vLLM holds after loading against the trainer's (bit for bit);
2. vLLM's 1x128 activation quantizer against ours on the same input (bit for bit);
3. vLLM's fused gate_up / qkv linear layers against the trainer's FP8Linear layers on the same input;
4. prompt log-probs of the whole model, vLLM against the trainer, BF16 lm_head included.
Prints one line per check; exits 0 even when a check fails, so every check reports.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def main():
    import torch
    from vllm import LLM, SamplingParams

    from trl_fp8 import convert_to_fp8, quantize_groups
    from trl_fp8.checkpoint.save import save_fp8_checkpoint
    from trl_fp8.demo.tiny_model import tiny_qwen3

    torch.manual_seed(0)
    model = tiny_qwen3(
        vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, initializer_range=0.05, dtype=torch.bfloat16,
    ).cuda().eval()  # fmt: skip
    convert_to_fp8(model)
    ckpt = Path("/tmp/trl_fp8_probe")
    save_fp8_checkpoint(model, ckpt, progress=False)
    llm = LLM(
        model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.3,
        max_model_len=512, seed=0, enable_prefix_caching=False, logprobs_mode="processed_logprobs",
    )  # fmt: skip
    vmodel = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    vlayer = vmodel.model.layers[0]
    tlayer = model.model.layers[0]

    def check(name, fn):
        try:
            print(f"[{name}] {fn()}", flush=True)
        except Exception:  # noqa: BLE001 - report and go on
            print(f"[{name}] FAILED\n{traceback.format_exc()}", flush=True)

    def params():
        lines = []
        for n, p in vlayer.mlp.gate_up_proj.named_parameters():
            lines.append(f"{n}: {tuple(p.shape)} {p.dtype} stride={p.stride()}")
        return "; ".join(lines) + f"; kernel={type(getattr(vlayer.mlp.gate_up_proj.quant_method, 'fp8_linear', None))}"

    def weights():
        q = torch.cat([tlayer.mlp.gate_proj.quantized_weight()[0], tlayer.mlp.up_proj.quantized_weight()[0]])
        s = torch.cat([tlayer.mlp.gate_proj.quantized_weight()[1], tlayer.mlp.up_proj.quantized_weight()[1]])
        vw, vs = vlayer.mlp.gate_up_proj.weight, vlayer.mlp.gate_up_proj.weight_scale_inv
        out = []
        for label, cand in (("as is", vw), ("transposed", vw.t())):
            if cand.shape == q.shape:
                out.append(
                    f"weight {label}: equal bits={torch.equal(cand.contiguous().view(torch.uint8), q.view(torch.uint8))}"
                )
        for label, cand in (("as is", vs), ("transposed", vs.t())):
            if cand.shape == s.shape:
                out.append(f"scale {label}: max rel diff={((cand.float() - s) / s).abs().max().item():.3e}")
        return (
            "; ".join(out)
            or f"shapes differ: vllm {tuple(vw.shape)} {tuple(vs.shape)}, ours {tuple(q.shape)} {tuple(s.shape)}"
        )

    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16) * 2

    def act_quant():
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

        vq, vs = per_token_group_quant_fp8(x, 128)
        q, s = quantize_groups(x)
        same = (vq.view(torch.uint8) == q.view(torch.uint8)).float().mean().item()
        return f"fp8 bytes equal: {same:.6f}; scale max rel diff {((vs.float() - s) / s).abs().max().item():.3e}"

    def linear(vname, tnames):
        def run():
            vmod = getattr(vlayer.mlp if "gate" in vname else vlayer.self_attn, vname)
            with torch.no_grad():
                out = vmod(x)
                vy = out[0] if isinstance(out, tuple) else out
                mods = [getattr(tlayer.mlp if "gate" in vname else tlayer.self_attn, t) for t in tnames]
                ty = torch.cat([m(x) for m in mods], dim=-1)
                emu = torch.cat([torch.nn.functional.linear(x.float(), m.weight.float()) for m in mods], -1)
            return f"vllm vs trainer rel {rel(vy, ty):.3e}; trainer vs bf16-exact rel {rel(ty, emu):.3e}; vllm vs bf16-exact rel {rel(vy, emu):.3e}"

        return run

    def prompt_logprobs():
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 4096, (48,), generator=g).tolist() for _ in range(8)]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        deltas = []
        for p, o in zip(prompts, outs, strict=True):
            vl = torch.tensor([d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)], device="cuda")
            with torch.no_grad():
                logits = model(torch.tensor([p], device="cuda")).logits[0, :-1].float()
            tl_ = torch.log_softmax(logits, -1).gather(-1, torch.tensor(p[1:], device="cuda")[:, None])[:, 0]
            deltas.append(vl - tl_)
        d = torch.cat(deltas)
        return f"prompt logprob |delta| mean {d.abs().mean().item():.3e} max {d.abs().max().item():.3e}"

    check("vllm gate_up params", params)
    check("weights vs trainer", weights)
    check("activation quantizer", act_quant)
    check("gate_up linear", linear("gate_up_proj", ["gate_proj", "up_proj"]))
    check("prompt logprobs", prompt_logprobs)


if __name__ == "__main__":
    main()
