"""Spec: the training losses hold a chunk's vocabulary-wide logits at a time, whatever the batch.

The DFlash and EAGLE-3 recipes (their default configs: 32 anchors of 16-token blocks; 3 unrolled steps) read
a row of 50,258 logits per drafted slot: a batch's at once was 11.8 GB (dflash) and 14-15 GB (eagle3) of
resident memory at `--preset tiny` (dev/LOG.md). dflash.py's checkpointed_chunks reads LOSS_ROWS
rows at a time and makes them again in the backward. The AR and MDLM recipes (6.1 GB) train with
train/fused_loss.py, which forms ROWS rows' loss and gradients at a time; its one-piece contrast is the core's
loss (ar.py, diffusion.py).
Measured in a fresh process by its peak resident memory after a loss and backward of 1, 2, then 8 windows of
32 tokens on a tiny target, in chunks of one window (the drafters) or 8 rows: 8 windows after 2 add only their
narrow activations; the same in one piece (after them) adds 6 windows' logits at once. The peak is Linux's
VmHWM, this address space's: getrusage's ru_maxrss would start from the pytest worker's, which a child
inherits through fork and exec. glibc's own malloc settings (TINYDIFF_MALLOC=default), its mmap threshold
fixed at 128 kB: the tensors' peak, not the heap that train.py keeps for reuse (io/cpu_memory.py), nor the
blocks that glibc's moving threshold would keep on the heap, whose fragments would blur it (AR in chunks: 15
MB of growth with the threshold moving, 1.4 MB fixed, against 117-129 MB in one piece). Not a timing.
"""
import json
import os
import subprocess
import sys

import pytest

PEAK = """
import json, re, sys, torch
from tinydiff import dflash
torch.set_num_threads(1)
sys.path.insert(0, "tests")
from stats_helpers import random_model
from tinydiff.model import ModelConfig
from tinydiff.train import fused_loss
kind = sys.argv[1]
target = random_model(ModelConfig(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=kind != "mdlm"), seed=0)
if kind in ("ar", "mdlm"):  # the fused loss, 8 rows a chunk (2 windows' masked rows fill several); then the core's
    from tinydiff.ar import ar_loss
    from tinydiff.diffusion import mdlm_loss
    model, fused_loss.ROWS = target, 8
    losses = {"chunked": getattr(fused_loss, f"{kind}_loss"), "whole": ar_loss if kind == "ar" else mdlm_loss}
else:  # a window a chunk; then the batch in one piece
    if kind == "dflash":
        from tinydiff.dflash import DFlashConfig, DFlashDrafter
        from tinydiff.dflash import dflash_loss as loss_fn
        model = DFlashDrafter(DFlashConfig.for_target(target.config), target)
    else:
        from tinydiff.eagle3 import EagleConfig, EagleHead
        from tinydiff.eagle3 import eagle_loss as loss_fn
        model = EagleHead(EagleConfig.for_target(target.config), target)
    def rows(n):
        def loss(*args):
            dflash.LOSS_ROWS = n
            return loss_fn(*args)
        return loss
    losses = {"chunked": rows(1), "whole": rows(10 ** 9)}
windows = torch.randint(0, 50257, (8, 33), generator=torch.Generator().manual_seed(0))[:, :32 + (kind == "ar")]
peaks = {}
for name, loss in losses.items():
    for batch in (1, 2, 8):  # 1: every kernel and buffer once
        loss(model, windows[:batch], torch.Generator().manual_seed(0))[0].backward()
        status = open("/proc/self/status").read()  # VmHWM: this address space's peak resident memory, in kB
        peaks[f"{name} {batch}"] = int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)) * 1024
from tinydiff.io.cli import step_floor
peaks["floor per window"] = step_floor(model, "fp32", 1)[1]
print(json.dumps(peaks))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
@pytest.mark.parametrize("kind", ["dflash", "eagle3", "ar", "mdlm"])
def test_a_bigger_batch_adds_no_batch_of_logits_to_the_peak(kind):
    """8 windows after 2 add a few MB to the peak in chunks, 100s of MB in one piece (measured after them, in the
    same process: the peak only grows); and no less than train.py's step floor (io/cli.step_floor) says."""
    res = subprocess.run([sys.executable, "-c", PEAK, kind], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TINYDIFF_MALLOC": "default", "MALLOC_MMAP_THRESHOLD_": "131072"})
    assert res.returncode == 0, res.stderr[-2000:]
    peak = json.loads(res.stdout.splitlines()[-1])
    chunked, whole = peak["chunked 8"] - peak["chunked 2"], peak["whole 8"] - peak["whole 2"]
    assert chunked < whole / 8, peak
    assert chunked >= 6 * peak["floor per window"], peak  # step_floor is a floor: 6 more windows hold more
