"""What makes a posterior file trustworthy: the SHA-256 over header and tensors, the optional
HMAC-SHA256 under a secret key (Krawczyk, Bellare & Canetti 1997, RFC 2104), and the
fingerprint of the frozen network a posterior sits on (:func:`base_fingerprint`)."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..user_frame import user_stacklevel
from .format import _HASH_FIELD, _SIGNATURE_FIELD, PosteriorFileError, UnverifiedSignatureWarning


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
                stacklevel=user_stacklevel(),
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
    parameters are left out (they are stored in the file and loaded with it), a point parameter
    under every name it has (a head tied to the input embeddings). Floating values
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
    # a frozen tensor that *is* a point parameter under another name (a head tied to the
    # embeddings) is stored in the file and trained with it: left out by identity too
    trained = {id(p) for p in getattr(model, "point_params", {}).values()}
    hashed = {n: t for n, t in hashed.items() if id(t) not in trained}
    others = {
        n: p
        for n, p in net.named_parameters(remove_duplicate=False)
        if n not in skip and n not in hashed and id(p) not in trained
    }
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
