r"""How far can a fitted posterior be trusted, and how to hand it to ArviZ.

* :mod:`~pyrobayes.diagnostics.export`: S guide draws evaluated on a data set
  (:func:`~pyrobayes.diagnostics.export.evaluate_draws`) and exported to ArviZ
  (:func:`to_datatree` / :func:`to_inference_data`).
* :mod:`~pyrobayes.diagnostics.psis`: Pareto-smoothed importance sampling and the Pareto
  :math:`\hat k` of any log importance ratios.
* :mod:`~pyrobayes.diagnostics.khat`: :func:`diagnose`, PSIS :math:`\hat k`, importance ESS, ELBO
  and calibration of a guide against the posterior (uses the two above).
* :mod:`~pyrobayes.diagnostics.plots`: reliability diagram of a posterior predictive, summary
  plot of an ArviZ export.

Nothing here imports the demo application (:mod:`pyrobayes.demo`).
"""

from __future__ import annotations

from .export import UncalibratedExportWarning, select_sites, to_datatree, to_inference_data
from .khat import Diagnostics, diagnose, khat_interpretation, khat_threshold
from .plots import plot_posterior_summary, reliability_diagram
from .psis import importance_ess, pareto_khat, psis_smooth

__all__ = [
    "to_datatree",
    "to_inference_data",
    "select_sites",
    "UncalibratedExportWarning",
    "diagnose",
    "Diagnostics",
    "khat_interpretation",
    "khat_threshold",
    "pareto_khat",
    "psis_smooth",
    "importance_ess",
    "reliability_diagram",
    "plot_posterior_summary",
]
