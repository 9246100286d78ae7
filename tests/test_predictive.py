"""Batched posterior predictive: equals per-sample forwards, chunking-invariant, reproducible."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from tests.common import conjugate_core, tiny_bert

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")


def _bert_problem():
    torch.manual_seed(0)
    model = pb.models.FineTuneModel(
        tiny_bert(num_labels=3),
        pb.models.LoRA(rank=2, target_modules=["query", "value"]),
        num_data=20,
    )
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(2):
        data.append(
            {
                "input_ids": torch.randint(1, 99, (5, 6), generator=g),
                "attention_mask": torch.ones(5, 6, dtype=torch.long),
                "labels": torch.randint(0, 3, (5,), generator=g),
            }
        )
    guide = pb.guides.MeanFieldGuide(model, init_scale=0.3)
    return model, guide, data


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_predict_equals_per_sample_forwards(chunk):
    model, guide, data = _bert_problem()
    pred = pb.predict(model, guide, data, num_samples=8, seed=1, samples_per_forward=chunk)
    draws = guide.sample_posterior(8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        manual = torch.cat(
            [
                torch.stack(
                    [
                        torch.log_softmax(
                            model.output(
                                {k: v for k, v in b.items() if k != "labels"},
                                {s: d[i] for s, d in draws.items()},
                            ),
                            -1,
                        )
                        for i in range(8)
                    ]
                )
                for b in data
            ],
            1,
        )
    assert pred.log_probs.shape == (8, 10, 3)
    torch.testing.assert_close(pred.log_probs, manual, rtol=1e-6, atol=1e-6)
    assert torch.equal(pred.targets, torch.cat([b["labels"] for b in data]))


def test_predict_is_reproducible_and_seed_dependent():
    model, guide, data = _bert_problem()
    a = pb.predict(model, guide, data, num_samples=4, seed=3)
    b = pb.predict(model, guide, data, num_samples=4, seed=3)
    c = pb.predict(model, guide, data, num_samples=4, seed=4)
    assert torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.log_probs, c.log_probs)
    # the predictive averages probabilities, not logits
    torch.testing.assert_close(a.mean_probs, a.log_probs.exp().mean(0))


def test_gaussian_prediction_carries_loc_and_scale():
    prob = conjugate_core()
    guide = pb.guides.MeanFieldGuide(prob.model)
    pred = pb.predict(prob.model, guide, [(prob.x, prob.y)], num_samples=3)
    assert pred.log_probs is None and pred.loc.shape == (3, 64, 5) and pred.scale == 0.5
    with pytest.raises(AttributeError, match="regression"):
        _ = pred.probs


def test_map_guide_predicts_with_one_draw():
    model, _, data = _bert_problem()
    guide = pb.guides.DeltaGuide(model)
    pred = pb.predict(model, guide, data, num_samples=16)
    assert pred.num_samples == 1


def test_batches_with_and_without_labels_are_refused_naming_the_batch():
    # [(x,), (x, y)] gave log-probs for 20 examples and targets for 10, misaligned
    prob = conjugate_core(num_data=40)
    guide = pb.guides.MeanFieldGuide(prob.model)
    x, y = prob.x, prob.y
    with pytest.raises(ValueError, match=r"predict: batch 1 carries labels and batch 0 does not"):
        pb.predict(prob.model, guide, [(x[:10],), (x[10:20], y[10:20])], num_samples=2)
    with pytest.raises(ValueError, match=r"predict: batch 0 carries labels and batch 2 does not"):
        pb.predict(prob.model, guide, [(x[:5], y[:5]), (x[5:10], y[5:10]), x[10:20]])
    # the linearised predictive (Laplace's) reads the batches itself: the same refusal
    laplace = pb.guides.LaplaceGuide(prob.model, structure="diag", prior_precision="model")
    pb.fit(prob.model, laplace, [(x, y)], epochs=0)
    with pytest.raises(ValueError, match=r"predict: batch 1 carries labels and batch 0 does not"):
        pb.predict(prob.model, laplace, [(x[:10],), (x[10:20], y[10:20])])
    # all labelled or none: as before
    assert pb.predict(prob.model, guide, [(x[:10],), x[10:20]], num_samples=2).targets is None
    both = pb.predict(prob.model, guide, [(x[:10], y[:10]), (x[10:20], y[10:20])], num_samples=2)
    assert torch.equal(both.targets, y[:20])


@pytest.mark.parametrize("family", ["map", "meanfield", "laplace"])
def test_a_bfloat16_classifier_predicts_float32_log_probabilities(family):
    """bf16 logits, float32 log-softmax: a bf16 log-probability near -4 is rounded to 2^-6 nats,
    which the metrics' row-sum check and the NLL would inherit."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = pb.models.FineTuneModel(
        net.bfloat16(),
        pb.models.LoRAXS(rank=2, target_modules=["0"]),
        num_data=32,
        trainable_modules=["2"],
    )
    x, y = torch.randn(32, 4).bfloat16(), torch.arange(32) % 3
    guide = pb.posterior(model, family)
    pb.fit(model, guide, [(x, y)], epochs=1, progress=False)
    pred = pb.predict(model, guide, [(x, y)], num_samples=4)
    assert pred.log_probs.dtype == torch.float32
    logits = model.output(x, {s: v for s, v in guide.mean().items()}).float()
    if family == "map":  # one draw at the point: the float32 log-softmax of its bf16 logits,
        # up to the bf16 rounding of logits near 1 by the batched and the plain forward (2^-8)
        torch.testing.assert_close(pred.log_probs[0], logits.log_softmax(-1), rtol=0, atol=1e-2)
