"""train.py beside nanoGPT's train.py at one shape, each project's own trainer in its own process.

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT   # a scratch folder, never copied in here
    python scripts/beside_nanogpt.py --nanogpt ../nanoGPT --data ../shared/data/tinystories-sample.txt

The shape: 8 layers x 192 (tinydiff's `13m` preset, an AR model; nanoGPT with n_head 6, no biases),
context 256, batch 8, fp32 on this CPU, both with 50,304 vocabulary rows. Each contender trains --steps
steps on the same uint16 token file (tinydiff's cache, which is nanoGPT's train.bin format), eager and
compiled, in --rounds rounds whose order alternates, so drift in the machine's speed hits both sides.
A run's tokens/s leaves out its first step (tracing and compiling, or first touches) and evaluation:
tinydiff's from its `done:` line (eager runs keep their first step in, a little against tinydiff),
nanoGPT's from its per-iteration `time` lines. nanoGPT runs from a temporary folder holding links to
its configurator.py and to the token files, so its checkout stays as it was. Each side runs as it
ships: train.py sets glibc to keep freed memory (tinydiff/io/cpu_memory.py), nanoGPT does not, and
that setting is most of the difference (dev/LOG.md); --same-malloc gives nanoGPT's process the same
setting through glibc's environment variables, to see the rest.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinydiff.checks import UserError  # noqa: E402
from tinydiff.io.cli import run_main  # noqa: E402
from tinydiff.io.cpu_memory import KEEP  # noqa: E402
from tinydiff.io.tokens import prepare_tokens  # noqa: E402

BATCH, CONTEXT = 8, 256
SAME_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(KEEP), "MALLOC_TRIM_THRESHOLD_": str(KEEP),
               "MALLOC_TOP_PAD_": str(64 << 20)}  # cpu_memory.keep_freed_memory's mallopt calls, as glibc reads them


def last_line(res: subprocess.CompletedProcess) -> str:
    """What a failed run said last: its error line, or its last output."""
    return ((res.stderr or res.stdout).strip().splitlines() or ["no output"])[-1]


def tinydiff_run(data: str, cache: str, mode: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "train.py", "--model", "ar", "--preset", "13m", "--context", str(CONTEXT),
               "--batch-size", str(BATCH), "--dtype", "fp32", "--device", "cpu", f"--{mode}", "--data", data,
               "--cache-dir", cache, "--out", out, "--max-steps", str(steps + 1), "--eval-every", str(10 * steps),
               "--ckpt-every", str(10 * steps)]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    done = re.search(r"done: .* at ([\d,]+) tok/s", res.stdout)
    if res.returncode or not done:
        raise UserError(f"tinydiff --{mode} failed: {last_line(res)}")
    return float(done.group(1).replace(",", ""))


def nanogpt_run(nanogpt: Path, train_bin: Path, val_bin: Path, mode: str, steps: int, same_malloc: bool) -> float:
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        (work / "configurator.py").symlink_to(nanogpt / "configurator.py")
        (work / "data" / "tinydiff").mkdir(parents=True)
        (work / "data" / "tinydiff" / "train.bin").symlink_to(train_bin)
        (work / "data" / "tinydiff" / "val.bin").symlink_to(val_bin)
        settings = dict(dataset="tinydiff", out_dir=work / "out", n_layer=8, n_head=6, n_embd=192, bias=False,
                        block_size=CONTEXT, batch_size=BATCH, gradient_accumulation_steps=1, device="cpu",
                        dtype="float32", compile=mode == "compile", max_iters=steps, eval_interval=10 * steps,
                        eval_iters=1, log_interval=1)
        cmd = [sys.executable, str(nanogpt / "train.py")] + [f"--{k}={v}" for k, v in settings.items()]
        env = {**os.environ, **(SAME_MALLOC if same_malloc else {})}
        res = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    ms = [float(t) for t in re.findall(r"^iter \d+: .*time ([\d.]+)ms", res.stdout, re.M)]
    if res.returncode or len(ms) < 2:
        raise UserError(f"nanoGPT --compile={mode == 'compile'} failed: {last_line(res)}")
    return (len(ms) - 1) * BATCH * CONTEXT / (sum(ms[1:]) / 1000)  # iteration 0 also evaluates and compiles


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nanogpt", required=True, help="a checkout of github.com/karpathy/nanoGPT (its train.py)")
    p.add_argument("--data", required=True, help="TinyStories-format text both sides train on")
    p.add_argument("--steps", type=int, default=30, help="timed steps a run (default 30)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of all four runs (default 3)")
    p.add_argument("--same-malloc", action="store_true", help="give nanoGPT train.py's malloc setting too")
    args = p.parse_args(argv)
    nanogpt = Path(args.nanogpt).resolve()
    if not (nanogpt / "train.py").is_file() or not (nanogpt / "configurator.py").is_file():
        raise UserError(f"{nanogpt} has no nanoGPT train.py and configurator.py; pass --nanogpt a nanoGPT checkout")
    with tempfile.TemporaryDirectory() as cache:  # the token files, when --data's folder is read-only
        compare(args, nanogpt, cache)


def compare(args, nanogpt: Path, cache: str):
    train_bin, val_bin = prepare_tokens(args.data, cache)
    ours = partial(tinydiff_run, args.data, cache, steps=args.steps)
    theirs = partial(nanogpt_run, nanogpt, train_bin, val_bin, steps=args.steps, same_malloc=args.same_malloc)
    runs = {"tinydiff eager": partial(ours, "no-compile"), "tinydiff compiled": partial(ours, "compile"),
            "nanoGPT eager": partial(theirs, "no-compile"), "nanoGPT compiled": partial(theirs, "compile")}
    rates, ratios = {name: [] for name in runs}, []
    for r in range(args.rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            rates[name].append(runs[name]())
            print(f"round {r + 1}: {name} {rates[name][-1]:,.0f} tok/s", flush=True)
        ratios.append(max(rates["tinydiff eager"][-1], rates["tinydiff compiled"][-1])
                      / max(rates["nanoGPT eager"][-1], rates["nanoGPT compiled"][-1]))
    for name, values in rates.items():
        print(f"{name}: median {statistics.median(values):,.0f} tok/s ({min(values):,.0f}-{max(values):,.0f})")
    print(f"tinydiff's best over nanoGPT's best, round by round: {min(ratios):.2f}-{max(ratios):.2f}x "
          f"(median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    sys.exit(run_main(main))
