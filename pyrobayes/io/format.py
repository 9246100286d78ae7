"""The posterior file's format: its header fields and version, the errors a file raises, and
the JSON helpers every part of :mod:`pyrobayes.io` shares."""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import torch

_HEADER_KEY = "pyrobayes"


_HASH_FIELD = "sha256"


_SIGNATURE_FIELD = "hmac_sha256"


_FINGERPRINT_FIELD = "base_fingerprint"


#: the dtype of the network the posterior was fitted on (told when the fingerprint differs)
_DTYPE_FIELD = "base_dtype"


#: 1: no hash; 2: ``sha256`` over header and tensors, ``model`` settings in the header
FORMAT_VERSION = 2


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


def _kwargs(config: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in config.items())
