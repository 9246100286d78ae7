"""A tokenizer that appends an end-of-sequence token to every encoded text (T5 / ByT5, a LLaMA
tokenizer saved with ``add_eos_token=True``): the rows of ``encode_multiple_choice`` put each
choice right after the prompt's tokens, not after a ``</s>``, as for a tokenizer that appends
nothing."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import ByT5Tokenizer, PreTrainedTokenizerFast

from pyrobayes.models.multiple_choice import encode_multiple_choice

PROMPTS = ["Capital of France?\nAnswer:", "Is water wet?"]
CHOICES = [["Paris", "Rome", "Nice"], ["yes", "no", "maybe"]]


def char_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """One token a character; ``template`` (a ``TemplateProcessing`` single-text template)
    says which special tokens encoding with special tokens adds."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ :?.\n":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize("side", ["left", "right"])
def test_an_eos_appended_to_the_prompt_is_not_put_before_the_choices(side):
    appends = char_tokenizer("<s> $A </s>")
    assert appends("Hi")["input_ids"][-1] == appends.eos_token_id
    got = encode_multiple_choice(appends, PROMPTS, CHOICES, [0, 1], padding_side=side)
    want = encode_multiple_choice(
        char_tokenizer("<s> $A"), PROMPTS, CHOICES, [0, 1], padding_side=side
    )
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    real = got["input_ids"][got["attention_mask"].bool()]
    assert appends.eos_token_id not in real.tolist()
    # an end-of-sequence token that is the prompt's own text stays before the choice
    ended = encode_multiple_choice(appends, ["Done.</s>"], ["yes", "no"], padding_side=side)
    row = ended["input_ids"][0, 0][ended["attention_mask"][0, 0].bool()].tolist()
    assert "".join(appends.convert_ids_to_tokens(row)) == "<s>Done.</s> yes"


def test_byt5_rows_are_the_prompt_bytes_then_the_choice_bytes():
    # ByT5 adds no BOS and appends </s> (id 1); a byte b is id b + 3
    batch = encode_multiple_choice(
        ByT5Tokenizer(), ["Hi?"], [["yes", "no"]], [0], padding_side="right"
    )
    row = batch["input_ids"][0, 0][batch["attention_mask"][0, 0].bool()].tolist()
    assert row == [b + 3 for b in b"Hi? yes"]
    cont = batch["continuation_mask"][0, 0][batch["attention_mask"][0, 0].bool()].tolist()
    assert cont == [0, 0, 0, 1, 1, 1, 1]
