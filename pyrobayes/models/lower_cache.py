r"""The frozen lower blocks' output of every training example, computed once per fit.

When the latent sites and point parameters all sit in blocks ``i ≥ i_0`` of a network's stack
(the demo's MiniLM adapts blocks 3–5 of 6) and the backbone runs without dropout, the
embeddings and blocks ``< i_0`` compute the same function of an example in every epoch,
``h_{i_0}(x) = (f_{i_0 - 1} ∘ … ∘ f_0 ∘ embed)(x)``. At its start :func:`pyrobayes.fit` reads
the training and validation batches once, computes ``h_{i_0}(x)`` for every distinct example
on its real tokens only, in a canonical order (examples of equal length together, sorted by
their tokens, at most :data:`GROUP_TOKENS` tokens per forward, no padding), and each batch's
input to block ``i_0`` is then assembled from those entries (zeros at the padded positions,
which the attention mask hides from every real token). Examples are told apart by every input
they carry (a sentence pair's ``token_type_ids``, ``position_ids``) and computed in forwards of
examples carrying the same inputs, so an entry is the lower blocks' output on exactly its own
example's inputs, whatever the other batches hold. The lower blocks cost one pass over the
data per fit instead of one per epoch, and an example's entry depends on the data alone, not on
the batch it falls in or where a run was resumed, so resumed fits stay bit-exact. Against the
plain padded forward an entry differs by floating-point rounding only (MiniLM, float32: at most
2e-6).

It applies to training data given as a ``DataLoader``, list or tuple of batches of token ids
(``input_ids``, ``attention_mask``, ``token_type_ids``, ``position_ids``, the labels; the
multiple-choice likelihood's flattened choice rows with ``logits_to_keep``) whose rows hold one
run of real tokens each: right padding, or left padding with ``position_ids`` that count the
real tokens (without them the network numbers the padding too) on a network that attends
causally (found by a probe: a change at the last position of an example leaves every earlier
position's output at the cut bit for bit unchanged), whose head reads real tokens only (the
last one, or the scored continuations). A bidirectional encoder computes the padding's hidden
states from the real tokens, and its head may read them (BERT, ELECTRA and DistilBERT pool
position 0, a padding token under left padding): zeros there would fit another function than
the plain forward computes, so left padding on it runs the plain forward (logged at INFO,
once). So does padded data on a network whose lower blocks read the padding (ConvBERT's
span-based convolution: probed once, on the first padded row, against its real tokens alone;
INFO). It falls back to the plain forward otherwise too: other batch keys, left padding without
positions, a 4-d attention mask, dropout in the backbone (``train_backbone_mode``), a trainable
or pyrobayes module (an adapter, a σNorm member) that runs before block ``i_0``, a block whose
output is more than its hidden states or whose hidden states are not ``(rows, tokens, ...)``
(XLNet's are tokens first), a block of the stack that runs more than once in a forward or a
lower block that runs after a later one (ALBERT's shared layer groups and inner layers: the
output of block ``i_0 - 1`` at its first call is then not the input of block ``i_0``; also a
stack holding one module twice), data over :data:`MAX_BYTES` of hidden states, data reaching
past the position at which the network's rotary frequencies change (``longrope``, ``dynamic``
scaling: an entry's would be its example's, the plain forward's its batch's; INFO), or a batch
holding an example the pass did not see.
:func:`pyrobayes.models.sharing.unshared` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

__all__ = ["LowerBlockCache", "MAX_BYTES", "GROUP_TOKENS", "stubbed_below", "rope_length_limit"]

#: Largest cache (bytes of stored hidden states); larger data run every block in every epoch.
MAX_BYTES = 2**30

#: Tokens per forward when the entries are computed (examples of one length together).
GROUP_TOKENS = 2048

#: Token-aligned batch keys a cached batch may hold (after the labels are split off).
_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "position_ids"})

#: Keys read above the blocks (the head's positions, no key/value cache): not per token.
_ABOVE = frozenset({"logits_to_keep", "use_cache"})


#: Why left-padded rows of a network that does not attend causally run the plain forward.
_LEFT = (
    "left padding on a network that does not attend causally (a bidirectional encoder): its "
    "padding's hidden states are computed from the real tokens and may be read (BERT pools "
    "position 0)"
)


#: Why data with padding on a network whose lower blocks read the padding runs the plain forward.
_PADDING = (
    "the lower blocks' output at an example's real tokens changes with the padding after them "
    "(ConvBERT's span-based convolution reads it): entries computed without padding would fit "
    "another function than the padded batches compute"
)


#: Why a block whose hidden states are not laid out as the token ids is not cached.
_LAYOUT = "the block's hidden states are not (rows, tokens, ...) (XLNet's are tokens first)"


def rope_length_limit(net: nn.Module) -> int | None:
    """The longest forward (its largest position id + 1) over which ``net``'s rotary embeddings
    keep their frequencies, or ``None`` when they never change with the forward.

    transformers' ``longrope`` (Phi-3 and Phi-3.5 128k, Phi-4-mini) takes its short or long
    factors by the largest position id of each forward, past ``original_max_position_embeddings``,
    and ``dynamic`` NTK scaling grows its frequencies past ``max_position_embeddings``: a prompt
    run alone, or an example run on its own tokens, then gets other frequencies than in the
    full rows of its batch. Unknown limits are 0 (never the same).

    Parameters
    ----------
    net : nn.Module

    Returns
    -------
    int or None
    """
    limits: list[int] = []
    for module in net.modules():
        kind = getattr(module, "rope_type", None)
        kinds = list(kind.items()) if isinstance(kind, dict) else [(None, kind)]
        for layer_type, name in kinds:
            if not isinstance(name, str):
                continue
            if name == "longrope":
                params = getattr(getattr(module, "config", None), "rope_parameters", None)
                params = params if isinstance(params, dict) else {}
                if layer_type is not None and isinstance(params.get(layer_type), dict):
                    params = params[layer_type]
                limit = params.get("original_max_position_embeddings")
            elif "dynamic" in name:
                limit = getattr(module, "original_max_seq_len", None)
            else:
                continue
            limits.append(limit if isinstance(limit, int) else 0)
    return min(limits) if limits else None


def _span(one: Mapping[str, Tensor]) -> int:
    """An example's largest position id + 1 (its length without ``position_ids``)."""
    pos = one.get("position_ids")
    if isinstance(pos, Tensor) and pos.numel():
        return int(pos.max()) + 1
    return int(one["input_ids"].shape[1])


class _Probe:
    """A padded row of the data (its token-aligned inputs, mask included), the run of its real
    tokens, the key of its entry and, once run, its output at the cut."""

    def __init__(self, row: dict[str, Tensor], start: int, length: int, key: bytes) -> None:
        self.row, self.start, self.length, self.key = row, start, length, key
        self.hidden: Tensor | None = None


class _Stop(Exception):
    """Raised by the hook on the last lower block: the rest of the forward is not needed."""


class LowerBlockCache:
    """Per-example outputs of the blocks below the first adapted one (``blocks[:first]``).

    Parameters
    ----------
    net : nn.Module
        The network (its lower blocks frozen, in eval mode).
    blocks : nn.ModuleList
        Its stack of blocks.
    first : int
        The first block holding a latent site (``> 0``).
    changing : list of str
        Names (in ``net``) of every parameter a fit changes (latent sites, point parameters).
    max_bytes : int
        Cap on the stored hidden states.
    """

    def __init__(
        self,
        net: nn.Module,
        blocks: Sequence[nn.Module],
        first: int,
        changing: Sequence[str],
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.net = net
        self.blocks = list(blocks)
        self.below = self.blocks[:first]
        self.changing = set(changing)
        self.max_bytes = max_bytes
        self.entries: dict[bytes, Tensor] = {}
        self.structure: tuple | None = None  # the block output's entries after the hidden states
        #: whether the network attends causally (probed where the data holds left padding)
        self.causal: bool | None = None
        self._told: set[str] = set()  # the reasons a batch ran the plain forward, logged once
        self._probed: Tensor | None = None  # the probe forward's hidden states at the cut

    # ------------------------------------------------------------------ building
    def build(
        self,
        datasets: Iterable[Iterable[Any]],
        network_inputs: Callable[[Any], Any],
        device: torch.device,
    ) -> bool:
        """Compute the entry of every example of ``datasets`` (iterables of batches;
        ``network_inputs`` maps a batch to the network's keyword arguments). Returns whether
        the cache applies; when it does not, it stays empty."""
        if self.net.training:
            return self._off("the backbone is in training mode (dropout)")
        examples: dict[bytes, dict[str, Tensor]] = {}
        width, tokens, left = None, 0, False
        probe: _Probe | None = None  # the first padded row, and its output at the cut
        for data in datasets:
            for batch in data:
                net_inputs = network_inputs(batch)
                rows = _rows(net_inputs)
                if rows is None:
                    return self._off(
                        "a batch is not rows of token ids with one run of real tokens each"
                    )
                host = _host(net_inputs)
                for i, a, n in rows:
                    left = left or a > 0
                    one = {k: v[i : i + 1, a : a + n] for k, v in host.items()}
                    key = _key(one)
                    if probe is None and n < int(host["input_ids"].shape[1]):
                        probe = _Probe(_padded_row(net_inputs, i), a, n, key)
                    if key not in examples:
                        examples[key] = one
                        tokens += n
                if width is None:  # the probe forward runs on the padded row where there is one
                    width = self._width(
                        probe.row if probe else next(iter(examples.values())), device
                    )
                    if width is None:
                        return False
                    if probe is not None:
                        probe.hidden, self._probed = self._probed, None
                if tokens * width > self.max_bytes:
                    return self._off(f"the data's hidden states exceed {self.max_bytes} bytes")
        why = _rope_refusal(self.net, examples.values())
        if why is not None:
            return self._off(why, logging.INFO)
        if left:
            self.causal = self._attends_causally(examples.values(), device)
            if not self.causal:
                return self._off(_LEFT, logging.INFO)
        for group in _groups(examples):
            stacked = {k: torch.cat([o[k] for _, o in group]).to(device) for k in group[0][1]}
            hidden = self._forward(stacked)
            if tuple(hidden.shape[:2]) != tuple(stacked["input_ids"].shape):
                return self._off(_LAYOUT)
            for j, (key, _) in enumerate(group):
                self.entries[key] = hidden[j]
        if probe is not None and self._reads_padding(probe, device):
            return self._off(_PADDING, logging.INFO)
        return bool(self.entries)

    def _width(self, one: Mapping[str, Tensor], device: torch.device) -> int | None:
        """Bytes per token of the entries (from a probe forward of one row, ``one``: kept in
        ``_probed``), or ``None`` when the cache does not apply to the network (what runs
        before the cut, or blocks that do not run once each, in order)."""
        if len({id(block) for block in self.blocks}) != len(self.blocks):
            self._off("the stack of blocks holds one module twice")
            return None
        ran: list[nn.Module] = []  # every module called before the cut
        order: list[int] = []  # the stack's blocks, call by call, in the whole forward
        holder: dict[str, Any] = {}
        position = {id(block): i for i, block in enumerate(self.blocks)}

        def called(module: nn.Module, args: tuple) -> None:
            if "output" not in holder:
                ran.append(module)
            if id(module) in position:
                order.append(position[id(module)])

        def cut(module: nn.Module, args: tuple, output: Any) -> None:
            holder.setdefault("output", output)

        handles = [m.register_forward_pre_hook(called) for m in self.net.modules()]
        handles.append(self.below[-1].register_forward_hook(cut))
        try:
            with torch.no_grad():
                self.net(**{k: v.to(device) for k, v in one.items()})
        finally:
            for handle in handles:
                handle.remove()
        output: Any = holder.get("output")
        why = _order_refusal(order, len(self.below)) or self._refusal(ran, output)
        if why is not None:
            self._off(why)
            return None
        self.structure = tuple(output[1:]) if isinstance(output, tuple) else None
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.dim() < 2 or tuple(hidden.shape[:2]) != tuple(one["input_ids"].shape):
            self._off(_LAYOUT)
            return None
        self._probed = hidden.detach()
        return int(hidden[0, 0].numel()) * hidden.element_size()

    def _run(self, inputs: Mapping[str, Tensor], device: torch.device | None = None) -> Any:
        """The last lower block's output on ``inputs`` (the forward stops there)."""
        holder: dict[str, Any] = {}

        def stop(module: nn.Module, args: tuple, output: Any) -> None:
            holder["output"] = output
            raise _Stop

        handle = self.below[-1].register_forward_hook(stop)
        try:
            with torch.no_grad():
                if device is not None:
                    inputs = {k: v.to(device) for k, v in inputs.items()}
                self.net(**inputs)
        except _Stop:
            pass
        finally:
            handle.remove()
        return holder.get("output")

    def _forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        output = self._run(inputs)
        hidden = output[0] if isinstance(output, tuple) else output
        return hidden.detach().clone()

    def _attends_causally(
        self, examples: Iterable[Mapping[str, Tensor]], device: torch.device
    ) -> bool:
        """Whether a change of the hidden states entering block 0 at the last position of the
        longest example leaves every earlier position's output at the cut bit for bit unchanged
        (causal attention: no position reads a later one). ``False`` where that cannot be
        probed (no example of two tokens, block 0 without hidden states to change)."""
        one = max(examples, key=lambda o: int(o["input_ids"].shape[1]))
        n = int(one["input_ids"].shape[1])
        if n < 2:
            return False
        changed: list[bool] = []

        def change(module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if args and isinstance(args[0], Tensor):
                hidden = args[0].clone()
                hidden[:, -1] += 1
                changed.append(True)
                return (hidden, *args[1:]), kwargs
            if isinstance(kwargs.get("hidden_states"), Tensor):
                hidden = kwargs["hidden_states"].clone()
                hidden[:, -1] += 1
                changed.append(True)
                return args, {**kwargs, "hidden_states": hidden}
            return None

        plain = self._run(one, device)
        handle = self.blocks[0].register_forward_pre_hook(change, with_kwargs=True)
        try:
            other = self._run(one, device)
        finally:
            handle.remove()
        plain = plain[0] if isinstance(plain, tuple) else plain
        other = other[0] if isinstance(other, tuple) else other
        if not changed or not isinstance(plain, Tensor) or not isinstance(other, Tensor):
            return False
        return bool(torch.equal(plain[:, : n - 1], other[:, : n - 1]))

    def _reads_padding(self, probe: _Probe, device: torch.device) -> bool:
        """Whether the lower blocks' output at the real tokens of the padded row of ``probe``
        differs from its entry's, computed on those tokens alone, by more than rounding: more
        than ``sqrt(eps)`` of the entry's scale (float32: 3.5e-4; padded and unpadded forwards
        differ by at most 5e-7 of it on BERT, DistilBERT, ELECTRA, (XLM-)RoBERTa, MPNet,
        ModernBERT, DeBERTa, MobileBERT and EuroBERT, while ConvBERT's span-based convolution,
        which reads the padding, moves it by 0.4 of it). The padded row's output is the probe
        forward's (:meth:`_width`) where it ran on that row: no forward of its own."""
        full = probe.hidden
        if full is None:  # the first batch had no padding: one forward of the row
            output = self._run(probe.row, device)
            full = output[0] if isinstance(output, tuple) else output
        alone = self.entries.get(probe.key)
        if not isinstance(full, Tensor) or alone is None or not alone.is_floating_point():
            return True
        full = full[0, probe.start : probe.start + probe.length].to(alone.device)
        if full.shape != alone.shape:
            return True
        tol = torch.finfo(alone.dtype).eps ** 0.5 * max(1.0, float(alone.abs().max()))
        return bool((full - alone).abs().max() > tol)

    def _refusal(self, ran: list[nn.Module], output: Any) -> str | None:
        """Why the cache does not apply: a pyrobayes or trained module runs before the cut, or
        the block returns more than its hidden states (alone, or first of a tuple of ``None``)."""
        names = {id(m): name for name, m in self.net.named_modules()}
        for module in ran:
            name = names.get(id(module), "?")
            if type(module).__module__.startswith("pyrobayes."):
                return f"a pyrobayes module ({type(module).__name__} {name!r}) runs below"
            for leaf, p in module.named_parameters(recurse=False):
                full = f"{name}.{leaf}" if name else leaf
                if p.requires_grad or full in self.changing:
                    return f"{full!r} runs below the first adapted block and is trained"
        if isinstance(output, tuple):
            if not output or not isinstance(output[0], Tensor):
                return "the block returns no hidden states"
            if any(o is not None for o in output[1:]):
                return "the block returns more than its hidden states"
            return None
        if not isinstance(output, Tensor):
            return f"the block returns a {type(output).__name__}"
        return None

    def _off(self, why: str, level: int = logging.DEBUG) -> bool:
        logger.log(level, "lower-block cache off: %s", why)
        self.entries.clear()
        return False

    def _plain(self, why: str) -> None:
        """A batch runs the plain forward for ``why`` (logged at INFO, once per reason)."""
        if why not in self._told:
            self._told.add(why)
            logger.info("lower-block cache: the plain forward runs: %s", why)

    # ------------------------------------------------------------------ lookup
    def output(self, net_inputs: Any) -> Any | None:
        """The last lower block's output for the batch ``net_inputs``, assembled from the
        entries, or ``None`` where the cache does not cover it (the plain forward runs)."""
        if not self.entries or self.net.training or not isinstance(net_inputs, Mapping):
            return None
        rows = _rows(net_inputs)
        if rows is None:
            return None
        if not self.causal and any(a > 0 for _, a, _ in rows):
            self._plain(_LEFT)
            return None
        host = _host(net_inputs)
        found = []
        for i, a, n in rows:
            entry = self.entries.get(_key({k: v[i : i + 1, a : a + n] for k, v in host.items()}))
            if entry is None:
                return None
            found.append(entry)
        ids = net_inputs["input_ids"]
        hidden = found[0].new_zeros(len(rows), int(ids.shape[1]), *found[0].shape[1:])
        for (i, a, n), entry in zip(rows, found, strict=True):
            hidden[i, a : a + n] = entry
        return hidden if self.structure is None else (hidden, *self.structure)


def _rope_refusal(net: nn.Module, examples: Iterable[Mapping[str, Tensor]]) -> str | None:
    """Why entries computed on each example's own tokens would not be the plain forward's: an
    example past the length at which ``net``'s rotary frequencies change (the plain forward's
    depend on the longest row of its batch, an entry's on its example), or ``None``."""
    limit = rope_length_limit(net)
    if limit is None:
        return None
    longest = max((_span(one) for one in examples), default=0)
    if longest <= limit:
        return None  # every forward, batch or entry, keeps the short frequencies
    return (
        f"{type(net).__name__}'s rotary frequencies change past position {limit} (longrope or "
        f"dynamic scaling) and the data reaches position {longest - 1}: they would depend on "
        "the other rows of a batch"
    )


def _order_refusal(order: Sequence[int], first: int) -> str | None:
    """Why the stack's blocks, called in ``order`` (their indices) in a forward, do not run
    once each and in order up to the cut below block ``first``, or ``None``."""
    for j, i in enumerate(order):
        if i in order[:j]:
            return f"block {i} of the stack runs more than once in a forward"
        if j and i < order[j - 1]:
            return f"block {i} of the stack runs after block {order[j - 1]}"
    if first - 1 not in order:
        return f"block {first - 1} of the stack does not run"
    return None


@contextlib.contextmanager
def stubbed_below(below: Sequence[nn.Module], output: Any) -> Iterator[None]:
    """Within the block, every module of ``below`` called on hidden states of ``output``'s
    rows and length returns ``output`` without computing (the next block's input is then
    ``output``'s hidden states); a call on other rows (a forward the output is not of) computes.
    Valid only where each block of the stack runs once per forward, in order (the callers
    check it: :class:`LowerBlockCache`'s probe, :func:`~pyrobayes.models.sharing.
    lower_layers_shared`).
    """
    hidden = output[0] if isinstance(output, tuple) else output
    shape = tuple(hidden.shape[:2]) if isinstance(hidden, Tensor) else None

    def stub(block: nn.Module) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            given = args[0] if args else kwargs.get("hidden_states")
            if isinstance(given, Tensor) and tuple(given.shape[:2]) == shape:
                return output
            return type(block).forward(block, *args, **kwargs)

        return forward

    stubbed: list[nn.Module] = []
    try:
        for block in below:  # an instance attribute shadows the class's forward
            block.forward = stub(block)
            stubbed.append(block)
        yield
    finally:
        for block in stubbed:
            del block.forward


def _rows(net_inputs: Any) -> list[tuple[int, int, int]] | None:
    """``[(row, first real column, number of real tokens)]`` of a batch of token ids whose rows
    hold one run of real tokens each, or ``None`` (the plain forward runs).

    A run that does not start at column 0 (left padding) needs ``position_ids``: without them
    the network numbers the padding too, and the run's positions depend on the batch.
    """
    if not isinstance(net_inputs, Mapping) or "input_ids" not in net_inputs:
        return None
    if not set(net_inputs) <= _KEYS | _ABOVE:
        return None
    ids = net_inputs["input_ids"]
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape[1] == 0:
        return None
    if ids.dtype not in (torch.long, torch.int):
        return None
    aligned = [net_inputs[k] for k in _KEYS if k in net_inputs]
    if any(not isinstance(v, Tensor) or v.shape != ids.shape for v in aligned):
        return None  # e.g. a 4-d attention mask
    mask = net_inputs.get("attention_mask")
    length = int(ids.shape[1])
    if mask is None:
        return [(i, 0, length) for i in range(int(ids.shape[0]))]
    real = mask != 0
    counts = real.sum(1)
    starts = real.int().argmax(1)
    positions = torch.arange(length, device=mask.device)
    run = (positions >= starts[:, None]) & (positions < (starts + counts)[:, None])
    if not bool((real == run).all()) or not bool((counts > 0).all()):
        return None  # holes, or a row without tokens
    if bool((starts > 0).any()) and "position_ids" not in net_inputs:
        return None
    return [
        (i, int(a), int(n))
        for i, (a, n) in enumerate(zip(starts.tolist(), counts.tolist(), strict=True))
    ]


def _padded_row(net_inputs: Mapping[str, Any], i: int) -> dict[str, Tensor]:
    """Row ``i`` of the batch's token-aligned inputs, its padding and mask included (host)."""
    return {k: v[i : i + 1].detach().cpu() for k, v in net_inputs.items() if k in _KEYS}


def _host(net_inputs: Mapping[str, Any]) -> dict[str, Tensor]:
    """The token-aligned inputs on the host (an all-ones mask of a run is not kept)."""
    return {
        k: v.detach().cpu() for k, v in net_inputs.items() if k in _KEYS and k != "attention_mask"
    }


def _key(one: Mapping[str, Tensor]) -> bytes:
    """An example's identity: its real tokens (ids, then token types and positions if given),
    each under its input's name (``token_type_ids`` and ``position_ids`` of equal values are
    other examples)."""
    parts = [k.encode() + b"=" + one[k].to(torch.int64).numpy().tobytes() for k in sorted(one)]
    return b"|".join(parts)


def _groups(
    examples: Mapping[bytes, Mapping[str, Tensor]],
) -> list[list[tuple[bytes, Mapping[str, Tensor]]]]:
    """The examples in a canonical order (by length and inputs, then by their tokens) cut into
    forwards of one length and one set of inputs (an example's entry is computed on its own
    inputs: none taken from, or missing for, another example of its forward) and at most
    :data:`GROUP_TOKENS` tokens: the same groups whatever order the data came in."""

    def kind(one: Mapping[str, Tensor]) -> tuple[int, tuple[str, ...]]:
        return int(one["input_ids"].shape[1]), tuple(sorted(one))

    ordered = sorted(examples.items(), key=lambda item: (kind(item[1]), item[0]))
    groups: list[list[tuple[bytes, Mapping[str, Tensor]]]] = []
    for key, one in ordered:
        n = int(one["input_ids"].shape[1])
        last = groups[-1] if groups else None
        if (
            last is not None
            and kind(last[0][1]) == kind(one)
            and (len(last) + 1) * n <= max(GROUP_TOKENS, n)
        ):
            last.append((key, one))
        else:
            groups.append([(key, one)])
    return groups
