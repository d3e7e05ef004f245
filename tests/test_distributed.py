"""Spec: data-parallel training (tinydiff/distributed.py). Two gloo ranks at batch 4 (2 rows each)
end an AR run where one process at batch 4 ends it (the same loss to 1e-6), rank 0 alone writes,
and a run that cannot split is refused in one line before any process group forms."""
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tinydiff import trainer as train
from tinydiff.ar import ar_loss
from tinydiff.checkpoint import load_checkpoint
from tinydiff.distributed import Ranks
from tinydiff.errors import UserError
from tinydiff.kinds import load_model
from test_train import argv, interrupt_at


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, args: list):
    """One torchrun rank: the environment torchrun gives it, then train.py's main."""
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    train.main(args)


def test_two_ranks_follow_one_process_at_the_same_global_batch(story_file, tmp_path):
    args = argv(story_file, tmp_path / "one", "--batch-size", "4", kind="ar")
    train.main(args)  # tokenises too: the ranks below find the cache
    one = load_checkpoint(tmp_path / "one" / "ckpt.pt")
    two_args = argv(story_file, tmp_path / "two", "--batch-size", "4", kind="ar")
    mp.spawn(rank_main, args=(2, free_port(), two_args), nprocs=2, join=True)
    two = load_checkpoint(tmp_path / "two" / "ckpt.pt")
    assert two["step"] == one["step"] == 6 and two["args"] == {**one["args"]}
    # The same global batch, so the same steps up to float rounding: an all-reduced half-batch gradient
    # is summed in another order. AdamW divides by sqrt(v), so where a gradient is near zero that
    # rounding can move an update by up to ~lr; such elements are rare, and the loss does not see them.
    ours, theirs = (load_model(tmp_path / name / "ckpt.pt")[0] for name in ("one", "two"))
    x = torch.randint(0, 50257, (8, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert abs(ar_loss(ours, x)[0].item() - ar_loss(theirs, x)[0].item()) < 1e-6
    diffs = torch.cat([(two["model"][n] - w).abs().flatten() for n, w in one["model"].items()])
    assert (diffs <= 1e-6).float().mean() > 0.9999 and diffs.max() < 1e-4
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
    ours, theirs = (load_model(tmp_path / name / "ckpt.pt")[0] for name in ("full", "run"))
    x = torch.randint(0, 50257, (8, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert abs(ar_loss(ours, x)[0].item() - ar_loss(theirs, x)[0].item()) < 1e-6
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 6


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
