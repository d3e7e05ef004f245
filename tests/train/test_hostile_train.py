"""Spec: train.py under careless and hostile input. Every number is checked where it enters, every
checkpoint it reads (--resume, --init, --target, --distill) before a model is built from it, and
what could fail at the end (the run folder, the sample's room) before the first step; each
refusal is one `error:` line and writes nothing. A run folder holds one run at a time; a resumed
run reads the data it started with; Ctrl-C while tokenising leaves no half-written cache; a full
disk during a save is one line and keeps the previous checkpoint; a killed save's temp file is
cleaned at the next start."""
import shutil
import subprocess
import sys

import pytest
from conftest import write_stories
from hostile import NON_FINITE, exit_status, refused, snapshot, tampered_checkpoints

import train
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_checkpoint
from tinydiff.io.files import claim_run_folder
from tinydiff.tokenizer import Tokenizer

COUNTS = ["0", "-1", "1.5", "1e12", "ten"]
NUMBERS = {
    "--max-steps": COUNTS, "--batch-size": [*COUNTS, "100000"], "--eval-every": COUNTS,  # a huge batch: memory
    "--eval-batches": [*COUNTS, "100000"],
    "--ckpt-every": COUNTS,  # 0 once failed at the first save, after the training had run
    "--lr": ["0", "-1", "100"], "--min-lr": ["-1"], "--warmup": ["-1", "1.5"], "--weight-decay": ["-1"],
    "--grad-clip": ["0", "-1"],  # -1 once turned training into gradient ascent
    "--seed": ["-1", str(2**64), "1.5"], "--context": ["1", "0", "8", str(2**40)],
    "--noise-block": ["-1"], "--block-size": ["1", "0"], "--regenerate": ["0", "-5", str(10**7)],  # 0 once meant "no"
    "--steps-ahead": ["0"], "--drafter-layers": ["0"], "--feature-layers": ["-1", "1,x", ","],
    "--distill-stories": ["0", str(10**7)], "--certainty-weight": ["-1"], "--teacher-temperature": ["-1", "1e-9"],
    "--anchor-weight": ["-1"], "--experts": ["0"], "--top-k": ["0"], "--route-threshold": ["0", "1.5"],
    "--route-guard": ["0"], "--route-mask-vote": ["0", "-1"],
}
CASES = [(flag, value) for flag, values in NUMBERS.items() for value in [*values, *NON_FINITE]]


def base(story_file, out):
    return [str(a) for a in ["--data", story_file, "--out", out, "--preset", "draft", "--context", "16",
                             "--batch-size", "2", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1",
                             "--device", "cpu"]]


@pytest.mark.parametrize("flag, value", CASES)
def test_every_bad_number_is_refused_at_the_command_line(story_file, tmp_path, capsys, flag, value):
    line = refused(train.main, [*base(story_file, tmp_path / "out"), flag, value], capsys, tmp_path)
    assert f"argument {flag}:" in line


def test_what_would_fail_at_the_end_fails_first(story_file, tmp_path, capsys, monkeypatch):
    (tmp_path / "a-file").write_text("")
    for out, message in ((tmp_path / "a-file", "is a file, not a folder"),
                         (tmp_path / "a-file" / "run", "is not a writable folder")):
        assert message in refused(train.main, base(story_file, out), capsys, tmp_path)
    # --cache-dir is read only when the data's folder is read-only: a file there failed nothing, silently
    line = refused(train.main, [*base(story_file, tmp_path / "out"), "--cache-dir", str(tmp_path / "a-file")], capsys,
                   tmp_path)
    assert "--cache-dir" in line and "is a file, not a folder" in line
    monkeypatch.setattr("tinydiff.io.files.os.access", lambda path, mode: False)  # a read-only filesystem
    assert "is not a writable folder" in refused(train.main, base(story_file, tmp_path / "ro"), capsys, tmp_path)


def test_flags_a_run_would_ignore_are_refused(story_file, tmp_path, capsys):
    train.main(base(story_file, tmp_path / "first"))
    init = ["--data", story_file, "--out", tmp_path / "x", "--init", tmp_path / "first" / "ckpt.pt", "--device", "cpu"]
    for flags in (["--preset", "13m"], ["--context", "64"]):  # once: trained --init's shape, recorded these
        assert "continues that model, in its shape: drop" in refused(train.main, [*init, *flags], capsys, tmp_path)
    drafter = ["--model", "dflash", "--target", tmp_path / "first" / "ckpt.pt", "--data", story_file, "--preset", "tiny"]
    assert "takes its dimensions from --target: drop --preset" in refused(train.main, drafter, capsys, tmp_path)


@pytest.fixture
def tampered(tmp_path, tiny_model, tiny_config):
    return tampered_checkpoints(tmp_path / "bad", tiny_model, tiny_config)


@pytest.mark.parametrize("damage", ["huge n_layer", "n_head 0", "string size", "other vocabulary", "NaN weights",
                                    "negative step", "code inside", "unknown kind", "wrong shape", "a folder"])
def test_a_damaged_checkpoint_is_refused_wherever_it_enters(story_file, tmp_path, capsys, tampered, damage):
    bad = tampered[damage]
    for flags in (["--init", bad], ["--model", "dflash", "--target", bad], ["--distill", bad]):
        argv = ["--data", story_file, "--out", tmp_path / "x", "--device", "cpu", *flags]
        assert str(bad) in refused(train.main, argv, capsys, tmp_path)
    run = tmp_path / "resumed"
    run.mkdir()
    if bad.is_file():
        shutil.copy(bad, run / "ckpt.pt")
        assert "ckpt.pt" in refused(train.main, ["--out", run, "--resume"], capsys, tmp_path)


def test_a_second_run_into_the_same_folder_is_refused(story_file, tmp_path, capsys):
    out = tmp_path / "out"
    with claim_run_folder(out):  # the first run, alive
        assert "another run (PID" in refused(train.main, base(story_file, out), capsys, story_file.parent)
    train.main(base(story_file, out))  # the lock went with its holder
    assert load_checkpoint(out / "ckpt.pt")["step"] == 2


def test_a_resumed_run_reads_the_data_it_started_with(story_file, tmp_path):
    out = tmp_path / "out"
    train.main([*base(story_file, out), "--max-steps", "4", "--ckpt-every", "2"])
    story_file.write_text(story_file.read_text().replace("Lily", "Lucy"))  # same path, other content
    with pytest.raises(UserError, match="is not the data the run in .* started with"):
        train.main(["--out", str(out), "--resume"])


def test_ctrl_c_while_tokenising_leaves_no_cache_and_no_folder(story_file, tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(Tokenizer, "encode_batch", interrupted)
    before = snapshot(tmp_path)
    assert exit_status(train.main, base(story_file, tmp_path / "out"), interrupted=train.INTERRUPTED) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("interrupted: before training started")
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_killed_saves_temp_file_is_cleaned_at_the_next_start(story_file, tmp_path):
    out = tmp_path / "out"
    train.main([*base(story_file, out), "--max-steps", "2"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = dead.stdout.strip()  # a process that has ended: its temp files are stale
    left = [out / f".ckpt.pt.tmp{pid}", story_file.parent / f".stories.txt.train.u16.tmp{pid}"]
    for path in left:
        path.write_bytes(b"half a file")
    other = write_stories(story_file.parent / "other.txt", 12)  # tokenising it cleans the data's folder
    train.main([*base(other, tmp_path / "other"), "--max-steps", "1"])
    train.main(["--out", str(out), "--resume"])  # a finished run, resumed: the claim cleans its folder
    assert not any(path.exists() for path in left)


def mount_tmpfs(path, size: int) -> bool:
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(story_file, tmp_path, capsys):
    train.main(base(story_file, tmp_path / "sized"))
    size = (tmp_path / "sized" / "ckpt.pt").stat().st_size  # room for one checkpoint, not a second beside it
    disk = tmp_path / "disk"
    if not mount_tmpfs(disk, int(size * 1.5)):
        pytest.skip("cannot mount a small tmpfs here (the test needs root); the full-disk case is unchecked")
    try:
        out = disk / "run"
        status = exit_status(train.main, [*base(story_file, out), "--max-steps", "4", "--ckpt-every", "2"])
        err = capsys.readouterr().err
        assert status == 1 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith(f"error: cannot write {out / 'ckpt.pt'}")
        assert "the previous one is intact" in err
        assert load_checkpoint(out / "ckpt.pt")["step"] == 2  # the last good checkpoint survived
        assert sorted(p.name for p in out.iterdir()) == [".lock", "ckpt.pt"]  # no temp file left behind
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
