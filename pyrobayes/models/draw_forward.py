"""``DrawForward``: the network evaluated at posterior draws, the base of
:class:`~pyrobayes.models.FineTuneModel`.

One parameter set or S of them (a sample-major batch) are swapped into the network's cached
slots for one forward, with the work that does not depend on the draws shared: a
multiple-choice prompt run once for its choices, the blocks below the first adapted one run
once on the un-expanded rows (:mod:`pyrobayes.models.sharing`) or read back from the fit's
lower-block cache (:mod:`pyrobayes.models.lower_cache`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ..batch import batch_size, expand_samples, split_batch
from .adapters import SiteSpec
from .layers import torch_layer_sequence_first
from .likelihoods import Likelihood, OutputKey, network_output
from .lower_cache import LowerBlockCache, stubbed_below
from .net_call import _call, _functional_call, _num_samples, _RowsMismatch
from .sharing import (
    TokenLogProbs,
    batch_memo,
    batch_prefix_plan,
    first_adapted_block,
    lower_inputs,
    lower_layers_shared,
    prefix_plan,
    prefix_shared_logits,
    reusing_within_batch,
    sharing_enabled,
    tokens_per_draw,
)

__all__ = ["DrawForward", "NOISE_PARAM"]

#: ``point_params`` key of a learned Gaussian noise ``ρ`` (``σ = softplus(ρ)``).
NOISE_PARAM = "likelihood.raw_scale"


class DrawForward:
    """The network at one or S posterior draws: the evaluation methods of
    :class:`~pyrobayes.models.FineTuneModel`, which inherits them and sets what they read."""

    # set by FineTuneModel.__init__
    net: nn.Module
    likelihood: Likelihood
    latent_sites: dict[str, SiteSpec]
    point_params: dict[str, nn.Parameter]
    label_key: str
    output_key: OutputKey | None
    _tuple_first: bool

    @property
    def device(self) -> torch.device:
        for t in self.net.parameters():
            return t.device
        return torch.device("cpu")

    def _call_net(self, net: nn.Module, inputs: Any) -> Any:
        """``net`` on ``inputs`` as the likelihood wants it called (``network_inputs``: e.g. the
        ``(B, K, L)`` choices flattened and the head restricted to the positions read)."""
        return _call(net, self.likelihood.network_inputs(inputs, net))

    def _run(self, inputs: Any) -> Any:
        """:meth:`_call_net` with the work shared across choices and draws (``sharing``): a
        multiple-choice batch runs each prompt once for its K choices; inside
        :meth:`_lower_shared` the blocks below the first adapted one see the un-expanded rows."""
        check_positions = getattr(self.likelihood, "check_positions", None)
        if check_positions is not None:
            check_positions(inputs, self.net)
        layout = self._prompt_layout(inputs)
        shared = None
        if layout is not None:
            draws = self._draws_in_net()
            plan = self.__dict__.get("_prompt_plan") or {}  # _batched's: S copies of its rows
            expanded = plan.get("inputs") is inputs and plan.get("copies") == draws
            shared = prefix_shared_logits(
                self.net,
                self.likelihood,
                inputs,
                draws,
                self._first_adapted(),
                layout,
                copies=expanded and plan.get("source") is not None,
            )
        if shared is not None:
            return shared
        lower = self.__dict__.get("_lower_rows")  # set by _lower_shared
        net_inputs = self.likelihood.network_inputs(inputs, self.net)
        if lower is None:
            return _call(self.net, net_inputs)
        out = _call(self.net, lower_inputs(self.net, net_inputs, *lower))
        if int(self.network_prediction(out).shape[0]) != lower[0] * lower[1]:
            raise _RowsMismatch  # a head that reads the (un-expanded) inputs again
        return out

    def output(
        self,
        inputs: Any,
        values: Mapping[str, Tensor],
        overrides: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        """Likelihood parameters for one parameter set (or a sample-major batch): ``(B, ...)``.

        A value of another floating dtype than the tensor it replaces runs in the network's
        dtype (a guide keeps a half-precision network's parameters in float32: its steps would
        round away in bfloat16)."""
        slots = self._slots()
        params = {}
        for site, value in values.items():
            name = self.latent_sites[site].param_name
            module, leaf = slots[name]
            held = module._parameters[leaf]
            if held is not None and value.dtype != held.dtype:
                value = value.to(held.dtype)
            params[name] = value
        if overrides:
            params.update(overrides)
        with self._planning_prompts(inputs):
            cached = None if "_lower_rows" in self.__dict__ else self._cached_lower(inputs)
            if cached is None:
                out = self._functional(inputs, params)
            else:
                with stubbed_below(cached[0], cached[1]):
                    out = self._functional(inputs, params)
        if isinstance(out, TokenLogProbs):  # the shared prompts' scored continuations
            return self.likelihood.params(out, inputs)  # type: ignore[arg-type]
        return self.likelihood.params(self.network_prediction(out), inputs)

    def network_prediction(self, out: Any) -> Tensor:
        """The prediction tensor in the network's output ``out`` (``output_key``)."""
        return network_output(out, self.output_key, first_of_tuple=self._tuple_first)

    def _draws_in_net(self) -> int:
        """Parameter sets the network holds now: the leading size of a site swapped in with a
        sample axis (a sample-major batch, or the linearised predictive's per-row copies)."""
        for spec in self.latent_sites.values():
            module, leaf = self._slots()[spec.param_name]
            value = module._parameters[leaf]
            if value is not None and value.dim() > len(spec.shape):
                return int(value.shape[0])
        return 1

    def _slots(self) -> dict[str, tuple[nn.Module, str]]:
        """``{parameter name: (owning module, attribute)}`` for every site and point parameter."""
        slots = self.__dict__.get("_slot_cache")
        if slots is None:
            slots = {}
            names = [s.param_name for s in self.latent_sites.values()]
            names += [n for n in self.point_params if n != NOISE_PARAM]  # the rest: the network's
            for name in names:
                parent, _, leaf = name.rpartition(".")
                module = self.net.get_submodule(parent) if parent else self.net
                if leaf not in module._parameters:
                    raise RuntimeError(f"{name!r} is not a registered parameter of the network.")
                slots[name] = (module, leaf)
            self.__dict__["_slot_cache"] = slots
        return slots

    def _functional(self, inputs: Any, params: dict[str, Tensor]) -> Any:
        """Run the network with ``params`` in place of its own tensors (as ``functional_call``).

        The sites and point parameters are known in advance, so their slots are cached and
        swapped directly (``functional_call`` walks every module each call, a millisecond-scale
        fixed cost per step on small networks); other names go through ``functional_call``.
        """
        slots = self._slots()
        if not all(name in slots for name in params):
            net_inputs = self.likelihood.network_inputs(inputs, self.net)
            return _functional_call(self.net, net_inputs, params)
        saved = []
        try:
            for name, value in params.items():
                module, leaf = slots[name]
                saved.append((module, leaf, module._parameters[leaf]))
                module._parameters[leaf] = value  # type: ignore[assignment]
            return self._run(inputs)
        finally:
            for module, leaf, original in reversed(saved):
                module._parameters[leaf] = original

    def batched_output(self, inputs: Any, values: Mapping[str, Tensor]) -> Tensor:
        """Likelihood parameters for S parameter sets in ONE forward: ``(S, B, ...)``.

        ``values[site]`` has shape ``(S, *site_shape)``, one entry per latent site. The input
        batch is expanded S-fold (sample-major) and each adapter layer applies its own sample
        to its slice.

        Raises
        ------
        ValueError
            When ``values`` names a site the model does not have, leaves one of its sites
            out (the network would run at the value its slot holds), or holds a value that is
            not ``(S, *site_shape)`` (e.g. one draw without its sample axis).
        """
        self._check_draws(values)
        return self._batched(inputs, values)

    def _check_draws(self, values: Mapping[str, Tensor]) -> None:
        """Refuse ``values`` that are not ``{site: (S, *site_shape)}`` for every latent site
        (shapes only: no synchronisation)."""
        owner = f"{type(self).__name__}.batched_output"
        sites = self.latent_sites
        unknown = [s for s in values if s not in sites]
        missing = [s for s in sites if s not in values]
        if unknown or missing:
            raise ValueError(
                f"{owner}: values must hold one entry per latent site of the model "
                f"({sorted(sites)[:6]}{', ...' if len(sites) > 6 else ''}); "
                + (f"{unknown[:3]} are not latent sites; " if unknown else "")
                + (
                    f"{missing[:3]} are missing (the network would run at the values their "
                    "slots hold, not at a draw); "
                    if missing
                    else ""
                )
                + "pass e.g. guide.sample_posterior(S)."
            )
        for site, value in values.items():
            shape = tuple(sites[site].shape)
            got = tuple(value.shape) if isinstance(value, Tensor) else None
            if got is None or len(got) != len(shape) + 1 or got[1:] != shape:
                raise ValueError(
                    f"{owner}: values[{site!r}] has shape {got}, but the site has shape "
                    f"{shape}: a value must be (S, *{shape}), S draws along a leading sample "
                    "axis (one draw: value.unsqueeze(0); one draw without the axis would be "
                    "read as draws along its first dimension)."
                )

    def _batched(
        self,
        inputs: Any,
        values: Mapping[str, Tensor],
        overrides: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        num_samples = _num_samples(values)
        num_rows = batch_size(inputs)
        if num_samples == 1 and not reusing_within_batch():
            out = self.output(inputs, {s: v[0] for s, v in values.items()}, overrides)
            _check_output_rows(out, 1, num_rows, type(self).__name__)
            return out.unsqueeze(0)
        expanded = expand_samples(inputs, num_samples)
        # one prompt plan for both tries, from the un-expanded rows' (once per batch in predict)
        with self._planning_prompts(expanded, inputs, num_samples):
            shared = self._lower_shared(inputs, expanded, values, overrides, num_samples)
            out = self.output(expanded, values, overrides) if shared is None else shared
        _check_output_rows(out, num_samples, num_rows, type(self).__name__)
        return out.reshape(num_samples, num_rows, *out.shape[1:])

    def _lower_shared(
        self,
        inputs: Any,
        expanded: Any,
        values: Mapping[str, Tensor],
        overrides: Mapping[str, Tensor] | None,
        num_samples: int,
    ) -> Tensor | None:
        """:meth:`output` of the S-fold ``expanded`` batch with the network's blocks below the
        first adapted one run once on the un-expanded rows (``sharing``), or ``None`` where
        that does not apply (or the network's output does not keep the expanded rows). The
        prompt-sharing path shares them itself where it runs; where it declines the batch
        (:func:`~pyrobayes.models.sharing.prefix_plan`) the full rows share them here."""
        if not sharing_enabled() or "_lower_rows" in self.__dict__:
            return None
        found = self._first_adapted()
        # a sequence-first stack's block arguments hold the positions on their leading axis,
        # which the sharing expands: its S-fold rows would be copies of positions
        if found is None or torch_layer_sequence_first(found[0][found[1]]):
            return None
        if self._prompt_layout(expanded) is not None:
            return None  # the prompt-sharing path runs the choices instead
        rows = batch_size(inputs) * (self.likelihood.rows_per_output(inputs) or 1)
        cached = self._lower_cache_output(inputs)  # the fit's memory of the lower blocks
        self.__dict__["_lower_rows"] = (rows, num_samples)
        key = tuple(sorted(self.latent_sites))
        memo = batch_memo(inputs, ("lower", key))  # the chunks of one batch in pb.predict
        if cached is not None:
            memo = {} if memo is None else memo
            memo["below"] = cached[1]
        try:
            blocks, first = found
            below = list(blocks)[:first]
            with lower_layers_shared(list(blocks)[first:], rows, num_samples, below, memo):
                out = self.output(expanded, values, overrides)
        except _RowsMismatch:
            if memo is not None:
                memo.pop("below", None)
            return None
        finally:
            del self.__dict__["_lower_rows"]
        return out

    @contextlib.contextmanager
    def caching_lower_blocks(self, *datasets: Iterable[Any]) -> Iterator[None]:
        """Within the block (:func:`pyrobayes.fit` opens it with its training and validation
        data), the frozen blocks below the first adapted one are not run on the examples of
        ``datasets``: their output is computed once per example on entry and read back
        (:mod:`pyrobayes.models.lower_cache`). Where that does not apply, the plain forward
        runs. Data other than a ``DataLoader``, list or tuple is not read ahead (the first, the
        training data, must be one)."""
        found = self._first_adapted()
        readable = [d for d in datasets if isinstance(d, (DataLoader, list, tuple))]
        if (
            found is None
            or not datasets
            or not isinstance(datasets[0], (DataLoader, list, tuple))
            or "_lower_cache" in self.__dict__
            or not sharing_enabled()
        ):
            yield
            return
        changing = [spec.param_name for spec in self.latent_sites.values()]
        changing += [name for name in self.point_params if name != NOISE_PARAM]
        cache = LowerBlockCache(self.net, list(found[0]), found[1], changing)

        def network_inputs(batch: Any) -> Any:
            return self.likelihood.network_inputs(split_batch(batch, self.label_key)[0], self.net)

        if cache.build(readable, network_inputs, self.device):
            self.__dict__["_lower_cache"] = cache
        try:
            yield
        finally:
            self.__dict__.pop("_lower_cache", None)

    def _cached_lower(self, inputs: Any) -> tuple[list[nn.Module], Any] | None:
        """``(lower blocks, their output for inputs)`` from the fit's lower-block cache, or
        ``None`` outside :meth:`caching_lower_blocks` or where it does not apply."""
        if self.__dict__.get("_lower_cache") is None or not sharing_enabled():
            return None
        if self._prompt_layout(inputs) is not None:
            return None  # prompts and continuations run as rows of their own
        return self._lower_cache_output(inputs)

    def _lower_cache_output(self, inputs: Any) -> tuple[list[nn.Module], Any] | None:
        """:meth:`_cached_lower` of the full rows of ``inputs`` (whether or not their prompts
        would be shared)."""
        cache = self.__dict__.get("_lower_cache")
        if cache is None or not sharing_enabled():
            return None
        output = cache.output(self.likelihood.network_inputs(inputs, self.net))
        return None if output is None else (cache.below, output)

    @contextlib.contextmanager
    def _planning_prompts(self, inputs: Any, source: Any = None, copies: int = 1) -> Iterator[None]:
        """Within the block, :meth:`_prompt_layout` of ``inputs`` is computed once, when first
        asked (its checks read the batch: one synchronisation with the device per batch, for
        the lower-block cache, the lower-block sharing and the prompt path alike). ``inputs``
        that are the un-expanded ``source`` expanded ``copies``-fold get the layout of
        ``source``, expanded (:func:`~pyrobayes.models.sharing.batch_prefix_plan`: inside
        :func:`~pyrobayes.models.sharing.reuse_within_batch`, once for all the chunks of draws
        of a batch). A nested block on the same inputs keeps the outer one's plan."""
        held = self.__dict__.get("_prompt_plan")
        if held is not None and held["inputs"] is inputs:
            yield
            return
        self.__dict__["_prompt_plan"] = {"inputs": inputs, "source": source, "copies": copies}
        try:
            yield
        finally:
            if held is None:
                self.__dict__.pop("_prompt_plan", None)
            else:
                self.__dict__["_prompt_plan"] = held

    def _prompt_layout(self, inputs: Any) -> dict[str, Tensor] | None:
        """:func:`~pyrobayes.models.sharing.prefix_plan` of ``inputs``: the layout the
        prompt-sharing path runs them with, ``None`` when it will not run for them (computed
        once inside :meth:`_planning_prompts`)."""
        held = self.__dict__.get("_prompt_plan")
        if held is None or held["inputs"] is not inputs:
            return prefix_plan(self.net, self.likelihood, inputs)
        if "layout" not in held and held["source"] is not None:
            held["layout"] = batch_prefix_plan(
                self.net, self.likelihood, held["source"], held["copies"]
            )
        elif "layout" not in held:
            held["layout"] = prefix_plan(self.net, self.likelihood, inputs)
        layout: dict[str, Tensor] | None = held["layout"]
        return layout

    def tokens_per_draw(self, inputs: Any) -> int | None:
        """Token positions one more draw costs on ``inputs`` in prediction, the work
        shared across draws left out (:func:`~pyrobayes.models.sharing.tokens_per_draw`);
        ``None`` when nothing is shared. :func:`pyrobayes.predict` sizes its chunks of draws
        by it."""
        return tokens_per_draw(self.net, self.likelihood, inputs, self._first_adapted())

    def _first_adapted(self) -> tuple[nn.ModuleList, int] | None:
        """:func:`~pyrobayes.models.sharing.first_adapted_block` of the latent sites (cached)."""
        key = tuple(sorted(self.latent_sites))
        cached = self.__dict__.get("_lower_block")
        if cached is None or cached[0] != key:
            names = [spec.param_name for spec in self.latent_sites.values()]
            cached = (key, first_adapted_block(self.net, names))
            self.__dict__["_lower_block"] = cached
        return cached[1]


def _check_output_rows(out: Tensor, num_samples: int, num_rows: int, owner: str) -> None:
    """Refuse likelihood parameters ``out`` that do not lead with ``S·B`` rows, one per draw
    and example (``num_samples`` draws of a batch of ``num_rows`` examples; ``owner``, the
    model's class, starts the message): read as ``(S, B, ...)`` they would pair outputs with
    the wrong examples, or fail inside torch.

    Raises
    ------
    ValueError
        Naming both counts and the likely cause: ``data`` iterated one example at a time (a
        torch ``Dataset`` or a tensor passed as ``data``), or a network that drops or merges
        the batch dim.
    """
    rows = int(out.shape[0]) if out.dim() else 0
    if rows == num_samples * num_rows:
        return
    draws = f" ({num_samples} draws x {num_rows} examples)" if num_samples > 1 else ""
    raise ValueError(
        f"{owner}: the likelihood's parameters have {rows} rows (shape {tuple(out.shape)}) "
        f"for a batch of {num_rows} examples; {num_samples * num_rows} rows{draws} were "
        "expected, one per example. Is each item of data one example rather than a batch (a torch Dataset, or a "
        "tensor, iterated row by row)? Pass batches (a DataLoader with a batch_size, or a list "
        "of (inputs, targets) batches), and a network that returns one row per example."
    )
