"""A join that fails before its ``metrics.json`` removes what it wrote; ``pb.predict`` computes
a multiple-choice batch's prompt layout once per batch, not once per chunk of draws.

Before, a join whose copy raised (a missing or unreadable file, a full disk) left its
``config.json`` and some copied files: the same join took the folder over, but a join of other
seeds was refused as an unfinished run of another config. And each chunk of draws of
``pb.predict`` got a freshly expanded batch whose prompt/continuation layout
(:func:`~pyrobayes.models.sharing.prefix_plan`) was computed again, with its host syncs (7
per chunk on a tiny LLaMA), and, where the lower blocks are shared, each chunk compared its
expanded rows with their first copy (one more sync per tensor of the batch).
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

import pyrobayes as pb
from pyrobayes.batch import expand_samples
from pyrobayes.demo import run_folder
from pyrobayes.demo.join_runs import join_runs
from pyrobayes.demo.run_folder import run_files
from pyrobayes.models import FineTuneModel, LoRA, MultipleChoice, sharing
from pyrobayes.models.multiple_choice import encode_multiple_choice
from pyrobayes.models.sharing import batch_prefix_plan, prefix_plan, reuse_within_batch, unshared
from tests.common import fake_lm_run, tiny_llama
from tests.models.test_multiple_choice import PROMPTS, CharTokenizer

pytestmark = [pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")]

#: pb.predict's draws and their chunks
DRAWS, CHUNK = 16, 4

#: the query projections of every block of the 3, or of the last one only (blocks 0-1 shared)
ALL_BLOCKS, UPPER_BLOCK = r".*self_attn\.q_proj", r".*layers\.2\.self_attn\.q_proj"

#: ragged: 4, 2 and 3 choices, one of them as long as a prompt
RAGGED = [
    ["it rained", "the sun", "nobody knows why at all", "maybe"],
    ["put the pan on the stove", "x"],
    ["purple", "a colour called green", "none of these"],
]


# ---------------------------------------------------------------------- join
@pytest.mark.parametrize(
    ("exists", "error"),
    [
        (False, OSError(28, "No space left on device")),
        (True, OSError(28, "No space left on device")),
        (False, KeyboardInterrupt()),  # Ctrl-C: as the fit jobs, an interrupt is an error
    ],
    ids=["new-folder", "existing-folder", "interrupted"],
)
def test_a_join_whose_copy_fails_removes_what_it_wrote(
    tmp_path, monkeypatch, caplog, exists, error
):
    """The second copied file raises (as a full disk would): the join re-raises, and leaves no
    config.json nor copied file (nor the folders it made), so a join of other seeds into the
    same folder is not refused. Before, config.json and the first posterior were left, and the
    other join was refused as "an unfinished run ... of another config"."""
    runs = [fake_lm_run(tmp_path / f"s{seed}", seed) for seed in (0, 1)]
    out = tmp_path / "joined"
    if exists:  # a folder the user made, holding a file of theirs: kept, with the folder
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    copy2, copied = shutil.copy2, []

    def failing(src, dst, **kwargs):
        if copied:
            raise error
        copied.append(dst)
        return copy2(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copy2", failing)
    with (
        caplog.at_level(logging.WARNING, logger=run_folder.__name__),
        pytest.raises(type(error)),
    ):
        join_runs(runs, out)
    assert len(copied) == 1  # the first file was copied, then the second one failed
    assert run_files(out) == []
    how = "was interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    assert f"join {how} before its first result" in caplog.text
    if exists:
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    else:
        assert not out.exists()
    monkeypatch.undo()
    joined = join_runs([runs[0], fake_lm_run(tmp_path / "s2", 2)], out)  # other seeds: taken
    assert [r["seed"] for r in joined] == [None, 0, 2]
    assert json.loads((out / "config.json").read_text())["seeds"] == [0, 2]


def test_a_join_that_fails_after_its_metrics_keeps_them(tmp_path, monkeypatch):
    """A failure once metrics.json is written (the table's) keeps the joined run: its records
    and posteriors are whole."""
    runs = [fake_lm_run(tmp_path / f"s{seed}", seed) for seed in (0, 1)]
    out = tmp_path / "joined"

    def failing_table(records):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("pyrobayes.demo.join_runs.format_table", failing_table)
    with pytest.raises(OSError, match="No space left"):
        join_runs(runs, out)
    left = {p.relative_to(out).as_posix() for p in run_files(out)}
    assert {"config.json", "metrics.json", "guides/map-seed1.safetensors"} <= left


# ---------------------------------------------------------------------- prompt layout
def _llama_model(target: str = ALL_BLOCKS) -> FineTuneModel:
    torch.manual_seed(0)
    return FineTuneModel(
        tiny_llama(num_hidden_layers=3).eval().double(),
        LoRA(rank=2, target_modules=target),
        likelihood=MultipleChoice(),
        trainable_modules=[],
        num_data=3,
    )


def _batch(side: str = "right") -> dict[str, torch.Tensor]:
    return encode_multiple_choice(
        CharTokenizer(), PROMPTS, RAGGED, answers=[0, 1, 2], padding_side=side, ragged=True
    )


@pytest.mark.parametrize("side", ["left", "right"])
def test_the_expanded_layout_is_the_layout_of_the_expanded_batch(side):
    """The layout is row-wise, so that of the un-expanded rows, expanded, is exactly the one
    computed on the S-fold batch (integer tensors: equal, not close)."""
    model = _llama_model()
    batch = _batch(side)
    batch.pop("labels")
    with torch.no_grad():
        direct = prefix_plan(model.net, model.likelihood, expand_samples(batch, CHUNK))
        planned = batch_prefix_plan(model.net, model.likelihood, batch, CHUNK)
    assert direct is not None and planned is not None
    assert direct.keys() == planned.keys()
    for name, value in direct.items():
        assert torch.equal(planned[name], value), name
        assert planned[name].dtype == value.dtype


def _counting(monkeypatch, name: str) -> list[int]:
    """Calls of ``sharing.<name>`` (each one's host syncs), counted."""
    calls: list[int] = []
    original = getattr(sharing, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(sharing, name, counted)
    return calls


@pytest.mark.parametrize(
    ("target", "chunk"),
    [
        (ALL_BLOCKS, CHUNK),  # every block adapted: the prompts shared
        (UPPER_BLOCK, CHUNK),  # the prompts and blocks 0-1 shared
        (ALL_BLOCKS, None),  # the chunks sized by tokens_per_draw (its layout is the chunks')
    ],
    ids=["prompts", "prompts-and-lower-blocks", "default-chunks"],
)
def test_predict_computes_the_prompt_layout_once_per_batch(monkeypatch, target, chunk):
    """S = 16 draws in chunks: the layout is computed once per batch (it was once per chunk, 4
    here, plus once for the chunk sizing), the expanded rows are not compared with their first
    copy (they are copies by construction; they were, per chunk, where the lower blocks are
    shared), and the log-probabilities equal those of the unshared predict."""
    model = _llama_model(target)
    data = [_batch("left"), _batch("right")]
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    layouts = _counting(monkeypatch, "_prefix_layout")
    compared = _counting(monkeypatch, "_sample_copies")
    got = pb.predict(model, guide, data, num_samples=DRAWS, samples_per_forward=chunk, seed=0)
    assert len(layouts) == len(data)
    assert compared == []
    with unshared():
        ref = pb.predict(model, guide, data, num_samples=DRAWS, samples_per_forward=chunk, seed=0)
    assert got.log_probs is not None and ref.log_probs is not None
    # float64: the shared prompt and the full rows sum the same terms in another order; scores
    # of a few nats (ulp ~9e-16) move by a few ulps: 1e-10
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=0, atol=1e-10)


def test_declined_prompts_keep_the_lower_blocks_for_every_chunk():
    """A batch whose prompts are not shared (a question's choices start with different tokens)
    runs block 0 on its rows once for the 4 chunks: the prompts' entry of the batch's memo
    does not clear the lower blocks' one."""
    model = _llama_model(UPPER_BLOCK)
    batch = _batch()
    batch["input_ids"][0, 1, 0] = 7  # choice 1 of question 0 starts with another token
    rows: list[int] = []
    block = model.net.model.layers[0].input_layernorm
    block.register_forward_pre_hook(lambda m, a: rows.append(int(a[0].shape[0])))
    guide = pb.posterior(model, "meanfield", init_scale=0.3)
    got = pb.predict(model, guide, [batch], num_samples=DRAWS, samples_per_forward=CHUNK, seed=0)
    assert rows == [int(batch["input_ids"].shape[:2].numel())]  # B·K rows, once
    with unshared():
        ref = pb.predict(
            model, guide, [batch], num_samples=DRAWS, samples_per_forward=CHUNK, seed=0
        )
    assert got.log_probs is not None and ref.log_probs is not None
    # float64, the same rows through the same blocks (0 seen once): 1e-10 as above
    torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=0, atol=1e-10)


def test_batch_memo_keeps_the_keys_of_one_batch():
    """Two keys on the same inputs live side by side; another batch clears both."""
    first, second = {"x": torch.zeros(1)}, {"x": torch.zeros(1)}
    with reuse_within_batch():
        a = sharing.batch_memo(first, "a")
        assert a is not None
        a["kept"] = 1
        assert sharing.batch_memo(first, "b") is not None
        assert sharing.batch_memo(first, "a") == {"inputs": first, "kept": 1}
        assert sharing.batch_memo(second, "b") == {"inputs": second}
        assert sharing.batch_memo(first, "a") == {"inputs": first}
