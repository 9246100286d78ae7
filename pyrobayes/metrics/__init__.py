r"""Predictive metrics for Bayesian and ensemble classifiers and regressors.

Classification metrics take per-sample predictive probabilities ``probs`` of shape ``(S, N, C)``
(``S`` posterior samples, particles or ensemble members; ``S = 1`` for a point model, for which a
2-D ``(N, C)`` tensor is also accepted), and integer ``labels`` of shape ``(N,)``. Wherever it
matters for precision, log-probabilities ``log_probs`` of the same shape can be given instead.
The posterior predictive is the sample average

.. math:: \bar p_{nc} = \frac1S \sum_s p_{s,nc},

and every metric is computed from it (never from averaged logits). :func:`report` also accepts any
object with a ``probs`` attribute (and optionally ``log_probs``), such as a prediction container,
and a regression prediction (``loc`` and ``scale``, as :func:`pyrobayes.predict` returns for a
Gaussian likelihood), for which it reports :func:`regression_report`.

Multi-label classifiers (a Bernoulli likelihood: ``probs`` of a 1 per label ``(S, N, L)``,
0/1 targets ``(N, L)``) have their own metrics (:mod:`pyrobayes.metrics.multilabel`), and
:func:`report` of a multi-label prediction is :func:`multilabel_report`.

Tensors go in; per-example quantities come back as tensors of shape ``(N,)`` and aggregate
metrics as Python floats.
"""

from __future__ import annotations

from .calibration import CalibrationError, calibration_error, ece, ece_floor
from .classification import accuracy, brier_score, mean_probs, nll, predictive_log_probs
from .diversity import disagreement, pairwise_kl
from .multilabel import (
    hamming_accuracy,
    mean_binary_entropy,
    multilabel_brier,
    multilabel_calibration_error,
    multilabel_mutual_information,
    multilabel_nll,
    multilabel_report,
    subset_accuracy,
)
from .ranking import auroc, ood_auroc
from .regression import gaussian_nll, gaussian_rmse, regression_report
from .reporting import report
from .uncertainty import expected_entropy, max_prob_score, mutual_information, predictive_entropy

__all__ = [
    "CalibrationError",
    "accuracy",
    "auroc",
    "brier_score",
    "calibration_error",
    "disagreement",
    "ece",
    "ece_floor",
    "expected_entropy",
    "gaussian_nll",
    "gaussian_rmse",
    "hamming_accuracy",
    "max_prob_score",
    "mean_binary_entropy",
    "mean_probs",
    "multilabel_brier",
    "multilabel_calibration_error",
    "multilabel_mutual_information",
    "multilabel_nll",
    "multilabel_report",
    "mutual_information",
    "nll",
    "ood_auroc",
    "pairwise_kl",
    "predictive_entropy",
    "predictive_log_probs",
    "regression_report",
    "report",
    "subset_accuracy",
]
