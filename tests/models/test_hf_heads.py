"""Hugging Face task models: which modules ``trainable_modules="auto"`` trains, decoder
classifiers without a pad token, and multi-label targets."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS, SigmaNormEnsemble
from pyrobayes.models.finetune import task_head_modules
from pyrobayes.models.likelihoods import check_class_targets
from tests.common import tiny_bert, tiny_gpt2, tiny_llama

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=50,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    num_labels=3,
)


def tiny_roberta(**overrides):
    config = transformers.RobertaConfig(**{**SMALL, "pad_token_id": 1, **overrides})
    return transformers.RobertaForSequenceClassification(config)


def tiny_deberta(**overrides):
    config = transformers.DebertaV2Config(
        **{**SMALL, "pad_token_id": 0, "relative_attention": True, **overrides}
    )
    return transformers.DebertaV2ForSequenceClassification(config)


def decoder_classifier(arch, pad_token_id):
    small = {**SMALL, "num_key_value_heads": 2}
    if arch == "llama":
        config = transformers.LlamaConfig(**small)
        config.pad_token_id = pad_token_id
        return transformers.LlamaForSequenceClassification(config)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**small)
        config.pad_token_id = pad_token_id
        return transformers.Qwen2ForSequenceClassification(config)
    return tiny_gpt2(num_labels=3, pad_token_id=pad_token_id)


def _batch(rows=4, length=6, pad_token_id=0):
    ids = torch.randint(2, 50, (rows, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[0, 4:] = 0
    ids[0, 4:] = pad_token_id
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.arange(rows) % 3}


# ------------------------------------------------------------------------------- "auto" heads


def test_auto_leaves_a_latent_layer_of_a_composite_head_out() -> None:
    model = FineTuneModel(
        tiny_roberta(),
        LoRAXS(rank=2, target_modules=["query", "value"]),
        num_data=8,
        latent_modules=["classifier.out_proj"],
    )
    assert set(model.point_params) == {"classifier.dense.weight", "classifier.dense.bias"}
    assert {s for s in model.latent_sites if s.startswith("classifier")} == {
        "classifier.out_proj.weight",
        "classifier.out_proj.bias",
    }
    # named explicitly, the composite is still an error naming both options
    with pytest.raises(ValueError, match="Remove 'classifier' from trainable_modules"):
        FineTuneModel(
            tiny_roberta(),
            LoRAXS(rank=2, target_modules=["query", "value"]),
            num_data=8,
            latent_modules=["classifier.out_proj"],
            trainable_modules=["classifier"],
        )


def test_auto_leaves_an_adapted_layer_of_a_composite_head_out() -> None:
    model = FineTuneModel(tiny_roberta(), LoRA(rank=2, target_modules=r"classifier\.dense"))
    assert set(model.point_params) == {"classifier.out_proj.weight", "classifier.out_proj.bias"}


def test_signorm_ensemble_on_a_composite_head_with_the_default_trainable_modules() -> None:
    torch.manual_seed(0)
    model = SigmaNormEnsemble(
        tiny_roberta(), LoRAXS(rank=2, target_modules=["query", "value"]), num_members=2, num_data=8
    )
    assert model.point_params == {}  # both head layers are member (latent) heads
    guide = pb.posterior(model, "signorm")
    batch = _batch(pad_token_id=1)
    pb.fit(model, guide, [batch], epochs=1, progress=False)
    assert pb.predict(model, guide, [batch], num_samples=2).log_probs.shape == (2, 4, 3)


def test_auto_trains_the_deberta_pooler_beside_the_classifier() -> None:
    net = tiny_deberta()
    assert task_head_modules(net) == ["pooler", "classifier"]
    model = FineTuneModel(net, LoRA(rank=2, target_modules=["query_proj", "value_proj"]))
    assert set(model.point_params) == {
        "pooler.dense.weight",
        "pooler.dense.bias",
        "classifier.weight",
        "classifier.bias",
    }
    assert all(p.requires_grad for p in model.point_params.values())


def test_auto_keeps_pretrained_poolers_and_language_model_heads_frozen() -> None:
    # BERT's pooler sits inside the (pretrained) base model
    assert task_head_modules(tiny_bert()) == ["classifier"]
    # a causal LM's head is the output embeddings (tied to the input embeddings): not a task head
    assert task_head_modules(tiny_llama()) == []
    assert task_head_modules(tiny_llama(tie_word_embeddings=False)) == []
    gpt2_lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2))
    assert task_head_modules(gpt2_lm) == []
    assert task_head_modules(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []
    model = FineTuneModel(tiny_llama(), LoRA(rank=2, target_modules=["q_proj"]), num_data=8)
    assert model.point_params == {}


# ------------------------------------------------------------------------------- pad token


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_a_decoder_classifier_without_pad_token_is_refused(arch) -> None:
    targets = ["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match=r"pad_token_id is None.*pad_token_id = tokenizer"):
        FineTuneModel(decoder_classifier(arch, None), LoRA(rank=2, target_modules=targets))
    # with a pad token, S draws of a batch of one run in one forward
    torch.manual_seed(0)
    model = FineTuneModel(
        decoder_classifier(arch, 0), LoRA(rank=2, target_modules=targets), num_data=4
    )
    guide = pb.posterior(model, "meanfield")
    batch = {k: v[1:2] for k, v in _batch().items()}
    assert pb.predict(model, guide, [batch], num_samples=3).log_probs.shape == (3, 1, 3)


def test_models_that_need_no_pad_token_are_accepted_without_one() -> None:
    # a causal LM (multiple-choice scoring) and an encoder classifier pooling the first token
    FineTuneModel(tiny_llama(pad_token_id=None), LoRA(rank=2, target_modules=["q_proj"]))
    FineTuneModel(tiny_bert(pad_token_id=None), LoRA(rank=2, target_modules=["query"]))


# ------------------------------------------------------------------------------- multi-label


@pytest.mark.parametrize("dtype", [torch.float32, torch.long])
def test_multi_hot_labels_are_refused_as_multi_label(dtype) -> None:
    logits = torch.randn(1, 5, 3)
    multi_hot = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=dtype)
    with pytest.raises(ValueError, match=r"\(5, 3\).*multi-label.*argmax.*likelihood='bernoulli'"):
        check_class_targets(multi_hot, logits.shape)
    # one label per example, or one per draw and example, as before
    assert check_class_targets(torch.tensor([0, 2, 1, 0, 2]), logits.shape).shape == (5,)
    assert check_class_targets(torch.zeros(2, 5, dtype=torch.long), (2, 5, 3)).shape == (2, 5)
    with pytest.raises(ValueError, match="integer class indices"):
        check_class_targets(torch.zeros(5), logits.shape)


def test_a_multi_label_classifier_is_refused_at_construction() -> None:
    net = tiny_bert(num_labels=3, problem_type="multi_label_classification")
    with pytest.raises(ValueError, match=r"multi_label_classification.*likelihood='bernoulli'"):
        FineTuneModel(net, LoRA(rank=2, target_modules=["query"]))
    # the Gaussian likelihood (regression on the outputs) does not read class labels
    FineTuneModel(
        tiny_bert(num_labels=3, problem_type="multi_label_classification"),
        LoRA(rank=2, target_modules=["query"]),
        likelihood="gaussian",
    )


def test_a_regression_head_under_the_categorical_likelihood_is_refused() -> None:
    # problem_type="regression" with num_labels = 3 was read as three class logits
    net = tiny_bert(num_labels=3, problem_type="regression")
    with pytest.raises(ValueError, match=r"'regression'.*likelihood='gaussian'"):
        FineTuneModel(net, LoRA(rank=2, target_modules=["query"]))
    FineTuneModel(net, LoRA(rank=2, target_modules=["query"]), likelihood="gaussian")
