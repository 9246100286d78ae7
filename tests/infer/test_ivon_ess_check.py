"""IVON's prior weighs ``1/ess`` of the mean log-likelihood (``ess`` defaults to the model's
``num_data``). The fit's data-size check compared the first epoch with ``num_data`` only, so
``ess`` set to the batch size (400 examples, ``ess=16``: NLL +0.095 and 14x the mutual
information of ``ess=400``, a hunt) passed in silence, while ``num_data=16, ess=400`` (a correct
fit: num_data does not enter it) got the num_data warning. An ``ess`` set apart from
``num_data`` is now what the epoch is checked against."""

from __future__ import annotations

import warnings

import pytest

import pyrobayes as pb
from pyrobayes.testing import tiny_problem


def _warnings(family: str, **options: float) -> list[str]:
    model, batches = tiny_problem(seed=0)  # 24 examples, model.num_data = 24
    guide = pb.posterior(model, family, **options)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pb.fit(model, guide, batches, epochs=1, lr=0.05)
    return [str(w.message) for w in seen if "yielded" in str(w.message)]


@pytest.mark.parametrize("family", ["ivon", "kron-ivon"])
def test_an_ess_below_the_data_warns_and_above_it_does_not(family: str) -> None:
    (small,) = _warnings(family, ess=8)
    assert "yielded 24 examples, but the guide's ess is 8" in small and "3x" in small
    assert _warnings(family, ess=24) == []  # = num_data: the usual check, silent
    assert _warnings(family, ess=1e4) == []  # above the data: tempered on purpose
    assert _warnings(family) == []


def test_num_data_below_the_data_with_a_right_ess_is_not_the_ivon_fits_concern() -> None:
    model, batches = tiny_problem(seed=0)
    model.num_data = 8  # the slip the num_data check is for, but IVON is given its ess
    guide = pb.posterior(model, "ivon", ess=24)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pb.fit(model, guide, batches, epochs=1, lr=0.05)
    assert not [w for w in seen if "yielded" in str(w.message)]
