"""`FP8GRPOConfig(exact_on_policy=True)` on CPU (`fake_vllm` stands in for vLLM): what it refuses, naming the fix;
the engine it asks vLLM for (batch-invariant mode, no compilation, no prefix cache, vLLM's own kernels only); and
the trainer's scoring taken from the exact forward. Whether the log-probabilities then equal the engine's bit for bit
is the GPU test's (`tests/gpu/test_exact_mode_gpu.py`)."""

import logging
import os

import pytest
import torch

from trl_fp8 import FP8GRPOConfig
from trl_fp8.nn.exact_forward import exact_token_logprobs, rope_table
from trl_fp8.ops.exact import REFERENCE_KERNELS
from trl_fp8.rollout.vllm import exact

from fake_vllm import tiny_trainer


def _config(tmp_path, **kwargs):
    return FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", use_vllm=True,
                         exact_on_policy=True, **kwargs)  # fmt: skip


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"vllm_mode": "server"}, "vllm_mode='colocate'"),
        ({"vllm_mode": "colocate", "rollout_precision": "fp8_online"}, "rollout_precision 'fp8' or 'bf16'"),
        ({"vllm_mode": "colocate", "vllm_fp8_backend": "cutlass"}, "vllm_fp8_backend 'auto' or 'deepgemm'"),
        ({"vllm_mode": "colocate", "top_p": 0.9}, "top_p=1.0"),
        ({"vllm_mode": "colocate", "top_k": 20}, "top_k=None"),
        ({"vllm_mode": "colocate", "repetition_penalty": 1.1}, "repetition_penalty=1.0"),
    ],
)
def test_exact_mode_refuses_what_it_cannot_make_exact_naming_the_fix(fake_vllm, tmp_path, fields, named):
    with pytest.raises(ValueError, match="exact_on_policy=True needs") as error:
        _config(tmp_path, **fields)
    assert named in str(error.value)


def test_exact_mode_refuses_a_vllm_release_that_is_not_exact_naming_the_release_that_is(
    fake_vllm, tmp_path, monkeypatch
):
    """vLLM 0.26's batch-invariant mode is not exact (its fused add + RMSNorm follows the launch's row count): the
    config stops there, before a model is loaded, and names vLLM 0.31."""
    from trl_fp8.rollout.vllm import exact

    monkeypatch.setattr(exact, "installed_versions", lambda packages: {"vllm": "0.26.0"})
    with pytest.raises(
        ValueError, match=r"exact_on_policy=True needs vLLM 0.31 .*vLLM 0\.26\.0 is not exact: .*RMSNorm"
    ):
        _config(tmp_path, vllm_mode="colocate")
    monkeypatch.setattr(exact, "installed_versions", lambda packages: {"vllm": "0.31.0"})
    assert _config(tmp_path, vllm_mode="colocate").exact_on_policy is True


def test_exact_mode_keeps_the_kv_cache_in_bf16_where_the_planner_would_choose(fake_vllm, tmp_path):
    assert _config(tmp_path, vllm_mode="colocate").fp8_kv_cache is False
    assert _config(tmp_path, vllm_mode="colocate", fp8_kv_cache=True).fp8_kv_cache is True  # asked for: kept
    assert FP8GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none").exact_on_policy is False


def _exact_trainer(tmp_path, monkeypatch, **kwargs):
    import trl_fp8.rollout.vllm.generation as generation

    monkeypatch.setattr(exact, "batch_invariant_missing", lambda: None)  # the installed vLLM has the mode
    monkeypatch.setattr(generation, "engine_rotary_table", lambda llm: None)  # FakeLLM has no model
    monkeypatch.setattr(generation, "exact_kernels", lambda query_quant=None: REFERENCE_KERNELS)  # vLLM's: GPU test
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # (monkeypatch restores the process's environment after)
    trainer = tiny_trainer(tmp_path, exact_on_policy=True, rollout_precision="bf16", **kwargs)
    assert trainer.vllm_generation.exact_kernels is REFERENCE_KERNELS  # taken when the engine started
    trainer.vllm_generation.exact_rotary_table = rope_table(trainer.model, 64)
    return trainer


def test_the_exact_engine_runs_vllms_batch_invariant_kernels_and_nothing_of_trl_fp8s(
    fake_vllm, tmp_path, monkeypatch, capsys
):
    _exact_trainer(tmp_path, monkeypatch)
    assert "[trl-fp8] vLLM engine in exact mode: vLLM's batch-invariant kernels" in capsys.readouterr().out
    (llm,) = fake_vllm.instances
    for name, value in exact.EXACT_LLM_KWARGS.items():
        assert llm.kwargs[name] == value, name
    assert os.environ["VLLM_BATCH_INVARIANT"] == "1" and os.environ["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    from trl_fp8.rollout.vllm import act_quant, norm_quant

    assert act_quant.installed() is None and norm_quant.installed() is None


def test_fp8_rollouts_in_exact_mode_need_deepgemm_and_say_so(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setattr(exact, "batch_invariant_missing", lambda: None)
    with pytest.raises(RuntimeError, match="exact_on_policy=True runs the engine's block-FP8 linears on DeepGEMM"):
        tiny_trainer(tmp_path, exact_on_policy=True)  # CPU: no DeepGEMM


def test_the_trainer_scores_with_the_exact_forward_and_refuses_inputs_it_cannot_score(
    fake_vllm, tmp_path, monkeypatch
):
    trainer = _exact_trainer(tmp_path, monkeypatch)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 128, (5, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, 10:] = 0
    logps, entropies, aux = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, mask, 6, batch_size=2, compute_entropy=True
    )
    table = trainer.vllm_generation.exact_rotary_table
    chunks = [exact_token_logprobs(trainer.model, ids[i : i + 2], mask[i : i + 2], 6, cos_sin_cache=table,
                                   dtype=table.dtype, with_entropy=True) for i in (0, 2, 4)]  # fmt: skip
    assert aux is None
    assert torch.equal(logps, torch.cat([c[0] for c in chunks]))  # two sequences a forward, as batch_size says
    assert torch.equal(entropies, torch.cat([c[1] for c in chunks]))
    with pytest.raises(ValueError, match="text-only dense models; this batch has pixel_values"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 6, pixel_values=torch.zeros(1))


def test_with_an_fp8_kv_cache_the_trainer_scores_on_the_engines_scales_of_each_sync_and_feeds_the_observer(
    fake_vllm, tmp_path, monkeypatch, caplog
):
    """Exact mode with `fp8_kv_cache=True`: the engine decodes on FlashAttention-3 (the trainer's kernel, not XQA);
    the scales the engine holds are taken at start-up and after every sync, the trainer's scoring quantizes with
    them, and what it quantizes feeds the KV-scale observer as the model's own attention would."""
    import trl_fp8.nn.exact_forward as exact_forward
    import trl_fp8.rollout.vllm.generation as generation

    layers = 4  # tiny_trainer's model (tiny_qwen3)
    taken = []

    def engine_scales(llm):  # FakeLLM has no attention layers: distinct scales per call, as after each sync
        taken.append(len(taken))
        return [tuple(torch.tensor(0.01 * (len(taken) + i + j)) for j in range(3)) for i in range(layers)]

    monkeypatch.setattr(generation, "engine_attention_scales", engine_scales)
    monkeypatch.setattr(generation, "engine_query_quant", lambda llm: None)
    seen = []
    real = exact_forward.exact_token_logprobs

    def spy(*args, **kwargs):
        seen.append((kwargs["kv_scales"], kwargs["observe"]))
        return real(*args, **kwargs)

    monkeypatch.setattr("trl_fp8.trainer.exact.exact_token_logprobs", spy)
    with caplog.at_level(logging.WARNING, logger="trl_fp8.rollout.vllm.generation"):
        trainer = _exact_trainer(tmp_path, monkeypatch, fp8_kv_cache=True)
    assert generation.FP8_KV_EXACT_CAVEAT in caplog.text  # the user hears where exactness ends
    generation_ = trainer.vllm_generation
    assert (
        generation_.report.kv_attention.kernel == "flash_attn"
        and "exact mode" in generation_.report.kv_attention.reason
    )
    assert len(taken) == 1 and generation_.exact_kv_scales[1][2].item() == pytest.approx(0.04)  # at start-up
    generation_.sync_weights()
    assert len(taken) == 2 and generation_.exact_kv_scales[1][2].item() == pytest.approx(0.05)  # after the sync
    observer = trainer.plan.rollout.kv_observer
    observer.scales()  # (clear what start-up observed)
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 6)
    kv_scales, observe = seen[-1]
    assert kv_scales is generation_.exact_kv_scales and observe is not None
    fed = observer.scales()
    assert len(fed) == 3 * layers and all(v > 0 for v in fed.values())  # q, k and v of every layer


def test_exact_mode_refuses_xqa_for_its_fp8_kv_cache(fake_vllm, tmp_path, monkeypatch):
    from trl_fp8 import FP8Tuning

    with pytest.raises(ValueError, match="drop FP8Tuning\\(vllm_fp8_kv_attention='xqa'\\)"):
        _exact_trainer(tmp_path, monkeypatch, fp8_kv_cache=True, tuning=FP8Tuning(vllm_fp8_kv_attention="xqa"))
