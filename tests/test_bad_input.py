"""Bad input, as a hostile new user would give it: every case raises a clear error.

A parametrized corpus (:data:`CASES`): each case runs one bad call and asserts the exception
type and the words of its message (what is wrong, and what to pass instead). The corpus also
runs in a ``python -O`` subprocess, where ``assert`` statements and torch's distribution argument
validation are gone: the checks must not rely on either.

Next to the corpus: the inputs whose intent is unambiguous and that are handled, not refused
(``(B, 1)`` class labels; MAP, and IVON with an explicit ``ess``, without ``num_data``).

No case writes files (the checkpoint-folder checks are argument checks made before any write),
so there is no "no partial files left behind" case here.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pyro
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import pyrobayes as pb
from pyrobayes.infer import make_fitter
from pyrobayes.infer.arguments import validate_fit_arguments
from pyrobayes.infer.objectives import split_training_batch
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.likelihoods import MultipleChoice
from pyrobayes.registry import available_guides, get_guide_class
from tests import families
from tests.common import mlp

#: these tests check the predictive's arithmetic on guides at their initialisation, on purpose;
#: the never-fitted warning itself is tested in tests/test_fitted_head.py
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = math.nan, math.inf
ROWS, CLASSES = 8, 3


# ------------------------------------------------------------------------------------------------
# a small model and its batches
# ------------------------------------------------------------------------------------------------


def _model(
    likelihood: str = "categorical",
    *,
    widths: tuple[int, ...] = (4, 6, CLASSES),
    adapter: Any = None,
    trainable_modules: Any = ("2",),
    **kw: Any,
) -> FineTuneModel:
    """``Linear(4, 6) - Tanh - Linear(6, C)``: a rank-2 LoRA-XS core on ``"0"``, head ``"2"``."""
    torch.manual_seed(0)
    kw.setdefault("num_data", 32)
    return FineTuneModel(
        mlp(*widths),
        LoRAXS(rank=2, target_modules=["0"]) if adapter is None else adapter,
        likelihood=likelihood,
        trainable_modules=list(trainable_modules),
        **kw,
    )


def _x(rows: int = ROWS) -> torch.Tensor:
    return torch.randn(rows, 4)


def _labels(*values: float, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``ROWS`` valid labels with the first ones replaced by ``values``."""
    y = torch.arange(ROWS) % CLASSES
    y = y.to(dtype)
    y[: len(values)] = torch.tensor(values, dtype=dtype)
    return y


def _with(x: torch.Tensor, value: float, index: tuple[int, ...] = (0, 0)) -> torch.Tensor:
    x = x.clone()
    x[index] = value
    return x


def _step(
    batch: Any,
    family: str = "meanfield",
    *,
    model: FineTuneModel | None = None,
    loss: Any = None,
    **guide_kw: Any,
) -> float:
    """One fitter step of ``family`` on ``batch``."""
    model = _model() if model is None else model
    guide = pb.posterior(model, family, **guide_kw)
    return make_fitter(model, guide, loss=loss).step(batch)


def _fit(batch: Any, family: str = "meanfield", *, model: FineTuneModel | None = None) -> Any:
    """``pb.fit`` for one step on ``[batch]``."""
    model = _model() if model is None else model
    return pb.fit(model, pb.posterior(model, family), [batch], optim=pb.Optimization(num_steps=1))


def _predict(data: Any, *, model: FineTuneModel | None = None, **kw: Any) -> Any:
    model = _model() if model is None else model
    return pb.predict(model, pb.posterior(model, "meanfield"), data, **kw)


def _gaussian(outputs: int = 1, **kw: Any) -> FineTuneModel:
    return _model("gaussian", widths=(4, 6, outputs), **kw)


def _choice(params: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A multiple-choice log-likelihood over two choices (logits already restricted)."""
    return MultipleChoice([5, 7]).log_prob(params, targets)


def _nested_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, CLASSES))


# ------------------------------------------------------------------------------------------------
# the corpus
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One bad call: ``run()`` must raise ``error`` with every one of ``words`` in its message
    and none of ``absent``."""

    id: str
    run: Callable[[], Any]
    error: type[BaseException]
    words: tuple[str, ...]
    absent: tuple[str, ...] = ()


def _case(
    id: str,
    run: Callable[[], Any],
    error: type[BaseException],
    *words: str,
    absent: tuple[str, ...] = (),
) -> Case:
    return Case(id, run, error, tuple(words), absent)


CASES: list[Case] = [
    # --- class labels: in range, non-negative, integer (never truncated) --------------------
    _case("label-out-of-range", lambda: _step((_x(), _labels(3))), ValueError, "0..2", "3 classes"),
    _case("label-negative", lambda: _step((_x(), _labels(-1))), ValueError, "0..2", "-1..2"),
    _case(
        "label-float-fraction",
        lambda: _step((_x(), _labels(0.7, dtype=torch.float32))),
        ValueError,
        "integer class indices",
        "torch.float32",
        "not truncated",
    ),
    _case(
        "label-float-whole",
        lambda: _step((_x(), _labels(1.0, dtype=torch.float64))),
        ValueError,
        "integer class indices",
        "torch.float64",
    ),
    _case("label-out-of-range-ivon", lambda: _step((_x(), _labels(5)), "ivon"), ValueError, "0..2"),
    _case("label-out-of-range-swag", lambda: _step((_x(), _labels(3)), "swag"), ValueError, "0..2"),
    _case(
        "label-out-of-range-pyro-elbo",
        lambda: _step((_x(), _labels(3)), loss=pyro.infer.Trace_ELBO()),
        ValueError,
        "0..2",
    ),
    _case(
        "label-out-of-range-fit",
        lambda: _fit((_x(), _labels(7))),
        ValueError,
        "0..2",
        "range over 0..7",
    ),
    _case(
        "label-out-of-range-predict",
        lambda: _predict([(_x(), _labels(3))], num_samples=2),
        ValueError,
        "0..2",
    ),
    _case(
        "label-float-predict",
        lambda: _predict([(_x(), _labels(0.5, dtype=torch.float32))], num_samples=2),
        ValueError,
        "integer class indices",
    ),
    _case(
        "label-shape-two-columns",
        lambda: _step((_x(), torch.zeros(ROWS, 2, dtype=torch.long))),
        ValueError,
        "(8, 2)",
        "shape (8,)",
    ),
    _case(
        "choice-label-out-of-range",
        lambda: _choice(torch.randn(ROWS, 2), _labels(2)),
        ValueError,
        "multiple_choice",
        "choice_token_ids=[5, 7]",
        "0..1",
    ),
    _case(
        "choice-label-negative",
        lambda: _choice(torch.randn(ROWS, 2), torch.full((ROWS,), -1)),
        ValueError,
        "0..1",
    ),
    _case(
        "choice-label-float",
        lambda: _choice(torch.randn(ROWS, 2), torch.full((ROWS,), 0.7)),
        ValueError,
        "multiple_choice",
        "integer class indices",
    ),
    _case(
        "choice-token-ids-repeated",
        lambda: MultipleChoice([5, 5, 7]),
        ValueError,
        "choice_token_ids",
        "repeat",
    ),
    _case(
        "choice-token-id-float",
        lambda: MultipleChoice([5.5, 7]),
        TypeError,
        "choice_token_ids",
        "integer",
    ),
    # --- targets whose count differs from the batch ------------------------------------------
    _case(
        "targets-fewer-than-examples",
        lambda: _step((_x(), _labels()[:-1])),
        ValueError,
        "8 examples but 7 targets",
    ),
    _case(
        "targets-more-than-examples-gaussian",
        lambda: _step((_x(), torch.randn(ROWS + 2)), model=_gaussian()),
        ValueError,
        "8 examples but 10 targets",
    ),
    _case(
        "targets-0-dim",
        lambda: _step((_x(), torch.tensor(1))),
        ValueError,
        "8 examples but a 0-dim tensor",
    ),
    _case(
        "targets-not-a-tensor",
        lambda: _step((_x(), [0] * ROWS)),
        TypeError,
        "must be a tensor",
        "list",
    ),
    _case(
        "targets-count-dict-batch",
        lambda: _step({"input": _x(), "labels": _labels()[:5]}, model=_dict_model()),
        ValueError,
        "8 examples but 5 targets",
    ),
    _case(
        "gaussian-two-columns-for-scalar-output",
        lambda: _step((_x(), torch.randn(ROWS, 2)), model=_gaussian()),
        ValueError,
        "(8, 2)",
        "(8,) or (8, 1)",
    ),
    _case(
        "gaussian-vector-output-scalar-targets",
        lambda: _step((_x(), torch.randn(ROWS)), model=_gaussian(3)),
        ValueError,
        "(8,)",
        "pass targets of shape (8, 3)",
    ),
    _case(
        "gaussian-targets-predict",
        lambda: _predict([(_x(), torch.randn(ROWS, 2))], model=_gaussian(), num_samples=2),
        ValueError,
        "(8,) or (8, 1)",
    ),
    # --- NaN / inf in inputs or targets: a data error, not "the learning rate" ---------------
    _case(
        "nan-in-inputs-fit",
        lambda: _fit((_with(_x(), NAN), _labels())),
        ValueError,
        "non-finite",
        "inputs (1 NaN, 0 inf of 32)",
        "data problem",
        absent=("learning rate",),
    ),
    _case(
        "inf-in-inputs-map",
        lambda: _step((_with(_x(), INF), _labels()), "map"),
        ValueError,
        "inputs (0 NaN, 1 inf",
        absent=("learning rate",),
    ),
    _case(
        "minus-inf-in-inputs-ivon",
        lambda: _step((_with(_x(), -INF), _labels()), "ivon"),
        ValueError,
        "non-finite",
        "inputs",
    ),
    _case(
        "nan-in-inputs-laplace",
        lambda: _step((_with(_x(), NAN), _labels()), "laplace"),
        ValueError,
        "non-finite",
    ),
    _case(
        "nan-in-gaussian-targets",
        lambda: _step((_x(), _with(torch.randn(ROWS), NAN, (3,))), model=_gaussian()),
        ValueError,
        "targets (1 NaN",
        absent=("inputs",),
    ),
    _case(
        "inf-in-gaussian-targets",
        lambda: _step((_x(), _with(torch.randn(ROWS), -INF, (0,))), model=_gaussian()),
        ValueError,
        "targets (0 NaN, 1 inf",
    ),
    _case(
        "nan-in-dict-inputs",
        lambda: _step({"input": _with(_x(), NAN), "labels": _labels()}, model=_dict_model()),
        ValueError,
        "inputs['input']",
    ),
    _case(
        "nan-in-tuple-inputs",
        lambda: _step(((_x(), _with(_x(), NAN)), _labels()), model=_two_input_model()),
        ValueError,
        "inputs[1]",
    ),
    # --- num_data missing for a posterior weighted by N/B ------------------------------------
    _case(
        "no-num-data-meanfield",
        lambda: _step((_x(), _labels()), model=_model(num_data=None)),
        ValueError,
        "num_data=None",
        "FineTuneModel(num_data=N)",
    ),
    _case(
        "no-num-data-fit",
        lambda: _fit((_x(), _labels()), model=_model(num_data=None)),
        ValueError,
        "FineTuneModel(num_data=N)",
    ),
    _case(
        "no-num-data-swag",
        lambda: _step((_x(), _labels()), "swag", model=_model(num_data=None)),
        ValueError,
        "SWAGGuide",
        "FineTuneModel(num_data=N)",
    ),
    _case(
        "no-num-data-laplace",
        lambda: _step((_x(), _labels()), "laplace", model=_model(num_data=None)),
        ValueError,
        "LaplaceGuide",
        "FineTuneModel(num_data=N)",
    ),
    _case(
        "no-num-data-pyro-elbo",
        lambda: _step((_x(), _labels()), model=_model(num_data=None), loss=pyro.infer.Trace_ELBO()),
        ValueError,
        "Trace_ELBO",
        "FineTuneModel(num_data=N)",
    ),
    _case(
        "no-num-data-ivon",
        lambda: pb.posterior(_model(num_data=None), "ivon"),
        ValueError,
        "ess=",
        "FineTuneModel(num_data=N)",
    ),
    _case(
        "no-num-data-kron-ivon",
        lambda: pb.posterior(_model(num_data=None), "kron-ivon"),
        ValueError,
        "KroneckerIVONGuide",
        "FineTuneModel(num_data=N)",
    ),
    # --- non-integer or non-finite counts -----------------------------------------------------
    _case("num-data-fraction", lambda: _model(num_data=100.5), TypeError, "num_data", "integer"),
    _case("num-data-float-whole", lambda: _model(num_data=100.0), TypeError, "num_data=100"),
    _case("num-data-nan", lambda: _model(num_data=NAN), TypeError, "num_data", "nan"),
    _case("num-data-bool", lambda: _model(num_data=True), TypeError, "num_data"),
    _case("num-data-zero", lambda: _model(num_data=0), ValueError, "num_data", ">= 1"),
    _case(
        "fit-epochs-fraction",
        lambda: validate_fit_arguments(epochs=2.5),
        TypeError,
        "epochs must be an integer",
    ),
    _case(
        "fit-epochs-float-whole", lambda: validate_fit_arguments(epochs=3.0), TypeError, "epochs=3"
    ),
    _case(
        "fit-epochs-negative",
        lambda: validate_fit_arguments(epochs=-1),
        ValueError,
        "epochs",
        ">= 0",
    ),
    _case(
        "fit-num-steps-fraction",
        lambda: validate_fit_arguments(num_steps=1.5),
        TypeError,
        "num_steps must be an integer",
    ),
    _case(
        "fit-num-steps-nan", lambda: validate_fit_arguments(num_steps=NAN), TypeError, "num_steps"
    ),
    _case(
        "fit-no-length",
        lambda: validate_fit_arguments(),
        ValueError,
        "epochs=... or optim=Optimization(num_steps=...)",
    ),
    _case(
        "fit-lr-nan", lambda: validate_fit_arguments(epochs=1, lr=NAN), ValueError, "lr", "finite"
    ),
    _case("fit-lr-negative", lambda: validate_fit_arguments(epochs=1, lr=-0.1), ValueError, "lr"),
    _case(
        "fit-warmup-nan", lambda: validate_fit_arguments(epochs=1, warmup=NAN), ValueError, "warmup"
    ),
    # --- checkpoint options ------------------------------------------------------------------
    _case(
        "resume-without-checkpoint-dir",
        lambda: validate_fit_arguments(epochs=1, resume=True),
        ValueError,
        "resume=True needs checkpoint_dir",
    ),
    _case(
        "checkpoint-every-negative",
        lambda: validate_fit_arguments(epochs=1, checkpoint_dir="ckpt", checkpoint_every=-5),
        ValueError,
        "checkpoint_every",
        ">= 1",
    ),
    _case(
        "checkpoint-every-zero",
        lambda: validate_fit_arguments(epochs=1, checkpoint_dir="ckpt", checkpoint_every=0),
        ValueError,
        "checkpoint_every",
    ),
    _case(
        "checkpoint-every-fraction",
        lambda: validate_fit_arguments(epochs=1, checkpoint_dir="ckpt", checkpoint_every=2.5),
        TypeError,
        "checkpoint_every",
    ),
    _case(
        "checkpoint-every-without-dir",
        lambda: validate_fit_arguments(epochs=1, checkpoint_every=10),
        ValueError,
        "checkpoint_every=10 needs checkpoint_dir",
    ),
    _case(
        "resume-not-a-bool",
        lambda: validate_fit_arguments(epochs=1, checkpoint_dir="ckpt", resume="yes"),
        TypeError,
        "resume must be True or False",
    ),
    # --- NaN / inf hyperparameters of the model and adapters ---------------------------------
    _case("prior-scale-nan", lambda: _model(prior_scale=NAN), ValueError, "prior_scale", "finite"),
    _case("prior-scale-inf", lambda: _model(prior_scale=INF), ValueError, "prior_scale", "got inf"),
    _case("prior-scale-zero", lambda: _model(prior_scale=0), ValueError, "prior_scale", "> 0"),
    _case("obs-scale-nan", lambda: _gaussian(obs_scale=NAN), ValueError, "obs_scale", "finite"),
    _case("obs-scale-inf", lambda: _gaussian(obs_scale=INF), ValueError, "obs_scale"),
    _case("obs-scale-typo", lambda: _gaussian(obs_scale="learned"), ValueError, "'learn'"),
    _case("lora-alpha-zero", lambda: LoRA(rank=4, alpha=0), ValueError, "LoRA", "alpha", "> 0"),
    _case("lora-rank-fraction", lambda: LoRA(rank=2.5), TypeError, "rank", "integer"),
    _case("lora-xs-alpha-zero", lambda: LoRAXS(rank=2, alpha=0), ValueError, "LoRAXS", "alpha"),
    _case("lora-xs-alpha-nan", lambda: LoRAXS(rank=2, alpha=NAN), ValueError, "alpha", "nan"),
    _case("lora-xs-init-scale-inf", lambda: LoRAXS(init_scale=INF), ValueError, "init_scale"),
    # --- NaN / inf options of every family ---------------------------------------------------
    _case(
        "meanfield-init-scale-nan",
        lambda: pb.posterior(_model(), "meanfield", init_scale=NAN),
        ValueError,
        "MeanFieldGuide",
        "init_scale",
    ),
    _case(
        "meanfield-init-scale-inf",
        lambda: pb.posterior(_model(), "meanfield", init_scale=INF),
        ValueError,
        "init_scale",
    ),
    _case("ivon-ess-nan", lambda: pb.posterior(_model(), "ivon", ess=NAN), ValueError, "ess"),
    _case("ivon-ess-inf", lambda: pb.posterior(_model(), "ivon", ess=INF), ValueError, "ess"),
    _case(
        "ivon-hess-init-nan",
        lambda: pb.posterior(_model(), "ivon", hess_init=NAN),
        ValueError,
        "IVONGuide",
        "hess_init",
    ),
    _case(
        "ivon-weight-decay-inf",
        lambda: pb.posterior(_model(), "ivon", weight_decay=INF),
        ValueError,
        "weight_decay",
    ),
    _case("ivon-lr-nan", lambda: pb.posterior(_model(), "ivon", lr=NAN), ValueError, "lr"),
    _case(
        "ivon-clip-radius-nan",
        lambda: pb.posterior(_model(), "ivon", clip_radius=NAN),
        ValueError,
        "clip_radius",
    ),
    _case(
        "ivon-beta1-one",
        lambda: pb.posterior(_model(), "ivon", beta1=1.0),
        ValueError,
        "beta1",
        "< 1",
    ),
    _case(
        "ivon-mc-samples-fraction",
        lambda: pb.posterior(_model(), "ivon", mc_samples=1.5),
        TypeError,
        "mc_samples",
    ),
    _case(
        "kron-ivon-diag-beta2-nan",
        lambda: pb.posterior(_model(), "kron-ivon", diag_beta2=NAN),
        ValueError,
        "diag_beta2",
    ),
    _case(
        "kron-ivon-beta2-nan",
        lambda: pb.posterior(_model(), "kron-ivon", beta2=NAN),
        ValueError,
        "KroneckerIVONGuide",
        "beta2",
    ),
    _case(
        "kron-ivon-t-inv-zero",
        lambda: pb.posterior(_model(), "kron-ivon", T_inv=0),
        ValueError,
        "T_inv",
    ),
    _case("swag-scale-nan", lambda: pb.posterior(_model(), "swag", scale=NAN), ValueError, "scale"),
    _case(
        "swag-swa-lr-inf",
        lambda: pb.posterior(_model(), "swag", swa_lr=INF),
        ValueError,
        "SWAGGuide",
        "swa_lr",
    ),
    _case(
        "swag-anneal-strategy",
        lambda: pb.posterior(_model(), "swag", anneal_strategy="cosine"),
        ValueError,
        "anneal_strategy",
        "'cos'",
    ),
    _case(
        "laplace-prior-precision-nan",
        lambda: pb.posterior(_model(), "laplace", prior_precision=NAN),
        ValueError,
        "LaplaceGuide",
        "prior_precision",
    ),
    _case(
        "laplace-temperature-inf",
        lambda: pb.posterior(_model(), "laplace", temperature=INF),
        ValueError,
        "temperature",
    ),
    _case(
        "laplace-log-prior-bounds-nan",
        lambda: pb.infer.Laplace(log_prior_bounds=(NAN, 1.0)),
        ValueError,
        "log_prior_bounds[0]",
    ),
    _case(
        "laplace-alternate-tol-nan",
        lambda: pb.infer.Laplace(alternate_tol=NAN),
        ValueError,
        "alternate_tol",
    ),
    # --- adapter structure -------------------------------------------------------------------
    _case(
        "lora-xs-rank-above-layer",
        lambda: _model(adapter=LoRAXS(rank=5, target_modules=["0"])),
        ValueError,
        "LoRAXS(rank=5)",
        "'0' (d_in=4, d_out=6)",
        "at most 4",
    ),
    _case(
        "lora-xs-rank-above-two-layers",
        lambda: _model(adapter=LoRAXS(rank=5, target_modules=["0", "2"]), trainable_modules=()),
        ValueError,
        "'0' (d_in=4, d_out=6)",
        "'2' (d_in=6, d_out=3)",
        "at most 3",
    ),
    _case(
        "adapted-layer-also-trainable",
        lambda: _model(trainable_modules=["0"]),
        ValueError,
        "trainable_modules: '0'",
        "adapted layer",
        "target_modules",
    ),
    _case(
        "lora-layer-also-trainable",
        lambda: _model(adapter=LoRA(rank=2, target_modules=["2"]), trainable_modules=["2"]),
        ValueError,
        "trainable_modules: '2'",
        "adapted layer, '2'",
    ),
    _case(
        "trainable-module-holds-adapted-layer",
        lambda: FineTuneModel(
            _nested_net(),
            LoRAXS(rank=2, target_modules=["0.0"]),
            num_data=32,
            trainable_modules=["0"],
        ),
        ValueError,
        "module '0'",
        "adapted layer, '0.0'",
    ),
    _case(
        "latent-module-also-trainable",
        lambda: FineTuneModel(mlp(4, 6, CLASSES), latent_modules=["2"], trainable_modules=["2"]),
        ValueError,
        "latent module, '2'",
        "latent_modules",
    ),
    # --- prediction ------------------------------------------------------------------------
    _case("predict-empty-list", lambda: _predict([]), ValueError, "no batches"),
    _case(
        "predict-empty-loader",
        lambda: _predict(DataLoader(TensorDataset(torch.zeros(0, 4)), batch_size=4)),
        ValueError,
        "no batches",
    ),
    _case(
        "predict-zero-samples",
        lambda: _predict([(_x(),)], num_samples=0),
        ValueError,
        "num_samples",
        ">= 1",
    ),
    _case(
        "predict-fractional-samples",
        lambda: _predict([(_x(),)], num_samples=2.5),
        TypeError,
        "num_samples",
    ),
    _case(
        "predict-zero-samples-per-forward",
        lambda: _predict([(_x(),)], samples_per_forward=0),
        ValueError,
        "samples_per_forward",
    ),
]


def _dict_model() -> FineTuneModel:
    """The MLP behind a dict batch ``{"input": x, "labels": y}``."""

    class DictNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp(4, 6, CLASSES)

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return self.body(input)

    torch.manual_seed(0)
    return FineTuneModel(
        DictNet(), LoRAXS(rank=2, target_modules=["body.0"]), num_data=32, trainable_modules=[]
    )


def _two_input_model() -> FineTuneModel:
    """An MLP over the sum of two inputs, for tuple batches ``((x1, x2), y)``."""

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp(4, 6, CLASSES)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.body(a + b)

    torch.manual_seed(0)
    return FineTuneModel(
        TwoInputs(), LoRAXS(rank=2, target_modules=["body.0"]), num_data=32, trainable_modules=[]
    )


def _unknown_option_cases() -> list[Case]:
    """A misspelt option to every registered family (``pb.posterior(..., typo=1)``)."""
    families = sorted({get_guide_class(name).family for name in available_guides()})
    return [
        _case(
            f"unknown-option-{family}",
            lambda family=family: pb.posterior(_model(), family, typo=1),
            TypeError,
            "'typo'",
            get_guide_class(family).__name__,
            "Its options",
        )
        for family in families
    ] + [
        _case(
            f"misspelt-option-{family}",
            lambda family=family: pb.posterior(_model(), family, hess_int=1.0),
            TypeError,
            "'hess_int': did you mean 'hess_init'?",
        )
        for family in ("ivon", "kron-ivon")
    ]


CASES += _unknown_option_cases()


def check_case(case: Case) -> str | None:
    """Run one case; ``None`` when it raised as expected, else what went wrong.

    Explicit comparisons (no ``assert``), so the same check runs under ``python -O``.
    """
    try:
        case.run()
    except case.error as err:
        message = str(err)
        missing = [w for w in case.words if w not in message]
        present = [w for w in case.absent if w in message]
        if missing or present:
            return f"{case.id}: message {message!r} lacks {missing} or has {present}"
        return None
    except Exception as err:  # noqa: BLE001 - the wrong type is the finding
        return f"{case.id}: expected {case.error.__name__}, got {type(err).__name__}: {err}"
    return f"{case.id}: expected {case.error.__name__}, nothing was raised"


def test_the_corpus_is_large_and_its_ids_unique():
    assert len(CASES) >= 50
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case):
    with pytest.raises(case.error) as info:
        case.run()
    message = str(info.value)
    for word in case.words:
        assert word in message, f"{word!r} not in {message!r}"
    for word in case.absent:
        assert word not in message, f"{word!r} in {message!r}"


def test_the_corpus_holds_under_python_O():
    # without assert statements and torch's distribution validation (__debug__ is False)
    script = (
        "import sys, pyro, torch\n"
        "assert False, 'asserts are on'\n"
        "pyro.enable_validation(False)\n"
        "from tests.test_bad_input import CASES, check_case\n"
        "failed = [f for f in map(check_case, CASES) if f]\n"
        "print('\\n'.join(failed))\n"
        "print(len(CASES), 'cases')\n"
        "sys.exit(1 if failed else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(CASES)} cases" in done.stdout


# ------------------------------------------------------------------------------------------------
# unambiguous intent: handled, not refused
# ------------------------------------------------------------------------------------------------


def test_column_labels_give_the_loss_of_flat_labels():
    model = _model()
    guide = pb.posterior(model, "map")
    x, y = _x(), _labels()
    flat = pb.infer.MAP().loss(model, guide, (x, y))
    column = pb.infer.MAP().loss(model, guide, (x, y.unsqueeze(-1)))
    torch.testing.assert_close(column, flat, rtol=0.0, atol=0.0)


def test_map_needs_no_num_data():
    # a point estimate: N only sets the prior's weight against one batch (weight decay)
    result = _fit((_x(), _labels()), "map", model=_model(num_data=None))
    assert len(result.losses) == 1 and math.isfinite(float(result.losses[0]))


def test_ivon_with_ess_needs_no_num_data():
    # IVON's objective is the per-example mean NLL; its N is ess
    model = _model(num_data=None)
    value = _step((_x(), _labels()), "ivon", model=model, ess=32.0)
    assert math.isfinite(value)


def test_valid_fit_arguments_pass():
    validate_fit_arguments(epochs=2)
    validate_fit_arguments(num_steps=0, lr=0.0, warmup=0.1)
    validate_fit_arguments(epochs=1, checkpoint_dir="ckpt", checkpoint_every=3, resume=True)


def test_finite_values_whose_sum_overflows_pass():
    # the fast check sums each tensor; an overflowing sum of finite values is checked exactly
    x = torch.full((ROWS, 4), 3e38, dtype=torch.float32)  # finite, the sum is inf in float32
    inputs, targets = split_training_batch(_model(), (x, _labels()))
    assert inputs is x and targets.shape == (ROWS,)


# ================================================================================================
# issue 30, models / predict / families: the silent cases of the new surface
# (NaN rows at predict, PermutationSpec on another model, σN's init_logit, obs_scale of a
# categorical model, encode_multiple_choice's strings and answers, [model] max_length, the
# mixture predictive's weights, merged_network of a σN-ensemble, python -O)
# ================================================================================================


def _family_model(family: str) -> FineTuneModel:
    """The MLP of :func:`_model` as the registry-wide tests build it for ``family`` (LoRA for
    symmetrized, a LayerNorm and two σN members for signorm)."""
    torch.manual_seed(0)
    net = families.net_for(family, mlp(4, 6, CLASSES))
    adapter = families.adapter_for(family, LoRAXS(rank=2, target_modules=["0"]))
    return FineTuneModel(net, adapter, num_data=32, trainable_modules=["2"])


def _nan_row_predict(family: str) -> Any:
    """``pb.predict`` on two batches, the second with a NaN at row 5."""
    model = _family_model(family)
    data = [(_x(), _labels()), (_with(_x(), NAN, (5, 1)), _labels())]
    return pb.predict(model, families.posterior(model, family), data, num_samples=2)


def _norm_net(norm: str = "layer") -> nn.Module:
    """``Linear(4, 6) - norm - Tanh - Linear(6, C)``; a BatchNorm with non-trivial statistics."""
    torch.manual_seed(0)
    layer = {"layer": nn.LayerNorm(6), "batch": nn.BatchNorm1d(6), "rms": nn.RMSNorm(6)}[norm]
    if isinstance(layer, nn.BatchNorm1d):
        with torch.no_grad():
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    with torch.no_grad():  # a pretrained scale and shift that are not the defaults
        if getattr(layer, "weight", None) is not None:
            layer.weight.uniform_(0.5, 1.5)
        if getattr(layer, "bias", None) is not None:
            layer.bias.normal_(0.0, 0.3)
    return nn.Sequential(nn.Linear(4, 6), layer, nn.Tanh(), nn.Linear(6, CLASSES)).eval()


def _signorm_model(norm: str = "layer", **kw: Any) -> Any:
    return pb.models.SigmaNormEnsemble(
        _norm_net(norm), num_members=3, heads=["3"], trainable_modules=[], num_data=8, **kw
    )


class _CharTokenizer:
    """One token per character (ids 1..); no special tokens."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [1 + ord(c) % 50 for c in text]}


def _encode(prompts: Any = ("Is it wet?",), choices: Any = ("yes", "no"), **kw: Any) -> Any:
    return pb.models.encode_multiple_choice(_CharTokenizer(), prompts, choices, **kw)


def _spec_on_other_model(adapter_b: Any) -> float:
    """A PermutationSpec built on a LoRA(rank=2) model, checked on another model."""
    spec = pb.models.PermutationSpec.from_model(_model(adapter=LoRA(rank=2, target_modules=["0"])))
    other = _model(adapter=adapter_b)
    return spec.check_function(other, _x(), other.init_values())


def _config(**model: Any) -> Any:
    from pyrobayes.demo.pipeline import resolve_config

    return resolve_config({"model": model})


ISSUE30_CASES: list[Case] = [
    # --- a NaN input row at predict: NaN NLL/ECE/Brier beside a finite accuracy, refused -----
    *[
        _case(
            f"predict-nan-row-{family}",
            lambda family=family: _nan_row_predict(family),
            ValueError,
            "batch 1",
            "rows [5]",
            "NaN or inf",
            "data problem",
        )
        for family in ("meanfield", "map", "ibdr", "signorm", "symmetrized")
    ],
    _case(
        "metrics-nan-probs",
        lambda: pb.metrics.report(
            _with(torch.full((2, 5, 3), 1 / 3), NAN, (1, 3, 0)), _labels()[:5]
        ),
        ValueError,
        "probs holds NaN at examples [3] (of 5)",
        "NLL, ECE and Brier",
    ),
    _case(
        "categorical-labels-per-token",  # a (B, T, C) output with (B, T) labels: NER-style
        lambda: (
            lambda m: pb.fit(
                m,
                pb.posterior(m, "map"),
                [(torch.randn(ROWS, 5, 4), torch.randint(0, CLASSES, (ROWS, 5)))],
                epochs=1,
            )
        )(_model()),
        ValueError,
        "labels of shape (8, 5) label every position",
        "per-token labels are not supported",
    ),
    _case(
        "metrics-report-of-an-unlabelled-prediction",
        lambda: (
            lambda m: pb.metrics.report(  # pb.predict over batches without targets
                p := pb.predict(m, pb.posterior(m, "map"), [(_x(),)], num_samples=1), p.targets
            )
        )(_model()),
        ValueError,
        "labels is None",
        "report(pred, y)",
    ),
    _case(
        "metrics-nan-regression-means",
        lambda: pb.metrics.gaussian_rmse(_with(torch.zeros(2, 4), NAN, (0, 2)), torch.zeros(4)),
        ValueError,
        "means holds NaN at examples [2]",
    ),
    # --- a PermutationSpec applied to another model -------------------------------------------
    _case(
        "permutation-spec-other-sites",
        lambda: _spec_on_other_model(LoRAXS(rank=2, target_modules=["0"])),
        ValueError,
        "'0.lora_A'",
        "does not have",
        "built on another model",
        "from_model(model)",
    ),
    _case(
        "permutation-spec-other-shapes",
        lambda: _spec_on_other_model(LoRA(rank=3, target_modules=["0"])),
        ValueError,
        "permutes 2 units on axis",
        "built on another model",
    ),
    # --- σN: a saturated sigmoid never moves the member scales ---------------------------------
    _case(
        "signorm-init-logit-50",
        lambda: _signorm_model(init_logit=50.0),
        ValueError,
        "init_logit=50",
        "saturates the sigmoid",
        "|init_logit| <= 10",
    ),
    _case(
        "signorm-init-logit-minus-12",
        lambda: pb.models.SigmaNorm(num_members=2, init_logit=-12.0),
        ValueError,
        "SigmaNorm: init_logit=-12",
    ),
    _case(
        "signorm-init-logit-nan",
        lambda: pb.models.SigmaNorm(num_members=2, init_logit=NAN),
        ValueError,
        "init_logit",
        "finite",
    ),
    _case(
        "merged-network-stacked-members",
        lambda: pb.models.merged_network(
            _signorm_model(), pb.posterior(_signorm_model(), "signorm").component_locs()
        ),
        ValueError,
        "values['1.gamma'] has shape (3, 6)",
        "these are 3 draws; pass one",
    ),
    _case(
        "merged-network-rms-shift",
        lambda: pb.models.merged_network(
            (m := _signorm_model("rms")), {**m.init_values(), "1.beta": torch.ones(6)}
        ),
        ValueError,
        "RMSNorm has no bias",
        "model.output(x, values)",
    ),
    # --- obs_scale is the Gaussian's: never ignored by another likelihood ---------------------
    _case(
        "obs-scale-learn-categorical",
        lambda: _model(obs_scale="learn"),
        ValueError,
        "obs_scale='learn'",
        "likelihood='categorical' has none",
        "likelihood='gaussian'",
    ),
    _case(
        "obs-scale-negative-categorical",
        lambda: _model(obs_scale=-3),
        ValueError,
        "obs_scale=-3",
        "ignored",
    ),
    _case(
        "obs-scale-multiple-choice-instance",
        lambda: _model(likelihood=MultipleChoice([5, 7]), obs_scale=0.5),
        ValueError,
        "'MultipleChoice' has none",
    ),
    # --- encode_multiple_choice: strings where lists are meant, K = 1, float answers ----------
    _case("mc-single-shared-choice", lambda: _encode(choices=["yes"]), ValueError, "K >= 2"),
    _case(
        "mc-choices-one-string",
        lambda: _encode(choices="AB"),
        TypeError,
        "choices is one string ('AB')",
        "one choice per character",
    ),
    _case(
        "mc-per-prompt-choices-string",
        lambda: _encode(prompts=["a?", "b?"], choices=[["x", "y"], "zw"]),
        TypeError,
        "choices[1] is 'zw'",
    ),
    _case(
        "mc-prompts-one-string",
        lambda: _encode(prompts="Hello world"),
        TypeError,
        "prompts is one string ('Hello world')",
        "one prompt per character",
        "[prompt]",
    ),
    _case(
        "mc-float-answers",
        lambda: _encode(answers=[0.7]),
        TypeError,
        "answers must be integer choice indices",
        "not truncated",
    ),
    _case(
        "mc-answer-out-of-range",
        lambda: _encode(answers=[2]),
        ValueError,
        "index the 2 choices (0..1)",
    ),
    # --- the CLI / demo config: a zero length is not "no limit" -------------------------------
    _case(
        "config-max-length-zero",
        lambda: _config(max_length=0),
        ValueError,
        "'model.max_length' must be an integer >= 2 but got 0",
    ),
    _case(
        "config-num-labels-one",
        lambda: _config(num_labels=1),
        ValueError,
        "'model.num_labels' must be an integer >= 2",
    ),
]
# a new list (test_bad_input's parametrization above keeps the earlier one): the python -O corpus
# run and the size check see every case; test_issue30_bad_input runs these
CASES = CASES + ISSUE30_CASES


@pytest.mark.parametrize("case", ISSUE30_CASES, ids=[c.id for c in ISSUE30_CASES])
def test_issue30_bad_input(case: Case):
    assert check_case(case) is None


def test_mixture_predictive_is_the_exact_equal_weight_mixture(caplog):
    # K = 3 point particles, the default S = 32: predict draws 33 (11 per particle), so its
    # predictive is exactly (1/K) Σ_k softmax(f(x; μ_k)) (with 32, the weights were 11/32,
    # 11/32, 10/32: off by 1/96 per component)
    model = _family_model("ibdr")
    guide = pb.posterior(model, "ibdr", num_particles=3, init_scale=0.5)
    x = _x()
    with caplog.at_level("INFO", logger="pyrobayes.predictive"):
        pred = pb.predict(model, guide, [(x, _labels())])
    assert pred.num_samples == 33
    assert "drawing 33" in caplog.text and "11 draws each" in caplog.text
    with torch.no_grad():
        per_particle = model.batched_output(x, guide.component_locs()).softmax(-1)  # (K, B, C)
    exact = per_particle.mean(0)
    # the three particles' predictives differ (the test would pass for any weights otherwise)
    assert float((per_particle[0] - per_particle[2]).abs().max()) > 1e-3
    torch.testing.assert_close(pred.mean_probs, exact, rtol=1e-6, atol=1e-7)


def test_signorm_predictive_weights_its_members_equally():
    model = _signorm_model()  # M = 3 members
    guide = pb.posterior(model, "signorm")
    x = _x()
    pred = pb.predict(model, guide, [(x,)], num_samples=4)
    assert pred.num_samples == 6
    with torch.no_grad():
        exact = model.batched_output(x, guide.component_locs()).softmax(-1).mean(0)
    torch.testing.assert_close(pred.mean_probs, exact, rtol=1e-6, atol=1e-7)


def test_predict_names_non_finite_draws_when_the_inputs_are_finite():
    model = _model()
    guide = pb.posterior(model, "map")
    with torch.no_grad():
        guide.loc_param(next(iter(guide.sites))).fill_(NAN)
    with pytest.raises(FloatingPointError, match=r"rows \[0, 1, .*finite inputs.*diverged fit"):
        pb.predict(model, guide, [(_x(), _labels())])


def test_a_mixture_with_explicit_values_is_not_resampled():
    model = _family_model("ibdr")
    guide = pb.posterior(model, "ibdr", num_particles=3)
    values = guide.sample_posterior(4)
    assert pb.predict(model, guide, [(_x(),)], values=values).num_samples == 4


@pytest.mark.parametrize("norm", ["layer", "batch", "rms"])
def test_merged_network_of_a_signorm_member_is_that_member(norm):
    # each member's norm layer becomes the pretrained class with weight c·σ(γ_t), bias β_t and
    # (BatchNorm) the member's statistics: the merged network computes member t exactly
    model = _signorm_model(norm)
    guide = pb.posterior(model, "signorm", init_noise=1.0)
    members = guide.sample_components(1)
    with torch.no_grad():  # members that differ from the pretrained layer in every tensor
        for site, v in members.items():
            if site.endswith((".beta", ".running_mean")) and norm != "rms":
                v.add_(torch.randn_like(v))
    x = _x()
    for t in range(3):
        member = {s: v[t, 0] for s, v in members.items()}
        merged = pb.models.merged_network(model, member)
        assert not any(type(m).__module__.startswith("pyrobayes") for m in merged.modules())
        assert type(merged[1]) is type(_norm_net(norm)[1])
        with torch.no_grad():
            torch.testing.assert_close(merged(x), model.output(x, member), rtol=1e-5, atol=1e-6)
    # and the members differ (else any one member's merge would pass)
    first = pb.models.merged_network(model, {s: v[0, 0] for s, v in members.items()})
    last = pb.models.merged_network(model, {s: v[2, 0] for s, v in members.items()})
    assert float((first(x) - last(x)).abs().max()) > 1e-3


def test_signorm_init_logit_at_the_bound_is_accepted():
    for logit in (-10.0, 10.0):
        model = _signorm_model(init_logit=logit)
        layer = model.net[1]
        assert layer.init_logit == logit
        # the layer is still the pretrained one at γ_0 (c = w / σ(γ_0))
        with torch.no_grad():
            torch.testing.assert_close(model.output(_x(), model.init_values()), _norm_net()(_x()))


def test_tau_sweep_refuses_unlabelled_eval_data():
    from pyrobayes.infer.signorm import tau_sweep

    data = [(_x(), _labels())]
    with pytest.raises(ValueError, match="eval_data carries no targets"):
        tau_sweep(_signorm_model, data, [(_x(),)], taus=[0.5], epochs=1)


def test_a_gaussian_model_keeps_its_default_obs_scale():
    assert _gaussian().likelihood.obs_scale == 1.0
    assert _gaussian(obs_scale=0.3).likelihood.obs_scale == pytest.approx(0.3)


def test_multiple_choice_valid_inputs_still_encode():
    batch = _encode(prompts=["a?", "b?"], choices=[["x", "y"], ["z", "w"]], answers=[1, 0])
    assert batch["input_ids"].shape[:2] == (2, 2) and batch["labels"].tolist() == [1, 0]
    batch = _encode(answers=torch.tensor([1]))
    assert batch["labels"].tolist() == [1]


@pytest.mark.integration
def test_signorm_merge_and_nan_predict_under_python_O():
    # without assert statements: merged_network of a σN member is still that member (it kept
    # the initial member norm under -O before), and NaN rows are refused for the particle and
    # symmetrized families
    script = (
        "import sys, torch\n"
        "assert False, 'asserts are on'\n"
        "from tests.test_bad_input import _signorm_model, _nan_row_predict, _x\n"
        "import pyrobayes as pb\n"
        "model = _signorm_model('batch')\n"
        "guide = pb.posterior(model, 'signorm', init_noise=1.0)\n"
        "member = {s: v[1, 0] for s, v in guide.sample_components(1).items()}\n"
        "x = _x()\n"
        "gap = float((pb.models.merged_network(model, member)(x) - model.output(x, member)).abs().max())\n"
        "moved = float((member['1.gamma'] - model.init_values()['1.gamma']).abs().max())\n"
        "print('gap', gap, 'moved', moved)\n"
        "for family in ('ibdr', 'signorm', 'symmetrized'):\n"
        "    try:\n"
        "        _nan_row_predict(family)\n"
        "        print(family, 'silent')\n"
        "    except ValueError as err:\n"
        "        print(family, 'refused' if 'rows [5]' in str(err) else err)\n"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.split("\n")
    gap, moved = (float(v) for v in lines[0].split()[1::2])
    assert moved > 0.1 and gap < 1e-5, done.stdout  # a member away from γ_0, merged exactly
    assert lines[1:4] == ["ibdr refused", "signorm refused", "symmetrized refused"], done.stdout


# ================================================================================================
# issue 30, IBDR (engineer: ibdr/symmetrized/meanfield): rho=0 is the plain step; rho < 0 refused
# ================================================================================================


class TestIBDRZeroRadius:
    @staticmethod
    def _problem() -> tuple[FineTuneModel, list[Any]]:
        torch.manual_seed(0)
        model = FineTuneModel(
            mlp(5, 12, 6), None, latent_modules=["0", "2"], trainable_modules=[], num_data=48
        )
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(48, 5, generator=g), torch.randint(0, 6, (48,), generator=g)
        return model, [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)]

    def test_rho_zero_stays_on_the_map_path(self) -> None:
        """The reported case: K = 1, α = 0, no jitter, rho=0 ended 0.06 off MAP after 40 Adam
        steps (the robust ascent still ran). Now it is the MAP step: 1e-6 after 40 steps."""
        pyro.clear_param_store()
        model_a, data = self._problem()
        map_guide = pb.posterior(model_a, "map")
        map_fitter = make_fitter(model_a, map_guide, lr=1e-2)
        model_b, _ = self._problem()
        guide = pb.posterior(model_b, "ibdr", num_particles=1, init_scale=0.0)
        fitter = make_fitter(model_b, guide, lr=1e-2, optimizer=pb.infer.IBDR(alpha=0.0, rho=0.0))
        for step in range(40):
            map_fitter.step(data[step % 3])
            fitter.step(data[step % 3])
        for site in guide.sites:
            torch.testing.assert_close(
                guide.loc(site)[0], map_guide.loc(site), rtol=1e-6, atol=1e-6
            )
        assert fitter.radius == 0.0 and fitter.lam == 3.0

    def test_negative_rho_is_refused_by_name(self) -> None:
        model, _ = self._problem()
        with pytest.raises(ValueError, match="rho"):
            pb.infer.IBDR(rho=-0.01)
        with pytest.raises(ValueError, match="rho"):
            pb.posterior(model, "ibdr", rho=-0.01)  # the deprecated keyword, checked too


# ------------------------------------------------------------------------------------------------
# found by probing unusual but plausible use (each raised a bare torch/pyro error or a misleading
# one before): a one-shot iterator, a batch of three items, NaN logits under IBDR
# ------------------------------------------------------------------------------------------------


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_x(), _labels()), (_x(), _labels())]


def _fit_iterator(family: str, epochs: int) -> Any:
    model = _model()
    return pb.fit(model, pb.posterior(model, family), iter(_batches()), epochs=epochs)


def _nan_head() -> FineTuneModel:
    # finite inputs, a head gone non-finite (a diverged fit): NaN logits reach IBDR's data term
    model = _model()
    with torch.no_grad():
        model.net[2].weight.fill_(NAN)
    return model


PROBE_CASES: list[Case] = [
    _case(
        "fit-one-shot-iterator-two-epochs",
        lambda: _fit_iterator("map", 2),
        ValueError,
        "one-shot iterator",
        "used up by the first epoch",
        "list of batches or a DataLoader",
    ),
    _case(
        "laplace-one-shot-iterator",
        lambda: _fit_iterator("laplace", 1),
        ValueError,
        "one-shot iterator",
        "curvature pass",
        "list of batches or a DataLoader",
    ),
    _case(
        "batch-of-three-items",
        lambda: _step((_x(), _x(), _labels())),
        TypeError,
        "tuple of 3 items",
        "((x1, x2), y)",
    ),
    _case(
        "ibdr-forward-overflows",
        lambda: _step((_x(), _labels()), "ibdr", model=_nan_head()),
        FloatingPointError,
        "Non-finite loss",
    ),
]


def test_a_one_shot_iterator_still_fits_one_epoch():
    # streaming data without len(): one pass is all a one-epoch fit needs
    model = _model()
    result = pb.fit(model, pb.posterior(model, "map"), iter(_batches()), epochs=1)
    assert len(result.losses) == 2


def _fit_with(family: str, optimizer: Any) -> Any:
    model = _model(adapter=LoRA(rank=2, target_modules=["0"])) if family == "symmetrized" else None
    model = _model() if model is None else model
    guide = pb.posterior(model, family)
    return pb.fit(model, guide, _batches(), epochs=1, optim=pb.Optimization(optimizer=optimizer))


SETTINGS_CASES: list[Case] = [
    _case(
        "ivon-with-a-torch-optimizer",  # IVON's update never ran: sigma stayed at its init
        lambda: _fit_with("ivon", torch.optim.SGD),
        TypeError,
        "is not IVON's",
        "pb.infer.IVON(...)",
    ),
    _case(
        "meanfield-with-symmetrized-settings",  # num_permutations was silently ignored
        lambda: _fit_with("meanfield", pb.infer.Symmetrized(num_permutations=4)),
        TypeError,
        "Symmetrized(...) holds another family's settings",
        "pb.infer.MeanField(...)",
    ),
    _case(
        "swag-with-ivon-settings",
        lambda: _fit_with("swag", pb.infer.IVON()),
        TypeError,
        "IVON(...) holds another family's settings",
        "pb.infer.SWAG(...)",
    ),
]
PROBE_CASES = PROBE_CASES + SETTINGS_CASES
CASES = CASES + PROBE_CASES


@pytest.mark.parametrize("case", PROBE_CASES, ids=[c.id for c in PROBE_CASES])
def test_probe_bad_input(case: Case):
    assert check_case(case) is None


def test_a_base_settings_record_is_widened_for_its_subfamily():
    # pb.infer.IVON(...) for Kronecker IVON and MeanField(...) for the symmetrized guide: bases
    # their families widen (documented), not another family's settings
    _fit_with("kron-ivon", pb.infer.IVON(beta2=0.999))
    _fit_with("symmetrized", pb.infer.MeanField())


def test_posterior_knobs_set_after_fitting_are_checked():
    # SWAG's scale and Laplace's pred_type are read at predict time and may be retuned after a
    # fit; a bad value failed inside torch (a Cholesky of a non-positive-definite matrix) or
    # with a message that left out the valid "nn"
    model = _model()
    swag = pb.posterior(model, "swag")
    for bad in (0.0, -1.0, NAN):
        with pytest.raises(ValueError, match="scale"):
            swag.scale = bad
    swag.scale = 0.25
    assert swag.scale == 0.25
    laplace = pb.posterior(model, "laplace")
    with pytest.raises(ValueError, match=r"pred_type must be one of \['glm', 'probit', 'nn'\]"):
        laplace.pred_type = "NN"
    laplace.pred_type = "nn"
    assert laplace.pred_type == "nn"


def test_the_laplace_temperature_is_a_setting_of_its_fit():
    # T scales the curvature the fit stores (H/T) and the evidence that chooses tau: set after a
    # fit it was silently ignored; now it is refused there and recorded when set before
    model = _model()
    laplace = pb.posterior(model, "laplace")
    laplace.temperature = 0.5  # before the fit: a setting of it
    assert laplace.config()["temperature"] == 0.5
    with pytest.raises(ValueError, match="temperature must be"):
        laplace.temperature = -1.0
    pb.fit(model, laplace, _batches(), epochs=1)
    curvature = {s: laplace.curvature(s).clone() for s in laplace.latent_subset}
    twin_model = _model()
    twin = pb.posterior(twin_model, "laplace", temperature=1.0)
    pb.fit(twin_model, twin, _batches(), epochs=1)
    for s, value in curvature.items():  # the fit ran at T = 0.5: twice the T = 1 curvature
        torch.testing.assert_close(value, 2.0 * twin.curvature(s), rtol=1e-5, atol=1e-7)
    laplace.temperature = 0.5  # the same value: nothing changes
    with pytest.raises(ValueError, match=r"fitted at T = 0.5.*temperature=2\)\) and fit it again"):
        laplace.temperature = 2.0
    assert laplace.temperature == 0.5


def test_targets_under_the_other_label_name_are_named():
    # a `datasets` column "label" (not "labels"): fit said only "must carry targets", and
    # predict passed label= into the network's forward and returned no targets
    from tests.common import tiny_bert

    model = FineTuneModel(tiny_bert(), LoRAXS(rank=2, target_modules=["query"]), num_data=8)
    guide = pb.posterior(model, "map")
    batch = {
        "input_ids": torch.randint(1, 99, (4, 6)),
        "attention_mask": torch.ones(4, 6, dtype=torch.long),
        "label": torch.tensor([0, 1, 0, 1]),
    }
    for call in (
        lambda: pb.fit(model, guide, [batch], epochs=1),
        lambda: pb.predict(model, guide, [batch]),
    ):
        with pytest.raises(ValueError, match=r"has no 'labels' but has 'label'.*label_key='label'"):
            call()
    renamed = FineTuneModel(
        tiny_bert(), LoRAXS(rank=2, target_modules=["query"]), num_data=8, label_key="label"
    )
    pred = pb.predict(renamed, pb.posterior(renamed, "map"), [batch])
    assert torch.equal(pred.targets, batch["label"])


def test_a_long_tuple_batch_points_a_hugging_face_user_to_a_dict():
    with pytest.raises(
        TypeError, match=r"Hugging Face model pass the dict .*GPT-2: past_key_values"
    ):
        pb.batch.split_batch((torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2)))


def test_a_data_set_of_single_examples_is_refused_with_how_to_batch_it():
    # a Hugging Face `datasets.Dataset` passed as data yields one example dict at a time: fit
    # read its 8 tokens as 8 examples of a 0-dim target, predict failed inside the network
    class ExampleDataset:  # what fit and predict see of datasets.Dataset
        column_names = ["input_ids", "labels"]
        features: dict[str, Any] = {}

        def __iter__(self):
            return iter([{"input_ids": torch.arange(8), "labels": torch.tensor(1)}])

    model = _model()
    guide = pb.posterior(model, "map")
    for call in (
        lambda: pb.fit(model, guide, ExampleDataset(), epochs=1),
        lambda: pb.predict(model, guide, ExampleDataset()),
    ):
        with pytest.raises(TypeError, match=r"single examples, not batches.*DataLoader"):
            call()
    with pytest.raises(TypeError, match=r"values are Python lists.*with_format\('torch'\)"):
        pb.predict(model, guide, [{"x": [[1.0] * 4] * 2}])


def test_the_ignore_index_is_named_among_labels_out_of_range():
    model = _model()
    guide = pb.posterior(model, "map")
    x, y = _batches()[0]
    y = y.clone()
    y[0] = -100
    with pytest.raises(ValueError, match=r"out of range.*-100 is Hugging Face's ignore index"):
        pb.fit(model, guide, [(x, y)], epochs=1)


def test_ood_predictions_of_another_width_say_how_to_compare_them():
    # multiple-choice sets of different widths (up to 4 choices, up to 3): the message said
    # only "ood_probs has 3 classes, probs has 4"
    probs = torch.softmax(torch.randn(2, 5, 4), -1)
    ood = torch.softmax(torch.randn(2, 6, 3), -1)
    labels = torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"has 3 classes, probs has 4.*padded with probability 0"):
        pb.metrics.report(probs, labels, ood_probs=ood)
    padded = torch.cat([ood, torch.zeros(2, 6, 1)], -1)  # what the message says works
    assert 0.0 <= pb.metrics.report(probs, labels, ood_probs=padded)["auroc_entropy"] <= 1.0


# ================================================================================================
# the silent-case sweep of 2026-12-06: mistakes that ran on silently or failed inside torch
# ================================================================================================


def _softmax_model() -> FineTuneModel:
    """``_model``'s network with a final ``nn.Softmax``: it returns probabilities."""
    torch.manual_seed(0)
    net = nn.Sequential(*mlp(4, 6, CLASSES), nn.Softmax(-1))
    return FineTuneModel(
        net, LoRAXS(rank=2, target_modules=["0"]), trainable_modules=["2"], num_data=32
    )


def _other_float() -> torch.dtype:
    """A floating dtype other than the network's (the suite's default dtype)."""
    return torch.float32 if torch.get_default_dtype() == torch.float64 else torch.float64


class _UnitDimNet(nn.Module):
    """``mlp(4, 6, C)`` whose output keeps a unit dim: ``(B, 1, C)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(4, 6, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).unsqueeze(1)


def _unit_dim_model() -> FineTuneModel:
    torch.manual_seed(0)
    adapter = LoRAXS(rank=2, target_modules=["body.0"])
    return FineTuneModel(_UnitDimNet(), adapter, trainable_modules=["body.2"], num_data=ROWS)


def _fitted_meanfield() -> tuple[FineTuneModel, Any]:
    model = _model(num_data=ROWS)
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, [(_x(), _labels())], optim=pb.Optimization(num_steps=1))
    return model, guide


SWEEP_CASES: list[Case] = [
    # a head ending in nn.Softmax: the likelihood's softmax ran twice, accuracy unchanged, NLL
    # and ECE silently wrong
    _case(
        "softmax-head",
        lambda: _fit((_x(), _labels()), model=_softmax_model()),
        ValueError,
        "outputs are probabilities",
        "Remove the final nn.Softmax",
    ),
    # a one-logit "categorical" head: a softmax over one class, a constant loss
    _case(
        "one-class-head",
        lambda: _fit((_x(), torch.zeros(ROWS, dtype=torch.long)), model=_model(widths=(4, 6, 1))),
        ValueError,
        "one logit per example",
        "2 for a binary task",
    ),
    # inputs of another dtype than the network: torch's "mat1 and mat2 must have the same dtype"
    _case(
        "float-inputs-of-another-dtype",
        lambda: _fit((_x().to(_other_float()), _labels())),
        TypeError,
        f"inputs are {_other_float()}",
        f"parameters are {torch.get_default_dtype()}",
        f"x.to({torch.get_default_dtype()})",
    ),
    _case(
        "float-inputs-of-another-dtype-predict",
        lambda: _predict([(_x().to(_other_float()), _labels())]),
        TypeError,
        f"inputs are {_other_float()}",
    ),
    _case(
        "integer-inputs",
        lambda: _fit((torch.randint(0, 5, (ROWS, 4)), _labels())),
        TypeError,
        "integer tensors (torch.int64)",
        "x.float()",
    ),
    # a dict batch with a column the network's forward does not take (GLUE's "idx")
    _case(
        "dict-extra-key",
        lambda: _fit({"input": _x(), "idx": torch.arange(ROWS), "labels": _labels()}),
        TypeError,
        "net(**batch)",
        "'idx'",
        "Drop that column",
    ),
    # a (B, 1, C) output: the message blamed the labels ("do not match the batch of 1")
    _case(
        "output-with-a-unit-dim",
        lambda: _fit((_x(), _labels()), model=_unit_dim_model()),
        ValueError,
        "(1, 3) per example for the 8 labels",
        "returns (B, C)",
    ),
    _case("fit-seed-negative", lambda: _fit_seed(-1), ValueError, "fit(): seed", ">= 0"),
    _case("fit-seed-too-large", lambda: _fit_seed(2**40), ValueError, "fit(): seed", "2**32 - 1"),
    # explicit draws: a bare StopIteration, KeyError or bmm size error before
    _case(
        "predict-values-empty",
        lambda: _predict([(_x(), _labels())], values={}),
        ValueError,
        "predict(values=...)",
        "'0.core'",
    ),
    _case(
        "predict-values-unknown-site",
        lambda: _predict([(_x(), _labels())], values={"0.cor": torch.zeros(3, 2, 2)}),
        ValueError,
        "unknown: ['0.cor']",
        "missing: ['0.core']",
    ),
    _case(
        "predict-values-shape",
        lambda: _predict([(_x(), _labels())], values={"0.core": torch.zeros(3, 3, 3)}),
        ValueError,
        "'0.core' takes draws of shape (S, *(2, 2))",
    ),
    _case(
        "validation-empty",
        lambda: _fit_validated([]),
        ValueError,
        "fit(validation=Validation(data))",
        "no batches",
    ),
    # σN over a LayerNorm of a binary classifier's two logits: ±γ + β, a sign with no
    # gradient back; the stress sweep's fits collapsed to the majority class (−30 to −46 pp)
    _case(
        "signorm-layernorm-over-two-logits",
        lambda: pb.models.SigmaNormEnsemble(
            nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2), nn.LayerNorm(2)),
            num_members=2,
            trainable_modules=["2"],
            num_data=8,
        ),
        ValueError,
        "LayerNorm over 2 feature(s)",
        "norm_modules=[...]",
    ),
    _case(
        "export-empty-data",
        lambda: pb.to_inference_data(*_fitted_meanfield(), []),
        ValueError,
        "to_inference_data",
        "no batches",
    ),
    _case(
        "calibrate-keyword-typo",
        lambda: pb.calibrate(*_fitted_meanfield(), [(_x(), _labels())], num_sample=8),
        TypeError,
        "calibrate: ",
        "'num_sample'",
        "num_samples",
    ),
]
CASES = CASES + SWEEP_CASES


def _fit_validated(validation_data: Any) -> Any:
    model = _model(num_data=ROWS)
    guide = pb.posterior(model, "map")
    return pb.fit(
        model, guide, [(_x(), _labels())], epochs=1, validation=pb.Validation(validation_data)
    )


def _fit_seed(seed: int) -> Any:
    model = _model(num_data=ROWS)
    return pb.fit(model, pb.posterior(model, "map"), [(_x(), _labels())], epochs=1, seed=seed)


@pytest.mark.parametrize("case", SWEEP_CASES, ids=[c.id for c in SWEEP_CASES])
def test_sweep_bad_input(case: Case):
    assert check_case(case) is None


def test_log_softmax_outputs_are_logits_and_pass():
    # log-probabilities differ from the logits by a per-row constant: the same likelihood
    torch.manual_seed(0)
    net = nn.Sequential(*mlp(4, 6, CLASSES), nn.LogSoftmax(-1))
    model = FineTuneModel(
        net, LoRAXS(rank=2, target_modules=["0"]), trainable_modules=["2"], num_data=ROWS
    )
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, [(_x(), _labels())], epochs=2)
    pred = pb.predict(model, guide, [(_x(), _labels())])
    assert torch.allclose(pred.probs.sum(-1), torch.ones(1, ROWS))


def test_calibrate_on_labels_of_one_class_warns():
    model, guide = _fitted_meanfield()
    x = _x(60)
    with pytest.warns(UserWarning) as seen:
        pb.calibrate(model, guide, [(x, torch.zeros(60, dtype=torch.long))])
    assert [w for w in seen if "labels of only 1 of the 3 classes" in str(w.message)]
    # every class present: no such warning (T may sit at a bound on this untrained model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pb.calibrate(model, guide, [(x, torch.arange(60) % CLASSES)])
    assert not [w for w in seen if "of only" in str(w.message)]


def test_calibration_data_unread_by_the_adapter_warns():
    batch = [(_x(), _labels())]
    for adapter in (LoRAXS(rank=2, target_modules=["0"]), LoRA(rank=2, target_modules=["0"])):
        with pytest.warns(UserWarning, match=r"calibration_data is read only by .*'wsvd'"):
            _model(adapter=adapter, calibration_data=batch)
    # W-SVD reads it: no warning (warnings are errors in the suite)
    _model(adapter=LoRAXS(rank=2, target_modules=["0"], projection="wsvd"), calibration_data=batch)


def test_diagnose_with_too_few_draws_says_so():
    from pyrobayes.diagnostics.khat import khat_interpretation

    model, guide = _fitted_meanfield()
    result = pb.diagnose(model, guide, [(_x(), _labels())], num_samples=8)
    assert result.interpretation.startswith("undefined: S = 8 draws leave 2 in the tail")
    # with enough draws for a tail fit, the reading is the k-hat's
    assert khat_interpretation(math.inf, 1000).startswith("bad")


# ================================================================================================
# probe B: silent or misleading failures of unusual data and networks (each ran on silently,
# or failed with a torch error or a misleading message, before)
# ================================================================================================


class _Example(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class _NamedExamples(Dataset):
    """``ROWS`` examples as namedtuples, which torch's ``default_collate`` keeps."""

    def __init__(self) -> None:
        torch.manual_seed(1)
        self.x, self.y = _x(), _labels()

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> _Example:
        return _Example(self.x[index], self.y[index])


def test_namedtuple_batches_are_predicted_and_fitted():
    # batch.to_device rebuilt a namedtuple from one generator: "missing 1 required positional
    # argument" in pb.predict and in Laplace's curvature pass
    data = _NamedExamples()
    loader = DataLoader(data, batch_size=4)
    assert isinstance(next(iter(loader)), _Example)
    model = _model(num_data=ROWS)
    guide = pb.posterior(model, "laplace")
    pb.fit(model, guide, loader, epochs=1)
    pred = pb.predict(model, guide, loader, num_samples=2)
    assert pred.log_probs.shape[1] == ROWS
    assert torch.equal(pred.targets, data.y)
    batch = _Example(torch.ones(4, 2), torch.arange(4))
    assert pb.batch.to_device(batch, "cpu") == batch
    expanded = pb.batch.expand_samples(batch, 2)
    assert isinstance(expanded, _Example) and expanded.x.shape == (8, 2)
    sliced = pb.batch.slice_examples(batch, 1, 3, 4)
    assert isinstance(sliced, _Example) and torch.equal(sliced.y, torch.tensor([1, 2]))


def _fit_data(data: Any, model: FineTuneModel | None = None) -> Any:
    """``pb.fit`` of MAP for one epoch on ``data`` as given (not wrapped in a list)."""
    model = _model(num_data=ROWS) if model is None else model
    return pb.fit(model, pb.posterior(model, "map"), data, epochs=1)


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    return _x(), _labels()


#: data whose items are not batches (each was iterated one example, row or key at a time: a
#: shape error inside torch, a 0-dim-target message, or a silent prediction of the wrong rows)
DATA_CASES: list[Case] = [
    _case(
        "data-torch-dataset-fit",
        lambda: _fit_data(TensorDataset(*_xy())),
        TypeError,
        "fit(): data is a TensorDataset (a torch Dataset)",
        "single examples",
        "DataLoader(dataset, batch_size=32)",
    ),
    _case(
        "data-torch-dataset-predict",
        lambda: _predict(TensorDataset(_x())),
        TypeError,
        "predict: data is a TensorDataset",
        "Pass an iterable of batches",
    ),
    _case(
        "data-loader-without-batch-size",
        lambda: _predict(DataLoader(TensorDataset(*_xy()), batch_size=None)),
        TypeError,
        "predict: data is a DataLoader with batch_size=None",
        "give it a batch_size",
    ),
    _case(
        "data-tensor-predict",
        lambda: _predict(_x()),
        TypeError,
        "predict: data is a tensor of shape (8, 4)",
        "iterates its rows",
        "list of (inputs, targets) batches",
    ),
    _case(
        "data-tensor-gaussian-of-input-width",  # predicted silently: 8 rows as 8 batches of 4
        lambda: _predict(_x(), model=_gaussian(4)),
        TypeError,
        "data is a tensor",
    ),
    _case(
        "data-dict-batch-fit",
        lambda: _fit_data({"input": _x(), "labels": _labels()}),
        TypeError,
        "fit(): data is a dict (keys ['input', 'labels'])",
        "pass [batch]",
    ),
    _case(
        "data-one-pair-predict",
        lambda: _predict(_xy()),
        TypeError,
        "predict: data is a tuple of two items that reads as one (inputs, targets) batch",
        "[(x, y)] for a single batch",
    ),
    _case(
        "data-one-pair-fit",
        lambda: _fit_data((_x(), torch.randn(ROWS)), model=_gaussian(num_data=ROWS)),
        TypeError,
        "fit(): data is a tuple",
        "tensor of shape (8,), has a row per example of the first",
    ),
    _case(
        "data-rows-as-batches",  # the refusal above bypassed: the network sees single rows
        lambda: _predict(list(_x()), num_samples=1, values=_model().init_values()),
        ValueError,
        "FineTuneModel: the likelihood's parameters have 3 rows (shape (3,)) for a batch of 4",
        "one example rather than a batch",
    ),
]
CASES = CASES + DATA_CASES


@pytest.mark.parametrize("case", DATA_CASES, ids=[c.id for c in DATA_CASES])
def test_data_of_single_examples_is_refused(case: Case):
    assert check_case(case) is None


class _BatchedDataset(Dataset):
    """A map-style dataset whose items are whole batches (read with ``batch_size=None``)."""

    def __init__(self) -> None:
        self.batches = _batches()

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[index]


def test_iterables_of_batches_still_pass():
    model = _model(num_data=2 * ROWS)
    guide = pb.posterior(model, "map")
    pre_batched = DataLoader(_BatchedDataset(), batch_size=None)  # items are batches already
    pb.fit(model, guide, pre_batched, epochs=1)
    assert pb.predict(model, guide, pre_batched).log_probs.shape == (1, 2 * ROWS, CLASSES)
    x1, x2 = _x(), _x(5)
    for data in ((x1, x2), [x1, x2], (x1,), iter([x1, x2]), tuple(torch.cat([x1, x2]).split(8))):
        assert pb.predict(model, guide, data).log_probs.shape[1] in (ROWS, ROWS + 5)
    pairs = [(x1, _labels()), (x2, _labels()[:5])]  # two labelled batches: a pair of pairs
    assert pb.predict(model, guide, pairs).targets.shape == (ROWS + 5,)


def _with_empty_batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _xy()
    return [(x, y), (x[:0], y[:0])]


def _fit_family(family: str, data: Any) -> Any:
    model = _model(num_data=ROWS)
    guide = pb.posterior(model, family)
    pb.fit(model, guide, data, epochs=1)
    return model, guide


def _laplace_predict(data: Any, pred_type: str = "glm") -> Any:
    model, guide = _fit_family("laplace", [_xy()])
    guide.pred_type = pred_type
    return pb.predict(model, guide, data, num_samples=2)


def _fit_pyro_elbo(elbo: Any, data: Any) -> Any:
    model = _model(num_data=ROWS)
    guide = pb.posterior(model, "meanfield")
    return pb.fit(model, guide, data, epochs=1, optim=pb.Optimization(loss=elbo))


#: a batch of no examples: a ZeroDivisionError in the objective, a "Lower the learning rate"
#: FloatingPointError under IVON, a reshape error inside torch's distributions in predict
EMPTY_CASES: list[Case] = [
    _case(
        "empty-batch-fit-map",
        lambda: _fit_family("map", _with_empty_batch()),
        ValueError,
        "training batch holds no examples",
        "Drop empty batches",
    ),
    _case(
        "empty-batch-fit-ivon",
        lambda: _fit_family("ivon", _with_empty_batch()),
        ValueError,
        "training batch holds no examples",
        absent=("learning rate",),
    ),
    _case(
        "empty-batch-predict",
        lambda: _predict(_with_empty_batch(), num_samples=2),
        ValueError,
        "predict: batch 1 holds no examples",
        "Drop empty batches",
    ),
    _case(
        "empty-batch-predict-linearized",
        lambda: _laplace_predict(_with_empty_batch()[::-1]),
        ValueError,
        "predict: batch 0 holds no examples",
    ),
    # a Pyro ELBO skipped pyrobayes' batch split: the empty batch failed in Pyro's trace
    _case(
        "empty-batch-fit-pyro-trace-elbo",
        lambda: _fit_pyro_elbo(pyro.infer.Trace_ELBO(), _with_empty_batch()),
        ValueError,
        "training batch holds no examples",
    ),
    _case(
        "empty-batch-fit-pyro-tracegraph-elbo",
        lambda: _fit_pyro_elbo(pyro.infer.TraceGraph_ELBO(), _with_empty_batch()),
        ValueError,
        "training batch holds no examples",
    ),
]
CASES = CASES + EMPTY_CASES


@pytest.mark.parametrize("case", EMPTY_CASES, ids=[c.id for c in EMPTY_CASES])
def test_an_empty_batch_is_refused(case: Case):
    assert check_case(case) is None


def _fit_after_predict() -> Any:
    # predict read the network's log-softmax, which passes as logits, and marked the outputs
    # checked: the fit that followed skipped the check too
    model = _softmax_model()
    guide = pb.posterior(model, "map")
    with contextlib.suppress(ValueError):
        pb.predict(model, guide, [_xy()], values=model.init_values())
    return pb.fit(model, guide, [_xy()], epochs=1)


def _softmax_added_after_the_fit(pred_type: str) -> Any:
    model, guide = _fit_family("laplace", [_xy()])
    model.net.append(nn.Softmax(-1))  # the same model object: its head now returns probabilities
    guide.pred_type = pred_type
    return pb.predict(model, guide, [_xy()], num_samples=2)


#: a network ending in nn.Softmax reached predict unchecked: its log-softmax passed as logits
SOFTMAX_CASES: list[Case] = [
    _case(
        "softmax-head-predict-zero-shot",
        lambda: _predict([_xy()], model=_softmax_model(), values=_softmax_model().init_values()),
        ValueError,
        "predict: batch 0: Categorical likelihood: the network's outputs are probabilities",
        "Remove the final nn.Softmax",
    ),
    _case(
        "softmax-head-predict-unlabelled",
        lambda: _predict([_x()], model=_softmax_model(), num_samples=2),
        ValueError,
        "outputs are probabilities",
    ),
    _case(
        "softmax-head-fit-after-predict",
        _fit_after_predict,
        ValueError,
        "Categorical likelihood: the network's outputs are probabilities",
    ),
    _case(
        "softmax-head-linearized-glm",
        lambda: _softmax_added_after_the_fit("glm"),
        ValueError,
        "predict: batch 0: Categorical likelihood: the network's outputs are probabilities",
    ),
    _case(
        "softmax-head-linearized-probit",
        lambda: _softmax_added_after_the_fit("probit"),
        ValueError,
        "outputs are probabilities",
    ),
]
CASES = CASES + SOFTMAX_CASES


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=[c.id for c in SOFTMAX_CASES])
def test_a_softmax_head_is_refused_at_predict(case: Case):
    assert check_case(case) is None


def _laplace_regression_predict(x: torch.Tensor) -> Any:
    model = _gaussian(2, num_data=ROWS)
    guide = pb.posterior(model, "laplace")
    pb.fit(model, guide, [(_x(), torch.randn(ROWS, 2))], epochs=1)
    return pb.predict(model, guide, [(x, torch.zeros(ROWS, 2))])


def _laplace_calibrate(x: torch.Tensor) -> Any:
    model, guide = _fit_family("laplace", [_xy()])
    return pb.calibrate(model, guide, [(x, _labels())])


def _probit_of_a_nan_posterior() -> Any:
    model, guide = _fit_family("laplace", [_xy()])
    with torch.no_grad():
        guide.lap_prior_precision.fill_(NAN)
    return _predict_with(model, guide, "probit")


def _predict_with(model: FineTuneModel, guide: Any, pred_type: str) -> Any:
    guide.pred_type = pred_type
    return pb.predict(model, guide, [_xy()])


#: NaN or inf inputs under the linearised predictive: NaN predictions without an error (and
#: pb.calibrate fitted T at its bound on them)
LINEARIZED_NAN_CASES: list[Case] = [
    *[
        _case(
            f"laplace-{pred_type}-nan-input",
            lambda pred_type=pred_type: _laplace_predict(
                [(_with(_x(), NAN, (3, 0)), _labels())], pred_type
            ),
            ValueError,
            "predict: batch 0: rows [3] of the inputs hold NaN or inf",
            "NaN log-probabilities",
            "data problem",
        )
        for pred_type in ("glm", "probit")
    ],
    _case(
        "laplace-glm-inf-input-in-a-later-chunk",  # rows named in the batch, not in the chunk
        lambda: _model_predict_in_chunks(_with(_x(), INF, (5, 1))),
        ValueError,
        "predict: batch 1: rows [5] of the inputs",
    ),
    _case(
        "laplace-regression-glm-nan-input",
        lambda: _laplace_regression_predict(_with(_x(), NAN, (2, 0))),
        ValueError,
        "predict: batch 0: rows [2]",
        "non-finite predictive means (non-finite RMSE and NLL)",
    ),
    _case(
        "laplace-calibrate-nan-input",
        lambda: _laplace_calibrate(_with(_x(), NAN, (5, 1))),
        ValueError,
        "rows [5] of the inputs hold NaN or inf",
    ),
    _case(
        "laplace-probit-nan-posterior",  # finite inputs and f(x; θ̂), a NaN covariance
        _probit_of_a_nan_posterior,
        FloatingPointError,
        "predict: the LaplaceGuide's posterior precision H + τ I is not usable at 1 site(s)",
        "site '0.core': its prior precision τ is nan",
    ),
]
CASES = CASES + LINEARIZED_NAN_CASES


def _model_predict_in_chunks(x: torch.Tensor) -> Any:
    model, guide = _fit_family("laplace", [_xy()])
    data = [_xy(), (x, _labels())]
    return pb.predict(model, guide, data, num_samples=2, examples_per_forward=2)


@pytest.mark.parametrize("case", LINEARIZED_NAN_CASES, ids=[c.id for c in LINEARIZED_NAN_CASES])
def test_non_finite_inputs_are_named_by_the_linearized_predictive(case: Case):
    assert check_case(case) is None


class _TinyLM(nn.Module):
    """A causal LM of 11 tokens (no attention: each position's next-token logits from its own
    token), enough for continuation scores."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(11, 8), nn.Linear(8, 8), nn.Linear(8, 11)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(input_ids))))


def _ragged_choices() -> tuple[FineTuneModel, dict[str, torch.Tensor]]:
    """4 questions of 3 choices, the first with 2 real ones (choice 2 padded) and label 2."""
    torch.manual_seed(0)
    shape = (4, 3, 5)
    continuation = torch.zeros(shape, dtype=torch.long)
    continuation[..., 3:] = 1
    choice_mask = torch.ones(4, 3, dtype=torch.long)
    choice_mask[0, 2] = 0
    batch = {
        "input_ids": torch.randint(1, 11, shape),
        "attention_mask": torch.ones(shape, dtype=torch.long),
        "continuation_mask": continuation,
        "choice_mask": choice_mask,
        "labels": torch.tensor([2, 0, 1, 2]),
    }
    adapter = LoRAXS(rank=2, target_modules=["mid"])
    model = FineTuneModel(
        _TinyLM(), adapter, likelihood="multiple_choice", num_data=4, trainable_modules=[]
    )
    return model, batch


def _predict_ragged() -> Any:
    model, batch = _ragged_choices()
    return pb.predict(model, pb.posterior(model, "map"), [batch], values=model.init_values())


def _fit_ragged() -> Any:
    model, batch = _ragged_choices()
    return pb.fit(model, pb.posterior(model, "map"), [batch], epochs=1)


def _scores_with_a_masked_label() -> torch.Tensor:
    scores = torch.randn(2, ROWS, 3)  # (S, B, K)
    scores[:, 3, 2] = -INF
    labels = torch.zeros(ROWS, dtype=torch.long)
    labels[3] = 2
    return MultipleChoice().log_prob(scores, labels)


#: a label on a padded choice (choice_mask 0, scored -inf): an infinite NLL at predict, and a
#: "Lower the learning rate" FloatingPointError in fit
MASKED_CHOICE_CASES: list[Case] = [
    _case(
        "choice-label-on-a-padded-choice-log-prob",
        _scores_with_a_masked_label,
        ValueError,
        "multiple_choice likelihood (continuations): the labels of examples [3] (of 8)",
        "scored -inf",
    ),
    _case(
        "choice-label-on-a-padded-choice-predict",
        _predict_ragged,
        ValueError,
        "predict: batch 0: multiple_choice likelihood (continuations)",
        "examples [0] (of 4)",
        "choice_mask 0",
    ),
    _case(
        "choice-label-on-a-padded-choice-fit",
        _fit_ragged,
        ValueError,
        "examples [0] (of 4) point at a choice scored -inf",
        absent=("learning rate",),
    ),
]
CASES = CASES + MASKED_CHOICE_CASES


@pytest.mark.parametrize("case", MASKED_CHOICE_CASES, ids=[c.id for c in MASKED_CHOICE_CASES])
def test_a_label_on_a_padded_choice_is_refused(case: Case):
    assert check_case(case) is None


def test_labels_on_real_choices_of_a_ragged_batch_pass():
    model, batch = _ragged_choices()
    batch["labels"] = torch.tensor([1, 0, 1, 2])
    pred = pb.predict(model, pb.posterior(model, "map"), [batch], values=model.init_values())
    assert math.isfinite(pb.metrics.report(pred, pred.targets)["nll"])
    assert pred.log_probs[0, 0, 2] == -INF  # the padded choice keeps probability 0


#: IBDR fitted silently without num_data: its data term weighs each batch by N/B with N the
#: batch's own size, so the prior weighed N/B times too much
IBDR_NUM_DATA_CASES: list[Case] = [
    _case(
        "no-num-data-ibdr",
        lambda: _step((_x(), _labels()), "ibdr", model=_model(num_data=None)),
        ValueError,
        "IBDRGuide is fitted with IBDRLoss",
        "num_data=None",
        "FineTuneModel(num_data=N)",
    ),
    _case(
        "no-num-data-ibdr-fit",
        lambda: _fit((_x(), _labels()), "ibdr", model=_model(num_data=None)),
        ValueError,
        "IBDRLoss, which weights each minibatch by N/B",
    ),
]
CASES = CASES + IBDR_NUM_DATA_CASES


@pytest.mark.parametrize("case", IBDR_NUM_DATA_CASES, ids=[c.id for c in IBDR_NUM_DATA_CASES])
def test_ibdr_without_num_data_is_refused(case: Case):
    assert check_case(case) is None
