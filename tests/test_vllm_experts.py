"""The in-place expert sync (`trl_fp8.rollout.vllm.experts`): after one reload proves that vLLM's own kernel-format
conversion gives the engine's bits, later syncs write the FP8 experts into the engine in place. On CPU without vLLM
(`fake_vllm` stands in for its `LLM`, `FakeMoEEngine` for its MoE layers)."""

import logging

import torch

from fake_vllm import FakeMoEEngine, tiny_trainer


def test_fp8_experts_are_written_in_place_once_proven_bit_for_bit(fake_vllm, tmp_path, monkeypatch, caplog):
    """MoE syncs: the first pushes every expert tensor through the reload, then checks that vLLM's own kernel-format
    conversion of the stacked FP8 experts gives the engine's tensors bit for bit; later syncs leave the experts out of
    the reload and write them in place (the engine then holds the updated experts' FP8 bits). A conversion that
    gives other bits, or sleep mode (level 2 discards the engine's layers), keeps every sync on the reload path, with
    a warning saying why."""
    from test_fp8_experts import tiny_moe

    import trl_fp8.rollout.vllm.experts as vllm_experts
    from trl_fp8.nn.experts import FP8Experts
    from trl_fp8.nn.linear import invalidate_fp8_weights

    def identity(fp8_backend, layer, w13, w2, w13_scale, w2_scale, w13_input_scale, w2_input_scale):
        return w13, w2, w13_scale, w2_scale  # vLLM's conversion for the Triton MoE backend keeps the layout

    def other_scales(**kwargs):
        w13, w2, w13_scale, w2_scale = identity(**kwargs)
        return w13, w2, w13_scale, w2_scale * 2

    for convert, sleep_mode, fast in ((identity, False, True), (other_scales, False, False), (identity, True, False)):
        monkeypatch.setattr(vllm_experts, "_vllm_converter", lambda convert=convert: convert)
        trainer = tiny_trainer(tmp_path / f"{fast}{sleep_mode}", model=tiny_moe(), vllm_enable_sleep_mode=sleep_mode)
        generation, model = trainer.vllm_generation, trainer.model
        ours = {n: m for n, m in model.named_modules() if isinstance(m, FP8Experts)}
        assert list(ours) == ["model.layers.0.mlp.experts"]
        llm = fake_vllm.instances[-1]
        engine = FakeMoEEngine(ours)
        llm.llm_engine.model_executor.driver_worker.worker.model_runner = engine
        llm.on_reload = engine.load
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="trl_fp8.rollout.vllm.generation"):
            generation.sync_weights()
        assert any(".experts.3.down_proj.weight_scale_inv" in n for n, _ in llm.pushed)
        assert bool(generation.engine_experts) is fast
        warned = [r for r in caplog.records if r.levelno == logging.WARNING and "FP8 experts sync" in r.message]
        assert len(warned) == (0 if fast else 1)
        experts = ours["model.layers.0.mlp.experts"]
        with torch.no_grad():  # a training step's worth of change
            experts.gate_up_proj.add_(torch.randn_like(experts.gate_up_proj) * 0.05)
            experts.down_proj.mul_(1.5)
        invalidate_fp8_weights(model)
        generation.sync_weights()
        assert any(".experts." in n for n, _ in llm.pushed) is not fast
        assert "model.layers.0.mlp.gate.weight" in dict(llm.pushed)  # the router always goes through the reload
        layer = engine.layers["model.layers.0.mlp.experts"]
        for ours_name, key in (("gate_up_proj", "w13"), ("down_proj", "w2")):
            q, s = experts.quantized_expert_weight(ours_name)
            assert torch.equal(getattr(layer, f"{key}_weight").view(torch.uint8), q.view(torch.uint8)), key
            assert torch.equal(getattr(layer, f"{key}_weight_scale_inv"), s.float()), key
            # and the scales the MoE kernel reads outside CUDA graphs, which the last reload left in other storage
            assert torch.equal(
                getattr(layer.quant_method.moe_quant_config, {"w13": "w1_scale", "w2": "w2_scale"}[key]), s.float()
            )
