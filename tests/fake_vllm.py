"""Stand-ins for vLLM shared by the test files (CPU, no vLLM installed): `FakeLLM` records how TRL's code builds the
engine and what a sync pushes, `install_fake_vllm` puts it in TRL's place (as conftest.py's `fake_vllm` fixture),
`FakeMoEEngine` holds MoE layers as vLLM's block-FP8 `Fp8MoEMethod` does; and the tiny FP8 model and the colocated
trainer the tests drive."""

import os
import types

import torch

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer, convert_to_fp8
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.demo.toy_task import ANSWER_LENGTH, GRPO_SETTINGS, say_letter_dataset, say_letter_reward


def fp8_model(**kwargs):
    """A tiny Qwen3 (`tiny_qwen3(**kwargs)`) with its linear layers in FP8."""
    model = tiny_qwen3(**kwargs)
    convert_to_fp8(model)
    return model


class FakeLLM:
    """Stands in for vllm.LLM: records how TRL's code built it and what a sync pushed."""

    instances = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.env = {k: os.environ.get(k) for k in ("VLLM_USE_DEEP_GEMM", "VLLM_USE_DEEP_GEMM_E8M0")}
        self.pushed = []
        self.reloads = 0
        worker = types.SimpleNamespace(reload_weights=self._reload)
        self.shutdowns = 0
        self.llm_engine = types.SimpleNamespace(
            model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker)),
            engine_core=types.SimpleNamespace(shutdown=lambda: self._shutdown()),  # the class's, at call time
        )
        FakeLLM.instances.append(self)

    def _reload(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        self.pushed = [(n, t.clone()) for n, t in weights_iterator]
        self.reloads += 1
        if getattr(self, "on_reload", None):
            self.on_reload(self.pushed)

    def _shutdown(self):
        self.shutdowns += 1

    def reset_prefix_cache(self):
        pass

    def sleep(self, level):
        self.asleep = True

    def wake_up(self, tags=None):
        self.asleep = False


def sampling_rollout_func(tokenizer, sampler):
    """A `rollout_func` that samples each prompt's completion (one prompt at a time, `ANSWER_LENGTH` tokens) from the
    model `sampler(trainer)` gives and returns the sampled tokens' log-probs, as an engine does: rollouts that carry
    their own log-probs, without vLLM."""

    def rollout_func(prompts, trainer):
        model = sampler(trainer)
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:  # prompts arrive already repeated num_generations times
            ids = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
            ids = ids["input_ids"]
            gen = model.generate(torch.tensor([ids]), max_new_tokens=ANSWER_LENGTH, do_sample=True,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
            completion = gen.sequences[0, len(ids) :].tolist()
            out["prompt_ids"].append(ids)
            out["completion_ids"].append(completion)
            out["logprobs"].append([torch.log_softmax(score[0].float(), -1)[t].item()
                                    for score, t in zip(gen.scores, completion, strict=False)])  # fmt: skip
        return out

    return rollout_func


def install_fake_vllm(monkeypatch) -> type[FakeLLM]:
    """Put `FakeLLM` where TRL's colocate code builds `vllm.LLM`, and pass the vLLM version checks (the `fake_vllm`
    fixture of conftest.py)."""
    import trl.generation.vllm_generation as trl_vllm

    import trl_fp8.config
    import trl_fp8.rollout.vllm.generation as sync

    FakeLLM.instances.clear()
    sync._STARTED_ENGINES.clear()  # an earlier test's engines are not this test's to shut down
    # TRL's colocate set-up exports these for vLLM; undo that, or later subprocesses would think they are ranks.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(trl_vllm, "LLM", FakeLLM, raising=False)
    monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(sync, "check_vllm_version", lambda: "0.26.0")
    monkeypatch.setattr(trl_fp8.config, "check_vllm_version", lambda: "0.26.0")
    return FakeLLM


def tiny_trainer(tmp_path, model=None, **kwargs):
    """An FP8GRPOTrainer with vLLM colocated (needs the `fake_vllm` fixture) on a tiny Qwen3 or on `model`;
    `kwargs` are FP8GRPOConfig fields, plus `peft_config` and `tuning` (an `FP8Tuning`)."""
    tokenizer = tiny_char_tokenizer()
    model = model or tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    peft_config, tuning = kwargs.pop("peft_config", None), kwargs.pop("tuning", None)
    settings = {**GRPO_SETTINGS, "per_device_train_batch_size": 16, **kwargs}
    args = FP8GRPOConfig(**settings, output_dir=str(tmp_path), use_cpu=True, bf16=False, use_vllm=True,
                         vllm_mode="colocate")  # fmt: skip
    return FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(64),
                          processing_class=tokenizer, peft_config=peft_config, tuning=tuning)  # fmt: skip


class FakeMoEEngine:
    """A colocated engine's MoE layers as vLLM's block-FP8 `Fp8MoEMethod` holds them (w13 = gate rows then up rows),
    under the transformers names, filled from the pushed per-expert checkpoint tensors as vLLM's loader fills them."""

    def __init__(self, experts_layers: dict[str, torch.nn.Module]):
        self.model, self.layers = torch.nn.Module(), {}
        for name, ours in experts_layers.items():
            e, two_i, h = ours.gate_up_proj.shape
            layer = torch.nn.Module()
            layer.quant_method = types.SimpleNamespace(fp8_backend="TRITON", weight_scale_name="weight_scale_inv")
            for key, shape, dtype in [("w13_weight", (e, two_i, h), torch.float8_e4m3fn),
                                      ("w13_weight_scale_inv", (e, two_i // 128, h // 128), torch.float32),
                                      ("w2_weight", (e, h, two_i // 2), torch.float8_e4m3fn),
                                      ("w2_weight_scale_inv", (e, h // 128, two_i // 256), torch.float32)]:  # fmt: skip
                layer.register_parameter(key, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
            parent = self.model
            for part in name.split(".")[:-1]:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(name.rsplit(".", 1)[1], layer)
            self.layers[name] = layer

    def load(self, pushed):
        reloaded = set()
        for name, tensor in pushed:
            prefix, sep, rest = name.partition(".experts.")
            layer = self.layers.get(prefix + ".experts")
            if layer is None or not sep:
                continue
            reloaded.add(prefix + ".experts")
            expert, proj, leaf = rest.split(".", 2)
            target = getattr(layer, ("w2" if proj == "down_proj" else "w13") + "_" + leaf)
            half = target.shape[1] // 2
            rows = {"gate_proj": slice(0, half), "up_proj": slice(half, 2 * half)}.get(proj, slice(None))
            target.data[int(expert), rows].copy_(tensor)
        # vLLM's layerwise reload processes a layer on temporary tensors, builds the MoE kernel's quant config from
        # them, then copies their values back into the layer's own storage: the config keeps the temporaries.
        for name in reloaded:
            layer = self.layers[name]
            layer.quant_method.moe_quant_config = types.SimpleNamespace(
                w1_scale=layer.w13_weight_scale_inv.detach().clone(),
                w2_scale=layer.w2_weight_scale_inv.detach().clone(),
            )


def op_with_schema(namespace: str, name: str, schema: str, cpu_kernel):
    """Yield `torch.ops.<namespace>.<name>` defined with `schema` (vLLM's, for one of the ops trl-fp8 replaces) and
    `cpu_kernel` as its kernel, as vLLM's CUDA kernel is the real op's; destroyed after (a fixture's body). The kernel
    sits under CompositeExplicitAutograd, not the CPU key that `install` takes: torch 2.11 refuses a Python kernel
    over another Python kernel of the same key, and vLLM's own kernels are C++ ones, which it lets be overridden."""
    library = torch.library.Library(namespace, "DEF")  # noqa: TOR901
    library.define(f"{name}{schema}")  # the name `install` registers its kernel under
    library.impl(name, cpu_kernel, "CompositeExplicitAutograd")
    yield getattr(getattr(torch.ops, namespace), name).default
    library._destroy()


def count_kernel_calls(monkeypatch, module) -> list:
    """trl-fp8's kernel of `module` (`rollout.vllm.act_quant` or `norm_quant`), as its `install` registers it from now
    on, counting its calls in the returned list."""
    calls, kernel = [], module._kernel

    def counted(numerics):
        ours = kernel(numerics)

        def counting(*args):
            calls.append(1)
            ours(*args)

        return counting

    monkeypatch.setattr(module, "_kernel", counted)
    return calls
