r"""The causal-LM multiple-choice job: the Laplace-LoRA / BLoB table for one model and one task.

Laplace-LoRA (Yang et al. 2024, "Bayesian low-rank adaptation for large language models") and BLoB
(Wang et al. 2024, "BLoB: Bayesian low-rank adaptation by backpropagation for large language
models") fine-tune LoRA on a causal LM for multiple-choice tasks and report accuracy, ECE and NLL
per method. This job does the same for every configured posterior family, over several seeds,
with a zero-shot row (the base network, no adapter) first. A config (TOML, read by
``pyrobayes fit``) holds a ``[causal_lm]`` section (that section marks it as this job) and::

    [causal_lm]            model (a folder, a hub id in the local cache, or "tiny-llama": a
                           config-built two-layer LLaMA with a byte-level tokenizer; ``~`` is
                           the home folder), gguf_file, dtype, normalize, compare_normalize,
                           max_length, padding_side
    [causal_lm.task]       path, format ("bigbench", "json" or "hf"), append_choices
                           (bigbench), adapter and config (hf), template and field names
                           (json), fractions (bigbench, json), split_seed, num_fewshot,
                           batch_size, num_train / num_val / num_test (0: all of the split)
    [adapter]              kind ("lora" or "lora_xs"), rank, alpha, target_modules (unset: the
                           model's attention query / value projections, found by name); LoRA-XS
                           also projection ("svd", "dct", "random"), init_scale and seed
                           (the random projection's; the same bases for every job seed)
    families, seeds        the families (as LM_FAMILY_SETTINGS, else the demo's
                           FAMILY_SETTINGS, run them) and seeds
    [training] [predict] [export]   as in the demo; predict.samples_per_forward (0: pb.predict's
                           default chunking)

and writes::

    <run>/config.json      the resolved config
    <run>/normalize.json   with compare_normalize: the base network's validation metrics under
                           each normalize (compare_normalize())
    <run>/metrics.json     one record per (family, seed), the zero-shot row first
    <run>/table.md         mean ± sample standard deviation over the seeds per family
    <run>/guides/<family>-seed<seed>.safetensors
    <run>/posterior.nc     ArviZ export of the first Bayesian family
    <run>/plots/reliability_<family>-seed<seed>.png, compare.png

The splits come from ``task.split_seed`` alone, so every seed sees the same test questions; a
seed sets the adapter's initialisation and the fit's randomness. ``--quick`` swaps in the tiny
LLaMA and at most 16 questions per split (the tests run it), with a logged warning naming the
configured values it replaces (:data:`QUICK_OVERRIDES`).

Config mistakes are :class:`~pyrobayes.demo.config.ConfigError` naming the key:
:func:`resolve_config` checks the schema, bounds and combinations, :func:`check_inputs` what the
config names on this machine (before :func:`run` writes the folder); a run that fails before its
first result (an error, or an interrupt: Ctrl-C) removes what it wrote, so the same command
runs it again in that folder.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .. import metrics as pbmetrics
from ..api import posterior
from ..calibration import fit_temperature, tempered_nll
from ..infer.loop import fit
from ..infer.options import Progress
from ..infer.signorm import SigmaNormDiversity
from ..io import load, save
from ..models import FineTuneModel, MultipleChoice
from ..models.accounting import count_parameters
from ..models.adapters import adapter_from_dict, find_target_modules
from ..models.sharing import block_stack, prefix_shared_logits, sharing_enabled
from ..models.signorm import SigmaNorm, is_norm
from ..predictive import Prediction, predict
from ..rng import seed_forked
from ..tasks import (
    MultipleChoiceTask,
    read_bigbench,
    read_hf_dataset,
    read_json_examples,
)
from .causal_lm_config import (
    DEFAULT_CONFIG,
    LM_CHOICES,
    QUICK_OVERRIDES,
    TINY_LLAMA,
    expand_path,
    is_causal_lm_config,
    resolve_config,
    validate_keys,
)
from .config import (
    ConfigError,
    check_device,
    check_families,
    check_hub_model,
    check_run_inputs,
)
from .pipeline import (
    FAMILY_SETTINGS,
    FittedRun,
    RunFolderError,
    compare_metrics,
    comparison_plot,
    export_posterior,
    fit_options,
    fit_record,
    read_json,
    reliability_plot,
    uses_validation,
)
from .run_folder import claim_run_folder, claimed_run_folder, remove_unfinished_run, write_json

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CONFIG",
    "QUICK_OVERRIDES",
    "is_causal_lm_config",
    "resolve_config",
    "check_inputs",
    "run",
    "evaluate",
    "compare",
    "format_table",
    "TINY_LLAMA",
    "LM_FAMILY_SETTINGS",
    "compare_normalize",
]


def check_inputs(config: dict[str, Any]) -> None:
    """Check what a resolved config names on this machine, before a run folder is written.

    The model (``"tiny-llama"``, a folder that exists, or a Hugging Face id, which must be in
    the local cache while the hub is offline; with ``gguf_file``, that file in the folder), the
    modules ``adapter.target_modules`` names in it (on its skeleton, built from its config on
    the meta device: no weights are read) and the device. The task is read after the run folder
    is claimed (:func:`run` removes what it wrote when that fails).

    Raises
    ------
    ConfigError
        Naming the key, its value and what to do.
    """
    lm = config["causal_lm"]
    if config["training"]["device"] is not None:
        check_device(str(config["training"]["device"]))
    if lm["model"] != TINY_LLAMA:
        _check_model(lm["model"], lm["gguf_file"])
    skeleton = _skeleton(config)
    if skeleton is not None:
        _check_targets(config, skeleton)


def _check_model(name: str, gguf_file: str) -> None:
    """``causal_lm.model`` other than the tiny LLaMA: a model folder, or a hub id it can load."""
    path = Path(expand_path(name))
    if path.is_dir():
        if gguf_file and not (path / gguf_file).is_file():
            raise ConfigError(
                f"Config key 'causal_lm.gguf_file' = {gguf_file!r} is not a file in the model "
                f"folder {str(path)!r}; name one of its .gguf files "
                f"({sorted(p.name for p in path.glob('*.gguf'))})."
            )
        if not gguf_file and not (path / "config.json").is_file():
            raise ConfigError(
                f"Config key 'causal_lm.model' = {name!r} is a folder without a config.json; "
                "give a folder saved by save_pretrained (or set gguf_file for a GGUF folder)."
            )
        return
    looks_like_path = name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name
    if looks_like_path:
        raise ConfigError(
            f"Config key 'causal_lm.model' = {name!r}: the folder {str(path)!r} does not exist. "
            f"Fix the path (a folder saved by save_pretrained), or use model = {TINY_LLAMA!r}."
        )
    check_hub_model(name, "causal_lm.model", f"model = {TINY_LLAMA!r}", gguf_file or "config.json")


def _skeleton(config: dict[str, Any]) -> torch.nn.Module | None:
    """The configured network's modules without its weights (None where its config cannot be
    read here: the load reports that)."""
    lm = config["causal_lm"]
    if lm["model"] == TINY_LLAMA:
        return _tiny_llama()[0]
    if lm["gguf_file"]:
        return None
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        model_config = AutoConfig.from_pretrained(expand_path(lm["model"]))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(model_config)
    except (ImportError, OSError, ValueError, KeyError):
        return None


def _check_targets(config: dict[str, Any], net: torch.nn.Module) -> None:
    """``adapter.target_modules`` must select some linear module of ``net``."""
    try:
        find_target_modules(net, config["adapter"].get("target_modules"))
    except ValueError as err:
        raise ConfigError(f"Config key 'adapter.target_modules': {err}") from None


# ------------------------------------------------------------------------------- model, task


def _tiny_llama() -> tuple[torch.nn.Module, Any]:
    """A two-layer LLaMA from a config (seeded: the same weights in every process) and the
    byte-level ByT5 tokenizer, which needs no files (vocabulary 384 covers its ids)."""
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        seed_forked(0)  # the CPU's only: the model is built there (no GPU's generator moves)
        config = LlamaConfig(
            vocab_size=384,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=0,
        )
        net = LlamaForCausalLM(config)
    return net, ByT5Tokenizer()


def load_base(config: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The base causal LM (eval mode, in ``causal_lm.dtype``) and its tokenizer."""
    lm = config["causal_lm"]
    if lm["model"] == TINY_LLAMA:
        net, tokenizer = _tiny_llama()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        extra = {"gguf_file": lm["gguf_file"]} if lm["gguf_file"] else {}
        source = expand_path(lm["model"])
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
        net = AutoModelForCausalLM.from_pretrained(source, **extra)
        if getattr(tokenizer, "pad_token_id", None) is None:
            tokenizer.pad_token = tokenizer.eos_token
    return net.to(getattr(torch, lm["dtype"])).eval(), tokenizer


def check_task_path(spec: dict[str, Any]) -> None:
    """Config key ``causal_lm.task.path``: a file (bigbench, json) or a path-like dataset
    folder (hf) that exists; an hf hub id is the load's to find.

    Raises
    ------
    ConfigError
        Naming the key, the path and what it should name.
    """
    path, fmt = expand_path(spec["path"]), spec["format"]
    looks_like_path = path.startswith(("/", ".")) or Path(path).suffix in (".json", ".jsonl")
    if (fmt != "hf" or looks_like_path) and not Path(path).exists():
        raise ConfigError(
            f"Config key 'causal_lm.task.path' = {spec['path']!r}: {path} does not exist. Name "
            + (
                "the task file (a BIG-bench task.json)"
                if fmt == "bigbench"
                else "the task file (JSON/JSONL)"
                if fmt == "json"
                else "a folder written by DatasetDict.save_to_disk, or a hub id"
            )
            + "."
        )


def load_task(config: dict[str, Any]) -> MultipleChoiceTask:
    """The configured task, split (a file: by ``split_seed``; a dataset: its own splits)."""
    spec = config["causal_lm"]["task"]
    path, fmt = expand_path(spec["path"]), spec["format"]
    options = {"name": Path(path).stem or path, "num_fewshot": int(spec["num_fewshot"])}
    check_task_path(spec)
    if fmt == "hf":
        if not spec["adapter"]:
            raise ConfigError("causal_lm.task.format = 'hf' needs causal_lm.task.adapter.")
        splits = read_hf_dataset(path, spec["adapter"], config=spec["config"] or None)
        for split in ("train", "test"):
            if not splits.get(split):
                raise ConfigError(
                    f"causal_lm.task.path = {spec['path']!r}: the dataset's {split!r} split is "
                    f"{'missing' if split not in splits else 'empty or unlabelled'} (Winogrande's "
                    "test split, for one, has no answers: its rows are skipped). The job needs "
                    "labelled 'train' and 'test' splits; save a DatasetDict whose 'test' split "
                    "holds labelled rows (e.g. its validation split)."
                )
        return MultipleChoiceTask.from_splits(splits, seed=int(spec["split_seed"]), **options)
    if fmt == "bigbench":
        # true: the choices listed as BIG-bench lists them (where the task file asks for them)
        append = None if spec.get("append_choices", False) else False  # absent: older configs
        examples = read_bigbench(path, append_choices=append)
    else:
        examples = read_json_examples(
            path,
            template=spec["template"],
            question_key=spec["question_key"],
            choices_key=spec["choices_key"],
            answer_key=spec["answer_key"],
        )
    return MultipleChoiceTask.from_examples(
        examples,
        fractions=spec["fractions"],
        split_seed=int(spec["split_seed"]),
        seed=int(spec["split_seed"]),
        **options,
    )


def build_data(config: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Encoded batches ``train``, ``val`` (None when empty), ``test`` and ``num_train``.

    A split smaller than its configured ``num_*`` is used whole, with a logged warning naming
    the sizes asked for and found; an empty training or test split is refused. Questions cut
    by ``max_length`` are counted in one logged warning."""
    task = load_task(config)
    spec, lm = config["causal_lm"]["task"], config["causal_lm"]
    kwargs = {"max_length": int(lm["max_length"]), "padding_side": lm["padding_side"]}
    keys = {"train": "num_train", "validation": "num_val", "test": "num_test"}
    sizes = {split: len(task.splits[split]) for split in keys}
    empty = [split for split in ("train", "test") if not sizes[split]]
    if empty:
        raise ConfigError(
            f"task {task.name!r}: the {' and '.join(empty)} split(s) would be empty (the task "
            f"has {len(task)} questions: {sizes['train']} train, {sizes['validation']} "
            f"validation, {sizes['test']} test); give causal_lm.task.fractions larger train and "
            "test shares or a larger task."
        )
    short = [
        f"{key} = {spec[key]} but the {split} split has {sizes[split]}"
        for split, key in keys.items()
        if spec[key] > sizes[split]
    ]
    if short:
        logger.warning(
            "causal-LM job: task %r is smaller than asked: %s (%d questions, fractions %s); "
            "those splits are used whole.",
            task.name,
            "; ".join(short),
            len(task),
            spec["fractions"],
        )

    def batches(split: str, limit: int) -> list[dict[str, torch.Tensor]] | None:
        if not task.splits[split]:
            return None
        return task.encode(
            tokenizer,
            split,
            batch_size=int(spec["batch_size"]),
            limit=int(limit) or None,
            **kwargs,
        )

    train, test = batches("train", spec["num_train"]), batches("test", spec["num_test"])
    val = batches("validation", spec["num_val"])
    assert train is not None and test is not None  # (the splits are not empty)
    cut = {split: t for split, t in task.truncation.items() if t["truncated"]}
    if cut:
        logger.warning(
            "causal-LM job: questions longer than causal_lm.max_length = %d tokens lose prompt "
            "tokens from the left: %s. Raise max_length to keep them whole.",
            lm["max_length"],
            "; ".join(
                f"{split} {int(t['truncated'])} of {int(t['questions'])} (up to "
                f"{int(t['max_tokens'])} tokens, mean {t['mean_tokens']:.1f})"
                for split, t in cut.items()
            ),
        )
    num_train = sum(int(b["labels"].shape[0]) for b in train)
    return {"train": train, "val": val, "test": test, "num_train": num_train}


#: The causal-LM recipes: fit settings that differ from the demo's ``FAMILY_SETTINGS`` (same
#: keys; a family not listed runs the demo's settings, its MiniLM-specific adapter dropped).
#:
#: * ``ivon`` is the demo's (IVON-LoRA's h0 = 1e-3, ess = 1e7, clip 1e-3 and unrescaled step at
#:   α = 0.3; Cong et al. 2024), first chosen here on the five-choice sentiment task's
#:   validation split (seed 0, best of four epochs): NLL 1.489 against 1.583 for the previous
#:   recipe (α = 0.3, h0 = 10, ess = N, rescaled), which under-trained (−2.5 to −5.9 pp against
#:   MAP); α = 1 over-shot (1.572 after one epoch, rising); h0 = 1e-3 with ``rescale_lr`` left
#:   the network where it started (docs/causal_lm.md, ``benchmarks/lm_ivon_recipes.py``).
LM_FAMILY_SETTINGS: dict[str, dict[str, Any]] = {
    # as measured in docs/causal_lm.md: both LoRA factors latent, sd 1e-3 (the demo's
    # mean-field, A latent at 1e-2, was chosen on the MiniLM tasks and is not measured on LMs)
    "meanfield": {"options": {"init_scale": 1e-3}},
    # as measured in docs/causal_lm.md: over the adapter with one τ (the MiniLM demo's head
    # made latent with a τ per site has no head to cover here: the LM head stays frozen)
    "laplace": {"init": "map", "epochs": 0},
    # σN-ensemble (Lopez-Gonzalez et al. 2025) on a decoder: M = 4 members, each with its own
    # RMSNorm scales/shifts in the blocks that hold an adapted module (member_norm_paths; the
    # blocks below stay shared, the LM head frozen), the LoRA factors shared; the demo's
    # diversity weight λ = 0.01
    "signorm": {
        "adapter": lambda adapter, net: SigmaNorm(
            num_members=4,
            norm_modules=member_norm_paths(net, adapter.target_modules),
            heads=[],
            adapter=adapter,
        ),
        "optimizer": SigmaNormDiversity(strength=0.01),
    },
}


def _settings(family: str) -> dict[str, Any]:
    """The fit settings of ``family`` in this job: :data:`LM_FAMILY_SETTINGS`, else the demo's
    (its MiniLM-specific adapter transform dropped; this job's own, an ``adapter`` callable
    ``(adapter, net) -> adapter``, is applied by :func:`build_model`)."""
    settings = LM_FAMILY_SETTINGS.get(family, FAMILY_SETTINGS.get(family, {}))
    return {k: v for k, v in settings.items() if k != "adapter"}


def member_norm_paths(
    net: torch.nn.Module, target_modules: Sequence[str] | str | None
) -> list[str]:
    """The norm layers (LLaMA's ``RMSNorm``) inside the decoder blocks that hold a module of
    ``target_modules``: the σN members' own layers in this job. The blocks below the first
    adapted one keep their pretrained norms, so they stay shared by every member (one backward
    stop, one lower pass per batch), and so does the final norm under the frozen head."""
    adapted = find_target_modules(net, target_modules)
    blocks = block_stack(net, adapted) if adapted else None  # the stack holding the adapters
    if blocks is None:
        raise ValueError(
            f"signorm: {type(net).__name__} has no stack of decoder blocks holding the adapted "
            f"modules to place member norm layers in; fit pyrobayes.models.SigmaNorm("
            "norm_modules=...) with pyrobayes.fit."
        )
    stack = next(name for name, module in net.named_modules() if module is blocks)
    names = [name for name, _ in blocks.named_children()]  # (an nn.Sequential's may be words)
    held = {p[len(stack) + 1 :].split(".", 1)[0] for p in adapted if p.startswith(stack + ".")}
    indices = [i for i, name in enumerate(names) if name in held]
    paths = [
        f"{stack}.{names[i]}.{name}"
        for i in indices
        for name, module in blocks[i].named_modules()
        if name and is_norm(module)
    ]
    if not paths:
        raise ValueError(
            f"signorm: no norm layer inside the decoder blocks of adapter.target_modules="
            f"{target_modules!r} (blocks {indices} of {stack}); adapt modules inside blocks "
            "that hold RMSNorm/LayerNorm layers."
        )
    return paths


def build_model(
    config: dict[str, Any],
    base: torch.nn.Module,
    num_data: int,
    seed: int,
    family: str | None = None,
) -> Any:
    """A copy of ``base`` with the configured adapter (initialised under ``seed``), replaced by
    ``family``'s own where :data:`LM_FAMILY_SETTINGS` gives an ``adapter`` callable (σN: member
    norm layers around it, :func:`member_norm_paths`)."""
    torch.manual_seed(seed)
    adapter: Any = adapter_from_dict(dict(config["adapter"]))
    transform = LM_FAMILY_SETTINGS.get(family or "", {}).get("adapter")
    if transform is not None:
        adapter = transform(adapter, base)
    return FineTuneModel(
        copy.deepcopy(base),
        adapter,
        likelihood=MultipleChoice(normalize=config["causal_lm"]["normalize"]),
        prior_scale=float(config["prior_scale"]),
        num_data=num_data,
        trainable_modules=[],
    )


def _metrics(pred: Any) -> dict[str, float]:
    """Accuracy, NLL, ECE, Brier, and the ECE a calibrated predictor with these confidences
    would show on this many questions (``ece_floor``: about .09 on the 103 and 148 test
    questions of docs/causal_lm.md's BIG-bench tasks)."""
    result = pbmetrics.report(pred, pred.targets)
    floor, _ = pbmetrics.ece_floor(pred.probs)
    return {
        **{k: float(result[k]) for k in ("accuracy", "nll", "ece", "brier")},
        "ece_floor": floor,
    }


def _summed_scores(
    config: dict[str, Any], base: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The base network's summed continuation log-likelihoods ``(N, K)`` (``normalize="none"``;
    a padded choice ``-inf``), each choice's tokens and characters ``(N, K)`` and the targets.

    Each prompt runs once and its K choices are scored from its key/value cache
    (:func:`~pyrobayes.models.sharing.prefix_shared_logits`; the K full rows where that does
    not apply), as ``pb.predict`` scores them."""
    likelihood = MultipleChoice(normalize="none")
    device = config["training"]["device"]
    net = base.to(device)
    parts: dict[str, list[torch.Tensor]] = {"scores": [], "tokens": [], "chars": [], "labels": []}
    with torch.no_grad():
        for batch in batches:
            inputs = {k: v.to(device) for k, v in batch.items() if k != "labels"}
            output = prefix_shared_logits(net, likelihood, inputs) if sharing_enabled() else None
            if output is None:
                output = net(**likelihood.network_inputs(inputs, net)).logits
            parts["scores"].append(likelihood.params(output, inputs).double().cpu())
            parts["tokens"].append(batch["continuation_mask"].sum(-1).double())
            parts["chars"].append(batch["continuation_chars"].double())
            parts["labels"].append(batch["labels"])
    width = max(t.shape[-1] for t in parts["scores"])  # batches may differ in K

    def cat(key: str, value: float) -> torch.Tensor:
        pad = torch.nn.functional.pad
        return torch.cat([pad(t, (0, width - t.shape[-1]), value=value) for t in parts[key]])

    return {
        "scores": cat("scores", -math.inf),
        "tokens": cat("tokens", 1.0),
        "chars": cat("chars", 1.0),
        "labels": torch.cat(parts["labels"]),
    }


def _normalized(summed: dict[str, torch.Tensor], normalize: str) -> Prediction:
    scores = summed["scores"]
    if normalize == "length":
        scores = scores / summed["tokens"]
    elif normalize == "chars":
        scores = scores / summed["chars"].clamp_min(1)
    log_probs = torch.log_softmax(scores, -1)
    return Prediction(log_probs=log_probs[None], targets=summed["labels"])


def zero_shot(config: dict[str, Any], base: torch.nn.Module, data: Any) -> tuple[dict, Prediction]:
    """The base network's metrics on the test split (no adapter, no training)."""
    pred = _normalized(_summed_scores(config, base, data["test"]), config["causal_lm"]["normalize"])
    return _metrics(pred), pred


def compare_normalize(
    config: dict[str, Any], base: torch.nn.Module, batches: Sequence[dict[str, torch.Tensor]]
) -> dict[str, dict[str, float]]:
    """The base network's accuracy, NLL, ECE and Brier under each ``normalize``, from one forward.

    The three scores of a choice are one summed log-likelihood divided by 1, by its token count
    or by its character count (lm-evaluation-harness's ``acc`` and ``acc_norm``, Gao et al.
    2021), so one forward per question gives all three.

    Parameters
    ----------
    config : dict
        A resolved config (its device).
    base : torch.nn.Module
        The base causal LM.
    batches : sequence of dict
        Encoded multiple-choice batches (e.g. the validation split's).

    Returns
    -------
    dict
        ``{"none": metrics, "length": metrics, "chars": metrics}``; besides accuracy, NLL, ECE
        and Brier each holds ``temperature``, the T that minimises the NLL of
        ``softmax(scores / T)`` on these questions (Guo et al. 2017), and
        ``nll_at_temperature``: how well the scores rank the choices once their scale is
        fitted (``normalize`` changes both the ranking and the scale).
    """
    summed = _summed_scores(config, base, batches)
    out = {}
    for normalize in LM_CHOICES["causal_lm.normalize"]:
        pred = _normalized(summed, normalize)
        t = fit_temperature(pred, bounds=(0.01, 100.0))
        nll_t = float(tempered_nll(pred, summed["labels"], t))
        out[normalize] = {**_metrics(pred), "temperature": t, "nll_at_temperature": nll_t}
    return out


def _guide_path(out: Path, family: str, seed: int) -> Path:
    return out / "guides" / f"{family}-seed{seed}.safetensors"


def _fit_one(
    config: dict[str, Any],
    family: str,
    seed: int,
    base: torch.nn.Module,
    data: dict[str, Any],
    fitted: dict[str, FittedRun],
    progress_bar: bool,
) -> tuple[Any, Any, Any]:
    """``family`` under ``seed`` (post-hoc families from that seed's fitted ``init`` run)."""
    settings = _settings(family)
    cap = int(config["training"]["epochs"])
    model = build_model(config, base, data["num_train"], seed, family)
    epochs = int(settings.get("epochs", cap))
    validate = bool(settings.get("validate", True))
    source = settings.get("init")
    init = None
    if source in fitted:
        init = fitted[source].guide
    elif source is not None:  # that run is not in the job: the family fits its own MAP stage
        epochs, validate, source = cap + epochs, True, None
    if config["training"]["device"] is not None:  # fit runs where the model is
        model.to(config["training"]["device"])
    guide = posterior(model, family, init=init, **settings.get("options", {}))
    run_config = {**config, "training": {**config["training"], "seed": seed}}
    keep = config["training"]["keep"]
    start = time.perf_counter()
    result = fit(
        model,
        guide,
        data["train"],
        epochs=epochs,
        lr=float(settings.get("lr", config["training"]["lr"])),
        seed=seed,
        **fit_options(
            run_config,
            settings,
            data["val"]
            if uses_validation(settings.get("optimizer"), epochs, validate, keep)
            else None,
        ),
        progress=Progress(bar=progress_bar),
    )
    seconds = time.perf_counter() - start + (fitted[source].seconds if source else 0.0)
    fitted[family] = FittedRun(guide, {}, seconds, source, epochs)
    return model, guide, result


def run(
    config: dict[str, Any],
    out_dir: str | Path,
    *,
    progress_bar: bool = True,
    overwrite: bool = False,
) -> list[dict[str, Any]]:
    """Fit every family under every seed, evaluate, and write the run folder.

    Parameters
    ----------
    config : dict
        A resolved config (:func:`resolve_config`).
    out_dir : path
        The run folder.
    progress_bar : bool
        Show the fits' progress bars.
    overwrite : bool
        Replace a run already in ``out_dir`` (its files are removed first); without it such a
        folder is refused (``RunFolderError``) before the model is loaded.

    What the config names on this machine is checked (:func:`check_inputs`) before the folder
    is written. A run that fails or is interrupted (Ctrl-C) before its first result (a task
    file that cannot be read, a fit that diverges at once) removes the files it wrote, so the
    folder takes the same or the corrected run without ``overwrite``; one that fails or is
    interrupted later keeps its records and logs a warning naming those and the (family, seed)
    fits it did not reach. A run killed before its first result (SIGKILL), which leaves its
    ``config.json``, is taken over by a run of the same config
    (:func:`~pyrobayes.demo.run_folder.claim_run_folder`). The job holds ``out_dir``'s lock
    until it returns (:func:`~pyrobayes.demo.run_folder.claimed_run_folder`): another run
    started there meanwhile is refused (``RunFolderError``).

    Returns
    -------
    list of dict
        The records of ``metrics.json``: the zero-shot row, then one per (family, seed).
    """
    out = Path(out_dir)
    if not overwrite:  # refuse another run's folder before anything is checked or loaded
        claim_run_folder(out, overwrite, config=config)
    check_inputs(config)
    with claimed_run_folder(out, overwrite, config=config) as made:  # held until it ends
        write_json(out / "config.json", config)
        try:
            return _run(config, out, progress_bar)
        except BaseException as err:  # an interrupt too: say what the folder holds
            if (out / "metrics.json").exists():
                _log_partial_run(out, config, err)
            else:  # failed or interrupted before any result: leave no run behind
                remove_unfinished_run(out, made, "causal-LM job", err)
            raise


def _log_partial_run(out: Path, config: dict[str, Any], err: BaseException) -> None:
    """Log (WARNING) what a job that stopped after its first result left in ``out``: the
    (family, seed) records of ``metrics.json``, the one it stopped at and those never fitted
    (the folder has no ``table.md``; its ``config.json`` lists every family and seed)."""
    try:
        records = json.loads((out / "metrics.json").read_text())
        done = {(r["family"], r.get("seed")) for r in records}
    except (OSError, ValueError, TypeError, KeyError):
        done = set()
    wanted = [(f, int(s)) for s in config["seeds"] for f in config["families"]]
    fitted = [f"{f}@seed{s}" for f, s in wanted if (f, s) in done]
    left = [f"{f}@seed{s}" for f, s in wanted if (f, s) not in done]
    logger.warning(
        "causal-LM job stopped at %s (%s): %s/metrics.json holds %s; not fitted: %s. Evaluate "
        "or join what was fitted, fit the rest in another folder (pyrobayes fit CONFIG --seeds "
        "S --out NEW) and join it, or run the job again with --overwrite.",
        left[0] if left else "the table",
        f"{type(err).__name__}: {err}" if str(err) else type(err).__name__,
        out,
        ", ".join(fitted) or "no fitted family",
        ", ".join(left) or "none",
    )


def _run(config: dict[str, Any], out: Path, progress_bar: bool) -> list[dict[str, Any]]:
    """:func:`run` in a claimed folder holding the config."""
    base, tokenizer = load_base(config)
    _check_targets(config, base)
    data = build_data(config, tokenizer)
    if config["training"]["keep"] == "best" and data["val"] is None:
        raise ConfigError(
            "Config key 'training.keep' = 'best' selects each fit's epoch on the validation "
            f"split, but task {config['causal_lm']['task']['path']!r} has an empty validation "
            'split; give it one (causal_lm.task.fractions) or set keep = "last".'
        )
    num_samples = int(config["predict"]["num_samples"])
    device = config["training"]["device"]
    if config["causal_lm"]["compare_normalize"]:
        scored = data["val"] or data["test"]
        normalized = compare_normalize(config, base, scored)
        split = "validation" if data["val"] else "test"
        (out / "normalize.json").write_text(json.dumps({"split": split, **normalized}, indent=2))
        logger.info("causal-LM job: zero-shot %s metrics per normalize: %s", split, normalized)
    metrics, pred = zero_shot(config, base, data)
    records: list[dict[str, Any]] = [{"family": "zero-shot", "seed": None, **metrics}]
    mean_probs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if pred.targets is not None:
        mean_probs["zero-shot"] = (pred.mean_probs.detach(), pred.targets)
    reliability_plot(out, "zero-shot", pred)
    exported = False
    for seed in config["seeds"]:
        fitted: dict[str, FittedRun] = {}
        for family in config["families"]:
            logger.info("causal-LM job: %s, seed %d", family, seed)
            model, guide, result = _fit_one(config, family, seed, base, data, fitted, progress_bar)
            pred = predict(
                model,
                guide,
                data["test"],
                num_samples=num_samples,
                seed=0,
                device=device,
                samples_per_forward=int(config["predict"]["samples_per_forward"]) or None,
            )
            record = {
                **fit_record(family, guide, result, _metrics(pred), fitted[family]),
                "seed": seed,
            }
            records.append(record)
            save(guide, _guide_path(out, family, seed), extra={"metrics": record})
            reliability_plot(out, f"{family}-seed{seed}", pred)
            if seed == config["seeds"][0] and pred.targets is not None:
                mean_probs[family] = (pred.mean_probs.detach().cpu(), pred.targets)
            if not exported and not guide.is_deterministic:
                loaders = {"test": data["test"]}
                exported = export_posterior(out, model, guide, loaders, config, result.losses)
            write_json(out / "metrics.json", records)
    write_json(out / "metrics.json", records)
    (out / "table.md").write_text(format_table(records))
    first = [r for r in records if r["seed"] in (None, config["seeds"][0])]
    comparison_plot(out, first, mean_probs)
    return records


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """The Laplace-LoRA / BLoB table: per family, accuracy, ECE, NLL (and Brier) as mean ±
    sample standard deviation over its seeds (the value alone for one seed), and the ECE floor
    (:func:`pyrobayes.metrics.ece_floor`: what a calibrated predictor with the same confidences
    scores on this test split; an ECE near it is calibrated as far as the split can tell)."""
    order: list[str] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["family"] not in groups:
            order.append(r["family"])
            groups[r["family"]] = []
        groups[r["family"]].append(r)
    cols = [("accuracy", "acc ↑"), ("ece", "ECE ↓"), ("nll", "NLL ↓"), ("brier", "Brier ↓")]
    if all("ece_floor" in r for r in records):  # (records of runs before it was recorded)
        cols.insert(2, ("ece_floor", "ECE floor"))
    lines = [
        "| method | " + " | ".join(c[1] for c in cols) + " | seeds | fit s |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for family in order:
        rows = groups[family]
        cells = []
        for key, _ in cols:
            values = torch.tensor([float(r[key]) for r in rows], dtype=torch.float64)
            text = f"{float(values.mean()):.3f}"
            if len(rows) > 1:
                text += f" ± {float(values.std(unbiased=True)):.3f}"
            cells.append(text)
        seconds = [float(r["fit_seconds"]) for r in rows if "fit_seconds" in r]
        fit_s = f"{sum(seconds) / len(seconds):.1f}" if seconds else "–"
        name = family + (f" (from {rows[0]['init']})" if rows[0].get("init") else "")
        seeds = "–" if rows[0].get("seed") is None else str(len(rows))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {seeds} | {fit_s} |")
    return "\n".join(lines) + "\n"


def evaluate(run_dir: str | Path, *, device: str | None = None) -> list[dict[str, Any]]:
    """Reload a causal-LM run folder's posteriors and recompute every record's metrics.

    Raises
    ------
    RunFolderError
        No ``config.json`` or no saved posteriors.
    """
    run_dir = Path(run_dir)
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise RunFolderError(f"{run_dir} has no config.json; is it a pyrobayes run folder?")
    config = read_json(config_path)
    try:  # a hand-edited config.json: its keys and families checked as a new config's are
        validate_keys(config, DEFAULT_CONFIG)
        check_families(config["families"])
    except ConfigError as err:
        raise ConfigError(f"{config_path}: {err}") from None
    if device:
        check_device(device)
        config["training"]["device"] = device
    paths = sorted((run_dir / "guides").glob("*-seed*.safetensors"))
    if not paths:
        raise RunFolderError(f"{run_dir} has no saved posteriors (guides/*-seed*.safetensors).")

    def checks() -> None:
        check_inputs(config)
        check_task_path(config["causal_lm"]["task"])

    check_run_inputs(config_path, checks, names="the model, the task file")
    base, tokenizer = load_base(config)
    data = build_data(config, tokenizer)
    metrics, _ = zero_shot(config, base, data)
    records: list[dict[str, Any]] = [{"family": "zero-shot", "seed": None, **metrics}]
    wanted = [(f, s) for s in config["seeds"] for f in config["families"]]
    for family, seed in wanted:
        path = _guide_path(run_dir, family, seed)
        if not path.is_file():
            logger.warning(
                "evaluate: %s@seed%d is in %s's families and seeds but has no saved posterior "
                "(%s); skipped.",
                family,
                seed,
                config_path.name,
                path.relative_to(run_dir).as_posix(),
            )
            continue
        model = build_model(config, base, data["num_train"], seed, family)
        guide = load(path, model)
        pred = predict(
            model,
            guide,
            data["test"],
            num_samples=int(config["predict"]["num_samples"]),
            seed=0,
            device=config["training"]["device"],
            samples_per_forward=int(config["predict"]["samples_per_forward"]) or None,
        )
        counts = count_parameters(guide)
        records.append(
            {
                "family": family,
                "seed": seed,
                **_metrics(pred),
                "trainable_parameters": counts.get("trainable", 0),
                "posterior_parameters": counts.get("posterior_storage", 0),
            }
        )
    return records


def compare(
    saved: Sequence[dict[str, Any]], recomputed: Sequence[dict[str, Any]], *, tolerance: float
) -> list[str]:
    """:func:`~pyrobayes.demo.pipeline.compare_metrics` per (family, seed)."""

    def keyed(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            {
                **r,
                "family": r["family"]
                if r.get("seed") is None
                else f"{r['family']}@seed{r['seed']}",
            }
            for r in records
        ]

    # a record without its posterior, named by the file the run writes (compare_metrics would
    # name "guides/<family>@seed<seed>.safetensors")
    have = {(r["family"], r.get("seed")) for r in recomputed}
    missing = [
        r for r in saved if r.get("seed") is not None and (r["family"], r["seed"]) not in have
    ]
    drifts = [
        f"{r['family']}@seed{r['seed']}: in metrics.json but not recomputed: no saved posterior "
        f"({_guide_path(Path(), r['family'], r['seed']).as_posix()}), or not among "
        "config.json's families and seeds"
        for r in missing
    ]
    kept = [r for r in saved if r not in missing]
    return drifts + compare_metrics(keyed(kept), keyed(recomputed), tolerance=tolerance)
