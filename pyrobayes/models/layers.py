"""Sample-batched adapter layers.

Every latent weight in pyrobayes lives in one of these layers. Each accepts either an ordinary
weight (one parameter set) or a weight with a leading sample axis ``(S, ...)``; in the latter case
the input batch is *sample-major expanded* — row ``s * B + b`` of the input belongs to sample ``s``
— and each sample's slice is multiplied by its own weight with one ``bmm``. The frozen base matmul is
shared work. This is what lets S posterior samples, K particles or M members run in ONE forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "batched_linear",
    "LoRAXSLinear",
    "LoRALinear",
    "BatchedLinear",
    "base_weight_in_out",
    "rows_first",
]


def batched_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, module_path: str = ""
) -> Tensor:
    """``y = x Wᵀ + b`` where ``W`` may carry a leading sample axis.

    Parameters
    ----------
    x : Tensor `(S * B, ..., d_in)`
        Sample-major expanded input (or any input when ``weight`` is 2-D).
    weight : Tensor `(d_out, d_in)` or `(S, d_out, d_in)`
    bias : Tensor `(d_out,)` or `(S, d_out)`, optional
    module_path : str
        Path of the adapted (or latent) module in the network, named by the error below.

    Raises
    ------
    RuntimeError
        When ``weight`` carries S samples but the input's leading size is no multiple of S: the
        input does not carry the batch's rows (e.g. a table the network computes once for the
        whole batch), so the layer cannot apply a draw per row.
    """
    if weight.dim() == 2:
        return F.linear(x, weight, bias if bias is None or bias.dim() == 1 else bias[0])
    num_samples = weight.shape[0]
    if x.shape[0] % num_samples != 0:
        where = f"The adapted module {module_path!r}" if module_path else "An adapted module"
        raise RuntimeError(
            f"{where} got an input of shape {tuple(x.shape)} while running {num_samples} "
            f"parameter samples: its leading size is not a multiple of {num_samples}, so the "
            "input does not carry the batch's rows (S sample-major copies of the B examples). "
            "Such an input is a table shared by the whole batch (e.g. DeBERTa's relative-position "
            "projections pos_key_proj / pos_query_proj, which project one (1, 2k, d) table of "
            "position embeddings), so its adapter cannot be sampled per draw. Leave it out of "
            "target_modules: note that a regex like '.*(query_proj|value_proj)' selects "
            "pos_query_proj too; pass the names ['query_proj', 'value_proj'] (a list entry "
            r"matches whole names) or anchor the regex, '.*\.(query_proj|value_proj)'."
        )
    xs = x.reshape(num_samples, -1, x.shape[-1])  # (S, B*..., d_in)
    if bias is None:
        out = torch.bmm(xs, weight.transpose(-1, -2))
    elif bias.dim() == 1:
        out = torch.bmm(xs, weight.transpose(-1, -2)) + bias
    else:
        out = torch.baddbmm(bias.unsqueeze(1), xs, weight.transpose(-1, -2))
    return out.reshape(*x.shape[:-1], weight.shape[-2])  # (S*B, ..., d_out)


def _hook_stores(module: nn.Module) -> dict[str, object]:
    """The hook registries of ``module`` (``_forward_hooks``, ``_forward_pre_hooks``, their
    ``with_kwargs`` / ``always_called`` companions, backward and state-dict hooks), by name."""
    return {name: value for name, value in vars(module).items() if "hook" in name}


def carry_hooks(src: nn.Module, dst: nn.Module, *, share: bool = False) -> None:
    """Register the hooks of ``src`` on ``dst`` too, when ``dst`` replaces ``src`` in a network.

    Each registry of ``dst`` takes the entries of ``src``'s (hook ids are unique, so none is
    overwritten). With ``share``, an empty registry of ``dst`` *becomes* ``src``'s (the same
    dict), so that a ``RemovableHandle`` the user holds for a hook registered on ``src`` (which
    leaves the network) still removes it; without it (a copy, as a deployed network) ``dst``
    gets registries of its own.
    """
    for name, value in _hook_stores(src).items():
        mine = getattr(dst, name, None)
        if isinstance(value, dict) and isinstance(mine, dict):
            if share and not mine:
                setattr(dst, name, value)
            elif value:
                mine.update(value)
        elif name == "_is_full_backward_hook" and src._backward_hooks:
            setattr(dst, name, value)


def user_forward_hooks(module: nn.Module) -> list[object]:
    """The forward hooks and forward pre-hooks registered on ``module`` itself, less torch's
    own weight hooks (the older ``weight_norm``, pruning), which recompute its weight and are
    told apart by the weight not being a stored parameter."""
    from torch.nn.utils import prune
    from torch.nn.utils.weight_norm import WeightNorm

    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return [h for h in hooks if not isinstance(h, (WeightNorm, prune.BasePruningMethod))]


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' GPT-2 ``Conv1D`` (a linear layer storing its weight
    ``(d_in, d_out)``), told by name so that transformers need not be imported."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def base_weight_in_out(base: nn.Module) -> Tensor:
    """The frozen weight of ``base`` in row-vector orientation ``W0 ∈ R^{d_in×d_out}``.

    ``nn.Linear`` stores ``(d_out, d_in)``; transformers' GPT-2 ``Conv1D`` stores ``(d_in, d_out)``.
    """
    if isinstance(base, nn.Linear):
        return base.weight.detach().T
    if is_conv1d(base) and isinstance(base.weight, Tensor):
        return base.weight.detach()
    raise TypeError(
        f"Expected an nn.Linear or transformers Conv1D module but got {type(base).__name__}."
    )


def torch_layer_sequence_first(module: nn.Module) -> bool:
    """Whether ``module`` is torch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``
    built with ``batch_first=False`` (torch's default): it takes its hidden states and calls its
    ``linear1`` / ``linear2`` and norms sequence-first, ``(T, B, d)``."""
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return not module.self_attn.batch_first
    return False


def rows_first(x: Tensor, sequence_first: bool) -> Tensor:
    """``x`` with the batch's rows on its leading axis: a sequence-first input ``(T, S·B, ...)``
    transposed to ``(S·B, T, ...)`` (a view; the same call transposes an output back)."""
    return x.transpose(0, 1) if sequence_first and x.dim() >= 3 else x


class _AdapterBase(nn.Module):
    """A frozen base map plus a low-rank update; ``self.base`` is never trained.

    ``sequence_first``: the network calls the layer on sequence-first inputs ``(T, S·B, d)``
    (Longformer's self-attention transposes its hidden states before its projections), so the
    update is computed on the view whose leading axis holds the sample-major rows, where each
    row's draw applies (:func:`batched_linear`); set by
    :func:`~pyrobayes.models.adapters.inject_adapter`.
    """

    sequence_first: bool = False

    def __init__(self, base: nn.Module, scaling: float) -> None:
        super().__init__()
        self.base = base
        self.scaling = float(scaling)
        for p in self.base.parameters():
            p.requires_grad_(False)
        w = base_weight_in_out(base)
        self.in_features, self.out_features = int(w.shape[0]), int(w.shape[1])


class LoRAXSLinear(_AdapterBase):
    r"""LoRA-XS layer: ``y = base(x) + (α/r) · B (R (A x))`` with frozen ``A``, ``B``.

    In row-vector notation ``y = x W0 + (α/r) x A R B``; here ``down = Aᵀ`` `(r, d_in)`,
    ``up = Bᵀ`` `(d_out, r)` are buffers and the trainable core is ``core``, an ``nn.Linear(r, r)``
    (:class:`BatchedLinear`) whose weight is ``Rᵀ``. Keeping R an ordinary linear layer lets
    Kronecker curvature treat it as one (both factors r×r).
    """

    down: Tensor  # buffer (r, d_in)
    up: Tensor  # buffer (d_out, r)

    def __init__(
        self,
        base: nn.Module,
        down: Tensor,
        up: Tensor,
        *,
        scaling: float,
        init_scale: float = 1e-5,
    ) -> None:
        super().__init__(base, scaling)
        rank = down.shape[0]
        if down.shape != (rank, self.in_features) or up.shape != (self.out_features, rank):
            raise ValueError(
                f"Expected down {(rank, self.in_features)} and up {(self.out_features, rank)} "
                f"but got {tuple(down.shape)} and {tuple(up.shape)}."
            )
        dtype, device = down.dtype, down.device
        self.register_buffer("down", down.detach().clone())
        self.register_buffer("up", up.detach().clone())
        # an nn.Linear that also takes a sampled (S, r, r) weight: hooks on it (Kronecker curvature
        # in laplace-torch and Kronecker IVON) see R as an ordinary linear layer in every mode
        self.core = BatchedLinear(rank, rank, bias=False, dtype=dtype, device=device)
        with torch.no_grad():
            self.core.weight.normal_(0.0, init_scale)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def forward(self, x: Tensor) -> Tensor:
        result = self.base(x)
        x = rows_first(x, self.sequence_first)
        h = F.linear(x.to(self.down.dtype), self.down)  # (..., r), shared across samples
        # (..., r); per-sample cores on a sample-major expanded batch. The core's values may
        # come in another dtype than the bases (float32 draws for a bf16 network), as LoRA's
        # factors may: computed in theirs, cast back (no-ops when the dtypes agree)
        h = self.core(h.to(self.core.weight.dtype)).to(self.up.dtype)
        delta = (self.scaling * F.linear(h, self.up)).to(result.dtype)
        return result + rows_first(delta, self.sequence_first)

    def delta_weight(self, core: Tensor | None = None) -> Tensor:
        """``ΔW = (α/r) up · core · down`` in torch orientation `(d_out, d_in)`."""
        core = self.core.weight if core is None else core
        return self.scaling * self.up @ core.to(self.up.dtype) @ self.down


class LoRALinear(_AdapterBase):
    r"""LoRA layer: ``y = base(x) + (α/r) · B_lora (A_lora x)``.

    ``lora_A = nn.Linear(d_in, r)`` (Kaiming-uniform init, as peft) and
    ``lora_B = nn.Linear(r, d_out)`` (zeros), so the model starts at the pretrained function; both
    are :class:`BatchedLinear` (a weight may carry a leading sample axis).
    """

    def __init__(
        self,
        base: nn.Module,
        rank: int,
        *,
        scaling: float,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(base, scaling)
        w = base_weight_in_out(base)
        kw = {"dtype": dtype or w.dtype, "device": w.device}
        # nn.Linear subclasses that also take sampled (S, ...) weights: always called as modules,
        # so curvature hooks see ordinary linear layers with one draw and with S draws
        self.lora_A = BatchedLinear(self.in_features, rank, bias=False, **kw)
        self.lora_B = BatchedLinear(rank, self.out_features, bias=False, **kw)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @property
    def rank(self) -> int:
        return int(self.lora_A.weight.shape[-2])

    def forward(self, x: Tensor) -> Tensor:
        result = self.base(x)
        x = rows_first(x, self.sequence_first).to(self.lora_A.weight.dtype)
        delta = self.lora_B(self.lora_A(x))  # (..., d_out); per-sample A, B on an expanded batch
        return result + rows_first((self.scaling * delta).to(result.dtype), self.sequence_first)

    def delta_weight(self, lora_A: Tensor | None = None, lora_B: Tensor | None = None) -> Tensor:
        """``ΔW = (α/r) B_lora A_lora`` `(d_out, d_in)`."""
        a = self.lora_A.weight if lora_A is None else lora_A
        b = self.lora_B.weight if lora_B is None else lora_B
        return self.scaling * b @ a


class BatchedLinear(nn.Linear):
    """``nn.Linear`` whose weight and bias may carry a leading sample axis (latent layers).

    ``module_path`` names the adapted (or latent) module in the network, for errors; set by
    :func:`~pyrobayes.models.adapters.inject_adapter` and ``make_latent``. ``sequence_first``
    (set by ``make_latent``): the network calls the layer on ``(T, S·B, d)`` inputs, as an
    adapter layer's (:class:`LoRALinear`).
    """

    module_path: str = ""
    sequence_first: bool = False

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BatchedLinear:
        """A batched layer holding ``linear``'s weight and bias, which takes over the hooks
        registered on ``linear`` (forward, pre-forward, backward, state-dict): it replaces
        ``linear`` in the network, where they would otherwise be dropped in silence."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        carry_hooks(linear, new, share=True)
        return new

    def forward(self, x: Tensor) -> Tensor:
        x = rows_first(x, self.sequence_first)
        out = batched_linear(x, self.weight, self.bias, module_path=self.module_path)
        return rows_first(out, self.sequence_first)
