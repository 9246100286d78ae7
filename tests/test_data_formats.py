"""The data a user brings, through ``pb.fit``, ``pb.predict``, ``pb.metrics.report``,
``pb.calibrate`` and the ArviZ export: Hugging Face ``datasets`` batches collated by
``DataCollatorWithPadding`` (``BatchEncoding``, extra columns left in), lists of dict and of
``(x, y)`` batches, a one-shot generator, an ``IterableDataset``, worker processes, labels of
narrow integer dtypes, batches of one example, ``drop_last``; and the cases that were wrong: a
batch on the ``meta`` device, inputs that require grad, a resume over a sampler the fit cannot
seed, an export over a shuffling or dropping loader."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, TensorDataset

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA
from tests.common import teacher_mlp, tiny_bert

#: the fits here are a few steps long: calibrate's small-split and bound warnings are not
#: what these tests are about
pytestmark = [
    pytest.mark.filterwarnings("ignore:calibrate. T = .*:UserWarning"),
    pytest.mark.filterwarnings("ignore::pyrobayes.diagnostics.export.UncalibratedExportWarning"),
]

WORDS = "the a movie was good bad great awful i it very not plot acting fun boring".split()


class _Killed(Exception):
    """Raised by a progress callback: the fit stops there, as a killed run would."""


def _mlp(n: int = 40) -> tuple[FineTuneModel, torch.Tensor, torch.Tensor]:
    return teacher_mlp(n, num_data=n)


def _chunks(x: torch.Tensor, y: torch.Tensor, size: int = 8) -> list[tuple[Any, Any]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


class _Stream(IterableDataset):
    """Batches of 8 in order, without ``__len__``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from _chunks(self.x, self.y)


class _GlobalRandomSampler(Sampler[int]):
    """A sampler of the kind users write: a permutation from torch's global RNG, with no
    ``generator`` that the fit could seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(self.n).tolist())


def _through_everything(model: Any, family: str, train: Any, held: Callable[[], Any]) -> Any:
    """fit, predict, report, calibrate and export; returns the prediction."""
    guide = pb.posterior(model, family)
    pb.fit(model, guide, train, epochs=1, seed=0, progress=False)
    pred = pb.predict(model, guide, held(), num_samples=3, seed=0)
    report = pb.metrics.report(pred, pred.targets)
    assert torch.isfinite(torch.tensor(report["nll"]))
    pb.calibrate(model, guide, held())
    idata = pb.to_inference_data(model, guide, held(), num_samples=3, seed=0)
    rows = pred.log_probs.shape[1]
    assert idata.log_likelihood["obs"].shape[-1] == rows
    return pred


MLP_FORMATS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "list-of-tuples": _chunks,
    "generator": lambda x, y: iter(_chunks(x, y)),
    "iterable-dataset": lambda x, y: DataLoader(_Stream(x, y), batch_size=None),
    "workers": lambda x, y: DataLoader(TensorDataset(x, y), batch_size=8, num_workers=2),
    "int32-labels": lambda x, y: DataLoader(TensorDataset(x, y.int()), batch_size=8),
    "uint8-labels": lambda x, y: DataLoader(TensorDataset(x, y.to(torch.uint8)), batch_size=8),
    "last-batch-of-one": lambda x, y: DataLoader(TensorDataset(x, y), batch_size=8),  # 33
    "batch-size-one": lambda x, y: DataLoader(TensorDataset(x, y), batch_size=1),  # 12
}
SIZES = {"last-batch-of-one": 33, "batch-size-one": 12}


@pytest.mark.parametrize("family", ["map", "meanfield", "laplace", "ivon"])
@pytest.mark.parametrize("fmt", sorted(MLP_FORMATS))
def test_mlp_formats_pass_through_fit_predict_calibrate_and_export(fmt: str, family: str) -> None:
    model, x, y = _mlp(SIZES.get(fmt, 40))
    make = MLP_FORMATS[fmt]
    if fmt == "generator" and family == "laplace":  # its curvature pass reads the data again
        with pytest.raises(ValueError, match="iterator"):
            _through_everything(model, family, make(x, y), lambda: make(x, y))
        return
    pred = _through_everything(model, family, make(x, y), lambda: make(x, y))
    # the rows are the data's, in order: the targets come back as they went in
    ordered = torch.cat([batch[1] for batch in make(x, y)])
    assert torch.equal(pred.targets, ordered)


def test_a_shuffled_or_weighted_fit_loader_and_drop_last_fit_fine() -> None:
    model, x, y = _mlp(41)
    for steps, loader in zip(
        (5, 6, 6),
        (
            DataLoader(TensorDataset(x, y), batch_size=8, drop_last=True),
            DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True),
            DataLoader(
                TensorDataset(x, y),
                batch_size=8,
                sampler=torch.utils.data.WeightedRandomSampler(torch.ones(41), 41),
            ),
        ),
        strict=True,
    ):
        guide = pb.posterior(model, "map")
        assert pb.fit(model, guide, loader, epochs=1, seed=0, progress=False).state["step"] == steps


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("vocab")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (folder / "vocab.txt").write_text("\n".join(specials + WORDS) + "\n", encoding="utf-8")
    return transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))


def test_datasets_batches_with_extra_columns(tokenizer: Any) -> None:
    """``DataCollatorWithPadding`` batches (``BatchEncoding``, a ``UserDict``) with an
    ``idx`` column left in: BERT's forward takes it in its ``**kwargs`` and ignores it, so the
    prediction is the one without it (nothing to drop); the rows keep the dataset's order."""
    datasets = pytest.importorskip("datasets")
    from transformers import DataCollatorWithPadding

    n = 12
    texts = [" ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(i % 5 + 2)) for i in range(n)]
    table = datasets.Dataset.from_dict({"text": texts, "labels": [i % 3 for i in range(n)]})
    table = table.map(lambda b: tokenizer(b["text"]), batched=True).add_column(
        "idx", list(range(n))
    )
    collate = DataCollatorWithPadding(tokenizer)

    def loader(extra: bool) -> DataLoader:
        keep = ["input_ids", "attention_mask", "token_type_ids", "labels"] + ["idx"] * extra
        rows = table.remove_columns([c for c in table.column_names if c not in keep])
        return DataLoader(rows.with_format("torch"), batch_size=5, collate_fn=collate)

    assert type(next(iter(loader(True)))).__name__ == "BatchEncoding"
    torch.manual_seed(0)
    model = FineTuneModel(tiny_bert(3, vocab_size=len(WORDS) + 5), LoRA(rank=2), num_data=n)
    pred = _through_everything(model, "meanfield", loader(True), lambda: loader(True))
    assert torch.equal(pred.targets, torch.arange(n) % 3)
    guide = pb.posterior(model, "map")
    pb.fit(model, guide, loader(True), epochs=1, seed=0, progress=False)
    with_idx = pb.predict(model, guide, loader(True)).log_probs
    torch.testing.assert_close(with_idx, pb.predict(model, guide, loader(False)).log_probs)


def test_a_meta_batch_is_refused_by_name() -> None:
    """Before: fit failed in a finiteness check with torch's ``Tensor.item() cannot be called
    on meta tensors``, predict with ``Cannot copy out of meta tensor; no data!``."""
    model, x, y = _mlp()
    guide = pb.posterior(model, "map")
    meta = [(x[:8].to("meta"), y[:8])]
    with pytest.raises(ValueError, match=r"'meta' device \(torch.float\d+, shape \(8, 4\)\)"):
        pb.fit(model, guide, meta, epochs=1, progress=False)
    pb.fit(model, guide, _chunks(x, y), epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"'meta' device"):
        pb.predict(model, guide, meta)


def test_fit_leaves_inputs_that_require_grad_alone() -> None:
    """Before: the backward pass reached the user's input tensors, accumulating their
    ``.grad`` (|grad| sums of 23 to 35 per batch after two epochs) and torch warned
    ("Converting a tensor with requires_grad=True to a scalar"), an error under ``-W error``.
    The fit's losses are those of the same data without ``requires_grad``."""
    model, x, y = _mlp()
    plain = pb.fit(model, pb.posterior(model, "map"), _chunks(x, y), epochs=2, seed=0)
    model, x, y = _mlp()
    leaves = [xb.clone().requires_grad_() for xb, _ in _chunks(x, y)]
    data = [(xb, yb) for xb, (_, yb) in zip(leaves, _chunks(x, y), strict=True)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = pb.fit(model, pb.posterior(model, "map"), data, epochs=2, seed=0, progress=False)
    assert all(leaf.grad is None for leaf in leaves)
    assert torch.equal(result.losses, plain.losses)


def _fit_killed_and_resumed(
    folder: Path, loader: Callable[[], DataLoader], kill_at: int
) -> tuple[Any, Any]:
    """A 3-epoch MAP fit (5 batches an epoch) killed after step ``kill_at`` with a checkpoint
    every step, then resumed on a fresh model; returns the uninterrupted and resumed results."""

    def run(checkpoint: pb.Checkpointing | None, stop: int | None) -> Any:
        model, _, _ = _mlp()
        guide = pb.posterior(model, "map")

        def callback(step: int, _: float) -> None:
            if step == stop:
                raise _Killed

        progress = pb.Progress(bar=False, callback=callback)
        kw = {} if checkpoint is None else {"checkpoint": checkpoint}
        return pb.fit(model, guide, loader(), epochs=3, seed=7, progress=progress, **kw)

    uninterrupted = run(None, None)
    with pytest.raises(_Killed):
        run(pb.Checkpointing(folder, every=1), kill_at)
    return uninterrupted, run(pb.Checkpointing(folder, every=1, resume=True), None)


def test_a_resume_over_a_users_seeded_random_sampler_is_exact(tmp_path: Path) -> None:
    _, x, y = _mlp()
    data = TensorDataset(x, y)

    def loader() -> DataLoader:
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(123))
        return DataLoader(data, batch_size=8, sampler=sampler)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        uninterrupted, resumed = _fit_killed_and_resumed(tmp_path, loader, kill_at=7)
    assert torch.equal(uninterrupted.losses, resumed.losses)  # bit-exact


def test_a_resume_over_a_sampler_drawing_from_the_global_generator_is_exact(
    tmp_path: Path,
) -> None:
    """A sampler that draws its permutation from torch's global generator: before, the resumed
    epoch skipped the first batches of a new permutation (losses differ; parameters up to
    0.025 apart), which a later round only warned of; the data's reads now draw from a stream
    seeded from the fit's seed and the epoch (``DataOrder.read``), so the resume is exact."""
    _, x, y = _mlp()
    data = TensorDataset(x, y)

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=8, sampler=_GlobalRandomSampler(40))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        uninterrupted, resumed = _fit_killed_and_resumed(tmp_path, loader, kill_at=7)
    assert torch.equal(uninterrupted.losses, resumed.losses)  # bit-exact


class _OwnGeneratorSampler(torch.utils.data.Sampler[int]):
    """A sampler with a NumPy generator of its own, seeded once: nothing fit can seed."""

    def __init__(self, n: int) -> None:
        self.n, self.rng = n, np.random.default_rng(0)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rng.permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


def test_a_resume_over_a_sampler_with_its_own_generator_warns(tmp_path: Path) -> None:
    """Its order is its own: the resume replays another batch than the interrupted run took
    last, which the checkpoint's digest of that batch shows."""
    _, x, y = _mlp()
    data = TensorDataset(x, y)

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=8, sampler=_OwnGeneratorSampler(40))

    with pytest.warns(UserWarning, match=r"resumed after 1 batch of epoch 1.*replayed another"):
        uninterrupted, resumed = _fit_killed_and_resumed(tmp_path, loader, kill_at=7)
    assert not torch.equal(uninterrupted.losses, resumed.losses)  # what the warning is about


def test_an_export_over_a_dropping_loader_warns() -> None:
    """Before: silent, ``drop_last`` left 1 of 41 examples out of ``log_likelihood`` (and of
    ``log_joint``, a sum over the examples)."""
    model, x, y = _mlp(41)
    guide = pb.posterior(model, "meanfield")
    pb.fit(model, guide, _chunks(x, y), epochs=1, seed=0, progress=False)
    data = TensorDataset(x, y)
    with pytest.warns(UserWarning, match=r"the last 1 of its 41 examples are left out"):
        idata = pb.to_inference_data(model, guide, DataLoader(data, batch_size=8, drop_last=True))
    assert idata.observed_data["obs"].shape == (40,)  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pb.to_inference_data(model, guide, DataLoader(data, batch_size=41, drop_last=True))


@pytest.mark.parametrize("kind", ["weighted", "subset"])
def test_predict_over_a_sampler_that_draws_its_rows_warns(kind) -> None:
    """A ``WeightedRandomSampler`` (with replacement) or ``SubsetRandomSampler`` in predict
    gives rows in a random order (the weighted one resampled), as ``shuffle=True`` does, which
    already warned: these were silent (41 examples: NLL 1.0234 ordered against 0.9987 over the
    weighted sampler, and ``pb.calibrate``'s T 0.506 against 0.303)."""
    from torch.utils.data import (
        DataLoader,
        SubsetRandomSampler,
        TensorDataset,
        WeightedRandomSampler,
    )

    from pyrobayes.predictive import ShuffledDataWarning, warn_if_rows_differ

    dataset = TensorDataset(torch.randn(10, 3), torch.arange(10) % 2)
    sampler = (
        WeightedRandomSampler(torch.ones(10), 10)
        if kind == "weighted"
        else SubsetRandomSampler(range(10))
    )
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    match = "with replacement" if kind == "weighted" else "SubsetRandomSampler"
    with pytest.warns(ShuffledDataWarning, match=match):
        warn_if_rows_differ(loader, "predict")
