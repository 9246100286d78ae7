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

import contextlib
import errno
import hashlib
import hmac
import inspect
import itertools
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .calibration import match_state
from .registry import family_of, get_guide_class

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

_HEADER_KEY = "pyrobayes"
_HASH_FIELD = "sha256"
_SIGNATURE_FIELD = "hmac_sha256"
_FINGERPRINT_FIELD = "base_fingerprint"
#: the dtype of the network the posterior was fitted on (told when the fingerprint differs)
_DTYPE_FIELD = "base_dtype"
#: 1: no hash; 2: ``sha256`` over header and tensors, ``model`` settings in the header
FORMAT_VERSION = 2
#: adapter settings that do not change what a saved core means (the initial draw; the layers
#: the adapter targets are compared through the site names and shapes)
_ADAPTER_IGNORED = ("init_scale", "target_modules")


class PosteriorFileError(ValueError):
    """A posterior file that cannot be trusted: unreadable, edited, non-finite or too new."""


class PosteriorMismatchError(RuntimeError):
    """A posterior file (or guide) that does not belong to the guide or model it meets."""


class UnverifiedSignatureWarning(UserWarning):
    """A signed posterior file loaded without its key: the signature was not checked, so an
    edited header or tensor that was re-hashed would go unnoticed. Pass ``key=`` to verify."""


def library_versions() -> dict[str, str]:
    """Versions of the libraries a posterior depends on."""
    out = {}
    for name in ("pyrobayes", "torch", "pyro-ppl", "transformers", "peft", "arviz"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


# ------------------------------------------------------------------------------ integrity
def _canonical(header: Mapping[str, Any], without: tuple[str, ...] = (_HASH_FIELD,)) -> str:
    """The header as canonical JSON (sorted keys, no spaces), without the hash field."""
    body = {k: v for k, v in header.items() if k not in without}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _feed(h: Any, text: str, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Update the hash ``h`` with ``text`` and every tensor's key, dtype, shape and bytes."""
    h.update(text.encode())
    for key in sorted(tensors):
        t = tensors[key].detach().cpu().contiguous().reshape(-1)
        h.update(json.dumps([key, str(t.dtype), list(tensors[key].shape)]).encode())
        h.update(t.view(torch.uint8).numpy().data)
    return h


def _digest(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the canonical header and every tensor's key, dtype, shape and bytes."""
    return str(_feed(hashlib.sha256(), _canonical(header), tensors).hexdigest())


def _check_key(key: Any, where: str) -> bytes:
    if isinstance(key, str):
        raise TypeError(
            f"{where}(key=...) takes bytes, got a str; pass key.encode() (or a key read from a "
            "file in binary mode)."
        )
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(bytes(key)) == 0:
        raise TypeError(f"{where}(key=...) takes non-empty bytes, got {type(key).__name__}.")
    return bytes(key)


def _signature(header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], key: bytes) -> str:
    """HMAC-SHA256 (Krawczyk, Bellare & Canetti 1997, RFC 2104) under ``key`` over the canonical
    header without hash and signature, and every tensor (as :func:`_digest`)."""
    text = _canonical(header, (_HASH_FIELD, _SIGNATURE_FIELD))
    return str(_feed(hmac.new(key, digestmod=hashlib.sha256), text, tensors).hexdigest())


#: Values of a frozen tensor outside the adapted layers that the fingerprint reads: evenly
#: strided, so another checkpoint of the same shapes (values differ everywhere) differs in them.
_SAMPLED_VALUES = 4096


def _feed_tensor(h: Any, name: str, tensor: torch.Tensor, sample: bool = False) -> None:
    """``name``, shape and values (rounded to bfloat16; ``sample``: a strided sample)."""
    t = tensor.detach().reshape(-1)
    if sample and t.numel() > _SAMPLED_VALUES:
        t = t[:: -(-t.numel() // _SAMPLED_VALUES)]
    if t.is_floating_point():
        t = t.to(torch.float32).to(torch.bfloat16)
    h.update(json.dumps([name, list(tensor.shape)]).encode())
    h.update(t.cpu().contiguous().view(torch.uint8).numpy().data)


def base_fingerprint(model: Any, version: int = 2) -> dict[str, Any] | None:
    """A SHA-256 fingerprint of the frozen network a posterior over ``model`` sits on.

    What is hashed, in name order (version 2): every parameter and buffer of the network
    modules that hold a latent site (the adapted layers: a LoRA layer's frozen
    ``base.weight``/``base.bias``, a LoRA-XS layer's frozen base and its fixed projections
    ``down``/``up``) in full; every other parameter of the network by its name, its shape and
    4,096 evenly strided values (the lower blocks, embeddings and norm layers an adapter leaves
    alone: another checkpoint differs there too); and the network's modules, each path with its
    class (``Tanh`` against ``ReLU``; the modules holding latent or point tensors left out, as
    a head made latent post hoc changes its class). The latent tensors and the model's point-estimated
    parameters are left out (they are stored in the file and loaded with it). Floating values
    are rounded to bfloat16 (through float32) first, so float64, float32 and bfloat16 copies of
    one checkpoint share a fingerprint when the adapter is built on the same copy (a LoRA-XS
    adapter built on a bfloat16 copy has other SVD bases; the refusal then names both dtypes
    and the remedy, from the network's dtype the file records beside it). Cost: one pass over
    the adapted layers' tensors.

    Version 1 (files saved before 2026-12-06): the adapted modules' tensors only, or, when they
    hold nothing frozen, every other parameter in full (``load`` checks a file by the version
    it was saved with).

    Returns
    -------
    dict or None
        ``{"sha256": hex, "scope": ..., "tensors": count, "version": 2}``; None for a model
        without a ``net`` and ``latent_sites`` (a plain Pyro model).
    """
    net, latent = getattr(model, "net", None), getattr(model, "latent_sites", None)
    if not isinstance(net, torch.nn.Module) or not latent:
        return None
    skip = {spec.param_name for spec in latent.values()} | set(getattr(model, "point_params", {}))
    hashed: dict[str, torch.Tensor] = {}
    for path in sorted({spec.module_path for spec in latent.values()}):
        module = net.get_submodule(path)
        for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            full = f"{path}.{name}" if path else name
            if full not in skip:
                hashed[full] = t
    h = hashlib.sha256()
    if version == 1:
        scope = "adapted_modules"
        if not hashed:
            scope = "network"
            hashed = {n: p for n, p in net.named_parameters() if n not in skip}
        for name in sorted(hashed):
            _feed_tensor(h, name, hashed[name])
        return {"sha256": h.hexdigest(), "scope": scope, "tensors": len(hashed)}
    others = {n: p for n, p in net.named_parameters(remove_duplicate=False) if n not in skip}
    others = {n: p for n, p in others.items() if n not in hashed}
    for name in sorted(hashed):
        _feed_tensor(h, name, hashed[name])
    for name in sorted(others):
        _feed_tensor(h, name, others[name], sample=True)
    # the layer types, but of the modules holding a latent or point tensor (a head made latent
    # post hoc becomes a BatchedLinear: the same network)
    owners = {name.rpartition(".")[0] for name in skip}
    owners |= {spec.module_path for spec in latent.values()}
    modules = [
        [n, type(m).__name__]
        for n, m in net.named_modules(remove_duplicate=False)
        if n not in owners
    ]
    h.update(json.dumps(modules).encode())
    return {
        "sha256": h.hexdigest(),
        "scope": "adapted_modules+network",
        "tensors": len(hashed) + len(others),
        "version": 2,
    }


def _dtype_name(model: Any) -> str | None:
    """``model``'s dtype without the ``torch.`` prefix (None for a model without one)."""
    dtype = getattr(model, "dtype", None)
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None


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


def _non_finite(tensors: Mapping[str, torch.Tensor]) -> tuple[str, int] | None:
    """The first key (in key order) whose floating tensor holds NaN/inf, and how many."""
    for key in sorted(tensors):
        t = tensors[key]
        if t.is_floating_point() or t.is_complex():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                return key, bad
    return None


def _jsonable(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


# ------------------------------------------------------------------------------ save
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


def _os_error(err: OSError, message: str) -> OSError:
    """An error of ``err``'s type (``FileNotFoundError``, ``PermissionError``, ...) and errno
    whose message names the user's path and the fix instead of an internal file."""
    try:
        return type(err)(err.errno, message) if err.errno is not None else type(err)(message)
    except TypeError:  # an OSError subclass with another constructor
        return OSError(err.errno, message)


def _blocking_file(folder: Path) -> Path | None:
    """The first of ``folder`` and its parents (outermost first) that exists but is not a
    folder: what keeps ``folder`` from being created."""
    for candidate in [*reversed(folder.parents), folder]:
        if candidate.exists() and not candidate.is_dir():
            return candidate
    return None


def _target_folder(path: Path) -> None:
    """Refuse a ``path`` that cannot be a file, and create its folder, with errors that name
    ``path`` (not the temporary file ``save`` writes first)."""
    if path.is_dir():
        raise IsADirectoryError(
            errno.EISDIR,
            f"pb.save: {path} is a folder, not a file name; pass the path of the file to write "
            f"in it, e.g. {path / 'posterior.safetensors'}.",
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = _blocking_file(path.parent)
        if blocker is not None:
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"pb.save: cannot write {path}: {blocker} is a file, not a folder"
                + ("" if blocker == path.parent else f", so {path.parent} cannot be created")
                + f". Save to a path whose parent folders are folders (or move {blocker} away).",
            ) from err
        raise _os_error(
            err,
            f"pb.save: cannot create the folder {path.parent} for {path}: "
            f"{err.strerror or err}. Save to a folder you can write to.",
        ) from err


def _umask() -> int:
    """The process's umask (read by setting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_atomic(path: Path, tensors: dict[str, torch.Tensor], header: str) -> None:
    """``save_file`` into a temporary file next to ``path``, flushed, then ``os.replace``."""
    _target_folder(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _os_error(
            err,
            f"pb.save: cannot write {path}: cannot create a file in {path.parent} "
            f"({err.strerror or err}). Save to a folder you can write to.",
        ) from err
    os.close(fd)
    tmp = Path(name)
    try:
        save_file(tensors, str(tmp), metadata={_HEADER_KEY: header})
        # mkstemp's file is 0600: give it the mode a plain open() would (an existing file's,
        # or 0666 less the umask), so that the posterior stays readable as before
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.is_file() else 0o666 & ~_umask())
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        try:
            os.replace(tmp, path)
        except OSError as err:
            hint = (
                f"{path} is a folder; pass the path of a file in it"
                if path.is_dir()
                else "save to a path you can write to"
            )
            raise _os_error(
                err,
                f"pb.save: cannot move the written posterior into place at {path} "
                f"({err.strerror or err}); {hint}. Nothing was written.",
            ) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if os.name == "posix":  # the rename itself reaches the disk
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _check_guide_belongs(guide: Any, model: Any, guide_model: Any) -> None:
    """Refuse to pair ``guide`` with a ``model`` whose sites or head it was not fitted with."""
    latent = getattr(model, "latent_sites", None)
    if latent:
        theirs = {s: tuple(spec.shape) for s, spec in latent.items()}
        ours = {s: tuple(shape) for s, shape in guide.sites.items()}
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


# ------------------------------------------------------------------------------ read
def _check_readable(path: str | Path) -> None:
    """A ``path`` that is no file gets an error naming it and the fix: ``FileNotFoundError``
    (missing), ``IsADirectoryError`` (a folder, with the posterior files in it)."""
    target = Path(path)
    if target.is_dir():
        found = sorted(p.name for p in target.glob("*.safetensors"))
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        listed = f" (posterior files in it: {found[:5]}{more})" if found else ""
        raise IsADirectoryError(
            errno.EISDIR,
            f"{path} is a folder, not a posterior file{listed}; pass the path of the "
            ".safetensors file pb.save wrote.",
        )
    if not target.exists():
        where = (
            f"the folder {target.parent} exists but holds no such file"
            if target.parent.is_dir()
            else f"the folder {target.parent} does not exist"
        )
        raise FileNotFoundError(
            errno.ENOENT,
            f"No posterior file at {path} ({where}); pass the path pb.save wrote to.",
        )


def _safe_open(path: str | Path) -> Any:
    """``safe_open(path)`` on the CPU; the OS errors it can raise name ``path`` and the fix."""
    _check_readable(path)
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except OSError as err:
        raise _os_error(
            err, f"cannot read the posterior file {path}: {err.strerror or err}."
        ) from err


def _open_error(path: str | Path, err: Exception) -> PosteriorFileError:
    return PosteriorFileError(
        f"{path} cannot be read as a pyrobayes posterior file (truncated, or not a safetensors "
        f"file): {err}"
    )


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
    path: str | Path, *, verify: bool = False, key: bytes | None = None
) -> dict[str, Any]:
    """The JSON header of a saved posterior.

    Parameters
    ----------
    path : path
    verify : bool
        Also read every tensor and check the file's hash and finiteness (as ``load`` does).
    key : bytes, optional
        With ``verify``: also check the file's HMAC under this key (as ``load(key=...)``).

    Raises
    ------
    PosteriorFileError
        Not a (readable) posterior file, a format newer than this version, or with ``verify``
        an edited or non-finite file.
    """
    if verify:
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


def _check_signature(
    path: str | Path, header: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], key: Any
) -> None:
    """With ``key``: the file's HMAC must match. Without: a signed file loads with a warning."""
    stored = header.get(_SIGNATURE_FIELD)
    if key is None:
        if stored is not None:
            warnings.warn(
                f"{path} is signed (HMAC-SHA256) but was loaded without key=, so its signature "
                "was not checked: a header or tensor edited and re-hashed would go unnoticed. "
                "Pass key= (the bytes it was saved with) to verify it.",
                UnverifiedSignatureWarning,
                stacklevel=4,
            )
        return
    secret = _check_key(key, "pb.load")
    if stored is None:
        raise PosteriorFileError(
            f"{path} is not signed, so key= cannot authenticate it (its signature may have been "
            "stripped, or it was saved without key=). Re-save it from the fitted guide with "
            "pb.save(..., key=...), or load it without key= if you trust its source."
        )
    if not hmac.compare_digest(str(stored), _signature(header, tensors, secret)):
        raise PosteriorFileError(
            f"{path} failed its signature check: the HMAC-SHA256 under the given key does not "
            "match the one in the header. The file was edited after it was signed (and "
            "re-hashed), or signed with another key; do not use it, re-save it from the fitted "
            "guide with your key."
        )


# ------------------------------------------------------------------------------ checks
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


def _kwargs(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())


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


# ------------------------------------------------------------------------------ load
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


def _check_loadable(
    path: str | Path, header: dict[str, Any], tensors: Any, guide: Any, model: Any
) -> None:
    _check_family(path, header, guide)
    _check_sites(path, header, guide.sites, "guide")
    _check_config(path, header, guide)
    _check_model(path, header, model)
    guide_state, model_state = _split(tensors)
    _check_tensors(path, guide, getattr(model, "point_params", {}), guide_state, model_state)


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
        return _apply(path, guide, model, tensors)
