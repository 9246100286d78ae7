"""What a resumed fit must share with the run that wrote its checkpoint.

A checkpoint restores the run's optimizer, schedule, selection history and random streams; a
resume under other settings would carry on with the old ones without a word. The run record
(``state.json``'s ``run``) holds what can be compared before anything is restored: the
objective's, optimizer's and scheduler's classes and plain settings, the schedule's kind and
warm-up, ``select_by``, the seed and a record of the training data
(:func:`~pyrobayes.infer.data_record.training_data_record`); beside it the validation data's
fingerprint (:func:`~pyrobayes.infer.selection.data_fingerprint`), the rate, the schedule's
length and the budget. :class:`ResumeChecks` (a base of the fit loop) refuses every difference
by name, with both values, before the fitter begins.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyro
import torch

from .checkpoint import check_checkpoint, check_fitter_state, check_posterior, latest
from .data_record import describe_difference, training_data_record
from .distributed import world
from .selection import Selection, data_fingerprint

logger = logging.getLogger(__name__)

__all__ = [
    "ResumeChecks",
    "budget_text",
    "find_rate_source",
    "qualified_name",
    "record_objective",
    "record_scheduler",
]

#: Optimizer param-group keys a resume may change or that schedules move (the rate is checked
#: on its own, with its own message; SWAG's ``swa_lr``, which its SWALR adds to the groups
#: part-way through the run, with the fit's settings record).
_RATE_KEYS = frozenset({"params", "lr", "initial_lr", "swa_lr"})
#: The run record's keys and what they are, for the refusal's message.
_RUN_KEYS = {
    "objective": "objective (class, settings)",
    "optimizer": "optimizer (class, per-group settings)",
    "schedule": "learning-rate schedule (kind, warm-up fraction)",
    "scheduler": "learning-rate scheduler (class, settings)",
    "select_by": "validation criterion (select_by)",
    "seed": "seed",
}
#: The records of ``[class, settings]`` and what to call them in a refusal.
_CLASS_RECORDS = {
    "objective": "objective",
    "optimizer": "optimizer",
    "scheduler": "learning-rate scheduler",
}
#: Public attributes of an objective that move while it runs (Pyro's ELBO guesses its
#: ``max_plate_nesting`` at its first call; MAP keeps its last evaluation's prior constant):
#: not settings a resume compares.
_MOVING = frozenset({"max_plate_nesting", "max_iarange_nesting", "prior_constant"})
#: A scheduler's ``state_dict`` entries that are its progress (or the base rate, checked on its
#: own), not its settings.
_PROGRESS = frozenset(
    {
        "last_epoch",
        "_step_count",
        "_last_lr",
        "_get_lr_called_within_step",
        "_is_initial",
        "verbose",
        "base_lrs",
        "T_cur",
    }
)


def _plain(value: Any) -> bool:
    """Whether ``value`` is a JSON scalar or a tuple/list of them (an optimizer setting)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def qualified_name(obj: Any) -> Any:
    """A schedule or optimizer named for the record: a string as it is, else its qualified name."""
    if obj is None or isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"


def _shown(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


def record_objective(objective: Any) -> list[Any]:
    """The objective's class and plain public settings (``num_particles``, ``kl_weight``, ...):
    a Pyro ELBO's own for the wrapper that runs it. Taken when the fit builds it, before a
    step moves anything."""
    inner = getattr(objective, "elbo", None)
    if isinstance(inner, pyro.infer.ELBO):
        objective = inner
    attributes = getattr(objective, "__dict__", {})
    settings = {
        k: v
        for k, v in sorted(attributes.items())
        if not k.startswith("_") and k not in _MOVING and _plain(v)
    }
    return [qualified_name(type(objective)), settings]


def _settings_of(state: dict[str, Any]) -> dict[str, Any]:
    """The plain settings in a scheduler's ``state_dict`` (nested ones, such as a
    ``SequentialLR``'s schedulers, too), its progress left out."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key in _PROGRESS:
            continue
        if isinstance(value, dict):
            out[key] = _settings_of(value)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out[key] = [_settings_of(v) for v in value]
        elif _plain(value):
            out[key] = value
    return out


def record_scheduler(scheduler: Any) -> list[Any] | None:
    """The built scheduler's class and settings (``StepLR``'s ``step_size`` and ``gamma``, ...):
    a factory's name alone (``<lambda>``) does not tell two schedules apart."""
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    return [qualified_name(type(scheduler)), _settings_of(state if isinstance(state, dict) else {})]


def _comparable(key: str, then: Any, now: Any) -> tuple[Any, Any]:
    """The run record's entry ``key`` from a checkpoint (``then``) and from this fit (``now``)
    as compared: an optimizer's groups without the keys schedules move, and an objective's or
    scheduler's settings only where both records have them (a library update that adds a
    setting is not another run)."""
    if key == "optimizer" and isinstance(then, list) and len(then) == 2:
        then = [then[0], [{k: v for k, v in g.items() if k not in _RATE_KEYS} for g in then[1]]]
    if key in ("objective", "scheduler") and then is not None and now is not None:
        if then[0] == now[0]:
            common = set(then[1]) & set(now[1])
            then = [then[0], {k: v for k, v in then[1].items() if k in common}]
            now = [now[0], {k: v for k, v in now[1].items() if k in common}]
    return then, now


def _first_difference(key: str, meaning: str, then: Any, now: Any) -> tuple[str, Any, Any]:
    """What a refusal names of two differing ``[class, settings]`` records: the classes, or
    the first setting that differs (``meaning``, ``then`` and ``now`` as they are otherwise)."""
    noun = _CLASS_RECORDS.get(key)
    if noun is None or then is None or now is None:
        return meaning, then, now
    if then[0] != now[0]:
        return noun, then[0], now[0]
    a, b = then[1], now[1]
    if isinstance(a, dict) and isinstance(b, dict):
        a, b = [a], [b]
    if len(a) != len(b):
        return meaning, then, now
    return next(
        (f"{noun} setting {k!r}", x.get(k), y.get(k))
        for x, y in zip(a, b, strict=True)
        for k in sorted({*x, *y})
        if x.get(k) != y.get(k)
    )


def budget_text(epochs: Any, num_steps: Any) -> str:
    """A step budget as ``fit`` takes it: ``epochs=4``, ``optim=Optimization(num_steps=5)``
    or both."""
    parts = [] if epochs is None else [f"epochs={epochs}"]
    if num_steps is not None:
        parts.append(f"optim=Optimization(num_steps={num_steps})")
    return ", ".join(parts) or "no budget"


def find_rate_source(spec: Any) -> tuple[str, str] | None:
    """Where the fit's rate comes from when not from ``fit(lr=...)``, and how to give it
    another (a format string of ``lr``): an optimizer built by the caller (an instance or a
    factory) or a settings record's ``lr``. ``None``: ``fit``'s ``lr`` (or the family's
    default)."""
    if spec is None or isinstance(spec, type):
        return None
    if isinstance(spec, torch.optim.Optimizer) or callable(spec):
        return (
            "the optimizer passed (Optimization(optimizer=...))",
            "build that optimizer with lr={lr}",
        )
    if getattr(spec, "lr", None) is not None:
        name = type(spec).__name__
        return f"{name}(lr=...)", f"pass {name}(..., lr={{lr}})"
    return None


def _describe(fingerprint: dict[str, Any] | None) -> str:
    if fingerprint is None:
        return "none"
    examples = fingerprint.get("examples_sha256")
    return (
        f"{fingerprint['batches']} batches, {fingerprint['examples']} examples, targets "
        f"sha256 {fingerprint['targets_sha256'][:12]}"
        + (f", examples sha256 {examples[:12]}" if examples else "")
    )


class ResumeChecks:
    """The fit loop's checks of a checkpoint against this fit (a base of ``loop._Loop``,
    which sets the attributes below), and the run record it writes."""

    model: Any
    guide: Any
    data: Any
    fitter: Any
    sched: Any
    plan: Any
    lr: float
    seed: int | None
    selection: Selection | None
    ckpt: Path | None
    resume: bool
    rate_source: tuple[str, str] | None
    objective_record: list[Any]
    schedule_record: list[Any] | None
    scheduler_record: list[Any] | None

    def _val_fingerprint(self) -> dict[str, Any] | None:
        if self.selection is None:
            return None
        if not hasattr(self, "_fingerprint"):
            self._fingerprint = data_fingerprint(self.selection.data, self.model)
        return self._fingerprint

    def _data_record(self) -> dict[str, Any] | None:
        if not hasattr(self, "_training_record"):  # under torch.distributed each rank has its
            # own shard while rank 0's record is the one saved: nothing to compare
            sharded = world()[0] > 1
            self._training_record = None if sharded else training_data_record(self.data)
        return self._training_record

    def _checked_resume(self) -> Path | None:
        """The checkpoint to resume from (``None``: a new fit), with every refusal of the
        resume made before anything is restored or reset: another family first
        (:func:`~pyrobayes.infer.checkpoint.check_checkpoint`, with the position and the
        schedule), a posterior that would not load into the guide and model
        (:func:`~pyrobayes.infer.checkpoint.check_posterior`), the fitter's settings record
        and optimizer groups (:func:`~pyrobayes.infer.checkpoint.check_fitter_state`),
        then the validation data, the budget, the rate, the training data and the run's
        settings."""
        found = latest(self.ckpt) if self.resume and self.ckpt is not None else None
        if found is None:
            if self.resume:  # a job that always resumes starts so; a mistyped folder too
                logger.info("resume: no checkpoint in %s; starting a new fit there", self.ckpt)
            return None
        meta = check_checkpoint(
            found, self.guide, self.sched, steps_per_epoch=self.plan.steps_per_epoch
        )
        check_posterior(found, self.guide, self.model)  # (another adapter rank, guide shape)
        check_fitter_state(found, self.fitter)  # (its settings, its optimizer's groups)
        self._check_validation(meta, found)
        self._check_budget(meta, found)
        self._check_rate(meta, found)
        self._check_training_data(meta, found)
        # this fit's record: taken before the checkpoint's optimizer state overwrites its own
        self._check_run(meta, found, self._run_record())
        return found

    def _check_budget(self, meta: dict[str, Any], found: Path) -> None:
        """Refuse a resume from a checkpoint past this fit's budget (``epochs``,
        ``num_steps``): the fit would take no step and return the longer run's state as the
        one asked for."""
        plan = self.plan
        step, epoch, batch = meta["step"], meta["epoch"], meta.get("batch") or 0
        beyond = (
            (plan.total is not None and step > plan.total)
            or (plan.num_steps is not None and step > plan.num_steps)
            or (plan.epochs is not None and (epoch, batch) > (plan.epochs, 0))
        )
        if not beyond:
            return
        then = meta.get("budget")
        run = (
            f" (its budget: {budget_text(then.get('epochs'), then.get('num_steps'))})"
            if isinstance(then, dict)
            else ""
        )
        now = budget_text(plan.epochs, plan.num_steps)
        total = f", {plan.total} steps" if plan.total is not None else ""
        raise ValueError(
            f"fit({now}): the checkpoint {found} is at step {step} (epoch {epoch}, batch "
            f"{batch}) of a longer run{run}, past this fit's budget ({now}{total}): resuming "
            "would take no step and return that run's state, trained further than asked. "
            "Resume with the run's budget (or a larger one), or start a new fit "
            "(Checkpointing(..., overwrite=True))."
        )

    def _check_rate(self, meta: dict[str, Any] | None, found: Path) -> None:
        """Refuse a resume with another learning rate or schedule length than the checkpointed
        run's: the optimizer's restored state would keep the old rate without a word, and a
        schedule over another number of steps would join two curves."""
        if meta is None:
            return
        saved_lr = meta.get("lr")  # absent in checkpoints written before it was recorded
        if saved_lr is not None and float(saved_lr) != float(self.lr):
            then, source = float(saved_lr), self.rate_source
            if source is None:
                raise ValueError(
                    f"fit(lr={self.lr:g}): the checkpoint {found} was written by a fit with "
                    f"lr={then:g}, and resuming restores its optimizer with that rate. "
                    f"Resume with lr={then:g}, or start a new fit at the new rate "
                    "(Checkpointing(..., overwrite=True))."
                )
            setter, fix = source
            raise ValueError(
                f"fit(): the fit's rate is lr={self.lr:g}, set by {setter}, and the checkpoint "
                f"{found} was written by a fit with lr={then:g}; resuming restores its "
                f"optimizer with that rate. To resume, {fix.format(lr=f'{then:g}')} (a "
                "fit(lr=...) beside it is not used), or start a new fit at the new rate "
                "(Checkpointing(..., overwrite=True))."
            )
        saved_steps = meta.get("schedule_steps")
        now_steps = self.plan.total if self.sched is not None else None
        if saved_steps is not None and now_steps is not None and saved_steps != now_steps:
            raise ValueError(
                f"fit(): the checkpoint {found} was written by a fit whose learning-rate "
                f"schedule spans {saved_steps} steps; this fit's spans {now_steps} (another "
                "epochs or num_steps), so the rest of the run would follow another curve. "
                "Resume with the run's epochs and num_steps, or start a new fit "
                "(Checkpointing(..., overwrite=True))."
            )

    def _run_record(self) -> dict[str, Any]:
        """The fit's settings a resume restores from the checkpoint rather than takes from the
        call (JSON values): the optimizer's class and per-group hyperparameters (the rate
        aside: :meth:`_check_rate`), the schedule's kind and warm-up, the validation's
        ``select_by``, the seed and what a resume can check of the training data without a
        pass over them (:func:`~pyrobayes.infer.data_record.training_data_record`)."""
        optimizer = self.fitter.optimizer
        groups = [
            {k: v for k, v in group.items() if k not in _RATE_KEYS and _plain(v)}
            for group in optimizer.param_groups
        ]
        record = {
            "objective": self.objective_record,
            "optimizer": [qualified_name(type(optimizer)), groups],
            "schedule": self.schedule_record,
            "scheduler": self.scheduler_record,
            "select_by": self.selection.select_by if self.selection is not None else None,
            "seed": self.seed,
            "training_data": self._data_record(),
        }
        return json.loads(json.dumps(record))  # tuples as lists: as the file will hold them

    def _check_run(self, meta: dict[str, Any] | None, found: Path, now: dict[str, Any]) -> None:
        """Refuse a resume under other settings than :meth:`_run_record`'s: the restored
        optimizer, schedule, selection history and random streams would keep the old ones
        without a word (a seed passed as None takes the checkpoint's). ``now`` is this fit's
        record, taken before the checkpoint was loaded."""
        saved = meta.get("run") if meta is not None else None
        if not isinstance(saved, dict):  # written before the record: nothing to compare
            return
        if now["seed"] is None:
            now["seed"] = saved.get("seed")
        for key, meaning in _RUN_KEYS.items():
            if key not in saved:  # written before the record had it
                continue
            then, there = _comparable(key, saved[key], now[key])
            if then == there:
                continue
            meaning, then, there = _first_difference(key, meaning, then, there)
            effect = (
                "resuming would go on from the run's optimizer state under another objective"
                if key == "objective"
                else "resuming restores the run's"
            )
            raise ValueError(
                f"fit(): the checkpoint {found} was written by a fit with another {meaning} "
                f"({_shown(then)} then, {_shown(there)} now), and {effect}. Resume with the "
                "run's settings, or start a new fit (Checkpointing(..., overwrite=True))."
            )

    def _check_training_data(self, meta: dict[str, Any] | None, found: Path) -> None:
        """Refuse a resume on other training data than the checkpointed run's (before anything
        is restored): it would go on from the run's position in those data."""
        saved = meta.get("run") if meta is not None else None
        if not isinstance(saved, dict) or saved.get("training_data") is None:  # written
            return  # before the record, or without one (torch.distributed, an iterator)
        if world()[0] > 1:  # a single-process run resumed on several ranks: no record now
            return
        then, now = saved["training_data"], self._data_record()
        if then == now:  # the record holds JSON values only (no tuples to normalise)
            return
        raise ValueError(
            f"fit(): the checkpoint {found} was written by a fit on other training data "
            f"({describe_difference(then, now)}), and resuming would go on from its position "
            "in those data. Resume with the run's training data, or start a new fit "
            "(Checkpointing(..., overwrite=True))."
        )

    def _check_validation(self, meta: dict[str, Any] | None, found: Path) -> None:
        """Refuse a resume whose validation data is not the checkpointed run's."""
        if meta is None or "validation_data" not in meta:  # unreadable (load_checkpoint says
            return  # why) or written before fingerprints: nothing to compare
        saved, now = meta["validation_data"], self._val_fingerprint()
        if saved is None and now is not None:
            raise ValueError(
                f"fit(validation=...): the checkpoint {found} was written by a fit without "
                "validation data; resume it without validation=, or start a new fit "
                "(Checkpointing(..., overwrite=True)) to validate from the first epoch."
            )
        if saved is not None and now is None:
            raise ValueError(
                f"fit(): the checkpoint {found} was written by a fit validated on "
                f"{saved['batches']} batches ({saved['examples']} examples); pass the same "
                "data again (validation=pyrobayes.Validation(data, ...)) to resume it, or its "
                "validation history and best epoch would be dropped."
            )
        # the examples, not how they are batched: the score is a per-example mean at the
        # guide's validation values (a fingerprint written before examples_sha256 has none)
        same = ("examples", "targets_sha256", "examples_sha256")
        if (
            saved is not None
            and now is not None
            and any(k in saved and saved[k] != now[k] for k in same)
        ):
            raise ValueError(
                f"fit(validation=...): the validation data differ from those of the "
                f"checkpoint {found} ({_describe(now)} now, {_describe(saved)} then); resume "
                "with the run's validation data, or the history would mix two data sets."
            )
