"""The network called on a batch: plainly or with parameters swapped in (``functional_call``),
torch's error at a batch the network cannot take (a dict key its ``forward`` refuses, inputs of
another dtype, a latent layer's draws read without calling the layer) said in the batch's terms;
and the small helpers of the draw-batched forward."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .layers import BatchedLinear, LoRALinear, LoRAXSLinear

#: torch's error when a weight with a leading sample axis reaches ``F.linear`` as its weight
_SAMPLED_WEIGHT_ERROR = "t() expects a tensor with <= 2 dimensions"
#: nn.Module's error when a network reads an adapter layer's ``weight`` / ``bias``
_ADAPTER_WEIGHT_ERROR = re.compile(
    r"'(LoRALinear|LoRAXSLinear)' object has no attribute '(weight|bias)'"
)


class _RowsMismatch(Exception):
    """The network's output lost the S-fold rows of the shared lower layers."""


def _call(net: nn.Module, inputs: Any) -> Any:
    try:
        if isinstance(inputs, Mapping):
            return net(**inputs)
        if isinstance(inputs, (tuple, list)):
            return net(*inputs)
        return net(inputs)
    except (TypeError, RuntimeError, AttributeError) as err:
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
    except (TypeError, RuntimeError, AttributeError) as err:
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
    """The errors of a batch the network cannot take, said in the batch's terms: a dict
    batch with a key its ``forward`` does not accept, and inputs of another dtype than the
    network's parameters; and a latent layer's draws read by a module that does not call the
    layer (:func:`_explain_weight_read`). ``None``: another error, raised as it is."""
    text = str(err)
    if isinstance(err, RuntimeError) and _SAMPLED_WEIGHT_ERROR in text:
        return _explain_weight_read(net, err)
    if isinstance(err, AttributeError) and _ADAPTER_WEIGHT_ERROR.search(text):
        return _explain_adapter_read(net, err)
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


def _explain_weight_read(net: nn.Module, err: RuntimeError) -> Exception | None:
    """The error of a network that reads a latent layer's weight itself, run with S draws.

    A module that takes its child's ``weight`` instead of calling the child
    (``nn.MultiheadAttention`` its ``out_proj.weight``, torchvision's Swin
    ``ShiftedWindowAttention`` its ``qkv.weight`` and ``proj.weight``) passes the latent
    layer's ``(S, d_out, d_in)`` draws to ``F.linear``, which fails with torch's
    ``t() expects a tensor with <= 2 dimensions``. ``None``: no latent layer holds draws now
    (another error, raised as it is)."""
    sampled = []
    for path, module in net.named_modules():
        if not isinstance(module, BatchedLinear) or path != module.module_path:
            continue  # (an adapter's own factors name the adapted layer, not themselves)
        weight = module._parameters.get("weight")
        if weight is not None and weight.dim() == 3:
            sampled.append(path)
    if not sampled:
        return None
    listed = ", ".join(repr(p) for p in sampled[:4]) + (" ..." if len(sampled) > 4 else "")
    return RuntimeError(
        f"FineTuneModel: the network failed on the draws of the latent layer(s) {listed} "
        f"({err}): a module of the network reads one of these layers' weight itself instead of "
        "calling the layer (nn.MultiheadAttention reads out_proj.weight, torchvision's Swin "
        "ShiftedWindowAttention qkv.weight and proj.weight) and hands the S draws "
        "(S, d_out, d_in) to F.linear, which takes one matrix. Leave such a layer out of "
        "latent_modules (make latent a layer the network calls: a block's MLP, the head); this "
        "network was changed in place, so build the model from a fresh copy of it."
    )


def _explain_adapter_read(net: nn.Module, err: AttributeError) -> Exception:
    """The error of a network that reads an adapted layer's ``weight`` or ``bias`` itself
    instead of calling the layer (the adapter holds them in its frozen ``base``): no adapter
    there can act. The adapted layers are listed, since the error does not say which one."""
    adapted = [p for p, m in net.named_modules() if isinstance(m, (LoRALinear, LoRAXSLinear))]
    listed = ", ".join(repr(p) for p in adapted[:6]) + (" ..." if len(adapted) > 6 else "")
    return AttributeError(
        f"FineTuneModel: the network read the weight of an adapted layer itself ({err}) instead "
        "of calling the layer, so an adapter there could never act: one of the adapted layers "
        f"{listed} is read by its parent module (as torchvision's Swin attention reads "
        "qkv.weight). Leave such a layer out of target_modules and adapt linear layers the "
        "network calls (a block's MLP); this network was changed in place, so build the model "
        "from a fresh copy of it."
    )


def _num_samples(values: Mapping[str, Tensor]) -> int:
    sizes = {int(v.shape[0]) for v in values.values()}
    if len(sizes) != 1:
        raise ValueError(f"Expected one sample count across sites but got {sorted(sizes)}.")
    return sizes.pop()
