"""Crash-safe checkpoints, the folder lock, exact resume (mid-epoch, shuffled, after a SIGKILL)
and the refusal of non-finite gradients before the update."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import pyrobayes as pb
from pyrobayes.infer import checkpoint, grouped
from pyrobayes.infer.checkpoint import CheckpointLock, latest
from pyrobayes.registry import _REGISTRY
from tests.infer import kill_fit

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = sorted({cls.family for cls in _REGISTRY.values()})  # every registered family, once
SPE = kill_fit.STEPS_PER_EPOCH
WRITES_PER_EPOCH = SPE + 1  # checkpoint_every=1: one per step and one at the epoch end


def _rng(*key: object) -> random.Random:
    """The kill points: random, reproducible (set PYROBAYES_KILL_SEED to draw others)."""
    return random.Random(f"{os.environ.get('PYROBAYES_KILL_SEED', '')}{key}")


def _kill_cases() -> dict[str, tuple[str, str, int]]:
    """name -> (family, mode, n): a mid-epoch kill for every family, and kills inside a write."""
    cases = {}
    for family in FAMILIES:
        rng = _rng(family, "step")
        step = rng.choice([s for s in range(1, kill_fit.EPOCHS * SPE) if s % SPE])
        cases[family] = (family, "step", step)
    rng = _rng("write")
    # inside a mid-epoch write, between the complete generation and the pointer switch
    cases["switch-mid-epoch"] = ("meanfield", "switch", rng.choice([2, 3, 4, 8, 9, 10, 11]))
    # inside the epoch-end write: the run resumes after an epoch's last step, before its end
    cases["switch-epoch-end"] = ("swag", "switch", WRITES_PER_EPOCH)
    # half-way through flushing a generation's files
    cases["fsync"] = ("ivon", "fsync", rng.randrange(8, 60))
    return cases


KILLS = _kill_cases()


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Start every kill case at once (their start-up overlaps); each test waits for its own."""
    procs = {}
    for name, (family, mode, n) in KILLS.items():
        directory = tmp_path_factory.mktemp(f"kill-{name}")
        cmd = [sys.executable, "-m", "tests.infer.kill_fit", family, str(directory), mode, str(n)]
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs[name] = (directory, proc)
    yield procs
    for _, proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # reaps it and closes its pipes (a deselected case never read them)


def _assert_same(a: tuple[Any, Any, Any], b: tuple[Any, Any, Any], what: str) -> None:
    (model_a, guide_a, result_a), (model_b, guide_b, result_b) = a, b
    state_a, state_b = guide_a.state_dict(), guide_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for k, v in state_a.items():
        assert torch.equal(v, state_b[k]), f"{what}: guide {k} differs"
    for k, v in model_a.point_params.items():
        assert torch.equal(v, model_b.point_params[k]), f"{what}: point parameter {k} differs"
    assert torch.equal(result_a.losses, result_b.losses), what
    assert result_a.state["step"] == result_b.state["step"] == kill_fit.EPOCHS * SPE


@pytest.mark.integration
@pytest.mark.parametrize("case", list(KILLS), ids=list(KILLS))
def test_sigkill_and_resume_is_bit_identical(case, killed):
    family, mode, n = KILLS[case]
    directory, proc = killed[case]
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    found = latest(directory)
    assert found is not None and found.name.startswith("ckpt-")
    meta = json.loads((found / "state.json").read_text())
    if mode == "step":  # the checkpoint of the step before the kill
        assert meta["step"] == n - 1
    if case == "switch-epoch-end":  # the last step of epoch 0 done, its end work not
        assert (meta["step"], meta["epoch"], meta["batch"]) == (SPE, 0, SPE)
        assert not meta["epoch_end_done"]
    leftovers = [p.name for p in directory.iterdir() if p.name not in ("LATEST", ".lock")]
    if mode != "step":
        assert len(leftovers) > 1  # the half-done write left something behind
    uninterrupted = kill_fit.run(family)
    resumed = kill_fit.run(family, checkpoint_dir=directory, resume=True)
    _assert_same(resumed, uninterrupted, f"{case} (killed by {mode} {n})")
    names = sorted(p.name for p in directory.iterdir())
    assert names == [".lock", "LATEST", latest(directory).name]  # leftovers cleaned


def test_generations_pointer_and_cleanup(tmp_path):
    model, guide, loader = kill_fit.problem("map")
    pb.fit(
        model,
        guide,
        loader,
        optim=pb.Optimization(num_steps=3),
        checkpoint=pb.Checkpointing(tmp_path, every=1),
    )
    assert (tmp_path / "LATEST").read_text().strip() == "ckpt-000003"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "ckpt-000003"]
    files = {p.name for p in (tmp_path / "ckpt-000003").iterdir()}
    assert files == {"posterior.safetensors", "fitter.pt", "rng.pt", "state.json"}
    meta = json.loads((tmp_path / "ckpt-000003" / "state.json").read_text())
    assert (meta["step"], meta["epoch"], meta["batch"], meta["epoch_end_done"]) == (3, 0, 3, False)
    # what a killed fit leaves: a temp folder, an unswitched generation, a temp pointer
    (tmp_path / ".tmp-ckpt-000004-x").mkdir()
    shutil.copytree(tmp_path / "ckpt-000003", tmp_path / "ckpt-000004")
    (tmp_path / ".LATEST-y").write_text("ckpt-000004")
    assert latest(tmp_path) == tmp_path / "ckpt-000003"  # the pointer counts
    assert set(checkpoint.clean(tmp_path)) == {".tmp-ckpt-000004-x", ".LATEST-y"}
    assert (tmp_path / "ckpt-000004").is_dir()  # clean() never deletes a complete generation
    model, guide, loader = kill_fit.problem("map")
    result = pb.fit(
        model, guide, loader, epochs=1, checkpoint=pb.Checkpointing(tmp_path, resume=True)
    )
    assert result.state["step"] == SPE and len(result.losses) == SPE
    # temporaries cleaned at the start; the older generations dropped after the run's own
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "LATEST", "ckpt-000005"]


def test_the_earlier_layout_is_resumed(tmp_path):
    """``<dir>/last`` (and ``.last-old``, left by a kill between its two renames) still resume."""
    reference = kill_fit.run("meanfield")

    def stop(step: int, loss: float) -> None:
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kill_fit.run("meanfield", checkpoint_dir=tmp_path, checkpoint_every=1, callback=stop)
    for legacy in ("last", ".last-old"):
        folder = tmp_path / legacy
        shutil.copytree(latest(tmp_path), folder)
        meta = json.loads((folder / "state.json").read_text())
        old = {k: meta[k] for k in ("step", "epoch", "losses", "validation")}
        (folder / "state.json").write_text(json.dumps(old))  # what the earlier layout wrote
    shutil.rmtree(latest(tmp_path))
    (tmp_path / "LATEST").unlink()
    assert latest(tmp_path) == tmp_path / "last"
    shutil.rmtree(tmp_path / "last")  # a kill between the renames: only .last-old is left
    assert latest(tmp_path) == tmp_path / ".last-old"
    resumed = kill_fit.run("meanfield", checkpoint_dir=tmp_path, resume=True)
    _assert_same(resumed, reference, "earlier layout")  # position derived from step and epoch
    names = sorted(p.name for p in tmp_path.iterdir())  # the old folders replaced
    assert names[:2] == [".lock", "LATEST"] and len(names) == 3 and names[2].startswith("ckpt-")


def test_a_second_fit_on_a_locked_folder_is_refused(tmp_path):
    outcomes = []

    def second_fit(step: int, loss: float) -> None:
        if step == 2:  # while the first fit runs and holds the folder
            model, guide, loader = kill_fit.problem("map")
            with pytest.raises(RuntimeError, match="in use by another fit") as err:
                pb.fit(
                    model,
                    guide,
                    loader,
                    epochs=1,
                    checkpoint=pb.Checkpointing(tmp_path, overwrite=True),
                )
            assert str(tmp_path) in str(err.value) and str(os.getpid()) in str(err.value)
            outcomes.append("refused")

    first = kill_fit.run("map", checkpoint_dir=tmp_path, checkpoint_every=1, callback=second_fit)
    assert outcomes == ["refused"] and first[2].state["step"] == kill_fit.EPOCHS * SPE
    assert json.loads((latest(tmp_path) / "state.json").read_text())["step"] == 15
    # the lock is released when a fit ends, also by an exception
    with CheckpointLock(tmp_path):
        pass
    kill_fit.run("map", checkpoint_dir=tmp_path, resume=True)


@pytest.mark.integration
def test_a_lock_held_by_another_process_and_none_after_it_dies(tmp_path):
    code = (
        "import sys, time; from pyrobayes.infer.checkpoint import CheckpointLock; "
        f"lock = CheckpointLock({str(tmp_path)!r}).acquire(); print('locked', flush=True); "
        "time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        model, guide, loader = kill_fit.problem("map")
        with pytest.raises(RuntimeError, match=f"process {proc.pid}") as err:
            pb.fit(model, guide, loader, epochs=1, checkpoint=pb.Checkpointing(tmp_path))
        assert str(tmp_path) in str(err.value)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    model, guide, loader = kill_fit.problem("map")  # a killed holder leaves no stale lock
    assert (
        pb.fit(model, guide, loader, epochs=1, checkpoint=pb.Checkpointing(tmp_path)).state["step"]
        == SPE
    )


def test_a_new_fit_into_a_used_folder_needs_overwrite(tmp_path):
    model, guide, loader = kill_fit.problem("map")
    pb.fit(model, guide, loader, epochs=1, checkpoint=pb.Checkpointing(tmp_path))
    before = latest(tmp_path)
    model, guide, loader = kill_fit.problem("map")
    with pytest.raises(FileExistsError, match="resume=True") as err:
        pb.fit(model, guide, loader, epochs=2, checkpoint=pb.Checkpointing(tmp_path))
    assert str(tmp_path) in str(err.value) and "overwrite=True" in str(err.value)
    assert latest(tmp_path) == before  # refused before anything was touched
    result = pb.fit(
        model,
        guide,
        loader,
        optim=pb.Optimization(num_steps=2),
        checkpoint=pb.Checkpointing(tmp_path, overwrite=True),
    )
    # a num_steps fit ends with a checkpoint of its own, which replaces the other run's
    assert result.state["step"] == 2 and latest(tmp_path) != before and not before.exists()
    before = latest(tmp_path)
    pb.fit(
        model,
        guide,
        loader,
        optim=pb.Optimization(num_steps=2),
        checkpoint=pb.Checkpointing(tmp_path, overwrite=True, every=1),
    )
    meta = json.loads((latest(tmp_path) / "state.json").read_text())
    assert meta["step"] == 2 and not before.exists()


class _NaNGrad(torch.autograd.Function):
    """Identity forward, NaN backward: a non-finite gradient with a finite loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_non_finite_gradient_is_refused_before_the_update(tmp_path, family):
    model, guide, loader = kill_fit.problem(family)
    lr = kill_fit.LR.get(family, 1e-2)
    # the run is extended by an epoch: at a constant rate (IVON's default cosine over one epoch
    # would not extend; a resume under another schedule length is refused)
    optim = pb.Optimization(scheduler="constant") if family in ("ivon", "kron-ivon") else None
    pb.fit(
        model,
        guide,
        loader,
        epochs=1,
        seed=0,
        lr=lr,
        optim=optim,
        checkpoint=pb.Checkpointing(tmp_path),
    )
    saved = latest(tmp_path)
    fresh = kill_fit.problem(family)[0]
    expected = pb.load(saved / "posterior.safetensors", fresh).state_dict()
    hook = model.net[0].register_forward_hook(lambda mod, args, out: _NaNGrad.apply(out))
    try:
        with pytest.raises(FloatingPointError, match="Non-finite gradient") as err:
            pb.fit(
                model,
                guide,
                loader,
                epochs=2,
                lr=lr,
                optim=optim,
                checkpoint=pb.Checkpointing(tmp_path, resume=True),
            )
    finally:
        hook.remove()
    message = str(err.value)
    assert any(site in message for site in model.latent_sites)  # the site is named
    assert "fit step 5, epoch 1" in message and f"checkpoint in {tmp_path} is intact" in message
    for k, v in guide.state_dict().items():  # still the checkpoint's state: not updated
        assert torch.equal(v, expected[k]), k
    for k, v in model.point_params.items():
        assert torch.equal(v, fresh.point_params[k]), k
    assert latest(tmp_path) == saved  # the last good checkpoint is untouched and loads
    restored = pb.load(saved / "posterior.safetensors", kill_fit.problem(family)[0])
    for k, v in restored.state_dict().items():
        assert torch.equal(v, expected[k]), k


# SWAG with validation on purpose: the epoch end a resume must run holds both
@pytest.mark.filterwarnings("ignore:fit. validation= selects an epoch:UserWarning")
def test_a_kill_after_an_epochs_last_step_resumes_its_end(tmp_path, monkeypatch):
    """In-process: the epoch-end checkpoint fails, so the newest is the one after the last step;
    resume runs the epoch's end (SWAG's epoch collection, validation) and goes on."""
    val = kill_fit.problem("swag")[2]
    reference = kill_fit.run("swag", val_data=val)
    calls = [0]
    switch = checkpoint._switch

    def failing_switch(directory: Path, name: str) -> None:
        calls[0] += 1
        if calls[0] == 2 * WRITES_PER_EPOCH:  # epoch 1's end
            raise KeyboardInterrupt
        switch(directory, name)

    monkeypatch.setattr(checkpoint, "_switch", failing_switch)
    with pytest.raises(KeyboardInterrupt):
        kill_fit.run("swag", val_data=val, checkpoint_dir=tmp_path, checkpoint_every=1)
    monkeypatch.setattr(checkpoint, "_switch", switch)
    meta = json.loads((latest(tmp_path) / "state.json").read_text())
    assert (meta["step"], meta["epoch"], meta["batch"]) == (2 * SPE, 1, SPE)
    assert len(meta["validation"]) == 1
    resumed = kill_fit.run("swag", val_data=val, checkpoint_dir=tmp_path, resume=True)
    _assert_same(resumed, reference, "epoch-end kill")
    assert resumed[2].state["validation"] == reference[2].state["validation"]


def test_fit_owns_the_data_order():
    x, y = torch.randn(24, 4), torch.randint(0, 3, (24,))
    user = torch.Generator().manual_seed(5)
    loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True, generator=user)
    sampler, state = loader.sampler, user.get_state()
    orders = []
    for _ in range(2):
        model, guide, _ = kill_fit.problem("map")
        inputs: list[torch.Tensor] = []
        hook = model.net.register_forward_pre_hook(
            lambda mod, args, inputs=inputs: inputs.append(args[0])
        )
        pb.fit(model, guide, loader, epochs=2, seed=3)
        hook.remove()
        orders.append(torch.stack([b[:, 0] for b in inputs[:8]]))
    assert torch.equal(orders[0], orders[1])  # a function of the seed and the epoch
    assert not torch.equal(orders[0][:4], orders[0][4:])  # epochs differ
    assert loader.sampler is sampler and sampler.generator is user  # put back, untouched
    assert torch.equal(user.get_state(), state)
    distributed = DistributedSampler(TensorDataset(x, y), num_replicas=1, rank=0, seed=1)
    dl = DataLoader(TensorDataset(x, y), batch_size=6, sampler=distributed)
    model, guide, _ = kill_fit.problem("map")
    pb.fit(model, guide, dl, epochs=3, seed=3)
    assert distributed.epoch == 2  # set_epoch was called


class _Unsized:
    """Re-iterable batches without a length: the end of an epoch is known only by iterating."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


@pytest.mark.parametrize("write", [3, WRITES_PER_EPOCH], ids=["mid-epoch", "epoch-end"])
def test_resume_without_a_length(tmp_path, monkeypatch, write):
    def run(**kw: Any) -> tuple[Any, Any, Any]:
        model, guide, loader = kill_fit.problem("meanfield")
        batches = _Unsized([b for b in DataLoader(loader.dataset, batch_size=kill_fit.BATCH)])
        result = pb.fit(model, guide, batches, epochs=kill_fit.EPOCHS, seed=7, **grouped(**kw))
        return model, guide, result

    reference = run()
    calls, switch = [0], checkpoint._switch

    def failing_switch(directory: Path, name: str) -> None:
        calls[0] += 1
        if calls[0] == write:
            raise KeyboardInterrupt
        switch(directory, name)

    monkeypatch.setattr(checkpoint, "_switch", failing_switch)
    with pytest.raises(KeyboardInterrupt):
        run(checkpoint_dir=tmp_path, checkpoint_every=1)
    monkeypatch.setattr(checkpoint, "_switch", switch)
    assert json.loads((latest(tmp_path) / "state.json").read_text())["step"] == write - 1
    _assert_same(run(checkpoint_dir=tmp_path, resume=True), reference, f"unsized, write {write}")
    with pytest.raises(ValueError, match="no batches"):
        pb.fit(*kill_fit.problem("map")[:2], _Unsized([]), optim=pb.Optimization(num_steps=2))


# ---------------------------------------------------------------- damaged pointer and state files
def _interrupted_run(directory: Path) -> None:
    """A map run stopped after step 7: its newest checkpoint is step 6, mid-epoch 1."""

    def stop(step: int, loss: float) -> None:
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kill_fit.run("map", checkpoint_dir=directory, checkpoint_every=1, callback=stop)


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A checkpoint folder to copy per case, and the uninterrupted run to compare with."""
    directory = tmp_path_factory.mktemp("interrupted")
    _interrupted_run(directory)
    return directory, kill_fit.run("map")


def _files(directory: Path) -> dict[str, bytes]:
    """Every file of every generation folder, by path: what a refused fit must not touch."""
    return {
        str(f.relative_to(directory)): f.read_bytes()
        for g in directory.glob("ckpt-*")
        for f in sorted(g.rglob("*"))
        if f.is_file()
    }


def _edit_state(folder: Path, **changes: Any) -> None:
    meta = json.loads((folder / "state.json").read_text())
    meta.update(changes)
    (folder / "state.json").write_text(json.dumps(meta))


POINTER_DAMAGE = {
    "none": lambda d, g: None,
    "latest-deleted": lambda d, g: (d / "LATEST").unlink(),
    "latest-missing-folder": lambda d, g: (d / "LATEST").write_text("ckpt-999999\n"),
    "latest-garbage": lambda d, g: (d / "LATEST").write_bytes(b"\x00\xff garbage"),
    "latest-empty": lambda d, g: (d / "LATEST").write_text(""),
    "latest-partial": lambda d, g: (
        shutil.copytree(g, d / "ckpt-000100", ignore=shutil.ignore_patterns("fitter.pt")),
        (d / "LATEST").write_text("ckpt-000100"),
    ),
}
STATE_DAMAGE = {
    "none": lambda g: None,
    "step-10000": lambda g: _edit_state(g, step=10000),
    "batch-99": lambda g: _edit_state(g, batch=99),
    "step-6-to-2": lambda g: _edit_state(g, step=2),
    "truncated": lambda g: (g / "state.json").write_bytes((g / "state.json").read_bytes()[:40]),
}
DAMAGES = [(p, s) for p in POINTER_DAMAGE for s in STATE_DAMAGE if (p, s) != ("none", "none")]


@pytest.mark.parametrize("damage", DAMAGES, ids=["+".join(d) for d in DAMAGES])
def test_no_damaged_pointer_or_state_makes_fit_delete_an_intact_generation(
    tmp_path, interrupted, damage
):
    """Every pointer damage x every state damage, under the three ways to start a fit: resume
    continues from a complete generation or refuses; a new fit without overwrite refuses; with
    overwrite it replaces the old generations only after its own first checkpoint. A refused or
    interrupted fit leaves every generation file byte-identical."""
    source, reference = interrupted
    pointer, state = damage

    def prepared(mode: str) -> tuple[Path, dict[str, bytes]]:
        directory = tmp_path / mode
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns(".lock"))
        intact = latest(directory)
        assert intact is not None and intact.name.startswith("ckpt-")
        STATE_DAMAGE[state](intact)
        POINTER_DAMAGE[pointer](directory, intact)
        return directory, _files(directory)

    state_ok = state == "none"
    # resume=True: continues exactly from the intact generation, or refuses touching nothing
    directory, before = prepared("resume")
    if state_ok:
        resumed = kill_fit.run("map", checkpoint_dir=directory, resume=True)
        _assert_same(resumed, reference, f"resumed after {damage}")
        assert json.loads((latest(directory) / "state.json").read_text())["step"] == 15
    else:
        with pytest.raises((ValueError, RuntimeError)) as err:
            kill_fit.run("map", checkpoint_dir=directory, resume=True)
        assert str(directory) in str(err.value)
        assert "overwrite=True" in str(err.value)
        assert _files(directory) == before
    # a new fit without overwrite: refused, nothing deleted
    directory, before = prepared("new")
    with pytest.raises((FileExistsError, RuntimeError)) as err:
        kill_fit.run("map", checkpoint_dir=directory)
    assert str(directory) in str(err.value) and "overwrite=True" in str(err.value)
    assert _files(directory) == before
    # overwrite=True: stopped before its first checkpoint, the old generations stay ...
    directory, before = prepared("overwrite")

    def stop(step: int, loss: float) -> None:
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kill_fit.run("map", checkpoint_dir=directory, overwrite=True, callback=stop)
    assert _files(directory) == before
    # ... and its first checkpoint replaces them
    replaced = kill_fit.run("map", checkpoint_dir=directory, overwrite=True)
    _assert_same(replaced, reference, f"overwrite after {damage}")
    names = sorted(p.name for p in directory.iterdir())
    assert names == [".lock", "LATEST", latest(directory).name]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"step": 10000}, ["step=10000", "losses holds 6 values"]),
        ({"batch": 99}, ["batch=99 exceeds the 5 batches per epoch"]),
        ({"step": 2}, ["step=2 but losses holds 6 values", "epoch=1 x 5"]),
        ({"step": 5, "losses": [0.0] * 5}, ["step=5 but epoch=1 x 5 batches per epoch"]),
        ({"epoch": -1}, ["epoch=-1 is not an integer >= 0"]),
    ],
    ids=["step-10000", "batch-99", "step-6-to-2", "step-and-losses", "epoch-negative"],
)
def test_an_edited_state_is_refused_naming_the_file_and_fields(tmp_path, edit, words):
    _interrupted_run(tmp_path)
    folder = latest(tmp_path)
    assert folder is not None
    _edit_state(folder, **edit)
    with pytest.raises(ValueError, match="position does not add up") as err:
        kill_fit.run("map", checkpoint_dir=tmp_path, resume=True)
    message = str(err.value)
    assert str(folder / "state.json") in message
    for word in words:
        assert word in message
    # the position check alone: unknown steps per epoch checks what it can
    meta = json.loads((folder / "state.json").read_text())
    if "step" in edit and "losses" not in edit:
        with pytest.raises(ValueError, match="losses holds"):
            checkpoint.check_position(meta, None, source="x/state.json")


def test_a_pointerless_generation_is_resumed_not_restarted(tmp_path, caplog):
    """The reported case: LATEST gone, ckpt-NNNNNN intact. Resume continues from it (logged);
    holds_run sees it."""
    _interrupted_run(tmp_path)
    intact = latest(tmp_path)
    (tmp_path / "LATEST").unlink()
    assert checkpoint.holds_run(tmp_path)
    with caplog.at_level("WARNING", logger="pyrobayes.infer.checkpoint"):
        assert latest(tmp_path) == intact
    assert "no LATEST pointer" in caplog.text and intact.name in caplog.text
    assert checkpoint.clean(tmp_path) == [] and intact.is_dir()


def test_no_complete_generation_is_refused_naming_what_is_missing(tmp_path):
    _interrupted_run(tmp_path)
    intact = latest(tmp_path)
    (intact / "rng.pt").unlink()
    with pytest.raises(RuntimeError, match="holds no complete generation") as err:
        latest(tmp_path)
    assert f"{intact.name}: no rng.pt" in str(err.value) and "overwrite=True" in str(err.value)
    assert checkpoint.holds_run(tmp_path)
