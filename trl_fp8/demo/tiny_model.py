"""Small Qwen3-architecture models built locally (no Hub), with dims that are multiples of 128 so blockwise FP8
applies. Used by the tests, the demo and the notebooks."""

from __future__ import annotations

import torch


def tiny_qwen3_config(
    vocab_size: int = 256,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 128,
    **kwargs,
):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=kwargs.pop("max_position_embeddings", 512),
        tie_word_embeddings=kwargs.pop("tie_word_embeddings", False),
        **kwargs,
    )


def tiny_qwen3(seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A randomly initialised `Qwen3ForCausalLM` (about 2.5M parameters with the defaults)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_qwen3_config(**config_kwargs))
    return model.to(dtype)


CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n.,:;!?+-=*/()'\"_"


def tiny_char_tokenizer():
    """A character-level fast tokenizer with a ChatML-style chat template, built in memory (vocab < 128)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def word_tokenizer(words, *, pad: str, eos: str, unk: str):
    """A word-level fast tokenizer over `words` (token id = position), split on whitespace, left padding for
    generation; built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=unk))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=pad, eos_token=eos, unk_token=unk, padding_side="left"
    )
