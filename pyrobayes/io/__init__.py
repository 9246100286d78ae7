"""Posterior I/O: one safetensors file with a JSON header; nothing is ever unpickled.

The file holds the guide's state (``guide.<name>``) and the model's point-estimated parameters
(``model.<name>``, e.g. a classifier head fitted with it). The header records the family, the
guide's constructor options, the site shapes, the adapter, likelihood and model settings and
library versions, so ``load(path, model)`` rebuilds the guide through the registry.

A file cannot lie:

* the header carries a SHA-256 over the canonical JSON header (without the hash) and every
  tensor (key, dtype, shape and bytes, in key order); an edited header or tensor is refused;
* tensors holding NaN or inf are refused on save and on load, by key;
* loading checks that the file's family, constructor options, site shapes, adapter and model
  settings match the guide and model it is loaded into, and saving checks that the guide's
  sites (and the head) belong to the model saved with it;
* the file is written to a temporary name in the target folder and moved into place with
  ``os.replace``: a reader sees the old file or the new one, never half of one;
* the header carries a fingerprint of the frozen base weights the adapter sits on
  (:func:`base_fingerprint`), and ``load`` refuses a model with other base weights.

The SHA-256 is *integrity*, not *authenticity*: anyone can edit a header and recompute it. A
file saved with ``save(..., key=...)`` also carries an HMAC-SHA256 (RFC 2104) over the header
and tensors under that secret key; ``load(..., key=...)`` refuses it unless the HMAC matches,
and ``load`` without a key warns (:class:`UnverifiedSignatureWarning`) that the signature was
not checked.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ..calibration import match_state
from ..fitted_head import record_fitted_head, warn_if_head_changed
from ..registry import family_of, get_guide_class
from .compatibility import (
    _check_base,
    _check_guide_belongs,
    _check_loadable,
    _check_model,
    _check_sites,
    _latent_until_refused,
    _model_settings,
    _posterior_config,
    _saved_latent_layers,
    _sites_after,
    _split,
)
from .files import _open_error, _safe_open, _write_atomic
from .format import (
    _DTYPE_FIELD,
    _FINGERPRINT_FIELD,
    _HASH_FIELD,
    _HEADER_KEY,
    _SIGNATURE_FIELD,
    FORMAT_VERSION,
    PosteriorFileError,
    PosteriorMismatchError,
    UnverifiedSignatureWarning,
    _jsonable,
    _kwargs,
    _non_finite,
    library_versions,
)
from .integrity import (
    _check_key,
    _check_signature,
    _digest,
    _dtype_name,
    _signature,
    base_fingerprint,
)

logger = logging.getLogger(__name__)

__all__ = [
    "save",
    "load",
    "load_state",
    "read_header",
    "library_versions",
    "base_fingerprint",
    "PosteriorFileError",
    "PosteriorMismatchError",
    "UnverifiedSignatureWarning",
]


def save(
    guide: Any,
    path: str | Path,
    *,
    model: Any = None,
    extra: dict[str, Any] | None = None,
    key: bytes | None = None,
) -> Path:
    """Write ``guide`` (and ``model``'s point parameters) to ``path`` atomically.

    Parameters
    ----------
    guide : PosteriorGuide
        A registered family (``pyrobayes.register_guide``).
    path : path
        Target ``.safetensors`` file. It is written to a temporary file in the same folder and
        moved into place with ``os.replace``; on any error nothing is left behind and an
        existing file at ``path`` is untouched.
    model : FineTuneModel, optional
        Defaults to the model the guide was built on. Its latent sites must be the guide's
        (names and shapes); a model other than the guide's must have the same point parameters
        (head) as the guide's model, or the file would pair the posterior with a head it was not
        fitted with.
    extra : dict, optional
        JSON-able metadata stored in the header.
    key : bytes, optional
        A secret key: the header then carries an HMAC-SHA256 over header and tensors, which
        ``load(path, model, key=key)`` verifies (authenticity; the SHA-256 every file carries
        is only integrity, since anyone can recompute it).

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    PosteriorMismatchError
        The guide's sites or head do not belong to ``model``.
    ValueError
        A tensor holds NaN or inf (named by key), or the guide is not registered.
    TypeError
        ``key`` is not non-empty bytes.
    IsADirectoryError
        ``path`` is a folder (pass a file name in it).
    NotADirectoryError
        One of ``path``'s parent folders is a file, so the folder cannot be created.
    OSError
        The folder cannot be created or written (e.g. ``PermissionError``); the message names
        ``path``. Missing parent folders are created.

    Notes
    -----
    The header records :func:`base_fingerprint` of ``model``, so the file loads only into a
    model with the same frozen base weights.
    """
    if isinstance(guide, (str, os.PathLike)) and not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"pb.save(guide, path): the arguments are the other way round (got a path, then a "
            f"{type(path).__name__}); call pb.save(guide, path)."
        )
    path = Path(path)
    secret = None if key is None else _check_key(key, "pb.save")
    guide_model = getattr(guide, "model", None)
    model = model if model is not None else guide_model
    _check_guide_belongs(guide, model, guide_model)
    tensors = {f"guide.{k}": v.detach().contiguous().cpu() for k, v in guide.state_dict().items()}
    for name, p in getattr(model, "point_params", {}).items():
        tensors[f"model.{name}"] = p.detach().contiguous().cpu()
    bad = _non_finite(tensors)
    if bad is not None:
        raise ValueError(
            f"Refusing to save {path}: tensor {bad[0]!r} holds {bad[1]} non-finite value(s) "
            "(NaN/inf). The fit diverged; refit with a smaller learning rate, or resume from the "
            "last checkpoint."
        )
    if model is guide_model:
        warn_if_head_changed(guide, model, "pb.save")
    adapter: Any = getattr(model, "adapter", None)  # LoRA, LoRAXS or None (duck-typed)
    header: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "family": family_of(guide),
        "guide_class": type(guide).__name__,
        "config": guide.config(),
        "sites": {s: list(shape) for s, shape in guide.sites.items()},
        "adapter": adapter.to_dict() if hasattr(adapter, "to_dict") else None,
        "likelihood": model.likelihood.to_dict() if hasattr(model, "likelihood") else None,
        "model": _model_settings(model),
        "versions": library_versions(),
        "extra": extra or {},
        _FINGERPRINT_FIELD: base_fingerprint(model),
        _DTYPE_FIELD: _dtype_name(model),
    }
    try:
        header = _jsonable(header)
    except (TypeError, ValueError) as err:
        raise ValueError(f"Cannot save {path}: the header is not JSON-able ({err}).") from err
    if secret is not None:
        header[_SIGNATURE_FIELD] = _signature(header, tensors, secret)
    header[_HASH_FIELD] = _digest(header, tensors)
    _write_atomic(path, tensors, json.dumps(header))
    return path


def _parse_header(path: str | Path, meta: Mapping[str, str] | None) -> dict[str, Any]:
    meta = meta or {}
    if _HEADER_KEY not in meta:
        raise PosteriorFileError(
            f"{path} is not a pyrobayes posterior file (no {_HEADER_KEY!r} header)."
        )
    try:
        header = json.loads(meta[_HEADER_KEY])
    except json.JSONDecodeError as err:
        raise PosteriorFileError(
            f"{path}: the {_HEADER_KEY!r} header is not JSON ({err})."
        ) from err
    if not isinstance(header, dict):
        raise PosteriorFileError(f"{path}: the {_HEADER_KEY!r} header is not a JSON object.")
    version = header.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise PosteriorFileError(f"{path}: invalid format_version {version!r} in the header.")
    if version > FORMAT_VERSION:
        raise PosteriorFileError(
            f"{path} has format_version {version}, newer than this pyrobayes reads "
            f"({FORMAT_VERSION}); upgrade pyrobayes to load it."
        )
    for field in ("family", "config", "sites"):
        if field not in header:
            raise PosteriorFileError(f"{path}: the header has no {field!r} field.")
    return header


def read_header(
    path: str | Path, *, verify: bool | None = None, key: bytes | None = None
) -> dict[str, Any]:
    """The JSON header of a saved posterior.

    Parameters
    ----------
    path : path
    verify : bool, optional
        Also read every tensor and check the file's hash and finiteness (as ``load`` does).
        Default: ``True`` when a ``key`` is given, else ``False`` (the header alone, unchecked).
    key : bytes, optional
        Also check the file's HMAC under this key (as ``load(key=...)``); a key means
        verification, so it is refused with ``verify=False``.

    Raises
    ------
    PosteriorFileError
        Not a (readable) posterior file, a format newer than this version, or when verified
        an edited, non-finite or (with ``key``) unsigned or otherwise signed file.
    ValueError
        A ``key`` with ``verify=False``, which would leave the signature unchecked.
    """
    if key is not None and verify is False:
        raise ValueError(
            "read_header: key= is given with verify=False, which would return the header "
            "without checking the file's signature under the key. Drop verify=False (a key "
            "verifies), or drop key= to read the header unchecked."
        )
    if verify or key is not None:
        return _read_verified(path, key)[0]
    try:
        with _safe_open(path) as f:
            meta = f.metadata()
    except SafetensorError as err:  # truncated or foreign file
        raise _open_error(path, err) from err
    return _parse_header(path, meta)


def _read_verified(
    path: str | Path, key: bytes | None = None
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Header and tensors of ``path``, after the hash, signature and finiteness checks."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"pyrobayes.load / load_state: path must be a file path, got a "
            f"{type(path).__name__}; the signatures are pb.load(path, model) and "
            "load_state(guide, path)."
        )
    try:
        with _safe_open(path) as f:
            meta = f.metadata()
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    except SafetensorError as err:  # truncated or foreign file
        raise _open_error(path, err) from err
    header = _parse_header(path, meta)
    stored = header.get(_HASH_FIELD)
    if stored is None:
        if header["format_version"] >= 2:
            raise PosteriorFileError(
                f"{path} has no {_HASH_FIELD!r} field although its format_version is "
                f"{header['format_version']}: the header was edited. Re-save the posterior from "
                "the fitted guide."
            )
        logger.warning(
            "%s was written before posterior files carried a hash (format_version %s): it "
            "loads unverified. Re-save it with pb.save to add one.",
            path,
            header["format_version"],
        )
    else:
        actual = _digest(header, tensors)
        if actual != stored:
            raise PosteriorFileError(
                f"{path} failed its integrity check: the SHA-256 over header and tensors is "
                f"{actual[:16]}…, the header records {str(stored)[:16]}…. The header or a tensor "
                "was edited or corrupted after saving; re-save the posterior from the fitted "
                "guide (or use an earlier checkpoint)."
            )
    _check_signature(path, header, tensors, key)
    bad = _non_finite(tensors)
    if bad is not None:
        raise PosteriorFileError(
            f"{path}: tensor {bad[0]!r} holds {bad[1]} non-finite value(s) (NaN/inf); the file "
            "is corrupt or the fit had diverged. Refit, or use an earlier checkpoint."
        )
    return header, tensors


def load_state(
    guide: Any,
    path: str | Path,
    *,
    model: Any = None,
    key: bytes | None = None,
    check_base: bool = True,
) -> Any:
    """Load the tensors of ``path`` into an existing ``guide`` (and ``model``'s point params).

    Used by ``pb.fit(..., resume=True)``: the file must match the guide and model exactly.

    Parameters
    ----------
    guide : PosteriorGuide
        Of the file's family, built with the file's constructor options.
    path : path
    model : FineTuneModel, optional
        Defaults to the guide's model.
    key : bytes, optional
        Verify the file's HMAC under this key (as :func:`load`).
    check_base : bool
        Refuse a model whose frozen base weights differ from the file's (as :func:`load`).

    Returns
    -------
    PosteriorGuide
        ``guide``, loaded. On any error neither guide nor model is changed.

    Raises
    ------
    PosteriorFileError
        Unreadable, edited (hash mismatch) or non-finite file.
    PosteriorMismatchError
        Family, options, sites, adapter, likelihood, model settings or tensor shapes differ;
        the message names the field, both values and the fix.
    """
    header, tensors = _read_verified(path, key)
    model = model if model is not None else guide.model
    _check_loadable(path, header, tensors, guide, model)
    if check_base:
        _check_base(path, header, model)
    return _apply(path, guide, model, tensors)


def _apply(path: str | Path, guide: Any, model: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    guide_state, model_state = _split(tensors)
    point = getattr(model, "point_params", {})
    converted = {k: v.to(point[k].device, point[k].dtype) for k, v in model_state.items()}
    device = guide.device
    backup = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    try:
        match_state(guide, guide_state)  # the file's pyrobayes.calibrate temperature, or none
        guide.load_state_dict({k: v.to(device) for k, v in guide_state.items()}, strict=True)
    except (RuntimeError, KeyError, ValueError) as err:
        match_state(guide, backup)
        guide.load_state_dict(backup, strict=True)  # a failed strict load may have copied some
        raise PosteriorMismatchError(
            f"{path}: the file's guide tensors do not fit {type(guide).__name__} ({err}); it was "
            "written by another version or family. Re-save it from the fitted guide."
        ) from err
    with torch.no_grad():  # (shapes checked, values converted: the copies cannot fail)
        for name, value in converted.items():
            point[name].copy_(value)
    return guide


def load(path: str | Path, model: Any, *, key: bytes | None = None, check_base: bool = True) -> Any:
    """Rebuild the guide saved at ``path`` for ``model`` and load its state.

    The family is looked up in the registry; its constructor options come from the (verified)
    header. Layers the file holds as latent sites that ``model`` still holds as point
    parameters (a head made latent with ``model.make_latent`` before a post-hoc Laplace) are
    made latent first, as they were when the posterior was saved.

    A refused load leaves ``model`` as it was: every check that can run on the model as it is
    runs before anything changes, and where a check needs those layers latent (the base-weight
    fingerprint, the guide's tensors) a refusal puts the original layers, sites, point
    parameters and their values back before the error is raised.

    Parameters
    ----------
    path : path
        The ``.safetensors`` file :func:`save` wrote.
    model : FineTuneModel
        Built as when the posterior was saved: same network, adapter, likelihood and settings.
    key : bytes, optional
        The key the file was signed with (``save(..., key=...)``): its HMAC-SHA256 is checked,
        and an unsigned file is refused. Without ``key`` a signed file loads with an
        :class:`UnverifiedSignatureWarning`.
    check_base : bool
        Compare the file's :func:`base_fingerprint` with ``model``'s and refuse other frozen
        base weights (default). A file from before fingerprints loads with a logged warning.

    Returns
    -------
    PosteriorGuide

    Raises
    ------
    PosteriorFileError
        Unreadable, edited (hash mismatch) or non-finite file; with ``key``, an unsigned file
        or a signature mismatch.
    PosteriorMismatchError
        The model's sites, adapter, likelihood, settings or frozen base weights differ from
        the file's.
    ValueError
        The file's family is not registered in this session.
    FileNotFoundError
        No file at ``path``.
    IsADirectoryError
        ``path`` is a folder (the message lists the posterior files in it).
    """
    header, tensors = _read_verified(path, key)
    # every check that can run on the model as it is runs before anything changes
    layers = _saved_latent_layers(header, model)
    if getattr(model, "latent_sites", None) or layers:
        _check_sites(path, header, _sites_after(model, layers), "model")
    _check_model(path, header, model)
    try:
        cls = get_guide_class(str(header["family"]))
    except ValueError as err:
        raise ValueError(
            f"{path}: {err} Import the package that registers it (pyrobayes.register_guide) "
            "before loading."
        ) from None
    # the rest needs the saved layers latent; a refusal there undoes it
    with _latent_until_refused(path, model, layers):
        latent = getattr(model, "latent_sites", None)
        if latent:
            _check_sites(path, header, {s: spec.shape for s, spec in latent.items()}, "model")
        try:
            guide = cls(model, **_posterior_config(path, header, cls))
        except TypeError as err:
            raise PosteriorMismatchError(
                f"{path}: {cls.__name__} of this pyrobayes version does not take the file's "
                f"options ({_kwargs(header['config'])}): {err}."
            ) from err
        _check_loadable(path, header, tensors, guide, model)
        if check_base:  # after the head's check: a model without the head differs here too
            _check_base(path, header, model)
        _apply(path, guide, model, tensors)
        record_fitted_head(guide, model)  # the head this posterior now sits with
        return guide
