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

import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyro
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pyrobayes as pb
from pyrobayes.infer import make_fitter
from pyrobayes.infer.arguments import validate_fit_arguments
from pyrobayes.infer.objectives import split_training_batch
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.likelihoods import MultipleChoice
from pyrobayes.registry import available_guides, get_guide_class
from tests.common import mlp

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
    return pb.fit(model, pb.posterior(model, family), [batch], num_steps=1)


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
        "epochs=... or num_steps=...",
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
        lambda: pb.posterior(_model(), "laplace", log_prior_bounds=(NAN, 1.0)),
        ValueError,
        "log_prior_bounds[0]",
    ),
    _case(
        "laplace-alternate-tol-nan",
        lambda: pb.posterior(_model(), "laplace", alternate_tol=NAN),
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
