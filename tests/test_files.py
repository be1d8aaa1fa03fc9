"""A run's files are written whole or not at all: a crash (kill -9) mid-write leaves the previous version."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distillspec.config import DistillConfig, load_config
from distillspec.errors import DistillSpecError
from distillspec.files import RecordLog, exclusive, read_json, write_atomic, write_folder, write_json
from distillspec.training.learner import Learner, checkpoint_log, load_checkpoint, save_checkpoint

from .conftest import ROOT


def test_an_atomic_write_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = write_json(tmp_path / "results.json", {"a": 1})
    write_atomic(path, "x" * 1000)
    assert path.read_text() == "x" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert read_json(path) is None  # not JSON
    write_json(path, [1, 2])
    assert read_json(path) == [1, 2] and read_json(tmp_path / "missing.json") is None


def test_a_folder_whose_writing_fails_stays_as_it_was(tmp_path):
    folder = tmp_path / "draft"
    write_folder(folder, lambda tmp: (tmp / "weights").write_text("v1"))

    def broken(tmp: Path) -> None:
        (tmp / "weights").write_text("half of v2")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_folder(folder, broken)
    assert (folder / "weights").read_text() == "v1"
    assert [p.name for p in tmp_path.iterdir()] == ["draft"]
    # a crash between the two renames leaves the old folder aside: the next write brings it back first
    os.replace(folder, tmp_path / ".draft.old")
    with pytest.raises(OSError):
        write_folder(folder, broken)
    assert (folder / "weights").read_text() == "v1"


@pytest.mark.parametrize("what", ["file", "folder"])
def test_kill_9_while_writing_leaves_the_previous_version(tmp_path, what):
    target = tmp_path / ("results.json" if what == "file" else "checkpoint")
    if what == "file":
        write_json(target, {"version": 1})
    else:
        write_folder(target, lambda tmp: (tmp / "step.json").write_text(json.dumps({"step": 1})))
    started = tmp_path / "started"
    # The writer is killed while the new version is half written (the file's data written, not yet renamed; the
    # folder's first file written, the rest to come).
    script = f"""
import json, time
from pathlib import Path
from distillspec.files import write_atomic, write_folder

def slow(tmp):
    (tmp / "step.json").write_text(json.dumps({{"step": 2}}))
    Path({str(started)!r}).touch()
    time.sleep(60)

class Slow(str):
    def encode(self):
        Path({str(started)!r}).touch()
        time.sleep(60)

if {what!r} == "file":
    write_atomic({str(target)!r}, Slow('{{"version": 2}}'))
else:
    write_folder({str(target)!r}, slow)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    deadline = time.monotonic() + 60
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists(), "the writer never started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if what == "file":
        assert read_json(target) == {"version": 1}
    else:
        assert read_json(target / "step.json") == {"step": 1}
        write_folder(target, lambda tmp: (tmp / "step.json").write_text(json.dumps({"step": 3})))
        assert read_json(target / "step.json") == {"step": 3}


@pytest.mark.parametrize("train", ["all", "lora:2", "scales"])
def test_a_checkpoint_round_trips_and_loads_without_unpickling_code(tmp_path, text_pair, tokenizer, task, train):
    """The learner's state (weights, optimizer, scheduler, step; LoRA's factors) comes back as saved, through
    ``torch.load`` with ``weights_only=True`` (a checkpoint cannot run code when a run resumes from it)."""
    from distillspec.training.rollout import encode_examples

    target, draft = text_pair
    cfg = DistillConfig(steps=4, batch_size=2, max_new_tokens=4, recipe="supkd", train=train)
    learner = Learner(copy.deepcopy(draft), target, cfg)
    for _ in range(2):  # the first step's rate is 0 (the warm-up)
        learner.step(encode_examples(tokenizer, task.train[:2], max_len=32))
    log = RecordLog(tmp_path / "log.jsonl")
    log.append({"step": 1})
    save_checkpoint(tmp_path / "ckpt", learner, tokenizer, log, seconds=1.5, extra={"ledger": {"a": 1}})
    log.append({"step": 2})  # after the checkpoint: a rerun from it drops this record
    other = Learner(copy.deepcopy(draft), target, cfg)
    seconds = load_checkpoint(tmp_path / "ckpt", other)
    assert checkpoint_log(tmp_path / "ckpt", log.path).records == [{"step": 1}]
    assert (seconds, other.step_count) == (1.5, learner.step_count)
    assert (tmp_path / "log.jsonl").read_text() == '{"step": 1}\n'  # the file too: records are appended after it
    assert not (tmp_path / "ckpt" / "train_log.json").exists()  # a checkpoint counts the records, never copies them
    with pytest.raises(DistillSpecError, match="holds 1 records, its checkpoint counts 5"):
        RecordLog(log.path, 5)
    for a, b in zip(learner.draft.parameters(), other.draft.parameters(), strict=True):
        assert torch.equal(a, b)
    if learner.adapter is not None:
        for a, b in zip(learner.adapter.params, other.adapter.params, strict=True):
            assert torch.equal(a, b) and torch.count_nonzero(b) > 0
    assert read_json(tmp_path / "ckpt" / "ledger.json") == {"a": 1}


def test_a_cut_off_results_file_does_not_stop_the_rerun(tmp_path, capsys):
    from cluster.distill_job import check_rerun
    from distillspec.errors import DistillSpecError

    cfg = load_config(None, [f"output_dir={tmp_path}"])
    (tmp_path / "results.json").write_text('{"records": [')
    check_rerun(cfg, tmp_path)
    assert "does not parse" in capsys.readouterr().out
    write_json(tmp_path / "results.json", {"records": []})
    with pytest.raises(DistillSpecError, match="holds a finished run"):
        check_rerun(cfg, tmp_path)
    # overwrite=true runs it again from the start: a finished run's checkpoints would leave nothing to train
    for name in ("learner/checkpoint_000001", "checkpoint"):
        (tmp_path / name).mkdir(parents=True)
    write_json(tmp_path / "train_log.jsonl", {})
    check_rerun(load_config(None, [f"output_dir={tmp_path}", "overwrite=true"]), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_one_job_at_a_time_writes_into_a_folder(tmp_path):
    """A second job on a held folder stops at once naming the holder; a holder killed with SIGKILL leaves no lock."""
    from cluster.distill_job import run

    code = "import sys, time; from distillspec.files import exclusive\nwith exclusive(sys.argv[1]):\n"
    code += "    print('held', flush=True)\n    time.sleep(120)"
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DistillSpecError, match=f"in use by another job \\(process {holder.pid}\\)"):
            run(load_config(None, [f"output_dir={tmp_path}"]))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with exclusive(tmp_path):
        with pytest.raises(DistillSpecError, match="in use"), exclusive(tmp_path):
            pass
    with exclusive(tmp_path):
        pass
