"""Train a tinydiff model on TinyStories.

    python train.py                                   # HF TinyStories; 13m on a GPU, tiny on CPU
    python train.py --data ../shared/data/tinystories-sample.txt --max-steps 300
    python train.py --out out/ar-tiny --resume        # continue an interrupted run exactly

AdamW with linear warmup and cosine decay, gradient clipping, mixed precision by hardware (--dtype).
Checkpoints go to OUT/ckpt.pt every --ckpt-every steps, at the end, and on Ctrl-C or SIGTERM.
A run resumed from a checkpoint ends with the same weights as one never interrupted: batch i is
drawn from (seed, i) alone and the checkpoint carries optimizer, step and RNG states.
"""
import sys

from tinydiff.io.cli import run_main
from tinydiff.train.trainer import INTERRUPTED, main

if __name__ == "__main__":
    sys.exit(run_main(main, interrupted=INTERRUPTED))
