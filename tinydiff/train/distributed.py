"""Data-parallel training under torchrun: `torchrun --standalone --nproc_per_node=N train.py ...`.

Every rank draws the same global batch from (seed, step), as one process would, and trains on its
own slice of the rows (rank r of N: rows r*b/N .. (r+1)*b/N). After backward the gradients are
averaged across ranks (an all-reduce: NCCL on GPUs, gloo on CPU), so each rank steps with the
gradient of the whole batch and the weights stay identical everywhere. An AR run on N ranks at
batch b therefore follows the single-process run at batch b, to float rounding; a diffusion LM's
noise is drawn per rank for its slice, so its runs agree in distribution, not bit for bit.
Rank 0 alone tokenises (the others wait, then read its cache), writes checkpoints and prints;
a stop request (Ctrl-C, SIGTERM) on any rank stops all of them after the same step. Because the
batch rule does not depend on N, a run resumes with any number of ranks.
Leaves out: DDP's bucketed overlap of communication with backward (a 13M model's all-reduce is
small), drafter training and the runs that write stories first (refused in one line).
"""
import os
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tinydiff.checks import UserError


class Ranks:
    """This process's place among torchrun's: world size 1 (a plain `python train.py`) is a no-op."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = "cpu"

    @property
    def main(self) -> bool:
        return self.rank == 0

    def check(self, run: dict):
        """Before any work: a run that splits over this many ranks."""
        if self.world == 1:
            return
        if run["batch_size"] % self.world:
            raise UserError(f"--batch-size {run['batch_size']} does not split over {self.world} ranks: pass a "
                            f"multiple of {self.world} (each rank trains on batch / ranks rows)")
        single = [why for bad, why in ((run["model"] in ("dflash", "eagle3"), f"--model {run['model']} (a drafter)"),
                                        (run["regenerate"] is not None, "--regenerate"),
                                        (bool(run["distill"]), "--distill")) if bad]
        if single:
            raise UserError(f"{single[0]} trains in one process only; run it with python train.py, not torchrun")

    def start(self, device: str) -> str:
        """Join the process group; the device this rank trains on."""
        if self.world == 1:
            return device
        cuda = device.startswith("cuda")
        if cuda and self.local >= torch.cuda.device_count():
            raise UserError(f"torchrun started more processes on this machine than it has GPUs "
                            f"({torch.cuda.device_count()}); pass --nproc_per_node={torch.cuda.device_count()}")
        if cuda:
            device = f"cuda:{self.local}"
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", rank=self.rank, world_size=self.world)
        self.device = device
        return device

    def stop(self, finished: bool):
        """Leave the process group. After a finished run (or a stop request, which every rank obeys at
        the same step) each rank first waits for the others (rank 0 saves last), then on CPU until gloo
        has let go of that last collective. After an error there is no waiting: the others may never
        arrive."""
        if self.world > 1 and dist.is_initialized():
            if finished and self.device == "cpu":
                self.settle()
            elif finished:
                dist.barrier()
            dist.destroy_process_group()

    def settle(self, seconds: float = 5.0) -> bool:
        """A last all-reduce (every rank has arrived), then a wait, with the GIL free, until gloo's worker
        thread has let go of the tensor; whether it did. A worker that still held a collective's tensors
        when the interpreter began to shut down needed the GIL to free them and aborted the process
        ("terminate called without an active exception": dev/LOG.md). Letting go is two steps: the C++
        reference (`_use_count`), then, holding the GIL, the Python one it kept (`sys.getrefcount`)."""
        last = torch.zeros(1)
        alone = sys.getrefcount(last)  # Python's own references
        dist.all_reduce(last)
        deadline = time.monotonic() + seconds
        held = lambda: last._use_count() > 1 or sys.getrefcount(last) > alone  # noqa: E731
        while held() and time.monotonic() < deadline:
            time.sleep(0.001)
        return not held()

    @contextmanager
    def first(self):
        """A block rank 0 runs before the others (tokenising): they wait at its end, then run it."""
        if self.world > 1 and not self.main:
            dist.barrier()  # rank 0 is inside the block
        yield
        if self.world > 1 and self.main:
            dist.barrier()  # releases the others, who now find rank 0's cache

    def share(self, windows):
        """This rank's rows of the global batch (B, T) -> (B / N, T)."""
        if self.world == 1:
            return windows
        n = len(windows) // self.world
        return windows[self.rank * n:(self.rank + 1) * n]

    def average_gradients(self, parameters):
        """Each gradient replaced by its mean over the ranks (every rank's slice is the same size)."""
        if self.world == 1:
            return
        for p in parameters:
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= self.world

    def anyone(self, flag: bool) -> bool:
        """True on every rank if it is True on any (a stop request must stop all at the same step)."""
        if self.world == 1:
            return flag
        value = torch.tensor([int(flag)], device=self.device)  # NCCL reduces GPU tensors only
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

