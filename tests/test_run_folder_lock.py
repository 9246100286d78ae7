"""A run holds its folder's lock for its whole life: a second run of the same command on one
folder is refused while the first runs, and takes it over once the first is killed.

Before, a folder holding only a ``config.json`` (a run before its first result) was taken over
by the same config whether its run had been killed by SIGKILL or was still running: the second
run deleted the first one's files under it. Now the jobs enter
:func:`~pyrobayes.demo.run_folder.claimed_run_folder`, which holds ``fcntl.flock`` on the folder
until the job ends (the OS drops it when the process dies), and every claim refuses a folder
another live run holds. A join wrote its ``config.json`` after copying the fits, so a join killed
while copying left posteriors without a config, which blocked the same join; it now writes the
config first and takes over such a folder.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyrobayes.cli import main
from pyrobayes.demo import join_runs as join_module
from pyrobayes.demo import pipeline, run_folder
from pyrobayes.demo.join_runs import join_runs
from pyrobayes.demo.run_folder import (
    RunFolderError,
    claim_run_folder,
    claimed_run_folder,
    run_files,
)
from tests.common import fake_lm_run

pytestmark = pytest.mark.skipif(run_folder.fcntl is None, reason="no fcntl.flock (Windows)")

#: a run's config.json as the holder below writes it (a run's: it names its families)
_CONFIG = {"families": ["map"], "training": {"lr": 0.01}}

#: a run that claims ``argv[1]``, writes its config, says so, and runs until it is killed
_HOLDER = """
import sys, time
from pathlib import Path
from pyrobayes.demo.run_folder import claimed_run_folder, write_json
out, config = Path(sys.argv[1]), {"families": ["map"], "training": {"lr": 0.01}}
with claimed_run_folder(out, False, folder="--out", replace="--overwrite", config=config):
    write_json(out / "config.json", config)
    print("holding", flush=True)
    time.sleep(60)
"""


def _start_holder(out: Path) -> subprocess.Popen:
    """A second process running :data:`_HOLDER` on ``out``, returned once it holds the lock."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until the holder prints (or dies: "")
    if line.strip() != "holding":
        proc.kill()
        pytest.fail(f"the holder did not start: {proc.communicate()[1][-2000:]}")
    return proc


def test_a_folder_another_live_run_holds_is_refused_until_that_run_dies(tmp_path, caplog, capsys):
    """Another process runs on ``out`` before its first result (its config.json, no
    metrics.json): the same config's claim, a job's claim and the command line's are refused
    naming that process, and its config is left alone; once it is killed (SIGKILL: no handler
    runs, the OS drops the lock) the same claim takes the folder over. Before, the first claim
    took the folder over at once, deleting the running run's config.json."""
    out = tmp_path / "run"
    proc = _start_holder(out)
    try:
        with pytest.raises(RunFolderError, match="another run is writing there") as err:
            claim_run_folder(out, False, folder="--out", replace="--overwrite", config=_CONFIG)
        if Path("/proc/locks").is_file():  # Linux names the holder
            assert f"(process {proc.pid} holds the folder's lock)" in str(err.value)
        assert "Wait for that run to end (or stop it), or pass another --out." in str(err.value)
        with pytest.raises(RunFolderError, match="another run is writing there"):
            claim_run_folder(out, True, config=_CONFIG)  # overwrite too: it is still writing
        with pytest.raises(RunFolderError, match="another run is writing there"):
            with claimed_run_folder(out, False, config=_CONFIG):
                pytest.fail("a job entered a folder another run holds")
        config = tmp_path / "job.toml"
        config.write_text('families = ["map"]\n')
        assert main(["fit", str(config), "--quick", "--out", str(out), "--no-progress"]) == 2
        assert "another run is writing there" in capsys.readouterr().err
        assert json.loads((out / "config.json").read_text()) == _CONFIG  # left alone
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    with caplog.at_level(logging.WARNING, logger=run_folder.__name__):
        claim_run_folder(out, False, config=_CONFIG)  # the killed run's folder: taken over
    assert "taking it over" in caplog.text and run_files(out) == []


def test_a_job_holds_its_folder_until_it_ends_and_the_process_can_run_it_again(
    tmp_path, monkeypatch
):
    """The main job, stopped at its first loading step twice in one process: while it runs,
    another claim of its folder (here from the same process: a second open of the folder is
    another lock) is refused naming this process, and the job's own claim was not refused by
    its lock; once it ended, the same process runs it again there. Before, the claim inside
    the job took the folder over from the running job."""
    config = pipeline.resolve_config({"families": ["map"]}, quick=True)
    out = tmp_path / "run"
    seen: list[str] = []

    def loader(*args, **kwargs):
        with pytest.raises(RunFolderError, match="another run is writing there") as err:
            claim_run_folder(out, False, config=json.loads((out / "config.json").read_text()))
        seen.append(str(err.value))
        assert (out / "config.json").is_file()  # not taken over
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "build_data", loader)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            pipeline.run(config, out, progress_bar=False)
    assert len(seen) == 2 and f"another job of this process (pid {os.getpid()})" in seen[0]
    assert not out.exists()  # made by the job, removed with its files: nothing else in it
    with claimed_run_folder(out, False) as made:  # and free for the next job
        assert made == [out, out / "guides", out / "plots"]


def test_a_folder_replaced_while_it_is_locked_is_locked_again(tmp_path, monkeypatch):
    """A folder removed and made again between the open and the lock (a run that stopped
    before its first result removes its folder): the lock taken is on the folder now at the
    path, so a claim of that folder is refused. Locking the open, removed folder left the new
    one free for a second run."""
    out = tmp_path / "run"
    out.mkdir()
    flock, calls = run_folder.fcntl.flock, []

    def replacing_flock(fd, operation):
        calls.append(operation)
        if len(calls) == 1:  # after the first open: another run removes and remakes it
            out.rmdir()
            out.mkdir()
        return flock(fd, operation)

    monkeypatch.setattr(run_folder.fcntl, "flock", replacing_flock)
    with claimed_run_folder(out, False):
        monkeypatch.setattr(run_folder.fcntl, "flock", flock)
        with pytest.raises(RunFolderError, match="another run is writing there"):
            claim_run_folder(out, False)
    assert len(calls) == 2  # locked twice: the removed folder, then the one at the path


def test_a_join_killed_while_copying_is_taken_over_by_the_same_join(tmp_path, monkeypatch, caplog):
    """A join stopped after copying the fits (as SIGKILL would: nothing removed) leaves its
    config.json, so the same join takes the folder over and completes; another join (other
    seeds) is refused as an unfinished run of another config. Before, the config was written
    after the copies, and the same join was refused ("already holds a run (guides/...)")."""
    runs = [fake_lm_run(tmp_path / f"s{seed}", seed) for seed in (0, 1)]
    out = tmp_path / "joined"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(join_module, "_copy_seed_free", killed)
    # SIGKILL runs no handler: the join's removal of an unfinished run does not happen
    monkeypatch.setattr(join_module, "remove_unfinished_run", lambda *args: None)
    with pytest.raises(KeyboardInterrupt):
        join_runs(runs, out)
    left = sorted(p.relative_to(out).as_posix() for p in run_files(out))
    assert "config.json" in left and "guides/map-seed0.safetensors" in left
    assert "metrics.json" not in left
    monkeypatch.undo()
    with pytest.raises(RunFolderError, match=r"unfinished run .* of another config"):
        join_runs([runs[0], fake_lm_run(tmp_path / "s2", 2)], out)
    with caplog.at_level(logging.WARNING, logger=run_folder.__name__):
        joined = join_runs(runs, out)
    assert "taking it over" in caplog.text
    assert [r["seed"] for r in joined] == [None, 0, 1]
    assert json.loads((out / "config.json").read_text())["seeds"] == [0, 1]


def test_a_join_into_a_folder_a_running_job_holds_is_refused(tmp_path):
    """join_runs enters the folder's lock as the jobs do: a join into a folder a job of this
    process holds is refused, and writes nothing there."""
    runs = [fake_lm_run(tmp_path / f"s{seed}", seed) for seed in (0, 1)]
    out = tmp_path / "joined"
    start = time.monotonic()
    with claimed_run_folder(out, False):
        with pytest.raises(RunFolderError, match="another run is writing there"):
            join_runs(runs, out)
        assert run_files(out) == []
    assert time.monotonic() - start < 5  # refused at once (the lock is not waited for)
    join_runs(runs, out)
    assert [p.name for p in run_files(out)] == [
        "config.json",
        "metrics.json",
        "table.md",
        "map-seed0.safetensors",
        "map-seed1.safetensors",
        "reliability_map-seed0.png",
        "reliability_map-seed1.png",
    ]
