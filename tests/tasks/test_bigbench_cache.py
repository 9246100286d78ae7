"""``make lm-data``'s BIG-bench step: the sdist's sha256 is checked and only the named tasks'
``task.json`` are extracted to ``<cache>/bigbench/<task>/task.json``."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest

from pyrobayes.tasks import read_bigbench
from pyrobayes.tasks.cache import bigbench_task_path, extract_bigbench

ROOT = "bigbench-1.0.0/bigbench/benchmark_tasks/"


def fake_sdist(path):
    """A tarball laid out like bigbench-1.0.0.tar.gz: two tasks (one a subtask), a README."""
    files = {
        ROOT + "timedial/task.json": {"examples": [{"input": "a", "target_scores": {"x": 1}}]},
        ROOT + "goal_step_wikihow/step_inference/task.json": {
            "examples": [{"input": "Goal", "target_scores": {"do it": 0, "do that": 1}}]
        },
        ROOT + "timedial/README.md": "not json",
    }
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            data = (content if isinstance(content, str) else json.dumps(content)).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_extracts_only_the_named_tasks_after_checking_the_digest(tmp_path):
    sdist = tmp_path / "bigbench-1.0.0.tar.gz"
    digest = fake_sdist(sdist)
    cache = tmp_path / "cache"
    paths = extract_bigbench(sdist, ["goal_step_wikihow/step_inference"], cache, sha256=digest)
    want = cache / "bigbench" / "goal_step_wikihow" / "step_inference" / "task.json"
    assert paths == [want] == [bigbench_task_path("goal_step_wikihow/step_inference", cache)]
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file()) == [
        "bigbench/goal_step_wikihow/step_inference/task.json"
    ]
    (example,) = read_bigbench(want)  # readable by the task reader
    assert example.choices == ("do it", "do that") and example.answer == 1


def test_a_wrong_digest_or_an_unknown_task_is_refused(tmp_path):
    sdist = tmp_path / "bigbench-1.0.0.tar.gz"
    digest = fake_sdist(sdist)
    with pytest.raises(ValueError, match="has sha256 .* expected 0{64}; delete it"):
        extract_bigbench(sdist, ["timedial"], tmp_path, sha256="0" * 64)
    with pytest.raises(ValueError, match=r"no task.json for \['no_such_task'\]"):
        extract_bigbench(sdist, ["timedial", "no_such_task"], tmp_path, sha256=digest)
    with pytest.raises(FileNotFoundError, match="make lm-data"):
        extract_bigbench(tmp_path / "missing.tar.gz", ["timedial"], tmp_path)
