"""Multiple-choice encoding edge cases: ``max_length`` truncation keeps the tokenizer's BOS
token, and the single-answer-token likelihood refuses a row of padding only."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaTokenizer

from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.tasks import MCExample, MultipleChoiceTask
from tests.common import tiny_llama

BOS = 1
MAX_LENGTH = 16
EXAMPLES = [
    MCExample("What is the capital of France?", ("Paris", "Rome"), 0),
    MCExample("Is it wet?", ("yes", "no"), 1),  # short: not truncated
    MCExample("Which colour do red and blue make together?", ("purple", "green"), 0),
]


def llama_tokenizer() -> LlamaTokenizer:
    """A LLaMA tokenizer (one token a character, vocabulary 59 < the tiny LLaMA's 99) that adds
    a BOS token (id 1) before every encoded text, as LLaMA / SmolLM2 tokenizers do."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in "▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ:?.":
        vocab.setdefault(ch, len(vocab))
    tok = LlamaTokenizer(vocab=vocab, merges=[], add_bos_token=True)
    tok.pad_token = "<unk>"
    return tok


class TwoSpecialTokenizer:
    """Characters to ids 3..97; encoding with special tokens puts ``[1, 2]`` before the text."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [3 + ord(c) % 95 for c in text]
        return {"input_ids": ([1, 2] if add_special_tokens else []) + ids}


def real_rows(batch: dict[str, torch.Tensor]) -> list[list[list[int]]]:
    """Each (example, choice) row's real token ids."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    return [
        [ids[b, k][mask[b, k]].tolist() for k in range(ids.shape[1])] for b in range(ids.shape[0])
    ]


def task() -> MultipleChoiceTask:
    return MultipleChoiceTask({"test": EXAMPLES})


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_truncation_keeps_the_bos_token(padding_side):
    tok = llama_tokenizer()
    assert tok("Hi")["input_ids"][0] == BOS
    t = task()
    (whole,) = t.encode(tok, "test", padding_side=padding_side)
    (cut,) = t.encode(tok, "test", padding_side=padding_side, max_length=MAX_LENGTH)
    # questions 0 and 2 are longer than MAX_LENGTH, question 1 is not
    assert t.truncation["test"]["truncated"] == 2
    for b, (rows, full_rows) in enumerate(zip(real_rows(cut), real_rows(whole), strict=True)):
        for row, full in zip(rows, full_rows, strict=True):
            assert full[0] == BOS
            # BOS, then the last MAX_LENGTH - 1 tokens; an uncut row unchanged
            want = full if len(full) <= MAX_LENGTH else [BOS, *full[-(MAX_LENGTH - 1) :]]
            assert row == want, (b, row, want)
    # the task's batch is encode_multiple_choice's, which keeps BOS itself
    plain = encode_multiple_choice(
        tok,
        [e.prompt for e in EXAMPLES],
        [list(e.choices) for e in EXAMPLES],
        [e.answer for e in EXAMPLES],
        padding_side=padding_side,
        max_length=MAX_LENGTH,
    )
    assert sorted(cut) == sorted(plain)
    for key in plain:
        assert torch.equal(cut[key], plain[key]), key


def test_truncated_scores_are_the_model_on_bos_and_the_tail():
    torch.manual_seed(0)
    net = tiny_llama().double().eval()
    lik = MultipleChoice()
    tok = llama_tokenizer()
    (batch,) = task().encode(tok, "test", max_length=MAX_LENGTH)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        got = lik.params(net(**lik.network_inputs(inputs, net)).logits, inputs)
        for b, example in enumerate(EXAMPLES):
            context = tok(example.prompt)["input_ids"]
            for k, choice in enumerate(example.choices):
                cont = tok(" " + choice, add_special_tokens=False)["input_ids"]
                full = context + cont
                ids = full if len(full) <= MAX_LENGTH else [BOS, *full[-(MAX_LENGTH - 1) :]]
                log_p = torch.log_softmax(net(input_ids=torch.tensor([ids])).logits[0], -1)
                n = len(ids)
                want = sum(float(log_p[t - 1, ids[t]]) for t in range(n - len(cont), n))
                # float64 on both sides; left padding with position ids changes only the
                # summation order of the attention: agreement to ~1e-12, 1e-8 is loose
                assert abs(float(got[b, k]) - want) < 1e-8, (b, k, float(got[b, k]), want)


def test_a_tokenizer_without_bos_is_cut_as_before():
    class NoBos:
        pad_token_id = 0

        def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
            return {"input_ids": [3 + ord(c) % 95 for c in text]}

    (cut,) = task().encode(NoBos(), "test", max_length=MAX_LENGTH)
    want = encode_multiple_choice(
        NoBos(),
        [e.prompt for e in EXAMPLES],
        [list(e.choices) for e in EXAMPLES],
        [e.answer for e in EXAMPLES],
        max_length=MAX_LENGTH,
    )
    assert sorted(cut) == sorted(want)
    for key in want:
        assert torch.equal(cut[key], want[key]), key


def test_leading_special_tokens_that_would_cover_the_choice_are_refused():
    # " purple" is 7 tokens: with max_length 8 one prompt token is left, too few for [1, 2]
    t = MultipleChoiceTask({"test": EXAMPLES[2:]}, name="colours")
    with pytest.raises(ValueError, match=r"choice 0 of prompt 0 .* special tokens \[1, 2\]"):
        t.encode(TwoSpecialTokenizer(), "test", max_length=8)
    # with room for both, every row starts with them
    (batch,) = t.encode(TwoSpecialTokenizer(), "test", max_length=9)
    assert all(row[:2] == [1, 2] for rows in real_rows(batch) for row in rows)


def _answer_token_model() -> FineTuneModel:
    torch.manual_seed(0)
    return FineTuneModel(
        tiny_llama().eval(),
        LoRA(rank=2, target_modules=["q_proj"]),
        likelihood="multiple_choice",
        choice_token_ids=[5, 6, 7],
        trainable_modules=[],
    )


def test_choice_token_ids_refuse_a_row_of_padding():
    model = _answer_token_model()
    ids = torch.randint(3, 90, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1] = 0  # an empty prompt, left-padded to the batch's length
    with pytest.raises(ValueError, match=r"attention_mask of examples \[1\] \(of 3\) is all zeros"):
        model.output({"input_ids": ids, "attention_mask": mask}, model.init_values())
    # one real token is enough: it is read
    mask[1, -1] = 1
    with torch.no_grad():
        out = model.output({"input_ids": ids, "attention_mask": mask}, model.init_values())
    assert out.shape == (3, 3) and bool(out.isfinite().all())
