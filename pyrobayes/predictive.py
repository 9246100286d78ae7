r"""Sample-batched posterior predictive.

.. math:: \bar p(y\mid x) = \frac1S \sum_{s=1}^S p(y \mid x, θ_s),\qquad θ_s \sim q

S parameter sets are drawn once (the same draws for every test batch, so per-sample predictions
are coherent functions) and evaluated in chunks of ``samples_per_forward`` samples, each chunk in
ONE forward over a sample-major expanded batch. One wide batch was fastest on 2 CPU cores too;
on CPU the chunk is capped only to bound memory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.utils.data import DataLoader, RandomSampler, SubsetRandomSampler, WeightedRandomSampler
from tqdm.auto import tqdm

from .batch import (
    batch_size,
    check_batches,
    flagged_examples,
    image_tokens,
    split_batch,
    to_device,
)
from .calibration import apply_temperature, check_not_swapped
from .contract import LinearizedPredictive, Mixture, bound_model, implements
from .fitted_head import warn_if_head_changed, warn_if_never_fitted
from .models.adapters import check_int
from .models.sharing import reuse_within_batch
from .user_frame import user_stacklevel

logger = logging.getLogger(__name__)

__all__ = [
    "Prediction",
    "predict",
    "cat_examples",
    "default_samples_per_forward",
    "check_outputs",
    "observation_scale",
]


@dataclass
class Prediction:
    """Per-sample predictions on a data set.

    Attributes
    ----------
    log_probs : Tensor `(S, N, C)` or None
        Classification: per-sample log class probabilities. Multi-label classification (a
        :class:`~pyrobayes.models.Bernoulli` likelihood): `(S, N, L, 2)`, per label
        ``log (1 − p, p)`` with ``p`` the probability of a 1 (:attr:`multi_label`;
        :attr:`label_probs` is the predictive ``p̄`` `(N, L)`).
    loc : Tensor `(S, N, ...)` or None
        Regression: per-sample predictive means.
    scale : float or None
        Regression: the Gaussian likelihood's ``obs_scale`` σ.
    loc_var : Tensor `(S, N, ...)` or None
        Regression: the variance of the mean ``f`` around ``loc``, for a predictive that keeps
        it in closed form (the linearised Laplace predictive: ``diag(J Σ Jᵀ)``); the predictive
        is then ``N(loc, loc_var + σ²)`` per sample (:attr:`predictive_scale`).
    targets : Tensor `(N, ...)` or None
        Regression targets in the shape of ``loc[0]`` (``(N,)`` for a scalar output); class
        labels ``(N,)``; multi-label 0/1 targets ``(N, L)``.
    pooled_draws : int or None
        Classification under a pooled temperature (:func:`pyrobayes.calibrate`'s default):
        the number of posterior draws averaged into the one row of ``log_probs`` before
        tempering. That row has no per-draw spread, so mutual information (and any epistemic
        score) is 0 by construction; :func:`pyrobayes.metrics.report` reports it as NaN.
        ``None``: the rows are the draws.
    pooled_by : str or None
        Classification: how a posterior with spread became one row without a temperature
        (Laplace's probit predictive, a mixture's logit average), and how to keep the draws, in
        words; :func:`pyrobayes.metrics.report` then gives NaN mutual information, as for
        ``pooled_draws``. ``None``: the rows are the draws (or ``pooled_draws`` says why not).
    temperature : float or None
        The temperature ``T`` this prediction was tempered by (a calibrated guide's, applied by
        :func:`pyrobayes.predict`, or :func:`pyrobayes.calibration.apply_temperature`'s);
        ``None``: untempered. A tempered prediction is not tempered nor fitted a second time.
    """

    log_probs: Tensor | None = None
    loc: Tensor | None = None
    scale: float | None = None
    targets: Tensor | None = None
    loc_var: Tensor | None = None
    pooled_draws: int | None = None
    pooled_by: str | None = None
    temperature: float | None = None

    @property
    def predictive_scale(self) -> float | Tensor | None:
        """Regression: the predictive standard deviation around ``loc``, ``σ`` or
        ``sqrt(loc_var + σ²)`` (a tensor shaped like ``loc``)."""
        if self.loc_var is None or self.scale is None:
            return self.scale
        return (self.loc_var + self.scale**2).sqrt()

    @property
    def probs(self) -> Tensor:
        """Per-sample class probabilities `(S, N, C)`."""
        if self.log_probs is None:
            raise AttributeError("This is a regression prediction; use .loc and .scale.")
        return self.log_probs.exp()

    @property
    def mean_probs(self) -> Tensor:
        """Posterior-predictive probabilities ``p̄`` `(N, C)` (probabilities averaged; multi-label:
        `(N, L, 2)`)."""
        return self.probs.mean(0)

    @property
    def multi_label(self) -> bool:
        """Whether this is a multi-label prediction: ``log_probs`` `(S, N, L, 2)`."""
        return self.log_probs is not None and self.log_probs.dim() == 4

    @property
    def label_probs(self) -> Tensor:
        """Multi-label: the predictive probability of a 1 per label, ``p̄`` `(N, L)`."""
        if not self.multi_label:
            raise AttributeError(
                "label_probs is a multi-label prediction's (likelihood='bernoulli', log_probs "
                "(S, N, L, 2)); use mean_probs for class probabilities."
            )
        return self.mean_probs[..., 1]

    @classmethod
    def from_outputs(cls, outputs: Tensor, targets: Tensor | None, likelihood: Any) -> Prediction:
        """Wrap stacked per-sample outputs: log-probabilities or Gaussian means."""
        if likelihood.is_classification:
            return cls(log_probs=outputs, targets=targets)
        return cls(loc=outputs, scale=observation_scale(likelihood), targets=targets)

    @property
    def num_samples(self) -> int:
        """S, the number of per-sample rows."""
        ref = self.log_probs if self.log_probs is not None else self.loc
        if ref is None:
            raise AttributeError("This Prediction holds neither log_probs nor loc.")
        return int(ref.shape[0])


def observation_scale(likelihood: Any, where: str = "predict") -> float | None:
    """A regression likelihood's noise ``σ`` (its ``obs_scale``; ``None``: it has none), refused
    when not a finite number > 0: a learned ``σ = softplus(ρ)`` whose ``ρ`` is NaN (a file or
    an edit by hand) gave a prediction with ``scale = nan``, so every NLL and interval of it
    NaN, with no word of the cause.

    Raises
    ------
    FloatingPointError
        Naming ``where`` (the caller) and the value.
    """
    scale = getattr(likelihood, "obs_scale", None)
    if scale is None:
        return None
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise FloatingPointError(
            f"{where}: the Gaussian likelihood's noise σ (obs_scale) is {value}, not a finite "
            "number > 0, so the predictive's NLL and intervals would be NaN. A learned σ "
            "(obs_scale='learn') holds it as softplus(likelihood.raw_scale): set raw_scale to a "
            "finite value, or load the saved model again, and refit."
        )
    return value


def _equal_weight_samples(guide: Mixture, num_samples: int) -> int:
    """``num_samples`` rounded up to a multiple of the mixture's K (see :func:`predict`)."""
    k = int(guide.num_components)
    rounded = -(-num_samples // k) * k
    if rounded != num_samples:
        logger.info(
            "predict: num_samples=%d is not a multiple of the %d mixture components; drawing %d "
            "so that every component gets the same weight (%d draws each).",
            num_samples,
            k,
            rounded,
            rounded // k,
        )
    return rounded


#: On CPU, evaluate at most this many input rows (tokens for sequence inputs) per forward.
CPU_MAX_ROWS_PER_FORWARD = 1024


def _rows(inputs: Any) -> int:
    """Work units of one copy of a batch: examples × sequence length for token inputs, ×
    16² patches for images (:func:`~pyrobayes.batch.image_tokens`)."""
    if isinstance(inputs, dict) and isinstance(inputs.get("input_ids"), torch.Tensor):
        return int(inputs["input_ids"].numel())
    return image_tokens(inputs) or max(1, batch_size(inputs))


def default_samples_per_forward(
    num_samples: int, device: torch.device, inputs: Any = None, model: Any = None
) -> int:
    """Draws per forward: all of them on an accelerator; on CPU as many as keep the expanded
    batch within :data:`CPU_MAX_ROWS_PER_FORWARD` work units (rows, or rows × tokens).

    Measured on an idle 2-core CPU (``benchmarks/overhead.py``, S = 16): for a small MLP (64 rows)
    one wide forward was 0.83× the time of 16 narrow ones (per-call overhead dominates); for MiniLM
    (16 × 64 tokens per batch) 16 narrow forwards were fastest and one wide forward cost 1.3×
    (a compute-bound forward gains nothing from a wider batch on CPU, and its activations leave
    the cache). The cap of 1,024 units per forward serves both regimes. A ``model`` that
    shares work across draws (``model.tokens_per_draw(inputs)``: prompts or lower layers run
    once) counts only the work of one more draw: on a 4-layer LLaMA scoring 4 × 4 choices,
    chunks of 4 draws were 0.80× the time of single draws (S = 16; 8 and 16 alike), on the
    demo's MiniLM (lower half shared) chunks of 2 cost the same as single draws and 4 or 8 cost
    1.1–1.2× (``benchmarks/overhead.py``).
    """
    if device.type != "cpu" or inputs is None:
        return num_samples
    per_draw = getattr(model, "tokens_per_draw", None)
    units = per_draw(inputs) if callable(per_draw) else None
    return max(1, min(num_samples, CPU_MAX_ROWS_PER_FORWARD // (units or _rows(inputs))))


def _nonfinite_rows(inputs: Any, size: int) -> Tensor:
    """``(B,)`` bool: the rows of ``inputs`` whose floating-point tensors hold NaN or ±inf."""
    bad = torch.zeros(size, dtype=torch.bool)
    stack = [inputs]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (tuple, list)):
            stack.extend(item)
        elif (
            isinstance(item, Tensor)
            and item.is_floating_point()
            and item.dim() > 0
            and int(item.shape[0]) == size
        ):
            bad |= (~item.isfinite()).reshape(size, -1).any(-1).cpu()
    return bad


class _AlikeLabelled:
    """``data``'s batches, refusing one that carries labels where the first did not, or none
    where the first did: the prediction would hold outputs for every example and targets for
    the labelled ones only, misaligned (``targets[i]`` no longer the label of example ``i``)."""

    def __init__(self, data: Iterable[Any], label_key: str) -> None:
        self.data, self.label_key = data, label_key

    def __len__(self) -> int:  # for a progress bar; TypeError (no total) when data has none
        return len(self.data)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        first: bool | None = None
        for index, batch in enumerate(self.data):
            labelled = split_batch(batch, self.label_key)[1] is not None
            if first is None:
                first = labelled
            elif labelled != first:
                has, lacks = (
                    ("batch 0", f"batch {index}") if first else (f"batch {index}", "batch 0")
                )
                raise ValueError(
                    f"predict: {has} carries labels and {lacks} does not; the prediction would "
                    "hold outputs for every example but targets for the labelled batches only, "
                    "misaligned with them. Give every batch its labels ((x, y), or a dict with "
                    f"the model's label key {self.label_key!r}) or none of them ((x,) or x)."
                )
            yield batch


def check_outputs(
    out: Tensor, classification: bool, *, where: str, inputs: Any = None, offset: int = 0
) -> None:
    """Raise when a predictive's per-sample outputs ``(S, B, ...)`` are not usable.

    A NaN log-probability (or a non-finite regression mean) would turn the NLL, ECE and Brier
    score into NaN while the accuracy (an ``argmax``) stays finite, so it is refused here, with
    the example rows it sits on. ``-inf`` log-probabilities (a class masked by a ``-inf`` logit)
    are valid and pass. ``inputs`` are the B rows' inputs (their non-finite rows are named as
    the cause); ``offset`` is the index in its batch of ``out``'s first row, for a chunk of a
    batch (the rows are named in the batch).

    Raises
    ------
    ValueError
        When the NaN rows' inputs hold NaN or ±inf (a data error: the rows are named).
    FloatingPointError
        When the inputs are finite (the parameter draws or the network produce NaN: a diverged
        fit or an overflow).
    """
    bad = out.isnan() if classification else ~out.isfinite()
    if not bool(bad.any()):
        return
    per_row = bad.reshape(out.shape[0], out.shape[1], -1).any(-1).any(0)  # (B,)
    rows = [offset + row for row in per_row.nonzero().flatten().tolist()]
    what = "NaN log-probabilities" if classification else "non-finite predictive means"
    scores = (
        "NaN NLL, ECE and Brier score beside a finite accuracy"
        if classification
        else "non-finite RMSE and NLL"
    )
    if inputs is not None:
        data_rows = _nonfinite_rows(inputs, int(out.shape[1])).nonzero().flatten().tolist()
        data_rows = [offset + row for row in data_rows]
        if data_rows:
            raise ValueError(
                f"predict: {where} rows {flagged_examples(data_rows)} of the inputs hold NaN or inf, "
                f"which gives {what} ({scores}). "
                "This is a data problem: clean or drop those rows (torch.nan_to_num, or filter "
                "with torch.isfinite) before predicting."
            )
    raise FloatingPointError(
        f"predict: {where} rows {flagged_examples(rows)} get {what} from finite inputs: the parameter "
        "draws or the network's output are not finite (a diverged fit: refit with a smaller "
        "lr, or check the posterior's values with guide.mean())."
    )


class ShuffledDataWarning(UserWarning):
    """A prediction over a shuffling ``DataLoader``: its rows follow the pass's random order,
    not the dataset's (``pred.targets`` follows it too)."""


#: Samplers that draw the examples in a random order (a weighted one also with replacement)
_DRAWN = (RandomSampler, WeightedRandomSampler, SubsetRandomSampler)


def shuffles(data: Any) -> bool:
    """Whether ``data`` is a ``DataLoader`` that draws its examples in a random order (a
    ``RandomSampler``, ``WeightedRandomSampler`` or ``SubsetRandomSampler``, as its sampler or
    its batch sampler's): each pass over it yields another order."""
    if not isinstance(data, DataLoader):
        return False
    inner = getattr(data.batch_sampler, "sampler", None)
    return isinstance(data.sampler, _DRAWN) or isinstance(inner, _DRAWN)


def warn_if_rows_differ(data: Any, where: str) -> None:
    """Warn when the rows of a prediction over ``data`` will not be the dataset's, in its
    order: a ``DataLoader`` with ``drop_last=True`` that drops examples (``UserWarning``), or
    one that shuffles (:class:`ShuffledDataWarning`; scoring against ``pred.targets`` is then
    still right, against the dataset's own labels wrong)."""
    if not isinstance(data, DataLoader):
        return
    dataset: Any = data.dataset
    try:
        size = len(dataset)
    except TypeError:  # an iterable dataset: no rows to count, no sampler order
        return
    if data.drop_last and data.batch_size and size % data.batch_size:
        warnings.warn(
            f"{where}: data is a DataLoader with drop_last=True, so the last "
            f"{size % data.batch_size} of its {size} examples are not predicted (and not "
            "scored). Predict on a loader with drop_last=False.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
    if shuffles(data):
        sampler: Any = data.sampler
        if not isinstance(sampler, _DRAWN):
            sampler = getattr(data.batch_sampler, "sampler", None)
        drawn = (
            " drawn with replacement (some examples twice, others not at all)"
            if isinstance(sampler, WeightedRandomSampler) and sampler.replacement
            else ""
        )
        warnings.warn(
            f"{where}: data is a DataLoader that shuffles ({type(sampler).__name__}), so the "
            f"prediction's rows come in this pass's random order{drawn}, not the dataset's. "
            "Score it against pred.targets (collected in the same order), not the dataset's "
            "labels, or predict on a loader with shuffle=False (a SequentialSampler).",
            ShuffledDataWarning,
            stacklevel=user_stacklevel(),
        )


def check_fitted_model(model: Any, guide: Any, where: str) -> None:
    """Refuse to predict with ``guide`` on a ``model`` other than the one it was fitted on when
    the two differ outside the posterior.

    A guide holds the posterior over the latent sites only; the trained head and the frozen base
    weights are read from the model passed. Another model object with equal values there (a
    copy, or a float64 cast of one; base weights are compared by
    :func:`pyrobayes.io.base_fingerprint`, as :func:`pyrobayes.load` compares them) passes; one
    whose head or base weights differ (a model rebuilt after the fit, its head untrained) would
    pair the posterior with weights it was not fitted with, and predict silently wrong. On the
    guide's own model, a head changed since the guide was fitted or loaded (another fit on the
    same model trained it, or ``pb.load`` wrote another file's) gives a
    :class:`~pyrobayes.fitted_head.HeadChangedWarning`.

    Raises
    ------
    ValueError
        Naming what differs and the fix.
    """
    from .io.compatibility import (  # local: io imports the registry
        base_fingerprint,
        differing_point_params,
    )

    check_not_swapped(model, guide, where, f"pyrobayes.{where}(model, guide, data)")
    bound = bound_model(guide)
    if bound is model:
        warn_if_head_changed(guide, model, where)
    if bound is None or bound is model or getattr(model, "latent_sites", None) is None:
        return
    heads = differing_point_params(model, bound)
    differ = [f"the point parameters {heads[:4]} (the head)"] if heads else []
    here, there = base_fingerprint(model), base_fingerprint(bound)
    if here is not None and there is not None and here["sha256"] != there["sha256"]:
        differ.append("the frozen network (base weights, fixed projections or layer types)")
    if differ:
        raise ValueError(
            f"{where}: the {type(guide).__name__} was fitted with another model (guide.model) "
            f"than the one passed, and the two differ in {' and '.join(differ)}, which the "
            "guide does not hold: the prediction would pair the posterior with weights it was "
            "not fitted with. Pass guide.model, or save the posterior (pb.save(guide, path)) "
            "and load it into this model (pb.load(path, model)), which restores the head."
        )


def predict(
    model: Any,
    guide: Any,
    data: Iterable[Any],
    *,
    num_samples: int = 32,
    seed: int | None = 0,
    samples_per_forward: int | None = None,
    device: str | torch.device | None = None,
    progress_bar: bool = False,
    values: dict[str, Tensor] | None = None,
    examples_per_forward: int | None = None,
) -> Prediction:
    """Posterior predictive of ``model`` under ``guide`` on every batch of ``data``.

    Network sampling ``p̄(y|x) = (1/S) Σ_s p(y | f(x; θ_s))``, ``θ_s ~ q``, for every family,
    except a posterior with a linearised predictive
    (:class:`~pyrobayes.contract.LinearizedPredictive`, e.g. Laplace) whose ``pred_type`` is
    not ``"nn"``: that one is evaluated by :func:`pyrobayes.linearized.linearized_predict`
    (the network linearised at ``θ̂``; exact Gaussian for regression, Monte Carlo over the
    linearised logits or probit for classification). Explicit ``values`` always sample the
    network. A :class:`~pyrobayes.contract.Mixture` with ``average="logits"`` gives one
    prediction, ``softmax((1/S) Σ_s f(x; θ_s))``, exactly the particles' logit average (S is
    rounded up to a multiple of their number, see the Notes).
    A temperature fitted by :func:`pyrobayes.calibrate` (stored on the guide) is applied to
    every prediction (:func:`pyrobayes.calibration.apply_temperature`).

    Parameters
    ----------
    model : FineTuneModel
    guide : PosteriorGuide
    data : iterable of batches
    num_samples : int
        S, posterior draws (1 for a point-mass guide, whatever is asked). A linearised
        classification predictive with ``pred_type="glm"`` draws the guide's own
        ``link_samples`` linearised logits instead when that is set (cheap once the Jacobian is
        formed; few draws bias the NLL upwards), and probit / regression give one exact row.
    seed : int, optional
        Seed of the draws (reproducible predictions); ``None`` uses the global RNG.
    samples_per_forward : int, optional
        Samples evaluated per forward pass (chunking of the S-fold expanded batch). Default:
        :func:`default_samples_per_forward`.
    device : str or torch.device, optional
        Move ``model`` and ``guide`` there (in place: they stay there afterwards, as after
        ``model.to(device)``) and every batch with them.
    progress_bar : bool
    values : dict, optional
        Use these parameter draws ``{site: (S, *shape)}`` instead of sampling the guide; one
        parameter set ``{site: shape}`` (e.g. ``model.init_values()``, the network as built: a
        zero-shot baseline) is one draw.
    examples_per_forward : int, optional
        Linearised predictive only: examples per Jacobian forward (one forward with autograd
        and K backward passes; bounds its memory). Default: the whole batch on an accelerator,
        on CPU as many as keep a forward within :data:`CPU_MAX_ROWS_PER_FORWARD` rows or tokens.

    Returns
    -------
    Prediction

    Raises
    ------
    ValueError
        When ``data`` yields no batches or a batch of no examples, when ``num_samples`` /
        ``samples_per_forward`` is < 1, when some batches carry labels and others do not (the
        first batch that differs from batch 0 is named), when input rows holding NaN or ±inf
        give NaN predictions (the batch and its rows are named), or when a classifier's network
        returns probabilities (a final ``nn.Softmax``; the raw outputs of batch 0 are checked).
    TypeError
        When ``num_samples`` / ``samples_per_forward`` is not an integer, or when ``data`` is
        not an iterable of batches (a tensor, a dict, a torch ``Dataset``, one ``(x, y)`` pair:
        :func:`~pyrobayes.batch.check_batches`).
    FloatingPointError
        When finite inputs give NaN predictions (non-finite parameter draws: a diverged fit).

    Notes
    -----
    A :class:`~pyrobayes.contract.Mixture` of K components (IBDR's particles, a σN-ensemble's
    members) is sampled stratified: every block of K draws visits each component once. With S
    not a multiple of K the last, partial block would give some components one draw more than
    the others (S = 32, K = 3: weights 11/32, 11/32, 10/32 instead of 1/3 each), so S is
    rounded up to the next multiple of K (logged at INFO): the predictive average then weighs
    the components exactly equally, as ``q = (1/K) Σ_k q_k`` does. Explicit ``values`` are
    used as given.
    """
    num_samples = check_int("num_samples", num_samples, ge=1, owner="predict: ")
    if seed is not None:
        seed = check_int("seed", seed, owner="predict: ")
    if examples_per_forward is not None:
        examples_per_forward = check_int(
            "examples_per_forward", examples_per_forward, ge=1, owner="predict: "
        )
    if samples_per_forward is not None:
        samples_per_forward = check_int(
            "samples_per_forward", samples_per_forward, ge=1, owner="predict: "
        )
    check_fitted_model(model, guide, "predict")
    if values is None:
        warn_if_never_fitted(guide, model, "predict")
    warn_if_rows_differ(data, "predict")
    check_batches(data, "predict", model.label_key)
    if device is not None:
        model.to(device)
        guide.to(device)
    model.train(False)
    dev = model.device
    data = _AlikeLabelled(data, model.label_key)
    if (
        values is None
        and implements(guide, LinearizedPredictive)
        and cast(LinearizedPredictive, guide).pred_type != "nn"
    ):
        from .linearized import linearized_predict  # (linearized imports this module)

        return apply_temperature(
            linearized_predict(
                model,
                guide,
                data,
                num_samples=num_samples,
                seed=seed,
                examples_per_forward=examples_per_forward,
                progress_bar=progress_bar,
            ),
            guide,
        )
    values, one_draw = _draws_for(model, guide, values, num_samples, seed)
    values = {k: v.detach().to(dev) for k, v in values.items()}
    # a Mixture may ask for the softmax of its draws' averaged logits (the released IBDR code)
    average_logits = (
        model.likelihood.is_classification
        and implements(guide, Mixture)
        and cast(Mixture, guide).average == "logits"
    )
    batches = tqdm(data, disable=not progress_bar, desc="predict")
    outputs, targets = _predict_batches(model, batches, values, samples_per_forward, average_logits)
    if not outputs:
        raise ValueError(
            "predict: data yielded no batches; pass a non-empty iterable of batches (a "
            "DataLoader over a non-empty data set, or a list holding at least one batch)."
        )
    target = torch.cat(targets, 0) if targets else None
    joined = cat_examples(outputs, model.likelihood.is_classification)
    prediction = Prediction.from_outputs(joined, target, model.likelihood)
    # why the prediction is one row without the draws' spread (report's mutual information)
    if average_logits and len(next(iter(values.values()))) > 1:
        prediction = dataclasses.replace(prediction, pooled_by=_LOGIT_AVERAGE)
    elif one_draw and model.likelihood.is_classification:
        prediction = dataclasses.replace(prediction, pooled_by=_ONE_DRAW)
    return apply_temperature(prediction, guide)  # pb.calibrate's T (none: unchanged)


#: :attr:`Prediction.pooled_by` of one draw of a posterior with spread (``num_samples=1``)
_ONE_DRAW = (
    "one draw of a posterior with spread (num_samples=1), whose spread across draws the "
    "mutual information measures; predict with num_samples >= 2"
)


#: :attr:`Prediction.pooled_by` of a mixture's logit average
_LOGIT_AVERAGE = (
    "the softmax of the particles' averaged logits (average='logits'), one row; build the "
    "guide with average='probs' to keep the draws"
)


def cat_examples(outputs: list[Tensor], classification: bool) -> Tensor:
    """Per-batch outputs ``(S, B_i, ...)`` joined along the examples, ``(S, ΣB_i, ...)``.

    A classifier's batches may differ in their number of classes (multiple-choice questions with
    3 choices in one batch and 4 in another): the narrower ones are padded with log-probability
    ``−inf`` (probability 0), as a ragged batch pads its short choice lists.
    """
    if classification and len({o.shape[-1] for o in outputs}) > 1:
        width = max(o.shape[-1] for o in outputs)
        pad = torch.nn.functional.pad
        outputs = [pad(o, (0, width - o.shape[-1]), value=-math.inf) for o in outputs]
    return torch.cat(outputs, 1)


def _draws_for(
    model: Any, guide: Any, values: Any, num_samples: int, seed: int | None
) -> tuple[dict[str, Tensor], bool]:
    """``predict``'s draws: ``values`` checked (one parameter set as one draw), else the
    guide's; and whether they are one draw of a posterior with spread (whose mutual
    information is 0 by construction)."""
    if values is not None:
        values = _as_draws(model, values)
        check_values(model, values)
        return values, False
    draws = _posterior_draws(guide, num_samples, seed)
    return draws, not guide.is_deterministic and len(next(iter(draws.values()))) == 1


def _posterior_draws(guide: Any, num_samples: int, seed: int | None) -> dict[str, Tensor]:
    """``num_samples`` joint draws (one for a point posterior; whole components for a mixture).
    A guide's own refusal of its posterior (a Laplace guide's ``sample_posterior`` runs its
    ``check_finite``: a non-finite ``H + τ I`` named by site) is named as predict's."""
    if guide.is_deterministic:  # the Posterior protocol (contract.py)
        num_samples = 1
    elif implements(guide, Mixture):
        num_samples = _equal_weight_samples(cast(Mixture, guide), num_samples)
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    try:
        draws = guide.sample_posterior(num_samples, generator=generator)
    except FloatingPointError as err:
        raise FloatingPointError(f"predict: {err}") from None
    return cast(dict[str, Tensor], draws)


def _as_draws(model: Any, values: Any) -> Any:
    """One parameter set ``{site: shape}`` as one draw ``{site: (1, *shape)}``; anything else
    as given (:func:`check_values` judges it)."""
    sites = getattr(model, "latent_sites", None)
    if not isinstance(values, Mapping) or not values or not sites or set(values) != set(sites):
        return values
    one_set = all(
        isinstance(v, Tensor) and tuple(v.shape) == tuple(int(n) for n in sites[s].shape)
        for s, v in values.items()
    )
    return {s: v.unsqueeze(0) for s, v in values.items()} if one_set else values


def check_values(model: Any, values: Any) -> None:
    """Refuse explicit draws ``{site: (S, *shape)}`` that do not cover the model's latent sites
    with one draw count, or that name another site or shape (``predict(values=...)``)."""
    sites = model.latent_sites
    if not isinstance(values, Mapping) or not values:
        raise ValueError(
            "predict(values=...): pass a dict {site: (S, *shape) tensor} with a draw for every "
            f"latent site ({sorted(sites)}); got {values!r:.80}."
        )
    unknown = sorted(set(values) - set(sites))
    missing = sorted(set(sites) - set(values))
    if unknown or missing:
        raise ValueError(
            f"predict(values=...): the draws must name exactly the model's latent sites "
            f"{sorted(sites)}; unknown: {unknown}, missing: {missing}."
        )
    counts = set()
    for site, value in values.items():
        expected = tuple(int(n) for n in sites[site].shape)
        shape = tuple(int(n) for n in getattr(value, "shape", ()))
        if not isinstance(value, Tensor) or shape[1:] != expected or not shape:
            raise ValueError(
                f"predict(values=...): site {site!r} takes draws of shape (S, *{expected}); got "
                f"{shape if isinstance(value, Tensor) else type(value).__name__}."
            )
        counts.add(shape[0])
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"predict(values=...): every site needs the same number S >= 1 of draws; got "
            f"{sorted(counts)}."
        )


def _predict_batches(
    model: Any,
    batches: Iterable[Any],
    values: dict[str, Tensor],
    samples_per_forward: int | None,
    average_logits: bool,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per batch, the likelihood's parameters under every draw of ``values`` (``(S, B, ...)``;
    log-probabilities for a classifier) and the batch's targets, in chunks of draws."""
    dev = model.device
    num_samples = int(next(iter(values.values())).shape[0])
    classification = model.likelihood.is_classification
    check_targets = getattr(model.likelihood, "check_targets", None)
    outputs: list[Tensor] = []
    targets: list[Tensor] = []
    # reuse_within_batch: the layers below the first adapted one run once per batch, not per chunk
    with torch.no_grad(), reuse_within_batch():
        for index, batch in enumerate(batches):
            inputs, y = split_batch(to_device(batch, dev), model.label_key)
            check_not_empty(inputs, f"predict: batch {index}")
            chunk = samples_per_forward or default_samples_per_forward(
                num_samples, dev, inputs, model
            )
            parts = []
            for start in range(0, num_samples, chunk):
                sub = {k: v[start : start + chunk] for k, v in values.items()}
                try:  # no cost unless raised
                    params = model.batched_output(inputs, sub)  # (s, B, ...)
                except (RuntimeError, ValueError) as err:
                    if type(err) not in (RuntimeError, ValueError):  # OOM and the like: as is
                        raise
                    raise _forward_error(err, index, inputs) from err
                # before the likelihood's distribution (whose validation gives a raw dump)
                check_outputs(params, classification, where=f"batch {index}:", inputs=inputs)
                if start == 0:  # the raw parameters, before their log-softmax
                    if index == 0:
                        checked_params(model.likelihood, params, "predict: batch 0")
                    if y is not None:  # in the likelihood's shape ((B, 1) → (B,), Gaussian)
                        where = f"predict: batch {index}"
                        targets.append(checked_targets(check_targets, params, y, where))
                if classification:  # in float32 at least (bf16 rounds log-probabilities)
                    params = model.likelihood.class_log_probs(params)  # multi-label: (.., L, 2)
                parts.append(params)
            out = torch.cat(parts, 0)
            if average_logits:  # log_softmax(mean_s log_softmax_s) = log_softmax(mean_s logits_s)
                out = torch.log_softmax(out.mean(0, keepdim=True), dim=-1)
            outputs.append(out)
    return outputs, targets


def _forward_error(err: RuntimeError | ValueError, index: int, inputs: Any) -> Exception:
    """``err``, raised by the network's forward on batch ``index``, as one that names the batch
    and its input shapes (torch's "mat1 and mat2 shapes cannot be multiplied" names neither),
    its original message kept."""
    if isinstance(inputs, Tensor):
        shapes = f"input shape {tuple(inputs.shape)}"
    elif isinstance(inputs, Mapping):
        shapes = "input shapes " + ", ".join(
            f"{k}: {tuple(v.shape)}" for k, v in inputs.items() if isinstance(v, Tensor)
        )
    elif isinstance(inputs, (tuple, list)):
        shapes = "input shapes " + ", ".join(
            str(tuple(v.shape)) for v in inputs if isinstance(v, Tensor)
        )
    else:
        shapes = f"inputs of type {type(inputs).__name__}"
    return type(err)(
        f"predict: batch {index} ({shapes}): the network's forward failed: {err}. Check that "
        "batch against the earlier ones (a loader whose input width, dtype or keys change "
        "between batches), or run the network on it alone to see where it fails."
    )


def check_not_empty(inputs: Any, where: str) -> int:
    """The batch size of ``inputs``, refused when 0 (``where``, the batch, starts the message):
    an empty batch has no rows to predict, and torch's distributions fail on it with a reshape
    error.

    Raises
    ------
    ValueError
        When ``inputs`` hold no examples.
    """
    size = batch_size(inputs)
    if size == 0:
        raise ValueError(
            f"{where} holds no examples (its inputs have a batch size of 0). Drop empty "
            "batches from data (a DataLoader over an empty Subset, or a split or filter that "
            "left a batch empty)."
        )
    return size


def checked_params(likelihood: Any, params: Tensor, where: str) -> None:
    """The likelihood's check of its raw parameters ``params`` (``check_params``: a categorical
    likelihood refuses probabilities, a network ending in ``nn.Softmax``), its refusal
    prefixed by ``where``; a likelihood without one: nothing. ``params`` must be what the
    likelihood's ``params`` returned, not their log-softmax (which passes as logits)."""
    check = getattr(likelihood, "check_params", None)
    if check is None:
        return
    try:
        check(params)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def checked_targets(check: Any, params: Tensor, targets: Tensor, where: str) -> Tensor:
    """``check(params, targets)`` (the likelihood's target check: shape, ``(B, 1)`` → ``(B,)``,
    and a Gaussian's finite values; none: ``targets``), its refusal prefixed by ``where`` (the
    batch). Unchecked, a NaN target gives a NaN log-likelihood that
    :func:`pyrobayes.diagnose` reads as a bad guide."""
    if check is None:
        return targets
    try:
        return cast(Tensor, check(params, targets))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
