"""Posterior I/O: one safetensors file with a JSON header; nothing is ever unpickled.

The file holds the guide's state (``guide.<name>``) and the model's point-estimated parameters
(``model.<name>``, e.g. a classifier head fitted with it). The header records the family, the
guide's constructor options, the site shapes, the adapter config and library versions, so
``load(path, model)`` rebuilds the guide through the registry.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .registry import family_of, get_guide_class

logger = logging.getLogger(__name__)

__all__ = ["save", "load", "load_state", "read_header", "library_versions"]

_HEADER_KEY = "pyrobayes"
FORMAT_VERSION = 1


def library_versions() -> dict[str, str]:
    """Versions of the libraries a posterior depends on."""
    out = {}
    for name in ("pyrobayes", "torch", "pyro-ppl", "transformers", "peft", "arviz"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def save(
    guide: Any, path: str | Path, *, model: Any = None, extra: dict[str, Any] | None = None
) -> Path:
    """Write ``guide`` (and ``model``'s point parameters, if given) to ``path`` atomically.

    Parameters
    ----------
    guide : PosteriorGuide
    path : path
        Target ``.safetensors`` file; written to a temporary name, then renamed.
    model : FineTuneModel, optional
        Defaults to the model the guide was built on.
    extra : dict, optional
        JSON-able metadata stored in the header.
    """
    path = Path(path)
    model = model if model is not None else guide.model
    tensors = {f"guide.{k}": v.detach().contiguous().cpu() for k, v in guide.state_dict().items()}
    for name, p in getattr(model, "point_params", {}).items():
        tensors[f"model.{name}"] = p.detach().contiguous().cpu()
    adapter: Any = getattr(model, "adapter", None)  # LoRA, LoRAXS or None (duck-typed)
    header = {
        "format_version": FORMAT_VERSION,
        "family": family_of(guide),
        "guide_class": type(guide).__name__,
        "config": guide.config(),
        "sites": {s: list(shape) for s, shape in guide.sites.items()},
        "adapter": adapter.to_dict() if hasattr(adapter, "to_dict") else None,
        "likelihood": model.likelihood.to_dict() if hasattr(model, "likelihood") else None,
        "versions": library_versions(),
        "extra": extra or {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={_HEADER_KEY: json.dumps(header)})
    tmp.replace(path)
    return path


def read_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a saved posterior."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if _HEADER_KEY not in meta:
        raise ValueError(f"{path} is not a pyrobayes posterior file (no {_HEADER_KEY!r} header).")
    return json.loads(meta[_HEADER_KEY])


def load_state(guide: Any, path: str | Path, *, model: Any = None) -> Any:
    """Load tensors from ``path`` into an existing ``guide`` (and ``model``'s point params)."""
    header = read_header(path)
    if set(header["sites"]) != set(guide.sites):
        missing = set(header["sites"]) ^ set(guide.sites)
        raise RuntimeError(
            f"Saved posterior and guide have different sites (differing: {sorted(missing)[:5]}); "
            "build the model with the same adapter config as when it was saved."
        )
    guide_state, model_state = {}, {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            if key.startswith("guide."):
                guide_state[key[len("guide.") :]] = f.get_tensor(key)
            elif key.startswith("model."):
                model_state[key[len("model.") :]] = f.get_tensor(key)
    _load_guide_state(guide, guide_state)
    model = model if model is not None else guide.model
    point = getattr(model, "point_params", {})
    with torch.no_grad():
        for name, value in model_state.items():
            if name not in point:
                raise RuntimeError(f"Saved point parameter {name!r} does not exist in the model.")
            point[name].copy_(value.to(point[name].device, point[name].dtype))
    return guide


def _load_guide_state(guide: Any, state: dict[str, torch.Tensor]) -> None:
    device = guide.device
    guide.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True)


def load(path: str | Path, model: Any) -> Any:
    """Rebuild the guide saved at ``path`` for ``model`` (same sites) and load its state.

    The family is looked up in the registry; its constructor options come from the header.
    """
    header = read_header(path)
    cls = get_guide_class(header["family"])
    guide = cls(model, **header["config"])
    return load_state(guide, path, model=model)
