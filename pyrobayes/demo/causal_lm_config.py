"""The causal-LM job's config: its defaults, the ``--quick`` overrides, and the checks of a
user's config (keys, types, bounds, choices, seeds, task fields) before anything runs.

:func:`resolve_config` merges defaults, ``--quick`` overrides and the user's sections, and
refuses a bad value naming its key, the value and the fix. What a config names on this machine
(the model folder, the target modules) is :func:`pyrobayes.demo.causal_lm.check_inputs`'s.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import string
from pathlib import Path
from typing import Any

from ..tasks import ADAPTERS, DEFAULT_TEMPLATE
from ..tasks.task import check_fractions
from .config import (
    CHOICES,
    OPTIONAL_KEYS,
    ConfigError,
    check_choice,
    check_device,
    check_families,
    check_patience_needs_best,
    check_target_modules,
    did_you_mean,
    merge_config,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CONFIG",
    "QUICK_OVERRIDES",
    "TINY_LLAMA",
    "is_causal_lm_config",
    "resolve_config",
]

#: ``causal_lm.model`` naming the config-built tiny LLaMA (tests, ``--quick``).
TINY_LLAMA = "tiny-llama"


DEFAULT_CONFIG: dict[str, Any] = {
    "causal_lm": {
        "model": TINY_LLAMA,
        "gguf_file": "",
        "dtype": "float32",
        # per-token mean log-likelihood: the default "none" (summed) starts training badly
        # over-confident on multi-token answers (issue 28: zero-shot NLL 5.4 on SmolLM2)
        "normalize": "length",
        # also score the validation split (the test split without one) zero-shot under every
        # normalize, from one forward per question, into normalize.json
        "compare_normalize": False,
        "max_length": 256,
        "padding_side": "left",
        "task": {
            "path": "",
            "format": "bigbench",
            # bigbench: list the choices after the question as BIG-bench's prompts do (where the
            # task file asks for them); the measured tables were made without (false)
            "append_choices": False,
            "adapter": "",
            "config": "",
            "template": DEFAULT_TEMPLATE,
            "question_key": "question",
            "choices_key": "choices",
            "answer_key": "answer",
            "fractions": [0.5, 0.1, 0.4],
            "split_seed": 0,
            "num_fewshot": 0,
            "batch_size": 4,
            "num_train": 0,
            "num_val": 0,
            "num_test": 0,
        },
    },
    # adapter.target_modules unset: the model's attention query / value projections, found by
    # name (q_proj/v_proj on LLaMA, query_key_value on GPT-NeoX, c_attn on GPT-2, ...)
    "adapter": {"kind": "lora", "rank": 8, "alpha": 16.0},
    "prior_scale": 1.0,
    "families": ["map", "laplace"],
    "seeds": [0],
    # keep = "last": every family runs `epochs` and keeps its last iterate, as Laplace-LoRA's
    # and BLoB's tables train (a BIG-bench validation split of 26 questions chose the wrong
    # epoch: docs/causal_lm.md, "Which epoch to keep"); "best" selects on validation NLL
    "training": {
        "epochs": 3,
        "patience": 0,
        "keep": "last",
        "lr": 1e-3,
        "seed": 0,
        "device": "cpu",
    },
    # samples_per_forward: posterior draws per forward in pb.predict (0: pb.predict's default
    # chunking); all S in one forward was 0.73x the default's time on SmolLM2 at S = 4
    "predict": {"num_samples": 8, "samples_per_forward": 0},
    "export": {"num_samples": 20, "num_batches": 1},
}


#: ``--quick``: the tiny LLaMA and at most 16 questions per split.
QUICK_OVERRIDES: dict[str, Any] = {
    "causal_lm": {
        "model": TINY_LLAMA,
        "gguf_file": "",
        "max_length": 128,
        "task": {"num_train": 16, "num_val": 8, "num_test": 16},
    },
    "training": {"epochs": 1},
    "predict": {"num_samples": 2},
    "export": {"num_samples": 4, "num_batches": 1},
}


#: the keys whose value is one of a few, and those values
LM_CHOICES = {
    "causal_lm.dtype": ("float32", "float64", "bfloat16", "float16"),
    "causal_lm.normalize": ("none", "length", "chars"),
    "causal_lm.padding_side": ("left", "right"),
    "causal_lm.task.format": ("bigbench", "json", "hf"),
    "adapter.kind": ("lora", "lora_xs"),
    "training.keep": ("best", "last"),
}


#: The keys the defaults leave unset, typed as the demo's (:data:`OPTIONAL_KEYS`).
_OPTIONAL = {
    "adapter.target_modules",
    "adapter.projection",
    "adapter.init_scale",
    "adapter.moment",
    "adapter.seed",
    "training.scheduler",
    "training.warmup",
}


_MINIMA = {
    "causal_lm.max_length": 2,
    "causal_lm.task.batch_size": 1,
    "causal_lm.task.split_seed": 0,
    "causal_lm.task.num_fewshot": 0,
    "causal_lm.task.num_train": 0,
    "causal_lm.task.num_val": 0,
    "causal_lm.task.num_test": 0,
    "training.epochs": 1,
    "training.patience": 0,
    "training.seed": 0,
    "predict.num_samples": 1,
    "predict.samples_per_forward": 0,
    "export.num_samples": 1,
    "export.num_batches": 1,
    "adapter.rank": 1,
}


#: Number keys that must be above a bound (not equal to it).
_ABOVE = {"training.lr": 0.0, "prior_scale": 0.0, "adapter.alpha": 0.0}


#: What a bounded key means, said when its value is refused.
_MEANING = {
    "causal_lm.task.num_train": "training questions to use; 0: the whole split",
    "causal_lm.task.num_val": "validation questions to use; 0: the whole split",
    "causal_lm.task.num_test": "test questions to use; 0: the whole split",
    "causal_lm.task.num_fewshot": "training examples put before each prompt; 0: zero-shot",
    "causal_lm.task.split_seed": "seeds the split permutation",
    "training.epochs": "the epoch cap of every fit, e.g. 3",
    "training.lr": "the learning rate of every fit, e.g. 1e-3",
    "prior_scale": "the standard deviation of the Gaussian prior over the adapter, e.g. 1.0",
    "adapter.alpha": "the adapter's scaling α, the update is scaled by α/r; e.g. 16.0",
    "predict.samples_per_forward": "posterior draws per forward; 0: pb.predict's chunking",
    "export.num_batches": "the test batches the ArviZ export posterior.nc covers",
}


def is_causal_lm_config(config: Any) -> bool:
    """Whether a (user or saved) config is this job's: it holds a ``[causal_lm]`` section."""
    return isinstance(config, dict) and "causal_lm" in config


def _check_value(path: str, value: Any, default: Any) -> None:
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(float(value))
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, list):
        kind = type(default[0]) if default else str
        kinds: tuple[type, ...] = (int, float) if kind is float else (kind,)
        ok = isinstance(value, list) and all(
            isinstance(v, kinds) and not isinstance(v, bool) for v in value
        )
    else:
        ok = isinstance(value, type(default))
    if not ok and isinstance(default, list) and isinstance(value, list):  # name the element
        wanted = type(default[0]).__name__ if default else "str"
        index, bad = next(
            (i, v) for i, v in enumerate(value) if not isinstance(v, kinds) or isinstance(v, bool)
        )
        raise ConfigError(
            f"Config key {path!r} must be a list of {wanted} like {default!r}, but "
            f"{path}[{index}] = {bad!r} is a {type(bad).__name__}; write it as {wanted} (e.g. "
            f"{default!r})."
        )
    if not ok:
        raise ConfigError(
            f"Config key {path!r} must be like {default!r} ({type(default).__name__}) but got "
            f"{value!r} ({type(value).__name__})."
        )
    check_choice(path, value, LM_CHOICES)
    meaning = f" ({_MEANING[path]})" if path in _MEANING else ""
    if path in _MINIMA and value < _MINIMA[path]:
        raise ConfigError(
            f"Config key {path!r}{meaning} must be >= {_MINIMA[path]} but got {value!r}. Set it "
            "in the config file."
        )
    if path in _ABOVE and not value > _ABOVE[path]:
        raise ConfigError(
            f"Config key {path!r}{meaning} must be > {_ABOVE[path]:g} but got {value!r}. Set it "
            "in the config file."
        )
    if path == "training.device":
        check_device(value)
    if path == "causal_lm.model" and not value.strip():
        raise ConfigError(
            f"Config key 'causal_lm.model' = {value!r} names no model; give a model folder saved "
            "by save_pretrained (or one holding causal_lm.gguf_file), a Hugging Face model id in "
            f"the local cache, or {TINY_LLAMA!r} (the config-built test model)."
        )


def _check_targets_key(value: Any) -> None:
    """``adapter.target_modules``: a regex or a list of module names (unset: the attention's)."""
    if not isinstance(value, (str, list)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(
            f"Config key 'adapter.target_modules' must be a string (a regex over full module "
            f'paths) or a list of module names like ["q_proj", "v_proj"], but got {value!r}; '
            "leave it out to adapt the model's attention query and value projections."
        )
    check_target_modules(
        value, '["q_proj", "v_proj"]', r"'model\.layers\.\d+\.self_attn\.(q_proj|v_proj)'"
    )


def _check_optional(path: str, value: Any) -> None:
    """The keys the defaults leave unset (:data:`_OPTIONAL`): the demo's types and choices."""
    if path == "adapter.target_modules":
        _check_targets_key(value)
        return
    types = OPTIONAL_KEYS[path]
    ok = any(
        isinstance(value, (int, float)) and math.isfinite(value)
        if t is float
        else isinstance(value, t)
        for t in types
    ) and not isinstance(value, bool)
    if not ok:
        names = " or ".join("a number" if t is float else t.__name__ for t in types)
        raise ConfigError(f"Config key {path!r} must be {names} but got {value!r}.")
    if path in CHOICES and value not in CHOICES[path]:
        raise ConfigError(
            f"Config key {path!r} must be one of {list(CHOICES[path])} but got {value!r}"
            f"{did_you_mean(str(value), CHOICES[path])}."
        )
    if path in ("training.warmup", "adapter.init_scale") and value < 0:
        raise ConfigError(f"Config key {path!r} must be >= 0 but got {value!r}.")
    if path == "adapter.seed" and value < 0:
        raise ConfigError(
            f"Config key 'adapter.seed' (seeds LoRA-XS's random projection) must be an integer "
            f">= 0 but got {value!r}."
        )


def validate_keys(node: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> None:
    """Refuse a key of ``node`` that ``defaults`` lacks (naming the nearest valid one) or a value
    of another type, outside its bounds or its choices (:class:`ConfigError`)."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if path in _OPTIONAL:
            _check_optional(path, value)
            continue
        if key not in defaults:
            valid = sorted(defaults)
            where = f"[{prefix[:-1]}]" if prefix else "the top level"
            raise ConfigError(
                f"Unknown causal-LM config key {path!r}{did_you_mean(str(key), valid, prefix)}. "
                f"Valid keys in {where}: {', '.join(valid)}."
            )
        default = defaults[key]
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise ConfigError(f"Config key {path!r} must be a table ([{path}]), got {value!r}.")
            validate_keys(value, default, f"{path}.")
        else:
            _check_value(path, value, default)


def resolve_config(user: dict[str, Any] | None = None, *, quick: bool = False) -> dict[str, Any]:
    """Defaults ← ``--quick`` overrides ← the user's config, validated.

    Parameters
    ----------
    user : dict, optional
        The user's sections (see the module docstring).
    quick : bool
        Apply :data:`QUICK_OVERRIDES` over the user's values (the tiny LLaMA, small splits); a
        logged warning lists the values of the user's it replaces.

    Returns
    -------
    dict
        The full config.

    Raises
    ------
    ConfigError
        An unknown key (named with its path and the nearest valid one), a wrong type or value
        (a count below its minimum, a learning rate or prior scale <= 0, an unknown scheduler,
        a device torch cannot read or this machine lacks), an unknown family, no seeds or a
        seed listed twice, a ``training.seed`` (the job runs its ``seeds`` list), an empty
        ``causal_lm.model``, no task path, fractions that do not sum to 1 or give the train or
        test split a share of 0, a template with a stray brace or a positional field (``{}``),
        an empty or invalid ``adapter.target_modules``, a LoRA-XS option (``projection``,
        ``init_scale``, ``moment``, ``seed``) under ``adapter.kind = "lora"``, ``projection =
        "wsvd"`` or ``moment`` (the job collects no input statistics), ``adapter.seed`` but
        for ``projection = "random"`` (the one that reads it), ``dtype = "float16"`` (fits
        overflow), or ``keep = "best"`` with no validation split. What the config names on
        this machine (model, task file, target modules) is :func:`check_inputs`'s.
    """
    user = copy.deepcopy(user or {})
    if isinstance(user.get("families"), str):
        user["families"] = [user["families"]]
    validate_keys(user, DEFAULT_CONFIG)
    config = merge_config(DEFAULT_CONFIG, user)
    if quick:
        replaced = _replaced(user, QUICK_OVERRIDES)
        if replaced:
            logger.warning(
                "--quick replaces the config's %s (the tiny LLaMA, at most 16 questions per "
                "split, 1 epoch); run without --quick for the configured job.",
                ", ".join(replaced),
            )
        config = merge_config(config, QUICK_OVERRIDES)
    check_families(config["families"])
    check_patience_needs_best(user, config)
    _check_no_training_seed(user)
    seeds = config["seeds"]
    if not seeds:
        raise ConfigError("Config key 'seeds' is empty; give at least one seed, e.g. [0].")
    if any(s < 0 for s in seeds):
        raise ConfigError(f"Config key 'seeds' = {seeds!r} holds a negative seed; use seeds >= 0.")
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ConfigError(
            f"Config key 'seeds' = {seeds!r} lists seed(s) {repeated} more than once: the same "
            "run would be fitted twice and counted as two seeds. Give each seed once."
        )
    lm, spec = config["causal_lm"], config["causal_lm"]["task"]
    if not spec["path"]:
        raise ConfigError(
            "Config key 'causal_lm.task.path' is empty: name the task (a BIG-bench task.json, a "
            "JSON/JSONL file, or a Hugging Face dataset folder or id)."
        )
    if lm["dtype"] == "float16":
        raise ConfigError(
            "Config key 'causal_lm.dtype' = 'float16' cannot fit: the adapter's gradients and "
            "the loss overflow float16's range (the fit's loss goes NaN at its first step). Use "
            'dtype = "bfloat16" (as little memory, with float32 range) or "float32".'
        )
    if lm["gguf_file"] and lm["model"] == TINY_LLAMA:
        raise ConfigError(
            f"Config key 'causal_lm.gguf_file' = {lm['gguf_file']!r} names a file in a model "
            f"folder, but causal_lm.model = {TINY_LLAMA!r} is built from a config; set "
            "causal_lm.model to the folder holding the GGUF file, or remove gguf_file."
        )
    _check_splits(user, config)
    _check_adapter(config["adapter"])
    return config


def _check_splits(user: dict[str, Any], config: dict[str, Any]) -> None:
    """Refuse fractions that are not three shares summing to 1, the task keys of
    :func:`_check_task`, and (a task file, which the fractions split) a share of 0 for a split
    the job needs: train (the fits, the few-shot examples) and test (the table), and validation
    under ``keep = "best"``. The sizes a nonzero share gives depend on the file (the load's)."""
    spec = config["causal_lm"]["task"]
    try:
        fractions = check_fractions(spec["fractions"])
    except ValueError:
        raise ConfigError(
            f"Config key 'causal_lm.task.fractions' must be three numbers in [0, 1] summing to "
            f"1 (train, validation, test) but got {spec['fractions']!r}."
        ) from None
    _check_task(user, spec)
    if spec["format"] == "hf":  # a dataset keeps its own splits
        return
    empty = [
        split for split, share in zip(("train", "test"), fractions[::2], strict=True) if share == 0
    ]
    if empty:
        fewshot = spec["num_fewshot"] if "train" in empty else 0
        raise ConfigError(
            f"Config key 'causal_lm.task.fractions' = {spec['fractions']!r} (train, validation, "
            f"test) gives the {' and '.join(empty)} split no questions, but the job fits on the "
            "train split"
            + (f" (and causal_lm.task.num_fewshot = {fewshot} draws from it)" if fewshot else "")
            + " and reports on the test split. Give both a share, e.g. fractions = "
            "[0.5, 0.1, 0.4]."
        )
    if config["training"]["keep"] == "best" and fractions[1] == 0:
        raise ConfigError(
            "Config key 'training.keep' = 'best' selects each fit's epoch on the validation "
            f"split, but causal_lm.task.fractions = {spec['fractions']!r} gives it no questions. "
            'Give the validation split a share (e.g. [0.5, 0.1, 0.4]) or set keep = "last".'
        )


#: The adapter keys only LoRA-XS (``adapter.kind = "lora_xs"``) reads; LoRA takes none of them.
_LORA_XS_ONLY = ("projection", "init_scale", "moment", "seed")


def _check_adapter(adapter: dict[str, Any]) -> None:
    """Refuse a LoRA-XS option (:data:`_LORA_XS_ONLY`) under ``adapter.kind = "lora"`` (the
    default), which takes rank, alpha and target_modules only; LoRA-XS's W-SVD projection and
    its ``moment``, which need input moments the job does not collect; and ``seed`` under a
    projection that draws nothing (only ``"random"`` reads it)."""
    if adapter["kind"] != "lora":
        if adapter.get("projection") == "wsvd":  # the job gives the adapter no input moments
            raise ConfigError(
                "Config key 'adapter.projection' = 'wsvd' needs input statistics of the adapted "
                "layers (calibration_data), which the causal-LM job does not collect; it would "
                'fail after the model loads. Use projection = "svd" (the default).'
            )
        if "moment" in adapter:
            raise ConfigError(
                f"Config key 'adapter.moment' = {adapter['moment']!r} chooses the input "
                "statistics of LoRA-XS's W-SVD projection (projection = 'wsvd'), which the "
                "causal-LM job does not offer (it collects no input statistics of the adapted "
                "layers), so it would be ignored. Remove adapter.moment; the MiniLM demo's "
                "config (no [causal_lm] section) takes projection = 'wsvd' with moment."
            )
        projection = adapter.get("projection", "svd")
        if "seed" in adapter and projection != "random":
            raise ConfigError(
                f"Config key 'adapter.seed' = {adapter['seed']!r} seeds LoRA-XS's random "
                f"projection, but adapter.projection = {projection!r} draws nothing, so it "
                'would be ignored. Set projection = "random", or remove adapter.seed.'
            )
        return
    for key in _LORA_XS_ONLY:
        if key in adapter:
            raise ConfigError(
                f"Config key 'adapter.{key}' = {adapter[key]!r} is a LoRA-XS option, read only "
                "with adapter.kind = 'lora_xs'; adapter.kind = 'lora' takes rank, alpha and "
                f'target_modules. Set kind = "lora_xs", or remove adapter.{key}.'
            )


#: The task keys only some formats read, and those formats; every other key is read by all.
_FORMAT_KEYS = {
    "append_choices": ("bigbench",),
    "fractions": ("bigbench", "json"),
    "template": ("json",),
    "question_key": ("json",),
    "choices_key": ("json",),
    "answer_key": ("json",),
    "adapter": ("hf",),
    "config": ("hf",),
}


def _check_task(user: dict[str, Any], spec: dict[str, Any]) -> None:
    """Refuse a task key the user set that the chosen format does not read (it would be
    ignored), an ``hf`` task without a known dataset adapter, and a json template that
    ``str.format`` cannot read."""
    fmt = spec["format"]
    given = ((user.get("causal_lm") or {}).get("task")) or {}
    for key, value in given.items():
        formats = _FORMAT_KEYS.get(key, (fmt,))
        if fmt in formats or value == "":  # "" (adapter, config): unset
            continue
        reads = sorted(k for k in spec if fmt in _FORMAT_KEYS.get(k, (fmt,)))
        raise ConfigError(
            f"Config key 'causal_lm.task.{key}' = {value!r} is not read with causal_lm.task."
            f"format = {fmt!r} (only with format {' or '.join(map(repr, formats))}), so it "
            f"would be ignored. Format {fmt!r} reads the task keys {', '.join(reads)}. Remove "
            f"{key}, or set the format that reads it."
        )
    if fmt == "hf" and spec["adapter"] not in ADAPTERS:
        raise ConfigError(
            f"Config key 'causal_lm.task.adapter' = {spec['adapter']!r}"
            f"{did_you_mean(spec['adapter'], sorted(ADAPTERS))}: format = 'hf' reads a "
            f"dataset's rows through an adapter, one of {sorted(ADAPTERS)}; set adapter to the "
            "dataset's."
        )
    if fmt == "json":
        _check_template(spec["template"])


def _check_template(template: str) -> None:
    """Config key ``causal_lm.task.template`` (format json): a ``str.format`` template whose
    fields are named (each record fills it by name; whether a name is a record field is known
    only from the file).

    Raises
    ------
    ConfigError
        A stray brace, or a positional field (``{}``, ``{0}``, ``{[0]}``), which no record fills.
    """
    try:
        positional = _positional_fields(template)
    except ValueError as err:
        raise ConfigError(
            f"Config key 'causal_lm.task.template' = {template!r} is not a str.format template "
            f"({err}); fields are {{question}} or another record field, and a literal brace is "
            "written '{{' or '}}'."
        ) from None
    if positional:
        raise ConfigError(
            f"Config key 'causal_lm.task.template' = {template!r} has the positional field "
            f"{positional[0]!r}, but each record fills the template by field name, so nothing "
            "fills it. Name the field: {question} (the record's causal_lm.task.question_key "
            'field) or another record field, e.g. template = "Question: {question}\\nAnswer:"; '
            "write a literal brace as '{{' or '}}'."
        )


def _positional_fields(template: str) -> list[str]:
    """The replacement fields of ``template`` (those nested in a format spec too) that
    ``str.format`` reads as positional arguments, each as written (``"{}"``, ``"{0.x}"``)."""
    found = []
    for _, name, spec, _ in string.Formatter().parse(template):
        if name is None:
            continue
        head = re.split(r"[.\[]", name, maxsplit=1)[0]
        if not head or head.isdecimal():
            found.append("{" + name + "}")
        if spec:
            found += _positional_fields(spec)
    return found


def _check_no_training_seed(user: dict[str, Any]) -> None:
    """Refuse a ``training.seed`` the user set: the job fits each seed of its ``seeds`` list
    (the run sets ``training.seed`` to that seed per fit), so the key would be ignored."""
    training = user.get("training") or {}
    if "seed" in training:
        raise ConfigError(
            f"Config key 'training.seed' = {training['seed']!r} is ignored by a causal-LM job: "
            "it fits every seed of the top-level 'seeds' list (e.g. seeds = "
            f"[{training['seed']!r}], or --seeds on the command line). Remove training.seed and "
            "list the seed(s) in 'seeds'."
        )


def differing_keys(
    user: dict[str, Any], overrides: dict[str, Any], prefix: str = ""
) -> list[tuple[str, Any, Any]]:
    """``(dotted key, user's value, override's value)`` for every key both nested dicts set,
    to other values."""
    out: list[tuple[str, Any, Any]] = []
    for key, value in overrides.items():
        if key not in user:
            continue
        if isinstance(value, dict):
            if isinstance(user[key], dict):
                out += differing_keys(user[key], value, f"{prefix}{key}.")
        elif user[key] != value:
            out.append((f"{prefix}{key}", user[key], value))
    return out


def _replaced(user: dict[str, Any], overrides: dict[str, Any]) -> list[str]:
    """``"key = user's value -> override"`` for every key the user set that ``overrides``
    changes."""
    return [f"{k} = {mine!r} -> {theirs!r}" for k, mine, theirs in differing_keys(user, overrides)]


def expand_path(path: str) -> str:
    """``~`` in a configured path is the user's home (a hub id has none and is unchanged)."""
    return str(Path(path).expanduser()) if path.startswith("~") else path
