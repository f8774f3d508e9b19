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


class FlatLogprobs:
    """vLLM's `FlatLogprobs` as far as TRL and trl-fp8 read it: the flat arrays, and a dict of `Logprob`-like objects
    per position when iterated (what TRL's `extract_logprobs` reads)."""

    def __init__(self, positions):  # positions: per token, [(token_id, logprob, rank), ...]
        self.start_indices, self.end_indices, self.token_ids, self.logprobs, self.ranks = [], [], [], [], []
        for entries in positions:
            self.start_indices.append(len(self.token_ids))
            for token_id, logprob, rank in entries:
                self.token_ids.append(token_id)
                self.logprobs.append(logprob)
                self.ranks.append(rank)
            self.end_indices.append(len(self.token_ids))

    def __iter__(self):
        for start, end in zip(self.start_indices, self.end_indices, strict=True):
            yield {self.token_ids[i]: types.SimpleNamespace(logprob=self.logprobs[i], rank=self.ranks[i])
                   for i in range(start, end)}  # fmt: skip


def outputs_with(*completions):
    return [types.SimpleNamespace(outputs=[types.SimpleNamespace(logprobs=c)]) for c in completions]


def test_flat_log_probs_read_from_the_arrays_are_trls_lists():
    """One log-prob a token (TRL's `logprobs=0`): the lists TRL's reader gives, NaN as None, read from the arrays."""
    from trl.generation.vllm_generation import extract_logprobs

    from trl_fp8.rollout.vllm.sampling import flat_logprob_lists

    outputs = outputs_with(FlatLogprobs([[(5, -0.25, 3)], [(9, float("nan"), 1)], [(2, -1.5, 20)]]),
                           FlatLogprobs([[(7, -0.0, 1)]]), FlatLogprobs([]))  # fmt: skip
    ours = flat_logprob_lists(outputs)
    assert ours == extract_logprobs(outputs)
    assert ours == ([[[-0.25], [None], [-1.5]], [[-0.0]], []], [[[5], [9], [2]], [[7]], []])


def test_what_the_arrays_cannot_say_alone_is_left_to_trls_reader():
    """Several log-probs a token (TRL sorts them by rank, and a sampled token among the top ones is one dict entry),
    or log-probs kept as dicts: declined (None). An output without log-probs: `(None, None)`, as TRL's."""
    from trl_fp8.rollout.vllm.sampling import flat_logprob_lists

    top_two = FlatLogprobs([[(5, -0.25, 2), (4, -0.1, 1)]])
    assert flat_logprob_lists(outputs_with(top_two)) is None
    assert flat_logprob_lists(outputs_with([{5: types.SimpleNamespace(logprob=-0.5, rank=1)}])) is None
    assert flat_logprob_lists(outputs_with(FlatLogprobs([[(5, -0.25, 1)]]), None)) == (None, None)


def test_the_trainers_colocated_generate_reads_flat_log_probs_from_the_arrays(tmp_path, fake_vllm, monkeypatch):
    """The trainer's rollouts go through TRL's colocated generate with the flat reader in place of TRL's (which would
    fail on these outputs: they cannot be iterated), and TRL's reader is back after."""
    import trl.generation.vllm_generation as trl_vllm

    class NotIterable(FlatLogprobs):
        def __iter__(self):
            raise AssertionError("TRL's reader ran")

    def generate(self, prompts, sampling_params, use_tqdm=False):
        flat = NotIterable([[(5, -0.5, 1)], [(6, -0.75, 1)]])
        return [types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"],
                                      outputs=[types.SimpleNamespace(token_ids=[5, 6], logprobs=flat)])
                for p in prompts]  # fmt: skip

    monkeypatch.setattr(trl_vllm, "SamplingParams", RecordedSamplingParams, raising=False)
    monkeypatch.setattr(FakeLLM, "generate", generate, raising=False)
    trls = trl_vllm.extract_logprobs
    trainer = tiny_trainer(tmp_path)
    _, completion_ids, logprobs, token_ids = trainer.vllm_generation.generate([[1, 2, 3]], None, 1)
    assert completion_ids == [[5, 6]] and logprobs == [[[-0.5], [-0.75]]] and token_ids == [[[5], [6]]]
    assert trl_vllm.extract_logprobs is trls
