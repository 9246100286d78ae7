"""Whether a posterior file (or a guide being saved) belongs to the guide and model it meets:
family, constructor options, sites, adapter, likelihood, model settings, point parameters,
tensor shapes and the frozen base weights; each refusal names the field, both values and the
fix. A file whose saved latent layers (a head made latent post hoc) are point parameters of the
model has them made latent for the load, and put back if the load is refused."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..registry import family_of, get_guide_class
from .format import _DTYPE_FIELD, _FINGERPRINT_FIELD, PosteriorMismatchError, _jsonable, _kwargs
from .integrity import _dtype_name, base_fingerprint

logger = logging.getLogger(__name__)


#: adapter settings that do not change what a saved core means (the initial draw; the layers
#: the adapter targets are compared through the site names and shapes)
_ADAPTER_IGNORED = ("init_scale", "target_modules")


def differing_point_params(model: Any, other: Any, skip: Any = ()) -> list[str]:
    """Names of the point-estimated parameters (the head) where ``model`` and ``other`` differ:
    present in one only (sorted, first), then another shape or other values (sorted). Values are
    compared exactly (``torch.equal``, so a lossless cast such as float32 → float64 is equal);
    names in ``skip`` are left out on both sides."""
    mine = {k: v for k, v in getattr(model, "point_params", {}).items() if k not in skip}
    theirs = {k: v for k, v in getattr(other, "point_params", {}).items() if k not in skip}
    differ = sorted(set(mine) ^ set(theirs))
    differ += [
        k
        for k in sorted(set(mine) & set(theirs))
        if mine[k].shape != theirs[k].shape
        or not torch.equal(mine[k].detach().cpu(), theirs[k].detach().cpu())
    ]
    return differ


def _model_settings(model: Any) -> dict[str, Any]:
    """The model settings a posterior depends on: N and the prior's scale, and where the
    prediction is in the network's output (``output_key`` when an index or a name; a callable
    cannot be recorded)."""
    settings = {
        "num_data": getattr(model, "num_data", None),
        "prior_scale": getattr(model, "prior_scale", None),
    }
    output_key = getattr(model, "output_key", None)
    if isinstance(output_key, (int, str)):
        settings["output_key"] = output_key
    return settings


def _check_guide_belongs(guide: Any, model: Any, guide_model: Any) -> None:
    """Refuse to pair ``guide`` with a ``model`` whose sites or head it was not fitted with."""
    latent = getattr(model, "latent_sites", None)
    if latent:
        theirs = {s: tuple(spec.shape) for s, spec in latent.items()}
        ours = {s: tuple(shape) for s, shape in guide.sites.items()}
        if ours != theirs and model is guide_model:  # the model's sites changed since
            raise PosteriorMismatchError(
                "pb.save: the guide's sites are no longer its model's: "
                f"{_site_difference(ours, theirs, 'guide', 'model')}. The model changed after "
                "the guide was built (model.make_latent(...) made layers latent); save the "
                "guide before that change, or save the guide built on the model as it is now "
                "(e.g. the post-hoc Laplace over the head)."
            )
        if ours != theirs:
            raise PosteriorMismatchError(
                "pb.save: the guide's sites do not belong to model: "
                f"{_site_difference(ours, theirs, 'guide', 'model')}. Pass the model the guide "
                "was built and fitted on as model= (or omit model=)."
            )
    if guide_model is None or model is guide_model:
        return
    mine = getattr(model, "point_params", {})
    fitted = getattr(guide_model, "point_params", {})
    if set(mine) != set(fitted):
        raise PosteriorMismatchError(
            "pb.save: model's point parameters differ from those of the model the guide was "
            f"built on (model: {sorted(mine)}, guide.model: {sorted(fitted)}). Pass the model "
            "the guide was fitted with as model= (or omit model=)."
        )
    differ = differing_point_params(model, guide_model)
    if differ:
        raise PosteriorMismatchError(
            f"pb.save: model's point parameter {differ[0]!r} (the head) differs from that of the "
            "model the guide was built on; the file would pair this posterior with a head it "
            "was not fitted with. Pass the model the guide was fitted with as model= (or "
            "omit model=), or build the guide on this model."
        )
    # the header records model's base, adapter, likelihood and settings: they must be the fit's
    here, there = base_fingerprint(model), base_fingerprint(guide_model)
    mismatch = []
    if here is not None and there is not None and here["sha256"] != there["sha256"]:
        mismatch.append("the frozen network (base_fingerprint)")
    for what, get in (
        ("settings", _model_settings),
        ("likelihood", lambda m: _to_dict(getattr(m, "likelihood", None))),
    ):
        if get(model) != get(guide_model):
            mismatch.append(f"the {what} ({get(model)} against {get(guide_model)})")
    mine, fitted = (_to_dict(getattr(m, "adapter", None)) for m in (model, guide_model))
    if isinstance(mine, dict) and isinstance(fitted, dict):
        option = _adapter_difference(fitted, mine)
        if option is not None:
            mismatch.append(f"the adapter's {option[0]} ({option[2]!r} against {option[1]!r})")
    if mismatch:
        raise PosteriorMismatchError(
            f"pb.save: model differs from the model the guide was built on in "
            f"{'; '.join(mismatch)}; the file would record a model the posterior was not "
            "fitted on. Pass the model the guide was fitted with as model= (or omit model=)."
        )


def _adapter_difference(
    saved: Mapping[str, Any], current: Mapping[str, Any], prefix: str = ""
) -> tuple[str, Any, Any] | None:
    """The first adapter option (dotted into a nested adapter, e.g. σN's ``adapter.rank``)
    whose values differ, but the options that do not change the posterior's sites and bases
    (:data:`_ADAPTER_IGNORED`: the sites are compared by name and shape), or ``None``."""
    for key in sorted(set(saved) | set(current)):
        if key in _ADAPTER_IGNORED:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            inner = _adapter_difference(a, b, f"{prefix}{key}.")
            if inner is not None:
                return inner
        elif a != b:
            return f"{prefix}{key}", a, b
    return None


def _to_dict(config: Any) -> Any:
    """A config object's ``to_dict()`` as it reads back from JSON (``None`` without one)."""
    return _jsonable(config.to_dict()) if hasattr(config, "to_dict") else None


def _site_difference(
    a: Mapping[str, tuple[int, ...]], b: Mapping[str, tuple[int, ...]], name_a: str, name_b: str
) -> str:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    parts = []
    if only_a:
        parts.append(f"only in the {name_a}: {only_a[:5]}")
    if only_b:
        parts.append(f"only in the {name_b}: {only_b[:5]}")
    for s in sorted(set(a) & set(b)):
        if tuple(a[s]) != tuple(b[s]):
            parts.append(
                f"site {s!r} has shape {list(a[s])} in the {name_a} but {list(b[s])} in the "
                f"{name_b}"
            )
            break
    return "; ".join(parts)


def _check_base(path: str | Path, header: Mapping[str, Any], model: Any) -> None:
    """The model's frozen base weights must be those the posterior was fitted on."""
    if _FINGERPRINT_FIELD not in header:
        logger.warning(
            "%s has no base-model fingerprint (saved by an earlier pyrobayes): whether the "
            "model's frozen base weights are those it was fitted on is not checked. Re-save it "
            "with pb.save to add one.",
            path,
        )
        return
    saved = header[_FINGERPRINT_FIELD]
    if not isinstance(saved, dict):
        return  # saved from a model without a network: nothing to compare
    here = base_fingerprint(model, version=int(saved.get("version", 1)))
    if here is None:
        return  # loaded into a model without a network
    if saved.get("sha256") != here["sha256"]:
        then, now = header.get(_DTYPE_FIELD), _dtype_name(model)
        dtype_note = (
            f" The file was fitted on a {then} network and this one is {now}: an adapter's "
            f"fixed projections computed from weights already rounded to {now} (LoRA-XS's SVD "
            "bases) differ from those of the original weights (by up to 6e-3 in bfloat16). "
            f"Build the FineTuneModel on the {then} network, load, then cast "
            f"(model.to(torch.{now})), or pass check_base=False."
            if then is not None and then != now
            else ""
        )
        raise PosteriorMismatchError(
            f"{path} was fitted on another base model: the fingerprint of the frozen network "
            f"it sits on is {str(saved.get('sha256'))[:16]}… in the file "
            f"({saved.get('tensors')} tensors, {saved.get('scope')}) but {here['sha256'][:16]}… "
            f"for this model ({here['tensors']} tensors, {here['scope']}). It covers the "
            "frozen weights (the adapted layers' in full, the others sampled), the adapter's "
            "fixed projections (a whitened SVD from other calibration_data has other bases) "
            "and the network's layer types. Load it into the model built from the same "
            "pretrained weights and adapter it was fitted on; pass check_base=False only if "
            "you know the difference is harmless." + dtype_note
        )


def _check_family(path: str | Path, header: dict[str, Any], guide: Any) -> None:
    try:
        cls = get_guide_class(str(header["family"]))
    except ValueError:
        cls = None
    if cls is not type(guide):
        try:
            here = family_of(guide)
        except ValueError:
            here = type(guide).__name__
        raise PosteriorMismatchError(
            f"{path} holds a {header['family']!r} posterior ({header.get('guide_class')}) but the "
            f"guide is {here!r} ({type(guide).__name__}). Load it with pb.load(path, model), or "
            f"build the guide as pb.posterior(model, {header['family']!r}, ...) (to resume the "
            "fit that wrote it; a new fit of another family: Checkpointing(..., overwrite=True) "
            "or another folder)."
        )


def _posterior_config(path: str | Path, header: dict[str, Any], cls: type) -> dict[str, Any]:
    """The file's constructor options without the fit's settings an older file may carry
    (``cls.fit_options``: settings that moved to the fitter); logged when dropped."""
    config = dict(header["config"])
    dropped = {k: config.pop(k) for k in getattr(cls, "fit_options", ()) if k in config}
    dropped = {k: v for k, v in dropped.items() if v is not None}
    if dropped:
        settings = getattr(cls, "fit_settings_class", None)
        logger.info(
            "%s: ignoring the fit settings %s saved with this older posterior file (they are "
            "the fitter's now: pass them to it as optimizer=%s(...)).",
            path,
            _kwargs(dropped),
            f"pb.infer.{settings}" if settings else "...",
        )
    return config


def _option_defaults(cls: type) -> dict[str, Any]:
    """The constructor's default of each option (as JSON reads it back): what a file saved
    before an option existed means by its absence."""
    out = {}
    for name, param in inspect.signature(cls).parameters.items():
        if param.default is not inspect.Parameter.empty:
            try:
                out[name] = _jsonable(param.default)
            except TypeError:  # not JSON: no file could hold it either
                continue
    return out


def _check_config(path: str | Path, header: dict[str, Any], guide: Any) -> None:
    here = _jsonable(guide.config())
    # an option a file saved before it existed does not hold is read as its default
    defaults = _option_defaults(type(guide))
    saved = {
        **{k: defaults[k] for k in here if k in defaults},
        **_posterior_config(path, header, type(guide)),
    }
    diffs = [
        f"{k}={saved.get(k, '<absent>')!r} in the file but {k}={here.get(k, '<absent>')!r} in the "
        "guide"
        for k in sorted(set(saved) | set(here))
        if saved.get(k, "<absent>") != here.get(k, "<absent>")
    ]
    if diffs:
        raise PosteriorMismatchError(
            f"{path}: the {header['family']!r} options differ: {'; '.join(diffs)}. Build the "
            f"guide with the options it was saved with ({_kwargs(saved)}), or load it with "
            "pb.load(path, model)."
        )


def _saved_latent_layers(header: dict[str, Any], model: Any) -> list[str]:
    """The layers the file holds as latent sites (``FineTuneModel.make_latent`` before the fit:
    a task head under a post-hoc Laplace) that ``model`` still holds as point parameters, to be
    made latent as they were when the posterior was saved; ``[]`` when there are none, or when
    the file's extra sites are not all whole point-estimated head layers (left to the site
    check). Changes nothing."""
    point = getattr(model, "point_params", None)
    heads = getattr(model, "head_modules", None)
    if not point or heads is None or not hasattr(model, "make_latent"):
        return []
    have = set(getattr(model, "latent_sites", None) or {})
    missing = [s for s in header.get("sites", {}) if s not in have]
    if not missing or any(s not in point for s in missing):
        return []
    owners = {s.rpartition(".")[0] for s in missing}
    modules = [m for m in heads() if m in owners]
    if set(modules) != owners:  # not all of them head layers (e.g. LoRA factors): mismatch
        return []
    return modules


def _sites_after(model: Any, layers: list[str]) -> dict[str, tuple[int, ...]]:
    """``model``'s sites and their shapes once ``layers`` are made latent (each layer's point
    ``weight`` and ``bias`` become sites of their own shapes), without making them latent."""
    sites = {
        s: tuple(spec.shape) for s, spec in (getattr(model, "latent_sites", None) or {}).items()
    }
    point = getattr(model, "point_params", {})
    for layer in layers:
        for role in ("weight", "bias"):
            name = f"{layer}.{role}"
            if name in point:
                sites[name] = tuple(point[name].shape)
    return sites


@contextlib.contextmanager
def _latent_until_refused(path: str | Path, model: Any, layers: list[str]) -> Iterator[None]:
    """Make ``layers`` of ``model`` latent for the rest of a load; if the load then fails (a
    check that needs them latent refuses the file), undo it: the original modules, sites, point
    parameters (with their ``requires_grad``) and the model's caches are put back, so a refused
    load leaves the model as it was."""
    if not layers:
        yield
        return
    net = model.net
    modules = {layer: net.get_submodule(layer) for layer in layers}
    latent = dict(model.latent_sites)
    point = dict(model.point_params)
    grads = {name: p.requires_grad for name, p in point.items()}
    attributes = dict(model.__dict__)  # caches a conversion drops (FineTuneModel's slot cache)
    try:
        model.make_latent(layers)
        logger.info("%s: made %s latent, as they were when the posterior was saved", path, layers)
        yield
    except BaseException:
        for layer, module in modules.items():
            parent_path, _, child = layer.rpartition(".")
            setattr(net.get_submodule(parent_path) if parent_path else net, child, module)
        model.latent_sites.clear()
        model.latent_sites.update(latent)
        model.point_params.clear()
        model.point_params.update(point)
        for name, p in point.items():
            p.requires_grad_(grads[name])
        for name in [k for k in model.__dict__ if k not in attributes]:
            del model.__dict__[name]
        model.__dict__.update(attributes)
        raise


def _check_sites(
    path: str | Path, header: dict[str, Any], sites: Mapping[str, Any], whose: str
) -> None:
    saved = {s: tuple(shape) for s, shape in header["sites"].items()}
    here = {s: tuple(shape) for s, shape in sites.items()}
    if saved != here:
        raise PosteriorMismatchError(
            f"{path}: the saved posterior and the {whose} have different sites "
            f"({_site_difference(saved, here, 'file', whose)}); build the model with the same "
            f"network and adapter config as when it was saved ({header.get('adapter')})."
        )


def _check_model(path: str | Path, header: dict[str, Any], model: Any) -> None:
    """The adapter, likelihood and model settings the file was fitted under."""
    adapter: Any = getattr(model, "adapter", None)
    saved_adapter = header.get("adapter")
    if isinstance(saved_adapter, dict) and hasattr(adapter, "to_dict"):
        differ = _adapter_difference(saved_adapter, _jsonable(adapter.to_dict()))
        if differ is not None:
            key, a, b = differ
            raise PosteriorMismatchError(
                f"{path}: adapter {key} is {a!r} in the file but {b!r} in the model. Build "
                f"the model with the adapter config it was saved with ({saved_adapter})."
            )
    saved_lik = header.get("likelihood")
    likelihood: Any = getattr(model, "likelihood", None)
    if saved_lik is not None and hasattr(likelihood, "to_dict"):
        current_lik = _jsonable(likelihood.to_dict())
        for key in ("name", "obs_scale", "normalize", "choice_token_ids"):
            a, b = saved_lik.get(key), current_lik.get(key)
            if a != b:
                raise PosteriorMismatchError(
                    f"{path}: likelihood {key} is {a!r} in the file but {b!r} in the model. "
                    f"Build the model with the likelihood it was saved with ({saved_lik})."
                )
    for key, value in (header.get("model") or {}).items():
        current_value = getattr(model, key, None)
        if key == "output_key" and callable(current_value):
            continue  # a callable: not comparable with the recorded index or name
        if key == "output_key" and value != current_value:
            raise PosteriorMismatchError(
                f"{path}: model output_key is {value!r} in the file but {current_value!r} in "
                f"the model; build the model with output_key={value!r} (the output the "
                "posterior was fitted to predict)."
            )
        if value is not None and current_value is not None and value != current_value:
            raise PosteriorMismatchError(
                f"{path}: model {key} is {value!r} in the file but {current_value!r} in the "
                f"model; build the model with {key}={value!r} (as when it was fitted): it sets "
                "the prior's weight against the data, so the posterior differs."
            )


def _split(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    guide_state, model_state = {}, {}
    for key, value in tensors.items():
        if key.startswith("guide."):
            guide_state[key[len("guide.") :]] = value
        elif key.startswith("model."):
            model_state[key[len("model.") :]] = value
    return guide_state, model_state


def _check_tensors(
    path: str | Path,
    guide: Any,
    point: Mapping[str, torch.Tensor],
    guide_state: Mapping[str, torch.Tensor],
    model_state: Mapping[str, torch.Tensor],
) -> None:
    # key sets are left to the guide's strict load_state_dict (a family may convert an older
    # layout there, e.g. SWAG's swag_sq_mean); shapes of the keys both sides have are checked
    expected = {k: v for k, v in guide.state_dict().items() if k in guide_state}
    for key, value in guide_state.items():
        if key in expected and tuple(value.shape) != tuple(expected[key].shape):
            raise PosteriorMismatchError(
                f"{path}: guide tensor {key!r} has shape {list(value.shape)} in the file but "
                f"{list(expected[key].shape)} in the guide; build guide and model as when saved."
            )
    if set(model_state) != set(point):
        missing, extra = (
            sorted(set(point) - set(model_state)),
            sorted(set(model_state) - set(point)),
        )
        raise PosteriorMismatchError(
            f"{path}: the model's point parameters do not match the file's (missing in the file: "
            f"{missing[:5]}, not in the model: {extra[:5]}); build the model with the same "
            "trainable_modules and likelihood as when it was saved."
        )
    for name, value in model_state.items():
        if tuple(value.shape) != tuple(point[name].shape):
            raise PosteriorMismatchError(
                f"{path}: point parameter {name!r} has shape {list(value.shape)} in the file but "
                f"{list(point[name].shape)} in the model (e.g. another num_labels); build the "
                "model as when it was saved."
            )


def _check_loadable(
    path: str | Path, header: dict[str, Any], tensors: Any, guide: Any, model: Any
) -> None:
    _check_family(path, header, guide)
    _check_sites(path, header, guide.sites, "guide")
    _check_config(path, header, guide)
    _check_model(path, header, model)
    guide_state, model_state = _split(tensors)
    _check_tensors(path, guide, getattr(model, "point_params", {}), guide_state, model_state)
