"""A job killed (SIGTERM, SIGKILL) before its first result no longer blocks the same command.

1. SIGTERM (a cluster scheduler's pre-emption, ``kill``, ``timeout``) killed ``pyrobayes fit``
   with the default action, so no cleanup ran: its ``config.json`` stayed, and the same command
   was refused ("already holds a run (config.json)") until ``--overwrite``. The command line now
   handles it as Ctrl-C (the jobs remove what they wrote) and exits 143 = 128 + 15.
2. SIGKILL (the OOM killer) lets no handler run: :func:`claim_run_folder` now lets a run of the
   same config take over a folder holding an unfinished run (its ``config.json``, no
   ``metrics.json``), and still refuses another config's without ``overwrite``.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyrobayes.cli import main
from pyrobayes.demo.run_folder import RunFolderError, claim_run_folder, run_files, write_json
from tests.test_causal_lm_job import write_config, write_task
from tests.test_silent_cases_round9 import _job_config


def _module_and_loader(job: str):
    """The job's module and its first loading step (patched: nothing is loaded)."""
    from pyrobayes.demo import causal_lm, pipeline

    return (pipeline, "build_data") if job == "pipeline" else (causal_lm, "load_base")


class _OldHandler(Exception):
    """Raised by the handler a test installs before ``main``: SIGTERM reached it, not main's."""


def _old_handler(signum, frame):
    raise _OldHandler


# ---------------------------------------------------------------- 1. SIGTERM on the command line
@pytest.mark.parametrize("job", ["pipeline", "causal_lm"])
def test_sigterm_is_handled_as_ctrl_c_exits_143_and_restores_the_handler(
    tmp_path, monkeypatch, caplog, capsys, job
):
    """A real SIGTERM sent to this process at the job's first loading step: exit 143, the folder
    (made by the run) removed, the same command runs again, and the handler that was installed
    before ``main`` is back after it. Before, SIGTERM reached that handler (the CLI installed
    none; with the default one the process died and left config.json)."""
    module, loader = _module_and_loader(job)
    out = tmp_path / "run"
    seen: list[list[str]] = []

    def terminate(*args, **kwargs):  # SIGTERM at the first loading step, folder recorded
        seen.append(sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in this sleep (PEP 475): never reached to its end
        raise AssertionError("SIGTERM did not stop the job")

    monkeypatch.setattr(module, loader, terminate)
    command = ["fit", str(_job_config(tmp_path, job)), "--quick", "--out", str(out)]
    command += ["--no-progress"]
    previous = signal.signal(signal.SIGTERM, _old_handler)
    try:
        with caplog.at_level(logging.WARNING, logger=module.__name__):
            assert main(command) == 143
        assert signal.getsignal(signal.SIGTERM) is _old_handler  # restored after main
        assert seen == [["config.json"]]  # the run had written its config when terminated
        assert not out.exists()  # the folder (made by this run) is gone with its files
        assert "interrupted before its first result" in caplog.text
        err = capsys.readouterr().err
        assert "pyrobayes fit: terminated (SIGTERM)" in err and "Traceback" not in err
        assert main(command) == 143  # the same command: not refused, it reaches the loader
        assert seen == [["config.json"]] * 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _killable_job(tmp_path: Path) -> tuple[list[str], Path]:
    """A causal-LM ``fit`` command (tiny LLaMA, 16 questions) whose first fit runs for minutes
    (epochs = 100000 of 2 steps, ~10 ms each), so a signal sent once its folder holds
    ``config.json`` (about 0.5 s before the zero-shot row) arrives before its first result."""
    write_task(tmp_path / "task.json", num=16)
    write_config(
        tmp_path / "job.toml", tmp_path / "task.json", families='["map"]', extra="epochs = 100000"
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pyrobayes.cli", "fit", str(tmp_path / "job.toml")]
    return [*cmd, "--out", str(out), "--no-progress"], out


def _start_and_wait_for(cmd: list[str], ready) -> subprocess.Popen:
    """Start ``cmd``; return once ``ready()`` holds (the test fails if the child ends first)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the job ended (rc {proc.returncode}) before it was ready:\n{err[-2000:]}")
        time.sleep(0.01)
    return proc


# ---------------------------------------------------------------- 2. SIGKILL: the config left
@pytest.mark.integration
def test_a_fit_process_killed_before_its_first_result_does_not_block_the_same_command(tmp_path):
    """Real signals on ``python -m pyrobayes.cli fit`` (two processes, ~10 s). SIGKILL during
    the first fit (after the zero-shot plot) leaves config.json and that plot; the same command
    takes the folder over (a logged warning) and runs. ``kill <pid>`` (SIGTERM) once it wrote
    its config: exit 143 and no run file left. Before, the second process exited 2 at once
    ("already holds a run (config.json, plots/reliability_zero-shot.png)"); without the SIGTERM
    handler a process died of the signal (returncode -15) and left its config.json."""
    cmd, out = _killable_job(tmp_path)
    plot = out / "plots" / "reliability_zero-shot.png"
    proc = _start_and_wait_for(cmd, plot.exists)
    proc.kill()  # SIGKILL: no handler runs
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = sorted(p.relative_to(out).as_posix() for p in run_files(out))
    assert left == ["config.json", "plots/reliability_zero-shot.png"]
    first = (out / "config.json").stat()

    def rewritten() -> bool:  # write_json's os.replace: a new file (inode) at config.json
        path = out / "config.json"
        try:
            now = path.stat()
        except FileNotFoundError:
            return False
        return (now.st_ino, now.st_mtime_ns) != (first.st_ino, first.st_mtime_ns)

    proc = _start_and_wait_for(cmd, rewritten)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-2000:]
    assert "pyrobayes fit: terminated (SIGTERM)" in err
    assert "holds an unfinished run of the same config" in err and "taking it over" in err
    assert "already holds a run" not in err
    assert run_files(out) == []  # the folder (kept: not made by this run) holds no run


def _leave_config_as_sigkill(monkeypatch, module, loader: str, seen: list[str]) -> None:
    """The job stops at its first loading step and removes nothing: the folder SIGKILL leaves
    (the config.json written by the job itself, so as the job writes it)."""

    def stop(*args, **kwargs):
        seen.append("loader")
        raise KeyboardInterrupt

    monkeypatch.setattr(module, loader, stop)
    monkeypatch.setattr(module, "remove_unfinished_run", lambda *args: None)


@pytest.mark.parametrize("job", ["pipeline", "causal_lm"])
def test_the_cli_takes_over_the_same_config_and_refuses_another(
    tmp_path, monkeypatch, caplog, capsys, job
):
    """Both jobs through ``main``: the same command after a run killed before its first result
    reaches the loader again (the CLI's and the job's claims accept the config the job wrote);
    another config (here: without --quick) is refused, exit 2, naming what to do."""
    module, loader = _module_and_loader(job)
    out = tmp_path / "run"
    seen: list[str] = []
    _leave_config_as_sigkill(monkeypatch, module, loader, seen)
    config = _job_config(tmp_path, job)
    command = ["fit", str(config), "--quick", "--out", str(out), "--no-progress"]
    assert main(command) == 130
    assert [p.name for p in run_files(out)] == ["config.json"] and seen == ["loader"]
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.run_folder"):
        assert main(command) == 130  # before: 2, "already holds a run (config.json)"
    assert seen == ["loader"] * 2
    assert "holds an unfinished run of the same config" in caplog.text
    assert "already holds a run" not in capsys.readouterr().err
    assert main(["fit", str(config), "--out", str(out), "--no-progress"]) == 2  # no --quick
    err = capsys.readouterr().err
    assert "holds only an unfinished run (its config.json, no metrics.json" in err
    assert "of another config" in err
    assert "(they differ in " in err and "num_test" in err  # one of the keys --quick sets
    assert "Pass --overwrite to replace it, or another --out." in err
    assert seen == ["loader"] * 2  # refused before the loader


def test_claim_run_folder_compares_configs_as_config_json_holds_them(tmp_path, caplog):
    """The library rule: a config equal after write_json's JSON round trip (a tuple is a list, a
    NaN equals itself) takes the folder over, removing the unfinished run's files; another is
    refused unless ``overwrite``; a run with a result, or a call without ``config`` (as
    before), is refused as any run is."""
    config = {"families": ["map"], "training": {"lr": 0.01, "betas": (0.9, 0.99)}}
    config["x"] = {"clip": math.nan}
    write_json(tmp_path / "config.json", config)
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "reliability_zero-shot.png").write_bytes(b"png")
    with pytest.raises(RunFolderError, match="already holds a run"):
        claim_run_folder(tmp_path, False)  # no config: nothing is taken over
    other = {**config, "training": {"lr": 0.1, "betas": (0.9, 0.99)}}
    with pytest.raises(RunFolderError, match=r"another config \(they differ in training\.lr\)"):
        claim_run_folder(tmp_path, False, config=other)
    (tmp_path / "metrics.json").write_text("[]")  # a run with a result: never taken over
    with pytest.raises(RunFolderError, match="already holds a run"):
        claim_run_folder(tmp_path, False, config=config)
    (tmp_path / "metrics.json").unlink()
    with caplog.at_level(logging.WARNING, logger="pyrobayes.demo.run_folder"):
        claim_run_folder(tmp_path, False, config=config)
    assert "taking it over" in caplog.text and "plots/reliability_zero-shot.png" in caplog.text
    assert run_files(tmp_path) == []
