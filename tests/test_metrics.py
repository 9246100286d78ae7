"""Tests for pyrobayes.metrics: hand-computed examples and reference implementations."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch
from sklearn.metrics import accuracy_score, brier_score_loss, roc_auc_score
from torch.distributions import Categorical, MixtureSameFamily, Normal, kl_divergence
from torchmetrics.classification import MulticlassCalibrationError

from pyrobayes.metrics import (
    CalibrationError,
    accuracy,
    auroc,
    brier_score,
    calibration_error,
    disagreement,
    ece,
    expected_entropy,
    gaussian_nll,
    gaussian_rmse,
    max_prob_score,
    mean_probs,
    mutual_information,
    nll,
    ood_auroc,
    pairwise_kl,
    predictive_entropy,
    predictive_log_probs,
    report,
)

# Two members (S = 2), two examples (N = 2), three classes:
#   p_1 = [[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]],  p_2 = [[0.4, 0.5, 0.1], [0.3, 0.3, 0.4]]
#   p_bar = [[0.55, 0.35, 0.10], [0.20, 0.30, 0.50]],  labels y = [0, 1]
P1 = [[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]]
P2 = [[0.4, 0.5, 0.1], [0.3, 0.3, 0.4]]


def hand_probs() -> torch.Tensor:
    return torch.tensor([P1, P2])


def hand_labels() -> torch.Tensor:
    return torch.tensor([0, 1])


def entropy(p: list[float]) -> float:
    return -sum(x * math.log(x) for x in p if x > 0)


def random_probs(num_samples: int, num_examples: int, num_classes: int) -> torch.Tensor:
    logits = 2.0 * torch.randn(num_samples, num_examples, num_classes)
    return torch.softmax(logits + torch.randn(1, num_examples, num_classes), dim=-1)


def labels_from(probs: torch.Tensor) -> torch.Tensor:
    """Labels drawn from the predictive itself, so the model is roughly calibrated."""
    return torch.distributions.Categorical(probs=probs.mean(0)).sample()


# ----------------------------------------------------------------------------------------------
# hand-computed examples
# ----------------------------------------------------------------------------------------------


def test_mean_and_log_predictive() -> None:
    expected = torch.tensor([[0.55, 0.35, 0.10], [0.20, 0.30, 0.50]])
    assert torch.allclose(mean_probs(hand_probs()), expected, atol=1e-15)
    assert torch.allclose(predictive_log_probs(hand_probs().log()), expected.log(), atol=1e-14)


def test_accuracy_hand() -> None:
    # argmax p_bar = [0, 2] vs y = [0, 1] -> [correct, wrong] -> 0.5
    assert accuracy(hand_probs(), hand_labels()) == 0.5
    # a point model given as (N, C): argmax p_2 = [1, 2] -> both wrong
    assert accuracy(torch.tensor(P2), hand_labels()) == 0.0


def test_nll_hand() -> None:
    # -(log 0.55 + log 0.30) / 2
    expected = -(math.log(0.55) + math.log(0.30)) / 2
    assert nll(hand_probs(), hand_labels()) == pytest.approx(expected, rel=1e-14)
    assert nll(None, hand_labels(), log_probs=hand_probs().log()) == pytest.approx(
        expected, rel=1e-14
    )


def test_nll_is_log_mean_exp_not_mean_log() -> None:
    # p_1(y) = 0.9, p_2(y) = 0.1: the predictive gives y probability 0.5, so NLL = log 2 = 0.693,
    # while the mean per-sample NLL is -(log 0.9 + log 0.1) / 2 = 1.204 (Jensen).
    probs = torch.tensor([[[0.9, 0.1]], [[0.1, 0.9]]])
    labels = torch.tensor([0])
    assert nll(probs, labels) == pytest.approx(math.log(2.0), rel=1e-14)
    mean_of_logs = -(math.log(0.9) + math.log(0.1)) / 2
    assert abs(nll(probs, labels) - mean_of_logs) > 0.5


def test_nll_from_log_probs_survives_underflow() -> None:
    # log p_s(y) = -1000, -1001: exp underflows to 0 (NLL from probs = inf), but in log space
    # NLL = -(logsumexp(-1000, -1001) - log 2) = 1000 - log((1 + e^-1) / 2).
    log_probs = torch.tensor([[[-1000.0, 0.0]], [[-1001.0, 0.0]]])
    labels = torch.tensor([0])
    expected = 1000.0 - math.log((1.0 + math.exp(-1.0)) / 2.0)
    assert nll(None, labels, log_probs=log_probs) == pytest.approx(expected, rel=1e-14)
    assert nll(log_probs.exp(), labels) == math.inf


def test_brier_hand() -> None:
    # row 1: (0.55 - 1)^2 + 0.35^2 + 0.1^2 = 0.2025 + 0.1225 + 0.01 = 0.335
    # row 2: 0.2^2 + (0.3 - 1)^2 + 0.5^2 = 0.04 + 0.49 + 0.25 = 0.78      -> mean 0.5575
    assert brier_score(hand_probs(), hand_labels()) == pytest.approx(0.5575, rel=1e-13)
    # perfect and maximally wrong one-hot predictions hit the ends of [0, 2]
    one_hot = torch.eye(3).unsqueeze(0)
    assert brier_score(one_hot, torch.tensor([0, 1, 2])) == 0.0
    assert brier_score(one_hot, torch.tensor([1, 2, 0])) == 2.0


def test_entropies_and_mutual_information_hand() -> None:
    h_pred = torch.tensor([entropy([0.55, 0.35, 0.10]), entropy([0.20, 0.30, 0.50])])
    h_exp = torch.tensor(
        [(entropy(P1[0]) + entropy(P2[0])) / 2, (entropy(P1[1]) + entropy(P2[1])) / 2]
    )
    assert torch.allclose(predictive_entropy(hand_probs()), h_pred, atol=1e-14)
    assert torch.allclose(expected_entropy(hand_probs()), h_exp, atol=1e-14)
    assert torch.allclose(mutual_information(hand_probs()), h_pred - h_exp, atol=1e-14)
    assert torch.all(h_pred - h_exp > 0.01)  # the members disagree, so MI is clearly positive
    # 1 - max p_bar = [1 - 0.55, 1 - 0.5]
    assert torch.allclose(max_prob_score(hand_probs()), torch.tensor([0.45, 0.5]), atol=1e-15)
    # uniform predictions have maximal entropy log C
    assert predictive_entropy(torch.full((1, 1, 4), 0.25)).item() == pytest.approx(math.log(4))


def test_mutual_information_zero_for_point_model_and_nonnegative() -> None:
    probs = random_probs(1, 500, 5)
    assert torch.all(mutual_information(probs) == 0.0)
    assert torch.all(mutual_information(probs[0]) == 0.0)  # (N, C) input is S = 1
    many = random_probs(8, 500, 5)
    mi = mutual_information(many)
    assert mi.shape == (500,)
    assert torch.all(mi >= 0.0)
    assert mi.mean() > 0.01
    assert torch.all(mi <= predictive_entropy(many) + 1e-12)  # MI <= H[p_bar]
    # identical members carry no epistemic uncertainty
    same = probs.expand(4, -1, -1)
    assert torch.allclose(mutual_information(same), torch.zeros(500), atol=1e-12)


def test_calibration_error_hand() -> None:
    # Point model, 2 bins (0, 0.5] and (0.5, 1]:
    #   conf 0.5  pred 0 y 0 correct -> bin 1 (0.5 is the right edge of bin 1)
    #   conf 0.4  pred 0 y 1 wrong   -> bin 1
    #   conf 0.6  pred 1 y 1 correct -> bin 2
    #   conf 0.9  pred 0 y 2 wrong   -> bin 2
    #   conf 1.0  pred 1 y 1 correct -> bin 2
    # bin 1: n 2, acc 1/2, conf 0.45, gap 0.05; bin 2: n 3, acc 2/3, conf 2.5/3, gap 1/6
    # ECE = 2/5 * 0.05 + 3/5 * 1/6 = 0.02 + 0.1 = 0.12; MCE = 1/6
    probs = torch.tensor(
        [
            [0.5, 0.3, 0.2],
            [0.4, 0.35, 0.25],
            [0.1, 0.6, 0.3],
            [0.9, 0.05, 0.05],
            [0.0, 1.0, 0.0],
        ]
    )
    labels = torch.tensor([0, 1, 1, 2, 1])
    result = calibration_error(probs, labels, num_bins=2)
    assert isinstance(result, CalibrationError)
    assert result.num_bins == 2
    assert result.bin_counts.tolist() == [2, 3]
    assert torch.allclose(result.bin_accuracy, torch.tensor([0.5, 2 / 3]), atol=1e-15)
    assert torch.allclose(result.bin_confidence, torch.tensor([0.45, 2.5 / 3]), atol=1e-15)
    assert result.ece == pytest.approx(0.12, rel=1e-13)
    assert result.mce == pytest.approx(1 / 6, rel=1e-13)
    assert ece(probs, labels, num_bins=2) == result.ece


def test_calibration_error_bins_and_empty_bins() -> None:
    # default 15 bins, stored; all 3 examples at conf 0.9 -> bin 14 = (13/15, 14/15]
    probs = torch.tensor([[0.9, 0.1]] * 3)
    result = calibration_error(probs, torch.tensor([0, 0, 1]))
    assert result.num_bins == 15 and result.bin_counts.shape == (15,)
    assert result.bin_counts[13] == 3 and result.bin_counts.sum() == 3
    # empty bins report 0 and contribute nothing: ECE = |2/3 - 0.9|
    assert torch.all(result.bin_accuracy[result.bin_counts == 0] == 0)
    assert result.ece == pytest.approx(0.9 - 2 / 3, rel=1e-13)
    assert result.mce == pytest.approx(0.9 - 2 / 3, rel=1e-13)
    # a confidence on a bin edge goes to the bin it closes: 0.5 in (0.25, 0.5], the second
    edge = calibration_error(torch.tensor([[0.5, 0.5]]), torch.tensor([0]), num_bins=4)
    assert edge.bin_counts.tolist() == [0, 1, 0, 0]
    # an all-zero row (confidence 0) is no distribution: refused, not binned
    with pytest.raises(ValueError, match="sums are off from 1"):
        calibration_error(torch.zeros(1, 2), torch.tensor([0]), num_bins=4)


def test_auroc_hand_with_ties() -> None:
    # ID [0.1, 0.4, 0.35, 0.8], OOD [0.8, 0.9, 0.4]; count OOD > ID pairs, ties 1/2:
    #   0.8: beats 0.1, 0.4, 0.35, ties 0.8 -> 3.5;  0.9: beats all -> 4;
    #   0.4: beats 0.1, 0.35, ties 0.4 -> 2.5;   AUROC = (3.5 + 4 + 2.5) / 12 = 10/12
    id_scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    ood_scores = torch.tensor([0.8, 0.9, 0.4])
    assert ood_auroc(id_scores, ood_scores) == pytest.approx(10 / 12, rel=1e-14)
    assert ood_auroc(ood_scores, id_scores) == pytest.approx(2 / 12, rel=1e-14)
    assert ood_auroc(torch.ones(3), torch.ones(5)) == 0.5  # all tied


def test_diversity_hand() -> None:
    # argmax p_1 = [0, 2], argmax p_2 = [1, 2]: the pair disagrees on 1 of 2 examples -> 0.5
    assert disagreement(hand_probs()) == pytest.approx(0.5, rel=1e-14)
    # mean over the two ordered pairs and both examples of KL(p_s || p_s')
    kls = [
        sum(a * math.log(a / b) for a, b in zip(P[n], Q[n], strict=True))
        for P, Q in ((P1, P2), (P2, P1))
        for n in range(2)
    ]
    assert pairwise_kl(hand_probs()) == pytest.approx(sum(kls) / 4, rel=1e-12)
    assert pairwise_kl(None, log_probs=hand_probs().log()) == pytest.approx(sum(kls) / 4, rel=1e-12)
    # one member, or identical members: no diversity
    assert disagreement(hand_probs()[:1]) == 0.0 and pairwise_kl(hand_probs()[:1]) == 0.0
    same = hand_probs()[:1].expand(3, -1, -1)
    assert disagreement(same) == 0.0
    assert pairwise_kl(same) == pytest.approx(0.0, abs=1e-14)
    # a member that rules out a class another one supports: infinite KL
    assert pairwise_kl(torch.tensor([[[1.0, 0.0]], [[0.5, 0.5]]])) == math.inf


def test_gaussian_metrics_hand() -> None:
    # means (S=2, N=2) = [[0, 1], [2, 3]], y = [1, 1], sigma = 1
    # predictive mean [1, 2] -> RMSE = sqrt((0 + 1) / 2)
    means = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
    targets = torch.tensor([1.0, 1.0])
    assert gaussian_rmse(means, targets) == pytest.approx(math.sqrt(0.5), rel=1e-14)
    # n = 1: both components at distance 1 -> log N = -log(2 pi)/2 - 1/2
    # n = 2: distances 0 and 2 -> -log(2 pi)/2 + log((1 + e^-2) / 2)
    half_log_2pi = 0.5 * math.log(2 * math.pi)
    lp1 = -half_log_2pi - 0.5
    lp2 = -half_log_2pi + math.log((1 + math.exp(-2.0)) / 2)
    assert gaussian_nll(means, targets, 1.0) == pytest.approx(-(lp1 + lp2) / 2, rel=1e-14)


def test_gaussian_nll_matches_mixture_density() -> None:
    means = torch.randn(6, 50)
    targets = torch.randn(50)
    scales = 0.3 + torch.rand(6, 1)  # per-sample noise scale, broadcast over examples
    mixture = MixtureSameFamily(
        Categorical(logits=torch.zeros(50, 6)), Normal(means.T, scales.T.expand(50, 6))
    )
    expected = -mixture.log_prob(targets).mean().item()
    assert gaussian_nll(means, targets, scales) == pytest.approx(expected, rel=1e-12)
    # a point model, (N,) means: plain Gaussian NLL
    point = -Normal(means[0], 0.5).log_prob(targets).mean().item()
    assert gaussian_nll(means[0], targets, 0.5) == pytest.approx(point, rel=1e-12)
    with pytest.raises(ValueError):
        gaussian_nll(means, targets, 0.0)


# ----------------------------------------------------------------------------------------------
# reference implementations on random data
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_bins", [15, 7])
def test_calibration_matches_torchmetrics(num_bins: int) -> None:
    # torchmetrics bins [lo, hi) where we bin (lo, hi], and casts confidences to float32; both only
    # matter for confidences within ~1e-7 of a bin edge, which continuous random data avoids
    # (about 2000 * 14 * 1.2e-7 ~ 3e-3 chance per data set). float32 round-off in the binned
    # means is <= 1e-7, so atol 1e-6.
    probs = random_probs(5, 2000, 4)
    labels = labels_from(probs)
    p_bar = probs.mean(0)
    ours = calibration_error(probs, labels, num_bins=num_bins)
    for norm, value in (("l1", ours.ece), ("max", ours.mce)):
        metric = MulticlassCalibrationError(num_classes=4, n_bins=num_bins, norm=norm)
        assert value == pytest.approx(metric(p_bar, labels).item(), abs=1e-6)
    assert ours.bin_counts.sum().item() == 2000
    assert 0.0 < ours.ece < ours.mce


def test_brier_and_accuracy_match_sklearn() -> None:
    probs = random_probs(3, 1000, 5)
    labels = labels_from(probs)
    p_bar = probs.mean(0).numpy()
    # multi-class: sklearn's sum_c (p_c - y_c)^2 over [0, 2] when not halved
    sk_brier = brier_score_loss(labels.numpy(), p_bar, labels=list(range(5)), scale_by_half=False)
    assert brier_score(probs, labels) == pytest.approx(sk_brier, rel=1e-12)
    assert accuracy(probs, labels) == pytest.approx(
        accuracy_score(labels.numpy(), p_bar.argmax(-1)), rel=1e-15
    )
    # binary: sklearn's default is (p_1 - y)^2 in [0, 1]; ours sums both classes,
    # (p_0 - [y=0])^2 + (p_1 - [y=1])^2 = 2 (p_1 - y)^2, so ours / 2 equals sklearn's.
    binary = random_probs(3, 1000, 2)
    y = labels_from(binary)
    sk_binary = brier_score_loss(y.numpy(), binary.mean(0)[:, 1].numpy())
    assert brier_score(binary, y) / 2 == pytest.approx(sk_binary, rel=1e-12)


def test_auroc_matches_sklearn_with_ties() -> None:
    # rounding to one decimal makes heavy ties (only ~20 distinct values for 700 scores)
    id_scores = torch.round(torch.randn(400), decimals=1)
    ood_scores = torch.round(torch.randn(300) + 0.7, decimals=1)
    scores = torch.cat([id_scores, ood_scores])
    labels = torch.cat([torch.zeros(400, dtype=torch.long), torch.ones(300, dtype=torch.long)])
    expected = roc_auc_score(labels.numpy(), scores.numpy())
    assert auroc(scores, labels) == pytest.approx(expected, rel=1e-13)
    # auroc calls scikit-learn; the independent reference is the pairwise Mann-Whitney count
    wins = (ood_scores[:, None] > id_scores[None, :]).double().sum()
    ties = (ood_scores[:, None] == id_scores[None, :]).double().sum()
    assert auroc(scores, labels) == pytest.approx(
        ((wins + ties / 2) / (400 * 300)).item(), rel=1e-13
    )
    # infinite scores keep their order (scikit-learn alone refuses them): the +inf positive beats
    # -inf and 0 and ties the +inf negative, 2.5 / 3
    inf = float("inf")
    assert auroc(torch.tensor([-inf, 0.0, inf, inf]), torch.tensor([0, 0, 1, 0])) == 2.5 / 3
    assert ood_auroc(id_scores, ood_scores) == pytest.approx(expected, rel=1e-13)
    # a random permutation does not change the statistic
    perm = torch.randperm(700)
    assert auroc(scores[perm], labels[perm]) == pytest.approx(expected, rel=1e-13)
    with pytest.raises(ValueError):
        auroc(scores, torch.zeros(700, dtype=torch.long))


def test_diversity_matches_brute_force() -> None:
    probs = random_probs(5, 300, 4)
    preds = probs.argmax(-1)
    pairs = [(s, t) for s in range(5) for t in range(5) if s != t]
    brute_dis = sum((preds[s] != preds[t]).double().mean() for s, t in pairs) / len(pairs)
    brute_kl = sum(
        kl_divergence(Categorical(probs=probs[s]), Categorical(probs=probs[t])).mean()
        for s, t in pairs
    ) / len(pairs)
    assert disagreement(probs) == pytest.approx(brute_dis.item(), rel=1e-12)
    assert pairwise_kl(probs) == pytest.approx(brute_kl.item(), rel=1e-10)


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def test_report_tensor_and_duck_typed_prediction() -> None:
    probs = random_probs(4, 300, 3)
    labels = labels_from(probs)
    result = report(probs, labels)
    assert set(result) == {
        "accuracy",
        "nll",
        "ece",
        "ece_bins",
        "brier",
        "entropy",
        "mutual_information",
    }
    assert all(isinstance(v, float) for v in result.values())
    assert result["accuracy"] == accuracy(probs, labels)
    assert result["nll"] == pytest.approx(nll(probs, labels), rel=1e-12)
    assert result["ece"] == ece(probs, labels)
    assert result["ece_bins"] == 15.0
    assert result["brier"] == brier_score(probs, labels)
    assert result["entropy"] == pytest.approx(predictive_entropy(probs).mean().item())
    assert result["mutual_information"] == pytest.approx(mutual_information(probs).mean().item())
    # an object with probs / log_probs: the log-probs drive the NLL
    log_probs = probs.log()
    prediction = SimpleNamespace(probs=probs, log_probs=log_probs)
    from_object = report(prediction, labels, num_bins=10)
    assert from_object["ece_bins"] == 10.0
    assert from_object["nll"] == pytest.approx(nll(None, labels, log_probs=log_probs), rel=1e-12)
    # a label whose probability underflows (log p = -2000): its log-probability still counts
    tiny = torch.tensor([[[0.0, -2000.0], [-2000.0, 0.0]]], dtype=torch.float64)
    underflow = SimpleNamespace(probs=tiny.exp(), log_probs=tiny)
    assert report(underflow, torch.tensor([1, 1]))["nll"] == pytest.approx(1000.0, rel=1e-12)
    with pytest.raises(TypeError):
        report([[0.5, 0.5]], labels)


def test_report_ood_aurocs() -> None:
    # ID: members agree on a confident class; OOD: members are confident about different
    # classes, so p_bar is near uniform and MI is large -> all three scores separate well.
    id_logits = torch.zeros(4, 200, 3)
    id_logits[..., 0] = 6.0
    id_probs = torch.softmax(id_logits + 0.3 * torch.randn(4, 200, 3), -1)
    ood_logits = 6.0 * torch.eye(3)[torch.arange(4) % 3].unsqueeze(1).expand(4, 150, 3)
    ood_probs = torch.softmax(ood_logits + 0.3 * torch.randn(4, 150, 3), -1)
    labels = torch.zeros(200, dtype=torch.long)
    result = report(id_probs, labels, ood_probs=SimpleNamespace(probs=ood_probs))
    for key in ("auroc_entropy", "auroc_maxprob", "auroc_mi"):
        assert result[key] > 0.99
    assert result["accuracy"] == 1.0
    # swapping the roles flips the AUROC to 1 - AUROC
    swapped = report(ood_probs, torch.zeros(150, dtype=torch.long), ood_probs=id_probs)
    assert swapped["auroc_mi"] == pytest.approx(1.0 - result["auroc_mi"], abs=1e-12)


def test_input_validation() -> None:
    with pytest.raises(TypeError):
        accuracy(hand_probs(), torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError):
        accuracy(hand_probs(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError):
        nll(hand_probs(), torch.tensor([0, 3]))
    with pytest.raises(ValueError):
        brier_score(torch.ones(2, 2, 2, 2), hand_labels())


def test_ece_floor_is_the_mean_ece_of_labels_drawn_from_the_predictive():
    from pyrobayes.metrics import calibration_error, ece_floor

    torch.manual_seed(0)
    probs = torch.softmax(2 * torch.randn(4, 37, 3, dtype=torch.float64), dim=-1)  # (S, N, C)
    mean, sd = ece_floor(probs, num_draws=50, seed=3)
    # the same draws, turned into labels (top label when z_n = 1, another class otherwise) and
    # scored by calibration_error: the floor is their mean ECE exactly
    p_bar = probs.mean(0)
    conf, top = p_bar.max(-1)
    z = torch.rand(50, 37, generator=torch.Generator().manual_seed(3), dtype=torch.float64) < conf
    eces = torch.tensor(
        [calibration_error(probs, torch.where(zd, top, (top + 1) % 3)).ece for zd in z]
    )
    assert mean == pytest.approx(float(eces.mean()), abs=1e-12)
    assert sd == pytest.approx(float(eces.std()), abs=1e-12)


@pytest.mark.parametrize("c", [0.4, 0.9])
def test_ece_floor_of_one_example_is_two_c_one_minus_c(c):
    from pyrobayes.metrics import ece_floor

    # one example: ECE = |z - c|, z ~ Bernoulli(c), so E = c(1 - c) + (1 - c)c = 2c(1 - c) and
    # sd = sqrt(E[(z-c)^2] - E^2) = sqrt(c(1-c) - 4c^2(1-c)^2); the estimate over D draws is
    # within 4 sd / sqrt(D) of E
    probs = torch.tensor([[c, 1 - c]], dtype=torch.float64)
    draws = 4000
    mean, _ = ece_floor(probs, num_draws=draws, seed=0)
    sd = math.sqrt(c * (1 - c) - 4 * c**2 * (1 - c) ** 2)
    assert abs(mean - 2 * c * (1 - c)) <= 4 * sd / math.sqrt(draws)


# ----------------------------------------------------------------------------------------------
# invalid input
# ----------------------------------------------------------------------------------------------


def test_probabilities_that_are_not_distributions_are_refused() -> None:
    labels = torch.tensor([0, 1])
    # the probe's cases: a row summing to 1.4 gave an NLL of unnormalised numbers, a negative
    # entry a negative NLL and a NaN entropy
    unnormalised = torch.tensor([[0.7, 0.7], [0.2, 0.8]], dtype=torch.float64)
    negative = torch.tensor([[1.2, -0.2], [0.2, 0.8]], dtype=torch.float64)
    above_one = torch.tensor([[1.5, 0.2], [0.2, 0.8]], dtype=torch.float64)
    for call in (report, nll, ece, brier_score, accuracy):
        with pytest.raises(ValueError, match=r"sums are off from 1 .* furthest sums to 1\.4"):
            call(unnormalised, labels)
        with pytest.raises(ValueError, match=r"negative entries \(the smallest is -0\.2\)"):
            call(negative, labels)
        with pytest.raises(ValueError, match=r"entries above 1 \(the largest is 1\.5\)"):
            call(above_one, labels)
    for call in (predictive_entropy, expected_entropy, mutual_information, max_prob_score):
        with pytest.raises(ValueError, match="at examples \\[0\\] \\(of 2\\)"):
            call(negative)
    with pytest.raises(ValueError, match="ood_probs must hold probabilities"):
        report(unnormalised.abs().softmax(-1), labels, ood_probs=unnormalised)
    # logits passed as log-probabilities: exp(log_probs) is no distribution
    with pytest.raises(ValueError, match=r"exp\(log_probs\) must hold probabilities"):
        nll(None, labels, log_probs=torch.tensor([[2.0, -1.0], [0.5, 0.1]]))
    # ... and beside probs (nll gave -2.0 for logits there; report of an object holding both,
    # pairwise_kl), and into predictive_log_probs ("log-probabilities" above 0)
    probs = torch.tensor([[0.9, 0.1], [0.4, 0.6]])
    logits = torch.tensor([[2.0, -1.0], [0.5, 0.1]])
    with pytest.raises(ValueError, match=r"exp\(log_probs\) must .*torch.log_softmax"):
        nll(probs, labels, log_probs=logits)
    with pytest.raises(ValueError, match=r"exp\(log_probs\) must hold probabilities"):
        report(SimpleNamespace(probs=probs, log_probs=logits), labels)
    with pytest.raises(ValueError, match=r"exp\(log_probs\) must hold probabilities"):
        pairwise_kl(probs[None].expand(2, -1, -1), log_probs=logits[None].expand(2, -1, -1))
    with pytest.raises(ValueError, match=r"exp\(log_probs\) must hold probabilities"):
        predictive_log_probs(logits)
    assert torch.allclose(predictive_log_probs(probs.log()), probs.log())  # the right input
    # NaN keeps its own message (the examples whose inputs are probably not finite)
    with pytest.raises(ValueError, match="probs holds NaN at examples \\[1\\]"):
        report(torch.tensor([[0.5, 0.5], [math.nan, 0.5]]), labels)


def test_float_round_off_in_the_row_sums_is_accepted() -> None:
    labels = torch.tensor([0, 1])
    # a row off by 1e-7 (float64) and by 5e-5 (float32, half its 1e-4 tolerance) is round-off
    off64 = torch.tensor([[0.7, 0.3 + 1e-7], [0.2, 0.8]], dtype=torch.float64)
    assert nll(off64, labels) == pytest.approx(-(math.log(0.7) + math.log(0.8)) / 2)
    off32 = torch.tensor([[0.7, 0.3 + 5e-5], [0.2, 0.8]], dtype=torch.float32)
    assert math.isfinite(report(off32, labels)["nll"])
    with pytest.raises(ValueError, match="torch.float32 tolerance 1e-04"):
        nll(torch.tensor([[0.7, 0.301], [0.2, 0.8]], dtype=torch.float32), labels)
    # a float32 softmax over a large vocabulary, and exp of its log_softmax, pass
    logits = 30.0 * torch.randn(2, 4, 50_000, dtype=torch.float32)
    big_labels = torch.randint(0, 50_000, (4,))
    assert math.isfinite(brier_score(torch.softmax(logits, -1), big_labels))
    assert math.isfinite(nll(None, big_labels, log_probs=torch.log_softmax(logits, -1)))


def test_num_bins_and_num_draws_must_be_integers() -> None:
    probs, labels = hand_probs(), hand_labels()
    for bad in (2.5, True, "3"):
        with pytest.raises(TypeError, match="num_bins must be an integer >= 1"):
            ece(probs, labels, num_bins=bad)
    with pytest.raises(TypeError, match=r"pass num_bins=10"):
        report(probs, labels, num_bins=10.0)
    with pytest.raises(ValueError, match="num_bins must be an integer >= 1; got 0"):
        calibration_error(probs, labels, num_bins=0)
    from pyrobayes.metrics import ece_floor

    with pytest.raises(TypeError, match="ece_floor: num_draws must be an integer >= 2"):
        ece_floor(probs, num_draws=10.5)
    assert ece(probs, labels, num_bins=torch.tensor(4)) == ece(probs, labels, num_bins=4)


def test_gaussian_nll_refuses_bad_scales_and_reads_a_per_sample_vector() -> None:
    means, targets = torch.randn(6, 50), torch.randn(50)
    for bad in (math.nan, math.inf, 0.0, -1.0):
        with pytest.raises(ValueError, match="noise_scale must be finite and > 0"):
            gaussian_nll(means, targets, bad)
    with pytest.raises(ValueError, match="noise_scale must be finite and > 0"):
        gaussian_nll(means, targets, torch.tensor([[0.5], [math.nan], *[[0.5]] * 4]))
    # (S,) is the documented per-sample (S, 1) when S != N
    scales = 0.3 + torch.rand(6)
    assert gaussian_nll(means, targets, scales) == gaussian_nll(means, targets, scales[:, None])
    # S == N: a 1-D scale could be either; refused rather than guessed
    square = torch.randn(5, 5)
    with pytest.raises(ValueError, match=r"ambiguous .* pass it as \(5, 1\) .* or \(1, 5\)"):
        gaussian_nll(square, torch.randn(5), 0.3 + torch.rand(5))
    with pytest.raises(ValueError, match=r"shape \(7,\) does not broadcast to the means' \(S, N\)"):
        gaussian_nll(means, targets, torch.ones(7))


def test_ood_auroc_compares_scores_of_mixed_types_in_their_common_type() -> None:
    # integer ID scores truncated float OOD scores (2.5 -> 2, 3.5 -> 3): 0.667 for 5/6
    assert ood_auroc(torch.tensor([1, 2, 3]), torch.tensor([2.5, 3.5])) == pytest.approx(5 / 6)
    assert ood_auroc(torch.tensor([2.5, 3.5]), torch.tensor([1, 2, 3])) == pytest.approx(1 / 6)


def test_ood_auroc_refuses_scores_that_are_not_one_per_example() -> None:
    # a 2-D id_scores was flattened: 6 "examples" from 3
    with pytest.raises(ValueError, match=r"id_scores must be 1-D.* got shape \(3, 2\)"):
        ood_auroc(torch.rand(3, 2), torch.rand(4))
    with pytest.raises(ValueError, match=r"ood_scores must be 1-D.* got shape \(4, 1\)"):
        ood_auroc(torch.rand(3), torch.rand(4, 1))
    with pytest.raises(ValueError, match="ood_scores is empty"):
        ood_auroc(torch.rand(3), torch.rand(0))
    with pytest.raises(TypeError, match="id_scores must be a torch.Tensor"):
        ood_auroc([0.1, 0.2], torch.rand(4))
    assert ood_auroc(torch.zeros(5), torch.ones(5)) == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_probabilities_are_scored_in_float32(dtype):
    """Bin counts, accuracies and sums over N = 5000 examples run in float32: in bfloat16 a
    running count stops at 256 (the top bin's accuracy came out .410 for .958) and fp16 logs
    of small probabilities underflowed (pairwise KL inf). The half inputs' metrics equal the
    float32 metrics of the same rounded values (renormalised to pass the float32 check) to
    within what the renormalisation moves."""
    torch.manual_seed(0)
    conf = 0.5 + 0.5 * torch.rand(5000)
    labels = torch.where(torch.rand(5000) < conf, 0, 1)
    half = torch.stack([conf, 1 - conf], -1)[None].to(dtype)
    rounded = half.double()
    rounded = (rounded / rounded.sum(-1, keepdim=True)).float()  # the same values, renormalised
    got, want = calibration_error(half, labels), calibration_error(rounded, labels)
    assert int(got.bin_counts.sum()) == 5000  # every example counted
    # the renormalisation moves confidences by < 2^-8, a few across bin edges: ECE within 2e-3
    assert abs(got.ece - want.ece) < 2e-3
    assert float(got.bin_accuracy[-1]) > 0.9
    assert brier_score(half, labels) == pytest.approx(brier_score(rounded, labels), abs=2e-3)
    assert math.isfinite(pairwise_kl(half))


def test_half_precision_regression_means_are_scored_in_float32():
    """A bf16 network's predictive means with float32 targets: the NLL and RMSE of the bf16
    values computed in float32 (the targets were cast down to bf16 before)."""
    torch.manual_seed(0)
    means = torch.randn(4, 300).to(torch.bfloat16)
    targets = torch.randn(300)
    assert gaussian_nll(means, targets, 0.7) == pytest.approx(
        gaussian_nll(means.float(), targets, 0.7), rel=1e-6
    )
    assert gaussian_rmse(means, targets) == pytest.approx(
        gaussian_rmse(means.float(), targets), rel=1e-6
    )


def test_report_warns_when_labels_are_not_the_predictions_own_targets() -> None:
    # labels from the data set in another order than the loader's gave accuracy .34 for .98
    from pyrobayes.predictive import Prediction

    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (200,), generator=g)
    logits = 3.0 * torch.nn.functional.one_hot(y, 3) + torch.randn(200, 3, generator=g)
    pred = Prediction(log_probs=logits.log_softmax(-1)[None], targets=y)
    shuffled = y[torch.randperm(200, generator=g)]
    with pytest.warns(UserWarning, match=r"labels differ from the prediction's own targets at"):
        report(pred, shuffled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert report(pred, y.clone())["accuracy"] > 0.9  # the same labels: silent
        report(pred.probs, shuffled)  # a bare tensor carries no targets to compare


def test_metrics_of_no_examples_are_refused_not_nan() -> None:
    # accuracy, NLL and Brier of an empty prediction were NaN, pairwise KL 0.0 (a "result")
    probs, labels = torch.full((2, 0, 3), 1 / 3), torch.zeros(0, dtype=torch.long)
    for call in (accuracy, nll, brier_score, ece, report):
        with pytest.raises(ValueError, match="needs at least one example"):
            call(probs, labels)
    for call in (disagreement, pairwise_kl):
        with pytest.raises(ValueError, match=f"{call.__name__} needs at least one example"):
            call(probs)
