"""Spec: data-parallel training (tinydiff/train/distributed.py). Two gloo ranks at batch 4 (2 rows each)
end an AR run where one process at batch 4 ends it, rank 0 alone writes, and a run that cannot
split is refused in one line before any process group forms.

Both sides train in float64 (torch's default dtype set to it in every process), so the only
difference left is the order the all-reduce sums the half-batch gradients in, and the weights
agree to a tight bound. In float32 that rounding, divided by AdamW's sqrt(v) where a gradient is
near zero, moved single weights by up to ~lr, and by how much depended on the CPU's kernels."""
import socket

import pytest
import torch
import torch.multiprocessing as mp
from test_train import argv, interrupt_at

import train
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_checkpoint
from tinydiff.train.distributed import Ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


EXACT = 1e-12  # float64: the all-reduce's summation order moves weights by ~1e-16; float32's moved them 2e-4


@pytest.fixture(autouse=True)
def float64():
    """Every model these tests build, trains and loads is float64 (the ranks set it themselves)."""
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(torch.float32)


def rank_main(rank: int, world: int, port: int, args: list):
    """One torchrun rank: the environment torchrun gives it, then train.py's main, in float64."""
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    train.main(args)


def assert_same_weights(a: dict, b: dict):
    """Two state dicts of float64 weights, equal to EXACT of each tensor's largest magnitude."""
    assert a.keys() == b.keys()
    for name, w in a.items():
        assert w.dtype == b[name].dtype == torch.float64, name  # or float32 rounding is back
        assert (w - b[name]).abs().max() <= EXACT * max(1.0, w.abs().max().item()), name


def test_two_ranks_follow_one_process_at_the_same_global_batch(story_file, tmp_path):
    args = argv(story_file, tmp_path / "one", "--batch-size", "4", kind="ar")
    train.main(args)  # tokenises too: the ranks below find the cache
    one = load_checkpoint(tmp_path / "one" / "ckpt.pt")
    two_args = argv(story_file, tmp_path / "two", "--batch-size", "4", kind="ar")
    mp.spawn(rank_main, args=(2, free_port(), two_args), nprocs=2, join=True)
    two = load_checkpoint(tmp_path / "two" / "ckpt.pt")
    assert two["step"] == one["step"] == 6 and two["args"] == {**one["args"]}
    # The same global batch, so the same steps up to the all-reduce's summation order.
    assert_same_weights(one["model"], two["model"])
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [".lock", "ckpt.pt"]  # one writer, no temps


def test_a_run_killed_in_one_process_resumes_on_two_ranks(story_file, tmp_path, monkeypatch):
    """The batch rule does not depend on the number of ranks, so a run continues with any."""
    train.main(argv(story_file, tmp_path / "full", "--batch-size", "4", kind="ar"))

    def kill():  # dies in step 5: the step-4 checkpoint is what is left
        raise SystemExit("killed")
    interrupt_at(monkeypatch, "ar", 5, kill)
    with pytest.raises(SystemExit):
        train.main(argv(story_file, tmp_path / "run", "--batch-size", "4", kind="ar"))
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 4
    mp.spawn(rank_main, args=(2, free_port(), ["--out", str(tmp_path / "run"), "--resume"]), nprocs=2, join=True)
    full, run = (load_checkpoint(tmp_path / name / "ckpt.pt") for name in ("full", "run"))
    assert run["step"] == 6
    assert_same_weights(full["model"], run["model"])


def settling_rank(rank: int, world: int, port: int, rounds: int):
    """A rank that ends `rounds` collectives as a finished run ends its last one (Ranks.settle)."""
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    ranks = Ranks()
    ranks.start("cpu")
    released = sum(ranks.settle() for _ in range(rounds))
    ranks.stop(finished=False)
    assert released == rounds, f"rank {rank}: gloo still held {rounds - released} of {rounds} last tensors"


def test_a_finished_run_leaves_no_tensor_held_by_gloo():
    """Right after an all-reduce returns, gloo's worker thread sometimes still holds its tensor (measured on
    two cores: 2-3% of all-reduces per rank, 5-23% while other work keeps the cores busy); a rank whose
    worker still held one when the interpreter shut down aborted at exit. settle() waits until it lets
    go: both ranks' 100 rounds see the hold released. Without the wait, a 2% race shows up in the
    200 rounds with probability 1 - 0.98^200 > 0.98."""
    mp.spawn(settling_rank, args=(2, free_port(), 100), nprocs=2, join=True)


def test_a_run_that_cannot_split_is_refused_before_any_work(story_file, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UserError, match="--batch-size 3 does not split over 2 ranks"):
        train.main(argv(story_file, tmp_path / "odd", "--batch-size", "3", kind="ar"))
    with pytest.raises(UserError, match="--regenerate trains in one process only"):
        train.main(argv(story_file, tmp_path / "regen", "--regenerate", "4", "--target", "x.pt", kind="ar"))
    assert not (tmp_path / "odd").exists()
    monkeypatch.setenv("LOCAL_RANK", "1")  # a second process on a machine with one GPU (here: none)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="more processes on this machine than it has GPUs.*--nproc_per_node=1"):
        Ranks().start("cuda")
