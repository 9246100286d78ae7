"""``fit_laplace(backend=...)`` under ``torch.distributed`` is refused.

Only the default backend (:func:`~pyrobayes.infer.curvature.per_example_ggn_backend`) sums
each batch's curvature over the ranks; with another (laplace-torch's own, say) each rank fitted
the posterior of its own shard, with its own τ, without a word.
"""

from __future__ import annotations

import pytest

from pyrobayes.guides import LaplaceGuide
from pyrobayes.infer import laplace as laplace_module
from pyrobayes.testing import tiny_problem


def test_another_backend_under_torch_distributed_is_refused(monkeypatch):
    from laplace.curvature import CurvlinopsGGN

    model, data = tiny_problem()
    guide = LaplaceGuide(model, structure="diag", prior_precision=1.0)
    monkeypatch.setattr(laplace_module, "world", lambda: (2, 0))  # as rank 0 of 2 sees it
    with pytest.raises(ValueError, match=r"backend='CurvlinopsGGN'.*summed over the ranks"):
        laplace_module.fit_laplace(model, guide, data, backend=CurvlinopsGGN)


def test_another_backend_in_one_process_fits():
    """A guard: in one process the backend is the user's choice, as before."""
    from laplace.curvature import CurvlinopsGGN

    model, data = tiny_problem()
    guide = LaplaceGuide(model, structure="diag", prior_precision=1.0)
    la = laplace_module.fit_laplace(model, guide, data, backend=CurvlinopsGGN)
    assert guide.prior_precision > 0 and la is not None
