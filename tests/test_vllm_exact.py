"""Exact mode's engine settings (`rollout.vllm.exact`): what they ask of vLLM, and the clear error where the installed
vLLM has no batch-invariant mode. Whether an engine so set agrees with itself bit for bit is a GPU gate
(`tests/gpu/test_exactness_gates_gpu.py`)."""

import pytest

from trl_fp8.rollout.vllm import exact


def test_the_engine_runs_vllms_batch_invariant_kernels_on_deepgemm_without_e8m0_or_compilation():
    engine = exact.ExactEngine()
    assert engine.env["VLLM_BATCH_INVARIANT"] == "1"
    assert engine.env["VLLM_USE_DEEP_GEMM"] == "1" and engine.env["VLLM_USE_DEEP_GEMM_E8M0"] == "0"
    assert engine.env["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert engine.llm_kwargs["linear_backend"] == "deep_gemm"
    assert engine.llm_kwargs["attention_backend"] == "FLASH_ATTN"
    assert engine.llm_kwargs["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert engine.llm_kwargs["enable_prefix_caching"] is False
    assert "process-wide" in engine.describe()


def test_each_engine_gets_its_own_copy_of_the_settings():
    first, second = exact.ExactEngine(), exact.ExactEngine()
    first.llm_kwargs["compilation_config"]["mode"] = 3
    first.env["VLLM_BATCH_INVARIANT"] = "0"
    assert second.llm_kwargs["compilation_config"]["mode"] == 0 and second.env["VLLM_BATCH_INVARIANT"] == "1"
    assert exact.EXACT_LLM_KWARGS["compilation_config"]["mode"] == 0


@pytest.mark.parametrize("release", sorted(exact.BATCH_INVARIANT_FILES))
def test_the_batch_invariant_mode_is_found_where_each_tested_vllm_keeps_it(tmp_path, monkeypatch, release):
    module = tmp_path / "vllm" / exact.BATCH_INVARIANT_FILES[release]
    module.parent.mkdir(parents=True)
    module.write_text("")
    monkeypatch.setattr(exact, "vllm_package_dirs", lambda: [tmp_path / "vllm"])
    assert exact.batch_invariant_missing() is None
    assert exact.exact_engine().env == exact.EXACT_ENGINE_ENV


def test_a_vllm_without_the_mode_or_no_vllm_stops_exact_mode_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    monkeypatch.setattr(exact, "vllm_package_dirs", lambda: [tmp_path / "vllm"])
    assert "no batch-invariant mode" in exact.batch_invariant_missing()
    with pytest.raises(RuntimeError, match=r"Exact mode cannot run: .*no batch-invariant mode.*pip install"):
        exact.exact_engine()
    monkeypatch.setattr(exact, "vllm_package_dirs", lambda: [])
    assert "not installed" in exact.batch_invariant_missing()
    with pytest.raises(RuntimeError, match="vLLM is not installed"):
        exact.exact_engine()


def test_exact_mode_refuses_vllm_026_whose_decode_and_prefill_round_differently(tmp_path, monkeypatch):
    """A vLLM with the mode but not exact in it (`NOT_EXACT`: 0.26) stops exact mode with the reason and the fix;
    the tested 0.31, another release, or no vLLM at all is not refused on that ground."""
    assert "0.26.0 is not exact" in exact.release_not_exact("0.26.0") and "0.31" in exact.release_not_exact("0.26.1")
    assert exact.release_not_exact("0.31.0") is None and exact.release_not_exact("0.32.0") is None
    monkeypatch.setattr(exact, "installed_versions", lambda packages: {})
    assert exact.release_not_exact() is None
    module = tmp_path / "vllm" / exact.BATCH_INVARIANT_FILES["0.26"]
    module.parent.mkdir(parents=True)
    module.write_text("")
    monkeypatch.setattr(exact, "vllm_package_dirs", lambda: [tmp_path / "vllm"])
    monkeypatch.setattr(exact, "installed_versions", lambda packages: {"vllm": "0.26.0"})
    with pytest.raises(RuntimeError, match=r"Exact mode cannot run: vLLM 0\.26\.0 is not exact.*Install vLLM 0\.31"):
        exact.exact_engine()
    assert exact.ExactEngine().env == exact.EXACT_ENGINE_ENV  # (the settings alone: what the GPU gates measure)


def test_the_engines_attention_scales_are_copied_in_layer_order_with_its_query_quantizer(monkeypatch):
    """`_compat.engine_attention_scales`: each attention layer's (q, k, v) scales, by the layer number in its name
    (not the order the modules were registered in), copied (a sleeping engine's tensors go away, and a later sync
    writes the engine's in place); `engine_query_quant`: the first layer's quantizer of FP8 queries."""
    import torch
    from torch import nn

    from trl_fp8.rollout.vllm import _compat

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleDict()
    for i in (10, 2, 1):  # registered out of order; 10 after 2 by number, not by text
        block = nn.Module()
        block.self_attn = nn.Module()
        attn = block.self_attn.attn = nn.Module()
        attn.kv_cache_dtype = "fp8"
        attn._q_scale, attn._k_scale, attn._v_scale = (torch.tensor(float(i + j / 10)) for j in range(3))
        attn.query_quant = f"quantizer {i}"
        model.model.layers[str(i)] = block
    monkeypatch.setattr(_compat, "engine_model", lambda llm: model)
    scales = _compat.engine_attention_scales(None)
    assert [[s.item() for s in layer] for layer in scales] == [
        pytest.approx([i, i + 0.1, i + 0.2]) for i in (1, 2, 10)
    ]
    model.model.layers["1"].self_attn.attn._k_scale.fill_(7.0)  # the engine's, written in place by a sync
    assert scales[0][1].item() == pytest.approx(1.1)  # the copy keeps the rollout's scale
    assert _compat.engine_query_quant(None) == "quantizer 1"
