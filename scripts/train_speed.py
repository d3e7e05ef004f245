"""What a learner will wait: the default training recipe's step on this GPU, eager and compiled, per dtype.

    python scripts/train_speed.py --data ../shared/data/tinystories-sample.txt [--steps 200] [--dtypes bf16,fp16]

Each run is `python train.py` (the `13m` preset's default batch of 64 windows of 256 tokens) for --steps
steps, in a fresh process; its `done:` line gives the steps' tokens/s, the compile time left out of it.
Printed per run: tokens/s, MFU, the peak memory, and the projected wall time of the default run (30,000
steps) here and on a T4. FLOPs per token are nanoGPT's estimate, 6 N + 12 L D T (N the parameters, the
tied head counted once; T the context): for the masked-diffusion LM, whose head runs on the masked rows
only (half of them on average), it overcounts the head's share, so its MFU reads high by about that much.
Peaks are the dense tensor-core figures of NVIDIA's data sheets. The T4 projection assumes the T4 reaches
this GPU's MFU in fp16 (65 TFLOP/s): a small model that is launch-bound on a big GPU uses a small one
better, so it is an upper bound on the T4's time. gpu_check.sh runs it; its lines go to docs/gpu/ and
docs/RESULTS.md.
"""
import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tinydiff.model import Transformer, preset  # noqa: E402
from tinydiff.train.run_config import RUN_LENGTH  # noqa: E402

PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "A10": 125e12, "V100": 125e12,
        "T4": 65e12, "P100": 18.7e12}  # dense bf16 / fp16 tensor-core FLOP/s (fp16 on T4, V100, P100)


def flops_per_token(name: str) -> float:
    """nanoGPT's training FLOPs per token: 6 N (forward and backward of every weight) + 12 L D T (attention)."""
    config = preset(name)
    n = sum(p.numel() for p in Transformer(config).parameters())
    return 6 * n + 12 * config.n_layer * config.d_model * config.context


def peak(device_name: str):
    return next((flops for gpu, flops in PEAK.items() if gpu in device_name), None)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="TinyStories-format text to train on")
    p.add_argument("--steps", type=int, default=200, help="steps a run (its first, compiling, is left out)")
    p.add_argument("--dtypes", default="bf16,fp16", help="comma-separated train.py --dtype values")
    p.add_argument("--preset", default="13m")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    flops, gpu_peak, length = flops_per_token(args.preset), peak(name), RUN_LENGTH.get(args.preset, RUN_LENGTH[None])
    tokens = length["max_steps"] * length["batch_size"] * preset(args.preset).context
    print(f"{name} | {args.preset}: {flops / 1e6:.0f} MFLOP a token | the default run: {tokens / 1e6:.0f}M tokens")
    with tempfile.TemporaryDirectory() as cache:  # the token cache, when --data's folder is read-only
        for dtype in args.dtypes.split(","):
            for mode in ("--no-compile", "--compile"):
                with tempfile.TemporaryDirectory() as out:
                    cmd = [sys.executable, "train.py", "--data", args.data, "--out", out, "--preset", args.preset,
                           "--dtype", dtype, "--device", args.device, mode, "--max-steps", str(args.steps),
                           "--eval-every", str(args.steps), "--ckpt-every", str(args.steps), "--cache-dir", cache]
                    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                done = re.search(r"done: .*at ([\d,]+) tok/s(?:, compiling (\d+) s apart)?.* \| (peak .*)", res.stdout)
                if res.returncode or not done:
                    print(f"{dtype} {mode}: failed: {(res.stderr or res.stdout).strip().splitlines()[-1:]}")
                    continue
                tok_s = float(done.group(1).replace(",", ""))
                mfu = f"MFU {tok_s * flops / gpu_peak:.1%}" if gpu_peak else "MFU n/a (peak unknown)"
                here = tokens / tok_s / 3600
                t4 = tokens / (tok_s * PEAK["T4"] / gpu_peak) / 3600 if gpu_peak else None
                print(f"{dtype} {mode[2:]}: {tok_s:,.0f} tok/s | {mfu} | compile {done.group(2) or 0} s | "
                      f"default run {here:.2f} h here" + (f", {t4:.2f} h on a T4 at this MFU" if t4 else "")
                      + f" | {done.group(3)}")


if __name__ == "__main__":
    main()
