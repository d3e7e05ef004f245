"""Spec: train.py --compile (the training step traced and compiled by torch.compile; the default on CUDA)
trains as the eager step does. In float64, so that any CPU agrees: the same loss at each of 20 steps and the
same weights after them, up to float64 rounding carried through Adam (compiled kernels sum in another
order); a run resumes across the two, either way; the compile time is reported apart from tok/s. Every
kind compiles: traced through AOTAutograd (forward and backward graphs, inductor's input) for each, with
inductor itself for mdlm, the default kind (its C++ compile costs seconds a graph on a CPU).
"""
import functools
import os
import re
import signal

import pytest
import torch

import train
from tinydiff.io.checkpoint import load_checkpoint

pytestmark = pytest.mark.compile
# Relative to a loss or weight tensor's largest magnitude: measured 2.5e-16 (losses) and 1.2e-13 (weights after
# 20 steps) for mdlm, 3.1e-12 (weights) for mdlm-moe; float32's rounding (1e-7) or any real change exceeds it.
BOUND = 1e-10


@pytest.fixture(autouse=True)
def float64():
    import torch._dynamo  # here, not at the top: dynamo imports Triton, which the kernel tests import first
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the model train.py builds is float64; its rope tables stay float32
    with torch._dynamo.config.patch(recompile_limit=64):  # a worker compiles many models: never eager past 8
        yield  # (torch's own patch: pytest's monkeypatch deletes a config entry on undo)
    torch.set_default_dtype(before)


def run(story_file, out, *extra, kind="mdlm", steps=20, monkeypatch=None, stop_at=None):
    """train.py for `steps` steps; each training step's loss, in order. stop_at: Ctrl-C in that step."""
    real = train.training_loss
    loss_fn, more = real(kind)
    losses = []

    def recorded(model, windows, generator):
        if model.training and len(losses) + 1 == stop_at:
            os.kill(os.getpid(), signal.SIGINT)  # the step finishes, is saved, and the run stops
        loss, stats = loss_fn(model, windows, generator)
        if model.training:
            losses.append(loss.item())
        return loss, stats
    monkeypatch.setattr(train, "training_loss", lambda k: (recorded, more) if k == kind else real(k))
    shape = [] if "--target" in extra else ["--preset", "draft", "--context", "16"]
    train.main(["--model", kind, "--data", str(story_file), "--out", str(out), *shape, "--batch-size", "2",
                "--max-steps", str(steps), "--warmup", "2", "--eval-every", "10", "--eval-batches", "1", "--seed", "3",
                "--device", "cpu", *extra])
    monkeypatch.setattr(train, "training_loss", real)
    return losses


def assert_close(ours, theirs):
    for k in theirs:
        if theirs[k].is_floating_point():
            scale = float(theirs[k].abs().max())
            assert float((ours[k] - theirs[k]).abs().max()) <= BOUND * scale, k


def graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def weights(out):
    return load_checkpoint(out / "ckpt.pt")["model"]


def test_a_compiled_run_takes_the_eager_runs_steps_and_resumes_across_the_two(story_file, tmp_path, monkeypatch,
                                                                               capsys):
    eager = run(story_file, tmp_path / "eager", "--no-compile", monkeypatch=monkeypatch)
    assert "compiling" not in capsys.readouterr().out
    before = graphs()
    compiled = run(story_file, tmp_path / "compiled", "--compile", monkeypatch=monkeypatch)
    assert graphs() > before  # a graph was compiled (and ran: the losses below)
    printed = capsys.readouterr().out
    assert re.search(r"compiled the training step in [\d.]+ s \(its first step, left out of tok/s\)", printed)
    assert re.search(r"done: 20 steps \(19 in \d+ s at [\d,]+ tok/s, compiling \d+ s apart\)", printed)
    assert len(compiled) == len(eager) == 20
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager)) <= BOUND
    assert_close(weights(tmp_path / "compiled"), weights(tmp_path / "eager"))
    for first, then in (("--compile", "--no-compile"), ("--no-compile", "--compile")):
        out = tmp_path / f"from{first}"
        run(story_file, out, first, monkeypatch=monkeypatch, stop_at=11)
        assert load_checkpoint(out / "ckpt.pt")["step"] == 11
        rest = run(story_file, out, "--resume", then, monkeypatch=monkeypatch)
        assert max(abs(a - b) / abs(b) for a, b in zip(rest, eager[11:])) <= BOUND and len(rest) == 9
        assert_close(weights(out), weights(tmp_path / "eager"))


@pytest.mark.parametrize("kind", ["ar", "mdlm-moe", "ar-moe", "dflash", "eagle3"])
def test_every_kind_traces_forward_and_backward_and_trains_as_eagerly(kind, story_file, tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    extra = []
    if kind in ("dflash", "eagle3"):  # a drafter: its layers and its frozen target's forward compiled
        run(story_file, tmp_path / "target", "--context", "24", kind="ar", steps=1, monkeypatch=monkeypatch)
        extra = ["--target", str(tmp_path / "target" / "ckpt.pt")]
    eager = run(story_file, tmp_path / "eager", "--no-compile", *extra, kind=kind, steps=4, monkeypatch=monkeypatch)
    before = graphs()
    compiled = run(story_file, tmp_path / "compiled", "--compile", *extra, kind=kind, steps=4, monkeypatch=monkeypatch)
    assert graphs() >= before + (2 if extra else 1)  # a drafter's: its layers' and its target's
    assert max(abs(a - b) / abs(b) for a, b in zip(compiled, eager)) <= BOUND and len(compiled) == 4
    assert_close(weights(tmp_path / "compiled"), weights(tmp_path / "eager"))
