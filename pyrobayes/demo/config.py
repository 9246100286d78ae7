"""The demo's config: its defaults, its schema and the checks a config gets before any work.

``DEFAULT_CONFIG`` is the job the command line runs without a config file;
:func:`resolve_config` merges a user's (TOML) config over it and :func:`validate_config`
refuses a wrong key, type, value or combination with a :class:`ConfigError` that names the
key path and the fix. :func:`check_inputs` and :func:`check_device` check what the config
points to (files, hub names, the device) before a model is loaded.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..models.adapters import find_target_modules
from ..registry import available_guides
from . import data as pbdata

__all__ = [
    "CHOICES",
    "check_target_modules",
    "DEFAULT_CONFIG",
    "OPTIONAL_KEYS",
    "QUICK_OVERRIDES",
    "ConfigError",
    "check_device",
    "check_choice",
    "check_families",
    "check_patience_needs_best",
    "check_hub_model",
    "check_inputs",
    "did_you_mean",
    "merge_config",
    "parse_data_spec",
    "resolve_config",
    "validate_config",
]

DEFAULT_CONFIG: dict[str, Any] = {
    "model": {"name": "minilm", "num_labels": 2, "max_length": 48},
    "adapter": {
        "kind": "lora",
        "rank": 8,
        "alpha": 16.0,
        # the top half of MiniLM's layers: backward stops at the first adapted layer, which
        # halves a training step on CPU (all layers: target_modules = ["query", "value"]); with
        # another model.name and no target_modules of the user's, the model's attention query
        # and value projections, found by name (resolve_config)
        "target_modules": r"bert\.encoder\.layer\.[345]\.attention\.self\.(query|value)",
    },
    "prior_scale": 1.0,
    "data": {
        "train": "vader:movieReviewSnippets",
        "ood": ["vader:tweets", "chatterbot"],
        "num_train": 768,
        "num_val": 256,
        "num_test": 256,
        "num_ood": 192,
        "batch_size": 32,
        "seed": 0,
    },
    "families": ["map", "meanfield", "ivon", "kron-ivon", "swag", "laplace", "symmetrized"],
    # the stopping rule of every validated fit: stop after `patience` epochs without a better
    # validation NLL (0: never early; a family may wait longer, FAMILY_SETTINGS), `epochs` at
    # most, keeping the epoch of least NLL
    # keep: "best" (the epoch of least validation NLL, with early stopping) or "last" (every
    # fit runs `epochs` and keeps its last iterate; the validation split is not read by training)
    # patience 2, not 1: the 256-sentence validation NLL can rise for one epoch and fall again
    # (the suite's amazon task, seeds 0 and 2: one epoch of patience stopped the MAP at its 2nd
    # epoch, where its 4th has calibration NLL .033-.044 lower; polarity and fine-grained stop
    # at the same epoch under 1 and 3: benchmarks/results/suite/tune_*_map_patience.jsonl)
    "training": {
        "epochs": 12,
        "patience": 2,
        "keep": "best",
        "lr": 3e-3,
        "seed": 0,
        "device": "cpu",
    },
    "predict": {"num_samples": 6},
    "export": {"num_samples": 50, "num_batches": 2},
}

#: ``--quick``: the same job at a size that finishes in about two minutes on 2 CPU cores.
QUICK_OVERRIDES: dict[str, Any] = {
    "data": {"num_train": 256, "num_val": 64, "num_test": 64, "num_ood": 64},
    "training": {"epochs": 1},
    "predict": {"num_samples": 3},
    "export": {"num_samples": 10, "num_batches": 1},
}


def merge_config(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_config(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class ConfigError(ValueError):
    """A config that does not fit the schema: the message names the key path and the fix."""


#: Keys the pipeline reads that ``DEFAULT_CONFIG`` does not set, with their types (``None``
#: stands for any value of the listed types; ``float`` accepts integers too).
OPTIONAL_KEYS: dict[str, tuple[type, ...]] = {
    # pb.fit's learning-rate schedule ("cosine", "linear" or "constant"; unset: each family's
    # default) and its warm-up (steps or fraction)
    "training.scheduler": (str,),
    "training.warmup": (float,),
    # the LoRA-XS options adapter_from_dict passes on (LoRAXS's fields)
    "adapter.projection": (str,),
    "adapter.init_scale": (float,),
    "adapter.moment": (str,),
    "adapter.seed": (int,),
}
#: Keys whose value is a list; a single string is taken as a list of one.
LIST_KEYS: dict[str, type] = {"families": str, "data.ood": str}
#: Keys that take either a string or a list of strings.
STR_OR_LIST_KEYS = ("adapter.target_modules",)
#: Allowed values of string keys.
CHOICES: dict[str, tuple[str, ...]] = {
    "adapter.kind": ("lora_xs", "lora"),
    "adapter.projection": ("svd", "wsvd", "dct", "random"),
    "adapter.moment": ("centered", "second"),
    "training.scheduler": ("cosine", "linear", "constant"),
    "training.keep": ("best", "last"),
}
#: Smallest values of integer keys (a 0 batch size, length or count is never meant).
MINIMA: dict[str, int] = {
    # tokens per text, the tokenizer's special tokens ([CLS], [SEP]) included
    "model.max_length": 2,
    "model.num_labels": 2,
    "adapter.rank": 1,
    "data.batch_size": 1,
    "data.num_train": 1,
    # the validation split is tokenised for every run (it selects each fit's epoch)
    "data.num_val": 1,
    "data.num_test": 1,
    # (data.num_ood: at least 1 while data.ood names a set, _check_combinations)
    "training.epochs": 1,
    "training.patience": 0,
    "predict.num_samples": 1,
    "export.num_samples": 1,
    "export.num_batches": 1,
}
#: What a key of :data:`MINIMA` or :data:`LOWER_BOUNDS` means, said when its value is refused.
_MEANING: dict[str, str] = {
    "adapter.rank": "the adapter's rank r, e.g. 8",
    "adapter.alpha": "the adapter's scaling α, the update is scaled by α/r; e.g. 16.0",
    "adapter.init_scale": "the standard deviation of LoRA-XS's initial core entries, e.g. 1e-5",
    "data.num_val": "the validation split, which selects each fit's epoch and stops it early",
    "training.epochs": "the epoch cap of every fit, e.g. 12",
    "training.patience": (
        "epochs without a better validation NLL before a fit stops; 0 turns early stopping off"
    ),
    "training.lr": "the learning rate of every fit, e.g. 3e-3",
    "training.warmup": (
        "the learning-rate warm-up: a number of steps, an integer >= 1, or a fraction of the "
        "run below 1"
    ),
    "prior_scale": "the standard deviation of the Gaussian prior over the adapter, e.g. 1.0",
    "export.num_batches": "the test batches the ArviZ export posterior.nc covers",
}
#: Lower bounds of number keys: ``(bound, whether the bound itself is allowed)``.
LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "training.lr": (0.0, False),
    "training.warmup": (0.0, True),
    "prior_scale": (0.0, False),
    "adapter.alpha": (0.0, False),
    "adapter.init_scale": (0.0, True),
}
#: ``data.train`` / ``data.ood`` specs: ``vader:<domain>`` (labelled) or ``chatterbot`` (OOD).
KNOWN_DATA: tuple[str, ...] = (*(f"vader:{d}" for d in pbdata.VADER_DOMAINS), "chatterbot")
#: The class counts of a VADER training set: ``task="binary"`` and ``task="fine"``.
_VADER_NUM_LABELS = (2, 5)
#: LoRA-XS options that plain LoRA (``adapter.kind = "lora"``) does not take.
_LORA_XS_ONLY = ("projection", "init_scale", "moment", "seed")
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _schema() -> dict[str, Any]:
    """``DEFAULT_CONFIG``'s tree with each leaf replaced by its allowed types, plus
    :data:`OPTIONAL_KEYS` (a nested dict of tuples of types)."""

    def leaf(path: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: leaf(f"{path}.{k}" if path else k, v) for k, v in value.items()}
        if path in LIST_KEYS:
            return (list,)
        if path in STR_OR_LIST_KEYS:
            return (str, list)
        return (float,) if isinstance(value, float) else (type(value),)

    schema: dict[str, Any] = leaf("", DEFAULT_CONFIG)
    for path, types in OPTIONAL_KEYS.items():
        node = schema
        *parents, name = path.split(".")
        for part in parents:
            node = node[part]
        node[name] = types
    return schema


def _check_type(path: str, value: Any, types: tuple[type, ...]) -> None:
    ok = False
    for t in types:
        if t is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and not math.isfinite(float(value)):
                raise ConfigError(f"Config key {path!r} must be a finite number but got {value!r}.")
        elif t is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif t is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        else:
            ok = isinstance(value, t)
        if ok:
            break
    if not ok:
        expected = " or ".join(
            "a list of strings" if t is list else _TYPE_NAMES.get(t, t.__name__) for t in types
        )
        raise ConfigError(
            f"Config key {path!r} must be {expected} but got {value!r} ({type(value).__name__})."
        )
    if path in MINIMA and value < MINIMA[path]:
        meaning = f" ({_MEANING[path]})" if path in _MEANING else ""
        raise ConfigError(
            f"Config key {path!r}{meaning} must be an integer >= {MINIMA[path]} but got "
            f"{value!r}; it would otherwise be ignored or fail later. Set it in the config file."
        )
    if path in LOWER_BOUNDS:
        bound, inclusive = LOWER_BOUNDS[path]
        if value < bound or (value == bound and not inclusive):
            meaning = f" ({_MEANING[path]})" if path in _MEANING else ""
            raise ConfigError(
                f"Config key {path!r}{meaning} must be a number {'>=' if inclusive else '>'} "
                f"{bound:g} but got {value!r}. Set it in the config file."
            )
    check_choice(path, value, CHOICES)
    _check_value(path, value)


def check_choice(path: str, value: Any, choices: Mapping[str, Sequence[str]]) -> None:
    """Refuse a value of key ``path`` outside ``choices[path]`` (when the key has choices),
    naming the allowed values and the nearest one."""
    if path in choices and value not in choices[path]:
        raise ConfigError(
            f"Config key {path!r} must be one of {list(choices[path])} but got {value!r}"
            f"{did_you_mean(str(value), choices[path])}."
        )


def _check_value(path: str, value: Any) -> None:
    """The checks of single keys that bounds and choices do not express."""
    if path == "training.warmup" and value >= 1 and value != int(value):
        raise ConfigError(
            f"Config key 'training.warmup' ({_MEANING[path]}) got {value!r}, neither a whole "
            "number of steps nor a fraction below 1. Set it in the config file."
        )
    if path == "training.device":
        check_device(value, available=False)
    if path == "adapter.target_modules":
        check_target_modules(value, '["query", "value"]')
    if path in ("data.train", "data.ood"):
        for spec in [value] if isinstance(value, str) else value:
            parse_data_spec(spec, path)
        if path == "data.train" and value == "chatterbot":
            raise ConfigError(
                "Config key 'data.train' = 'chatterbot' names an unlabelled corpus (an OOD set); "
                "train on a labelled one: "
                f"{', '.join(repr(s) for s in KNOWN_DATA if s.startswith('vader:'))}."
            )


def parse_data_spec(spec: str, path: str | None = None) -> tuple[str, str]:
    """``("vader", domain)`` or ``("chatterbot", "")`` for a ``data.train`` / ``data.ood`` entry
    (the parser of the loader and of the config check).

    Raises
    ------
    ConfigError
        Any other spec (naming ``path``, the config key it came from, and the valid specs).
    """
    if spec == "chatterbot":
        return "chatterbot", ""
    if spec.startswith("vader:") and spec.split(":", 1)[1] in pbdata.VADER_DOMAINS:
        return "vader", spec.split(":", 1)[1]
    what = "an unknown VADER domain" if spec.startswith("vader:") else "not a data set of this job"
    where = f"Config key {path!r}: " if path else "Data spec "
    raise ConfigError(
        f"{where}{spec!r} is {what}{did_you_mean(spec, KNOWN_DATA)}. Use one of "
        f"{', '.join(repr(s) for s in KNOWN_DATA)} (files are not read; the VADER corpora and "
        "chatterbot-corpus are the job's data)."
    )


def did_you_mean(word: str, options: Sequence[str], prefix: str = "") -> str:
    """`` (did you mean '<prefix><nearest>'?)`` or nothing when no option is close."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {prefix + close[0]!r}?)" if close else ""


#: The section that makes a config the causal-LM job's (``pyrobayes.demo.causal_lm_config``).
_CAUSAL_LM_SECTION = "causal_lm"


def _causal_lm_hint(key: str) -> str:
    """What to say after an unknown top-level key of a demo config that looks meant for the
    causal-LM job (a misspelt ``[causal_lm]``, or its ``seeds`` list): the command line read
    the config as the demo's because it has no ``[causal_lm]`` section."""
    section = f"[{_CAUSAL_LM_SECTION}]"
    if key == "seeds":
        return (
            f" 'seeds' is a causal-LM job's key (a config with a {section} section); this "
            "config has none, so it runs the MiniLM demo, which fits one seed: set [training] "
            f"seed, or add the {section} section (docs/causal_lm.md, 'The job')."
        )
    squashed = re.sub(r"[\W_]", "", key.lower())
    near = difflib.get_close_matches(key.lower(), [_CAUSAL_LM_SECTION], n=1, cutoff=0.7)
    if squashed not in ("causallm", "causallms") and not near:
        return ""
    return (
        f" A causal-LM job is a config with a section named exactly {section} (and "
        f"[{_CAUSAL_LM_SECTION}.task]); this config has none, so it was read as the MiniLM "
        f"demo's. Name the section {section} (docs/causal_lm.md, 'The job')."
    )


def _validate(node: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> None:
    """Raise :class:`ConfigError` on the first unknown key or wrong type under ``node``."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key not in schema:
            valid = sorted(schema)
            hint = did_you_mean(str(key), valid, prefix)
            if prefix:
                raise ConfigError(
                    f"Unknown config key {path!r}{hint}. Valid keys in [{prefix[:-1]}]: "
                    f"{', '.join(valid)}."
                )
            raise ConfigError(
                f"Unknown config section {path!r}{hint}. Valid top-level keys: {', '.join(valid)}."
                f"{_causal_lm_hint(str(key))}"
            )
        expected = schema[key]
        if isinstance(expected, dict):
            if not isinstance(value, dict):
                raise ConfigError(
                    f"Config key {path!r} must be a table (a [{path}] section) with keys "
                    f"{', '.join(sorted(expected))}, but got {value!r}."
                )
            _validate(value, expected, f"{path}.")
        elif isinstance(value, dict):
            raise ConfigError(f"Config key {path!r} must be a value, not a table ({value!r}).")
        else:
            _check_type(path, value, expected)


def _normalize(user: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``user`` with a single string where a list is expected made a list of one."""
    user = copy.deepcopy(user)
    for path in LIST_KEYS:
        *parents, name = path.split(".")
        node: Any = user
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(name), str):
            node[name] = [node[name]]
    return user


def check_families(families: Sequence[str]) -> list[str]:
    """``families`` if every one is registered; otherwise a :class:`ConfigError` naming it."""
    known = available_guides()
    if not families:
        raise ConfigError(f"Config key 'families' is empty; choose some of {known}.")
    for family in families:
        if family not in known:
            raise ConfigError(
                f"Unknown family {family!r} in 'families'{did_you_mean(family, known)}. "
                f"Available: {', '.join(known)}."
            )
    repeated = sorted({f for f in families if list(families).count(f) > 1})
    if repeated:
        raise ConfigError(
            f"Config key 'families' names {', '.join(map(repr, repeated))} more than once: each "
            "family is fitted once per seed (its run folder and table row are keyed by name)."
        )
    return list(families)


def validate_config(config: dict[str, Any]) -> dict[str, Any]:
    """Check a (user or resolved) config against the schema derived from ``DEFAULT_CONFIG``.

    Parameters
    ----------
    config : dict
        Sections and keys as in ``DEFAULT_CONFIG`` (any subset), plus :data:`OPTIONAL_KEYS`.

    Returns
    -------
    dict
        ``config`` with single strings for list keys (``families = "map"``) made lists of one.

    Raises
    ------
    ConfigError
        An unknown key at any depth (naming its path and the nearest valid key), a wrong type,
        a value outside its bounds or choices (:data:`MINIMA`, :data:`LOWER_BOUNDS`,
        :data:`CHOICES`), an unknown data spec (:data:`KNOWN_DATA`), a device string torch does
        not parse, an unknown family, or keys that do not fit together (``model.num_labels``
        and a VADER ``data.train``, ``training.warmup`` without ``training.scheduler``). What
        the config names on this machine (the model, the device) is :func:`check_inputs`'s.
    """
    if not isinstance(config, dict):
        raise ConfigError(f"A config is a table of sections; got {type(config).__name__}.")
    config = _normalize(config)
    _validate(config, _schema())
    if "families" in config:
        check_families(config["families"])
    _check_adapter_options(config.get("adapter", {}))
    _check_combinations(merge_config(DEFAULT_CONFIG, config))
    return config


def _check_adapter_options(adapter: dict[str, Any]) -> None:
    """Refuse a LoRA-XS option under ``adapter.kind = "lora"`` (given, or the default kind when
    the config names none), and ``adapter.moment`` under a projection other than W-SVD's (the
    only one that reads it: it would be ignored)."""
    given = [k for k in _LORA_XS_ONLY if k in adapter]
    kind = adapter.get("kind", DEFAULT_CONFIG["adapter"]["kind"])
    if kind == "lora" and given:
        how = "" if "kind" in adapter else " (the default: the config sets no adapter.kind)"
        raise ConfigError(
            f"Config key 'adapter.{given[0]}' is a LoRA-XS option ({given[0]} = "
            f"{adapter[given[0]]!r}); adapter.kind = 'lora'{how} takes rank, alpha and "
            f'target_modules. Set kind = "lora_xs", or remove adapter.{given[0]}.'
        )
    projection = adapter.get("projection", "svd")
    if "moment" in adapter and projection != "wsvd":
        raise ConfigError(
            f"Config key 'adapter.moment' = {adapter['moment']!r} chooses the input statistics "
            f"of the W-SVD projection, but adapter.projection = {projection!r} reads none, so "
            'it would be ignored. Set projection = "wsvd", or remove adapter.moment.'
        )


def _check_combinations(config: dict[str, Any]) -> None:
    """The checks between keys of a full config (the user's keys over ``DEFAULT_CONFIG``)."""
    data, training = config["data"], config["training"]
    num_labels = config["model"]["num_labels"]
    if num_labels not in _VADER_NUM_LABELS:  # data.train is a VADER corpus (_check_value)
        raise ConfigError(
            f"Config key 'model.num_labels' = {num_labels!r} does not fit data.train = "
            f"{data['train']!r}: a VADER corpus has 2 classes (positive/negative) or 5 "
            "(fine-grained ratings). Set model.num_labels to 2 or 5."
        )
    _, domain = parse_data_spec(data["train"], "data.train")
    wanted = {k: data[k] for k in ("num_train", "num_val", "num_test")}
    if sum(wanted.values()) > pbdata.VADER_DOMAINS[domain]:
        raise ConfigError(
            f"Config keys {', '.join(f'data.{k} = {v}' for k, v in wanted.items())} ask for "
            f"{sum(wanted.values())} sentences, more than the {pbdata.VADER_DOMAINS[domain]} of "
            f"data.train = {data['train']!r}; make them smaller."
        )
    if data["ood"] and data["num_ood"] < 1:
        raise ConfigError(
            f"Config key 'data.num_ood' (sentences drawn from each OOD set) must be an integer "
            f">= 1 but got {data['num_ood']!r}; to score no OOD set, set data.ood = [] instead."
        )
    if training.get("warmup", 0) and "scheduler" not in training:
        raise ConfigError(
            f"Config key 'training.warmup' = {training['warmup']!r} needs 'training.scheduler' "
            f"(one of {list(CHOICES['training.scheduler'])}): the warm-up leads into a named "
            'learning-rate schedule. Set training.scheduler ("constant" keeps the rate after '
            "the warm-up) or remove training.warmup."
        )


def _offline() -> bool:
    """Whether the Hugging Face hub is off (``HF_HUB_OFFLINE``; the command line's default)."""
    flags = (os.environ.get(k, "") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(flag.strip().upper() in {"1", "ON", "YES", "TRUE"} for flag in flags)


def check_run_inputs(
    config_path: Path, checks: Callable[[], None], names: str = "the model"
) -> None:
    """Run ``checks``, a job's checks of what a run folder's ``config.json`` names on this
    machine (the model, its target modules, the device; a causal-LM job's task file), before
    anything is loaded, their refusal prefixed by ``config_path`` and what to do: a model moved
    since the run was reported by the loader (a hub message about repo ids, or the internet),
    and a run made on a GPU evaluated without one only after loading. ``names`` says what the
    config names besides the device, for the message.

    Raises
    ------
    ConfigError
        Naming ``config_path``, the key and where to set the new place.
    """
    try:
        checks()
    except ConfigError as err:
        moved = names.replace(", ", " or ")
        raise ConfigError(
            f"{config_path}: {err} (The run folder's config.json names {names} and the device "
            f"the run used: if {moved} has moved, write its new place into config.json; for "
            "another device, pass evaluate --device.)"
        ) from None


def check_inputs(config: dict[str, Any]) -> None:
    """Check what a valid config names on this machine, before anything is loaded.

    The model (``model.name``: ``"minilm"``, a folder that exists, or a Hugging Face id, which
    must be in the local cache while the hub is offline), the modules ``adapter.target_modules``
    names in it (on its skeleton, built from its config on the meta device: no weights are
    read), and the device (``training.device`` must be available).

    Raises
    ------
    ConfigError
        Naming the key, its value and what to do.
    """
    name = config["model"]["name"]
    if name != "minilm":
        _check_model_name(name)
    _check_target_modules(config)
    check_device(str(config["training"]["device"]))


def check_target_modules(value: str | list[str], example: str, regex: str = "") -> None:
    """Config key ``adapter.target_modules``: a regex that compiles, or a list naming modules
    (whether they are in the model is checked on the model).

    Parameters
    ----------
    value : str or list of str
    example : str
        A list of module names for the message (``'["query", "value"]'``).
    regex : str, optional
        A regex over the model's module paths for the message.

    Raises
    ------
    ConfigError
        An invalid regular expression, an empty one, an empty list or a blank name in it.
    """
    such = f" (e.g. {regex})" if regex else ""
    if isinstance(value, str) and value:
        try:
            re.compile(value)
        except re.error as err:
            raise ConfigError(
                f"Config key 'adapter.target_modules' = {value!r} is not a valid regular "
                f"expression ({err}); a string is a regex over full module paths{such}, a "
                f"list names modules (e.g. {example})."
            ) from None
        return
    if not value or not all(str(name).strip() for name in value):
        raise ConfigError(
            f"Config key 'adapter.target_modules' = {value!r} names no module; give the names "
            f"of the linear modules to adapt, e.g. {example}, or a regex over full module "
            f"paths{such}."
        )


def check_device(value: str, *, available: bool = True) -> None:
    """Config key ``training.device``: a device string torch reads, and (``available``) one this
    machine has.

    Raises
    ------
    ConfigError
        Naming the key, the value and what to use instead.
    """
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        hint = " (did you mean 'cuda'?)" if value.lower().startswith("gpu") else ""
        raise ConfigError(
            f"Config key 'training.device' must be a torch device such as 'cpu', 'cuda' "
            f"(an NVIDIA GPU), 'cuda:1' or 'mps' but got {value!r}{hint}."
        ) from None
    if not available:
        return
    if device.type == "cuda" and (
        not torch.cuda.is_available()
        or (device.index is not None and device.index >= torch.cuda.device_count())
    ):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ConfigError(
            f"Config key 'training.device' = {str(device)!r}, but this machine has {found} CUDA "
            'device(s) that torch can use; use device = "cpu" (or --device cpu).'
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            "Config key 'training.device' = 'mps', but MPS is not available on this machine; "
            'use device = "cpu" (or --device cpu).'
        )


def _check_target_modules(config: dict[str, Any]) -> None:
    """``adapter.target_modules`` must select some linear module of the configured network."""
    targets = config["adapter"].get("target_modules")
    if targets is None:
        return
    try:  # the skeleton only; what cannot be read here, the loader reports with its own error
        from transformers import AutoConfig, AutoModelForSequenceClassification

        name = config["model"]["name"]
        path = pbdata.minilm_path() if name == "minilm" else name
        model_config = AutoConfig.from_pretrained(path, num_labels=config["model"]["num_labels"])
        with torch.device("meta"):
            net = AutoModelForSequenceClassification.from_config(model_config)
    except (ImportError, OSError, ValueError, KeyError):
        return
    try:
        find_target_modules(net, targets)
    except ValueError as err:
        raise ConfigError(f"Config key 'adapter.target_modules': {err}") from None


def _check_model_name(name: str) -> None:
    """``model.name`` other than ``"minilm"``: a model folder, or a hub id it can load."""
    path = Path(name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"Config key 'model.name' = {name!r} is a folder without a config.json; give a "
                "folder saved by save_pretrained (or a Hugging Face model id)."
            )
        return
    check_hub_model(name, "model.name", 'name = "minilm"')


def check_hub_model(name: str, key: str, alternative: str, wanted: str = "config.json") -> None:
    """A model source that is not a folder: a valid Hugging Face model id, and (the hub being
    offline) one whose ``wanted`` file is in the local cache.

    Raises
    ------
    ConfigError
        Naming the config ``key``, the value and what to do (``alternative``: the setting that
        needs no download).
    """
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # transformers brings it; without it the load reports what is missing
        return
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ConfigError(
            f"Config key {key!r} = {name!r} is neither a model folder that exists nor a Hugging "
            f"Face model id ('name' or 'org/name'). Fix the path, or use {alternative}."
        ) from None
    if _offline() and not isinstance(try_to_load_from_cache(name, wanted), str):
        raise ConfigError(
            f"Config key {key!r} = {name!r} is not a folder, and as a Hugging Face model id it "
            "is not in the local cache while the hub is offline (HF_HUB_OFFLINE=1, the command "
            f"line's default). Download it once (HF_HUB_OFFLINE=0, or `hf download {name}`), or "
            "give the folder it was saved to."
        )


def resolve_config(user: dict[str, Any] | None = None, *, quick: bool = False) -> dict[str, Any]:
    """Defaults ← ``--quick`` overrides ← the user's config, validated.

    Parameters
    ----------
    user : dict, optional
        The user's sections (e.g. read from TOML); see :func:`validate_config`.
    quick : bool
        Apply :data:`QUICK_OVERRIDES` under the user's values.

    Returns
    -------
    dict
        The full config.

    Raises
    ------
    ConfigError
        See :func:`validate_config`.
    """
    user = validate_config(user or {})
    config = (
        merge_config(DEFAULT_CONFIG, QUICK_OVERRIDES) if quick else copy.deepcopy(DEFAULT_CONFIG)
    )
    if user.get("adapter", {}).get("kind") == "lora":  # drop the LoRA-XS defaults
        for key in _LORA_XS_ONLY:
            config["adapter"].pop(key, None)
    config = merge_config(config, user)
    if config["model"]["name"] != "minilm" and "target_modules" not in user.get("adapter", {}):
        del config["adapter"]["target_modules"]  # MiniLM's own paths: the attention's instead
    check_patience_needs_best(user, config)
    return config


def check_patience_needs_best(user: dict[str, Any], config: dict[str, Any]) -> None:
    """Refuse a ``training.patience`` the user set (> 0) under ``training.keep = "last"``,
    which reads no validation split, so the patience would be ignored."""
    patience = (user.get("training") or {}).get("patience")
    if patience and config["training"]["keep"] == "last":
        raise ConfigError(
            f"Config key 'training.patience' = {patience!r} is ignored under training.keep = "
            "'last': every fit then runs training.epochs and reads no validation split, so "
            'nothing can stop it early. Set keep = "best" (the epoch of least validation NLL, '
            "with early stopping) or remove training.patience."
        )
