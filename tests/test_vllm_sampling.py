"""Colocated rollouts ask vLLM for token ids and log-probs only (`trl_fp8.rollout.vllm.sampling`), through TRL's own
`generation_kwargs`, into the `SamplingParams` of TRL's colocated generate."""

import types

import pytest

from trl_fp8 import FP8GRPOConfig
from trl_fp8.rollout.vllm.sampling import TOKEN_IDS_ONLY, with_token_ids_only

from fake_vllm import FakeLLM, tiny_trainer


def test_both_fields_are_added_and_the_callers_dict_is_left_alone():
    mine = {"repetition_penalty": 1.1}
    kwargs, why = with_token_ids_only(mine)
    assert kwargs == {"repetition_penalty": 1.1, "detokenize": False, "flat_logprobs": True}
    assert mine == {"repetition_penalty": 1.1}
    assert "detokenize=False" in why and "flat_logprobs=True" in why
    assert with_token_ids_only(None)[0] == TOKEN_IDS_ONLY


def test_what_the_user_set_stays_and_the_log_says_so():
    kwargs, why = with_token_ids_only({"detokenize": True})
    assert kwargs == {"detokenize": True, "flat_logprobs": True}
    assert "kept detokenize=True (set in generation_kwargs)" in why
    kwargs, why = with_token_ids_only({"detokenize": True, "flat_logprobs": False})
    assert kwargs == {"detokenize": True, "flat_logprobs": False}
    assert why.startswith("vLLM's defaults")


def test_stop_strings_keep_the_text_vllm_matches_them_on():
    kwargs, why = with_token_ids_only({"stop": ["\n\n"]})
    assert "detokenize" not in kwargs and kwargs["flat_logprobs"] is True
    assert "`stop` strings" in why
    assert with_token_ids_only({"stop": []})[0]["detokenize"] is False  # no strings: nothing to match


class RecordedSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


def fake_outputs(prompts, sampling_params, use_tqdm=False):
    """What `LLM.generate` returns, as far as TRL reads it: token ids, and one log-prob dict per token."""
    FakeLLM.instances[-1].sampling_params = sampling_params
    logprob = types.SimpleNamespace(logprob=-0.5, rank=1)
    return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                  outputs=[types.SimpleNamespace(token_ids=[5, 6], logprobs=[{5: logprob}, {6: logprob}])])
            for p in prompts]  # fmt: skip


@pytest.mark.parametrize("token_ids_only", [True, False])
def test_trls_colocated_generate_passes_them_to_sampling_params(tmp_path, fake_vllm, monkeypatch, token_ids_only):
    import trl.generation.vllm_generation as trl_vllm

    monkeypatch.setattr(trl_vllm, "SamplingParams", RecordedSamplingParams, raising=False)
    monkeypatch.setattr(FakeLLM, "generate", lambda self, *a, **k: fake_outputs(*a, **k), raising=False)
    trainer = tiny_trainer(tmp_path, vllm_token_ids_only=token_ids_only)
    prompt_ids, completion_ids, logprobs, _ = trainer.vllm_generation.generate([[1, 2, 3]], None, 1)
    assert completion_ids == [[5, 6]] and logprobs == [[[-0.5], [-0.5]]]
    sent = FakeLLM.instances[-1].sampling_params.kwargs
    assert sent["logprobs"] == 0  # TRL's importance sampling still gets the sampled tokens' log-probs
    if token_ids_only:
        assert sent["detokenize"] is False and sent["flat_logprobs"] is True
    else:
        assert "detokenize" not in sent and "flat_logprobs" not in sent


def test_refused_without_vllm():
    with pytest.raises(ValueError, match="vllm_token_ids_only=False sets up vLLM rollouts, but use_vllm=False"):
        FP8GRPOConfig(output_dir="unused", use_cpu=True, use_vllm=False, vllm_token_ids_only=False)
