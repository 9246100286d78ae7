"""Batched posterior predictive: equals per-sample forwards, chunking-invariant, reproducible."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from tests.common import conjugate_core, tiny_bert


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
