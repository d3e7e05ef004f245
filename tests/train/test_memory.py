"""Spec: the drafters' losses hold a chunk's vocabulary-wide logits at a time, whatever the batch.

The DFlash and EAGLE-3 recipes (their default configs: 32 anchors of 16-token blocks; 3 unrolled steps) read
a row of 50,258 logits per drafted slot: a batch's at once was 11.8 GB (dflash) and 14-15 GB (eagle3) of
resident memory at `--preset tiny` (docs/LOG.md). dflash.checkpointed_chunks reads LOSS_ROWS rows at a time
and makes them again in the backward. Measured in a fresh process with resource.getrusage (its peak resident
memory) after a loss and backward of 1, 2, then 8 windows on a tiny target: 8 windows after 2 add 6
windows' logits at once without chunks (GBs, measured too), with chunks only their narrow activations.
glibc's own malloc settings (TINYDIFF_MALLOC=default): the tensors' peak, not the heap that train.py keeps
for reuse (io/cpu_memory.py), whose fragments would blur it. Not a timing.
"""
import json
import os
import subprocess
import sys

import pytest

PEAK = """
import json, resource, sys, torch
from tinydiff import dflash as core
torch.set_num_threads(1)
sys.path.insert(0, "tests")
from stats_helpers import random_model
from tinydiff.model import ModelConfig
kind, chunked = sys.argv[1], sys.argv[2] == "chunked"
core.LOSS_ROWS = core.LOSS_ROWS if chunked else 10 ** 9
target = random_model(ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
if kind == "dflash":
    from tinydiff.dflash import DFlashConfig, DFlashDrafter, dflash_loss as loss_fn
    model = DFlashDrafter(DFlashConfig.for_target(target.config), target)
else:
    from tinydiff.eagle3 import EagleConfig, EagleHead, eagle_loss as loss_fn
    model = EagleHead(EagleConfig.for_target(target.config), target)
windows = torch.randint(0, 50257, (8, 64), generator=torch.Generator().manual_seed(0))
peaks = []
for batch in (1, 2, 8):  # 1: every kernel and buffer once
    loss_fn(model, windows[:batch], torch.Generator().manual_seed(0))[0].backward()
    peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
print(json.dumps(peaks))
"""


def peaks(kind: str, chunked: bool) -> list:
    """The process's peak resident memory (bytes) after a loss and backward of 1, 2 and 8 windows, in turn."""
    res = subprocess.run([sys.executable, "-c", PEAK, kind, "chunked" if chunked else "whole"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TINYDIFF_MALLOC": "default"})
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux only")
@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_bigger_batch_adds_no_batch_of_logits_to_the_peak(kind):
    """8 windows after 2 add a few MB to the peak in chunks, GBs in one piece (measured here too: the contrast)."""
    chunked, whole = peaks(kind, True), peaks(kind, False)
    assert chunked[2] - chunked[1] < (whole[2] - whole[1]) / 8, (chunked, whole)
