"""The network called on a batch: plainly or with parameters swapped in (``functional_call``),
torch's error at a batch the network cannot take (a dict key its ``forward`` refuses, inputs of
another dtype) said in the batch's terms; and the small helpers of the draw-batched forward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn


class _RowsMismatch(Exception):
    """The network's output lost the S-fold rows of the shared lower layers."""


def _call(net: nn.Module, inputs: Any) -> Any:
    try:
        if isinstance(inputs, Mapping):
            return net(**inputs)
        if isinstance(inputs, (tuple, list)):
            return net(*inputs)
        return net(inputs)
    except (TypeError, RuntimeError) as err:
        explained = _explain_call_error(net, inputs, err)
        if explained is None:
            raise
        raise explained from err


def _functional_call(net: nn.Module, inputs: Any, params: dict[str, Tensor]) -> Any:
    try:
        if isinstance(inputs, Mapping):
            return torch.func.functional_call(net, params, args=(), kwargs=dict(inputs))
        if isinstance(inputs, (tuple, list)):
            return torch.func.functional_call(net, params, tuple(inputs))
        return torch.func.functional_call(net, params, (inputs,))
    except (TypeError, RuntimeError) as err:
        explained = _explain_call_error(net, inputs, err)
        if explained is None:
            raise
        raise explained from err


def _tensor_dtypes(obj: Any) -> set[torch.dtype]:
    """The dtypes of the tensors in a (nested) batch part."""
    if isinstance(obj, Tensor):
        return {obj.dtype}
    if isinstance(obj, Mapping):
        return set().union(*(_tensor_dtypes(v) for v in obj.values()))
    if isinstance(obj, (tuple, list)):
        return set().union(*(_tensor_dtypes(v) for v in obj))
    return set()


def _explain_call_error(net: nn.Module, inputs: Any, err: Exception) -> Exception | None:
    """The two errors of a batch the network cannot take, said in the batch's terms: a dict
    batch with a key its ``forward`` does not accept, and inputs of another dtype than the
    network's parameters (``None``: another error, raised as it is)."""
    text = str(err)
    if isinstance(err, TypeError) and "unexpected keyword argument" in text:
        if not isinstance(inputs, Mapping):
            return None
        return TypeError(
            f"FineTuneModel: the network is called as net(**batch) with every key of a dict "
            f"batch but the labels ({sorted(map(str, inputs))}), and its forward refused one: "
            f"{text}. Drop that column from the batches (e.g. dataset.remove_columns([...]) "
            "or a collate_fn), or rename it to an argument of forward."
        )
    if not isinstance(err, RuntimeError) or not any(
        word in text for word in ("dtype", "scalar type", "Input type")
    ):
        return None
    weights = {p.dtype for p in net.parameters() if p.is_floating_point()}
    found = _tensor_dtypes(inputs)
    floats = {d for d in found if d.is_floating_point}
    if len(weights) != 1:
        return None
    (weight,) = weights
    if floats and floats != {weight}:
        listed = ", ".join(sorted(str(d) for d in floats))
        return TypeError(
            f"FineTuneModel: the batch's floating-point inputs are {listed} but the network's "
            f"parameters are {weight}; torch does not mix them ({text}). Cast the batches "
            f"(x.to({weight}), e.g. in a collate_fn; numpy arrays become float64) or the "
            "network before building the model."
        )
    if not floats and found and all(not d.is_floating_point and not d.is_complex for d in found):
        listed = ", ".join(sorted(str(d) for d in found))
        return TypeError(
            f"FineTuneModel: the batch's inputs are integer tensors ({listed}) and the "
            f"network's first layer wants {weight} values ({text}). Cast them (x.float()); "
            "integer inputs are for networks that embed token ids."
        )
    return None


def _num_samples(values: Mapping[str, Tensor]) -> int:
    sizes = {int(v.shape[0]) for v in values.values()}
    if len(sizes) != 1:
        raise ValueError(f"Expected one sample count across sites but got {sorted(sizes)}.")
    return sizes.pop()
