"""Each sequence's own positions in the trainer's forwards (`trainer.positions`): TRL left-pads prompts and gives
no position ids, so without them a padded prompt's tokens sit p positions later than where the rollout engine (and
transformers' `generate`) put them, and their log-probs move in BF16."""

import tempfile

import torch
from transformers import Qwen3Config

from trl_fp8 import FP8GRPOConfig, FP8GRPOTrainer
from trl_fp8.demo.tiny_model import tiny_char_tokenizer, tiny_qwen3
from trl_fp8.demo.toy_task import GRPO_SETTINGS, say_letter_dataset, say_letter_reward
from trl_fp8.trainer.positions import positions_from_mask, sequence_positions, takes_sequence_positions

BF16_UNIT = 2**-8  # BF16's unit roundoff


def test_positions_count_each_rows_tokens_from_its_first():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 0]])
    assert sequence_positions(mask).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1], [0, 0, 1, 1]]


def test_the_hook_adds_positions_only_where_a_mask_and_no_positions_are_given():
    seen = []

    class Model(torch.nn.Module):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None):
            seen.append(None if position_ids is None else position_ids.tolist())

    model, mask = Model(), torch.tensor([[0, 1, 1]])
    with positions_from_mask(model):
        model(input_ids=mask, attention_mask=mask)
        model(input_ids=mask, attention_mask=mask, position_ids=torch.tensor([[5, 6, 7]]))  # the caller's are kept
        model(input_ids=mask)
    model(input_ids=mask, attention_mask=mask)  # the hook is gone after the block
    with positions_from_mask(model, on=False):
        model(input_ids=mask, attention_mask=mask)
    assert seen == [[[0, 0, 1]], [[5, 6, 7]], None, None, None]


def test_text_decoders_take_them_and_multimodal_models_number_their_own():
    assert takes_sequence_positions(tiny_qwen3())
    model = torch.nn.Module()
    model.config = Qwen3Config()
    model.config.vision_config = {"depth": 1}  # as a vision-language model's config holds its tower's
    assert not takes_sequence_positions(model)

    class NoPositions(torch.nn.Module):  # a forward that would refuse them
        config = Qwen3Config()

        def forward(self, input_ids, attention_mask=None):
            return input_ids

    assert not takes_sequence_positions(NoPositions())


def test_a_padded_rows_log_probs_are_those_of_the_row_alone():
    """In BF16, a left-padded row scored with its own positions gives its log-probs alone to within BF16's rounding;
    numbered from the batch's first column, as transformers does by default, it does not (the test's model has its
    random weights doubled: a sharper distribution, as a trained model's is)."""
    model = tiny_qwen3(dtype=torch.bfloat16, vocab_size=512).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    gen, width = torch.Generator().manual_seed(0), 256
    rows = [torch.randint(0, 512, (width - pad,), generator=gen) for pad in (9, 40, 120)]
    ids = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(r) for r in rows])[:, None]).long()

    def logps(ids, mask):
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]

    alone = [logps(r[None], torch.ones(1, len(r), dtype=torch.long))[0] for r in rows]
    default = logps(ids, mask)
    with positions_from_mask(model):
        own = logps(ids, mask)
    for i, row in enumerate(rows):
        kept = slice(width - len(row), None)
        assert (own[i, kept] - alone[i]).abs().mean() <= BF16_UNIT
        assert (default[i, kept] - alone[i]).abs().mean() > BF16_UNIT  # what the positions fix


def test_the_trainers_scoring_forward_gets_each_rows_positions(monkeypatch):
    """TRL's `_get_per_token_logps_and_entropies`, as the trainer calls it for the old log-probs and in the loss,
    hands the model each row's own positions (the model's rotary embedding sees them)."""
    tokenizer = tiny_char_tokenizer()
    model = tiny_qwen3(vocab_size=128, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    args = FP8GRPOConfig(**{**GRPO_SETTINGS, "per_device_train_batch_size": 16}, output_dir=tempfile.mkdtemp(),
                         use_cpu=True, bf16=False)  # fmt: skip
    trainer = FP8GRPOTrainer(model, say_letter_reward, args, train_dataset=say_letter_dataset(16),
                             processing_class=tokenizer)  # fmt: skip
    rotary = trainer.model.model.rotary_emb
    seen = []
    forward = rotary.forward
    monkeypatch.setattr(
        rotary, "forward", lambda x, position_ids: seen.append(position_ids) or forward(x, position_ids)
    )
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
    ids = torch.randint(1, 128, mask.shape) * mask
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, logits_to_keep=3)
    assert len(seen) == 2 and all(torch.equal(p, sequence_positions(mask)) for p in seen)
