"""Train a tinydiff model on TinyStories: the training loop itself, nanoGPT-style.

    python train.py                                   # HF TinyStories; 13m on a GPU, tiny on CPU
    python train.py --data ../shared/data/tinystories-sample.txt --max-steps 300
    python train.py --out out/ar-tiny --resume        # continue an interrupted run exactly
    torchrun --standalone --nproc_per_node=2 train.py --model ar ...   # data-parallel

The settings a learner uses (the rest: `python train.py --help`):
    --model mdlm | ar | mdlm-moe | ar-moe | dflash | eagle3     what to train (dflash, eagle3: with --target)
    --preset tiny | 13m | ...   --context N                     the model's size
    --data FILE                 TinyStories-format text (default: Hugging Face's TinyStories)
    --max-steps N --batch-size B --lr LR --warmup N             the schedule: warmup, then a cosine to lr/10
    --out DIR --resume          the run folder (OUT/ckpt.pt); continue it where it stopped
    --device cpu | cuda  --dtype auto | fp32 | bf16 | fp16   where and in what precision
    --compile | --no-compile    torch.compile the step (default: on CUDA, off on a CPU)

This file reads top-down: what each kind learns (LOSSES), the batch (get_batch), then the loop: batch,
forward, loss, backward, clip, step, evaluate, sample, checkpoint. What it calls lives in tinydiff/train/:
the settings, their checks and resume (run_config.py), the model of each kind (run_model.py), the
research variants' hooks (batches.py), mixed precision (precision.py) and data-parallel ranks
(distributed.py). A resumed run ends with the same weights as one never interrupted: batch i and its
noise come from (seed, i) alone, and the checkpoint carries the optimizer, step, scaler and RNG states.
Checkpoints go to OUT/ckpt.pt every --ckpt-every steps, at the end, and on Ctrl-C or SIGTERM.
"""
import argparse
import functools
import importlib
import math
import os
import re
import sys
import time
from contextlib import closing, nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from tinydiff.checks import COUNT, UserError, brief_error
from tinydiff.data import eval_windows, load_tokens, sample_windows
from tinydiff.io import progress
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.io.cli import add_device, check_fits, make_parser, run_main
from tinydiff.io.files import StopOnSignal, claim_run_folder
from tinydiff.io.tokens import prepare_tokens, recorded_sha256
from tinydiff.tokenizer import Tokenizer
from tinydiff.train import fused_loss
from tinydiff.train.batches import with_variants
from tinydiff.train.distributed import Ranks
from tinydiff.train.precision import DTYPES, MixedPrecision, choose_dtype
from tinydiff.train.run_config import add_flags, check_new, run_settings, same_data
from tinydiff.train.run_model import build_model, describe, sample_story

INTERRUPTED = ("before training started; what was finished (token caches, the target's or teacher's stories, "
               "the last checkpoint) is kept: run the same command again")

# What each kind of model learns: the core function that defines its loss, loss(model, windows, generator) ->
# (loss, stats), and the tokens a window holds beyond the context (an AR window also holds the token after its
# last position, which that position predicts). A kind's module is imported when that kind trains.
LOSSES = {
    "ar": ("ar.ar_loss", 1),                          # next-token cross-entropy
    "mdlm": ("diffusion.diffusion_loss", 0),          # the ELBO: mdlm_loss (block_diffusion_loss: --noise-block)
    "mdlm-moe": ("dmoe.mdlm_moe_loss", 0),            # the diffusion loss + the experts' balance term
    "ar-moe": ("extras.ar_moe.ar_moe_loss", 1),       # the next-token loss + the experts' balance term
    "dflash": ("dflash.dflash_loss", 0),              # the block drafter's weighted block cross-entropy
    "eagle3": ("eagle3.eagle_loss", 0),               # the training-time test: the head unrolled K steps
}


def training_loss(kind: str):
    """(the loss `kind` trains with, the tokens a window holds beyond the context)."""
    name, extra = LOSSES[kind]
    module, _, function = name.rpartition(".")
    loss = getattr(importlib.import_module(f"tinydiff.{module}"), function)
    # ar's and diffusion's losses (the MoEs' too, as their base) run faster, the head fused into the cross-entropy
    # (train/fused_loss.py); tests/train/test_fused_loss.py holds them equal to these in float64.
    return fused_loss.faster(loss), extra


def get_batch(tokens, step: int, run: dict, window: int, device: str):
    """Batch `step` of the run (B, window): B windows of `window` tokens at random starts, drawn from (seed, step)
    alone, so a resumed run draws the batches it would have drawn (nanoGPT's get_batch)."""
    return sample_windows(tokens, run["batch_size"], window, run["seed"], step).to(device)


def parse_args(argv=None):
    p = make_parser("python train.py", "Train a tinydiff model on TinyStories.")
    add_flags(p)  # the run's settings, one flag per RunConfig field (tinydiff/train/run_config.py)
    p.add_argument("--cache-dir", default="data", help="token cache when the data's folder is not writable, and for Hugging Face")
    p.add_argument("--out", help="run folder for ckpt.pt (default: out/MODEL-PRESET)")
    p.add_argument("--ckpt-every", type=COUNT, default=250, help="checkpoint every N steps")
    add_device(p)
    p.add_argument("--dtype", choices=DTYPES,
                   help="training precision (default: the resumed run's own, else auto: bf16 on a GPU with bf16 units, "
                        "fp16 with a gradient scaler on one without (T4, V100, P100), fp32 on a CPU)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   help="compile the model's training forward and backward with torch.compile (default: on CUDA, "
                        "off on a CPU); a run may resume with or without it")
    args = p.parse_args(argv)
    if Path(args.cache_dir).exists() and not Path(args.cache_dir).is_dir():  # else read only when it is needed
        raise UserError(f"--cache-dir {args.cache_dir} is a file, not a folder; name a folder (made if missing)")
    return args


def lr_at(step: int, run: dict) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps (nanoGPT's schedule)."""
    if step < run["warmup"]:
        return run["lr"] * (step + 1) / run["warmup"]
    progress = (step - run["warmup"]) / max(1, run["max_steps"] - run["warmup"])
    return run["min_lr"] + 0.5 * (run["lr"] - run["min_lr"]) * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model, run: dict):
    """AdamW with betas (0.9, 0.95); weight decay on matrices only, never on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": run["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    fused = decay[0].is_cuda  # one kernel for the whole update on a GPU (nanoGPT's choice), the plain loop on a CPU
    return torch.optim.AdamW(groups, lr=run["lr"], betas=(0.9, 0.95), fused=fused)


def compile_step(model):
    """torch.compile what a training step runs, traced at its first step (nanoGPT's default on a GPU):
    the model's forward and its backward; a drafter's layers (its loss calls `hidden`) and its frozen target;
    an MoE model's attention (the experts' loop gives each expert as many rows as the router sends it: traced,
    it would compile again for every count)."""
    if hasattr(model, "target"):  # a DFlash drafter or an EAGLE-3 head
        model.target.compile()
        model.hidden = torch.compile(model.hidden)
    elif any(hasattr(module, "router") for module in model.modules()):
        for block in model.blocks:
            block.attn.compile()
    else:
        model.compile()


def backward_and_step(loss, optimizer, parameters, precision, grad_clip: float, ranks=None) -> bool:
    """Backward, the ranks' mean gradient, clip, step; True when fp16's scaler skipped the step."""
    scaler = precision.scaler  # fp16's GradScaler; for bf16 and fp32 a disabled one, which passes everything through
    scale = scaler.get_scale()
    scaler.scale(loss).backward()  # fp16: the loss scaled up, so small gradients survive float16
    if ranks is not None:  # before unscaling: every rank then sees the same inf and skips the same step
        ranks.average_gradients(parameters)
    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
    torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    scaler.step(optimizer)  # skipped when the unscaled gradients hold inf or NaN
    scaler.update()
    skipped = scaler.get_scale() < scale  # the scale backs off exactly when the step was skipped
    precision.skipped += skipped
    return skipped


@torch.no_grad()
def evaluate(model, loss_fn, windows, batch_size: int, autocast) -> dict:
    """Mean of each stat of the loss over fixed validation windows and fixed noise (the same every time)."""
    model.eval()
    totals = {}
    generator = torch.Generator(windows.device).manual_seed(0)
    for i in range(0, len(windows), batch_size):
        with autocast:
            _, stats = loss_fn(model, windows[i:i + batch_size], generator)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + float(v) * len(windows[i:i + batch_size])
    model.train()
    stats = {k: v / len(windows) for k, v in totals.items()}
    if "elbo" in stats:  # the bound's exp bounds the perplexity; masked_ce's does not
        stats["ppl<="] = math.exp(stats["elbo"])
    return stats


def peak_memory(device: str) -> str:
    """The run's peak so far, in words: what PyTorch reserved on a GPU, else this process's resident memory."""
    if device.startswith("cuda"):
        return f"peak GPU memory {torch.cuda.max_memory_reserved() / 1e9:.1f} GB reserved"
    status = Path("/proc/self/status")
    if status.exists():  # Linux: this process's own peak (getrusage's would count a parent's, inherited by fork)
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", status.read_text()).group(1)) * 1024
    else:
        try:
            import resource
        except ImportError:  # Windows
            return "peak memory not measured here"
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS
    return f"peak resident memory {peak / 1e9:.1f} GB"


def restore(optimizer, precision, ckpt, out) -> int:
    """A resumed run's optimizer, gradient-scaler and RNG states; the step to continue from (0 for a new run)."""
    if ckpt is None:
        return 0
    try:
        optimizer.load_state_dict(ckpt["optimizer"])
        precision.load_state_dict(ckpt.get("precision", {}))
        torch.set_rng_state(ckpt["rng"]["cpu"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise UserError(f"{out / 'ckpt.pt'}: its optimizer or random-number state does not fit this model "
                        f"({brief_error(e, 100)}); it is damaged, so start a new run") from None
    if "cuda" in ckpt["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt["rng"]["cuda"])
    print(f"resuming {out / 'ckpt.pt'} at step {ckpt['step']}")
    return ckpt["step"]


def main(argv=None):
    args = parse_args(argv)
    ranks = Ranks()
    run, out, ckpt = run_settings(args)  # a new run's from the flags, a resumed run's from its checkpoint
    ranks.check(run)
    stored = (ckpt or {}).get("precision", {}).get("dtype")  # a resumed run keeps its precision
    precision = MixedPrecision(choose_dtype(args.dtype or stored or "auto", args.device), args.device)
    device = ranks.start(args.device)
    quiet = not ranks.main  # rank 0 alone prints, draws bars and writes
    printed = open(os.devnull, "w") if quiet else nullcontext(sys.stdout)
    bars = progress.routed_to(functools.partial(tqdm, disable=True)) if quiet else nullcontext()
    with printed as stdout, bars:
        before = sys.stdout
        sys.stdout = stdout
        finished = False
        try:
            train(args, ranks, run, out, ckpt, precision, device)
            finished = True
        finally:
            sys.stdout = before
            ranks.stop(finished)


VALIDATION_BYTES = 2**30  # the validation windows, drawn once and held for the whole run (int64 ids)


def check_validation(run: dict, window: int):
    """Refuse, before any work, --eval-batches x --batch-size windows that would hold more than VALIDATION_BYTES,
    naming the largest --eval-batches that fits (each flag is bounded alone; their product was not)."""
    per_batch = run["batch_size"] * window * 8
    if run["eval_batches"] * per_batch > VALIDATION_BYTES:
        raise UserError(f"--eval-batches {run['eval_batches']} of --batch-size {run['batch_size']} windows of "
                        f"{window} tokens hold {run['eval_batches'] * per_batch / 2**30:.1f} GiB of validation "
                        f"windows; pass --eval-batches {max(1, VALIDATION_BYTES // per_batch)} or less")


def train(args, ranks, run: dict, out, ckpt, precision, device: str):
    torch.manual_seed(run["seed"])  # every rank builds the same initial weights
    model = build_model(run, device, ckpt, out / "ckpt.pt")
    describe(model, run)
    check_fits(model, precision.dtype, -(-run["batch_size"] // ranks.world), device)  # this rank's windows
    if not run["distill"]:  # a student's validation is its teacher's stories (extras/distill.py)
        check_validation(run, model.config.context + LOSSES[run["model"]][1])
    compiled = args.compile if args.compile is not None else device.startswith("cuda")
    if compiled:
        compile_step(model)
    print(f"precision: {precision.describe()}" + (" | compiled" if compiled else "")
          + (f" | {ranks.world} ranks" if ranks.world > 1 else ""))
    with claim_run_folder(out) if ranks.main else nullcontext():  # from here on this folder is this run's alone
        if ckpt is None and ranks.main:
            check_new(out)  # another run may have finished here since the first look
        with ranks.first():  # rank 0 tokenises; the others then read its cache
            token_paths = prepare_tokens(run["data"], args.cache_dir)
        data_id = same_data(ckpt, recorded_sha256(token_paths[0]), out / "ckpt.pt")
        train_tokens, val_tokens = (load_tokens(path) for path in token_paths)
        loss_fn, extra = training_loss(run["model"])
        # The research variants' losses and text (the Markov head, soft labels, QAT, regeneration): a hook each,
        # applied in one step (train/batches.py)
        loss_fn, train_tokens, val_tokens = with_variants(run, model, loss_fn, train_tokens, val_tokens, out, device)
        if run["distill"]:  # a student learns from its teacher's stories, not windows: its hook gives the batches
            from tinydiff.extras import distill
            loss_fn, draw, val_batch = distill.distill_run(run, out, train_tokens, val_tokens, device, loss_fn)
        else:
            window = model.config.context + extra
            draw = functools.partial(get_batch, train_tokens, run=run, window=window, device=device)
            val_batch = eval_windows(val_tokens, run["eval_batches"] * run["batch_size"], window).to(device)
        optimizer = make_optimizer(model, run)
        step = restore(optimizer, precision, ckpt, out)
        loop(run, model, optimizer, precision, loss_fn, draw, val_batch, step, out, args.ckpt_every, device,
             data_id, ranks, compiled)


def out_of_memory(run: dict, device: str, out, saved) -> str:
    """What to do when a step does not fit: most of a step's memory is its batch's activations."""
    B = run["batch_size"]
    fix = f"pass --batch-size {B // 2}" if B > 1 else "one window does not fit: pass a smaller --preset or --context"
    kept = f"{out / 'ckpt.pt'} holds step {saved}" if saved else "nothing was written"
    return f"out of memory on {device} at --batch-size {B}: {fix} ({kept})"


def loop(run: dict, model, optimizer, precision, loss_fn, draw, val_batch, step: int, out, ckpt_every: int,
         device: str, data_id: str, ranks: Ranks, compiled: bool = False):
    """Steps from `step` to max_steps, each on batch draw(step): validation and a sample every eval_every, a
    checkpoint every ckpt_every, at the end and on Ctrl-C / SIGTERM (then it returns, saved)."""
    tokenizer = Tokenizer()
    parameters = [p for p in model.parameters()]
    saved = step if step else None  # the step OUT/ckpt.pt holds

    def save():
        nonlocal saved
        if not ranks.main:
            return
        saved = step
        rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
        save_checkpoint(out / "ckpt.pt", kind=run["model"], config=model.config, model=model,
                        optimizer=optimizer.state_dict(), precision=precision.state_dict(), step=step, rng=rng,
                        data={"seed": run["seed"], "index": step, "tokens": data_id}, args=run)

    bar = progress.bar(total=run["max_steps"], initial=step, desc="train", unit="step", dynamic_ncols=True)
    with StopOnSignal() as stop, closing(bar):  # closed on any exit, so an error's line is the last one
        tokens_per_step = run["batch_size"] * model.config.context
        steps_timed, seconds = 0, 0.0  # this process's training steps, evaluation and compiling excluded
        compiling = None  # seconds of a compiled model's first step, which traces and compiles it
        model.train()
        while step < run["max_steps"]:
            t0 = time.perf_counter()
            lr = lr_at(step, run)
            for group in optimizer.param_groups:
                group["lr"] = lr
            windows = ranks.share(draw(step))  # batch `step` of the whole run; this rank's rows of it
            noise = torch.Generator(device).manual_seed(run["seed"] * 998_244_353 + step)  # step's noise: resumable
            try:
                with precision.autocast:
                    loss, _ = loss_fn(model, windows, noise)  # forward and loss
                optimizer.zero_grad(set_to_none=True)
                backward_and_step(loss, optimizer, parameters, precision, run["grad_clip"], ranks)
            except torch.OutOfMemoryError:
                raise UserError(out_of_memory(run, device, out, saved)) from None
            step += 1
            if compiled and compiling is None:
                compiling = time.perf_counter() - t0
                bar.write(f"compiled the training step in {compiling:.1f} s (its first step, left out of tok/s)")
            else:
                steps_timed, seconds = steps_timed + 1, seconds + time.perf_counter() - t0
            tok_s = steps_timed * tokens_per_step / max(seconds, 1e-9)  # running mean: steadier than one step
            bar.update(1)
            skipped = f" | skipped {precision.skipped}" if precision.dtype == "fp16" else ""  # fp16's inf steps
            bar.set_postfix_str(f"loss {loss.item():.3f} | lr {lr:.2e} | tok/s {tok_s:,.0f}{skipped}")
            if ranks.main and (step % run["eval_every"] == 0 or step == run["max_steps"]):
                with torch.compiler.set_stance("force_eager") if compiled else nullcontext():  # not worth graphs
                    stats = evaluate(model, loss_fn, val_batch, run["batch_size"], precision.autocast)
                    story = sample_story(model, run["model"], tokenizer, run["seed"])
                bar.write(f"step {step} | " + " | ".join(f"val {k} {v:.4f}" for k, v in stats.items())
                          + f" | lr {lr:.2e} | tok/s {tok_s:,.0f}")
                bar.write("sample: " + story.replace("\n", " "))
            if step % ckpt_every == 0 or step == run["max_steps"]:
                save()
            if ranks.anyone(stop.requested):
                save()
                bar.close()
                print(f"interrupted: saved step {step} to {out / 'ckpt.pt'}; continue with "
                      f"python train.py --out {out} --resume")
                return
    rate = f" at {steps_timed * tokens_per_step / seconds:,.0f} tok/s" if steps_timed else ""
    rate += f", compiling {compiling:.0f} s apart" if compiling is not None else ""
    print(f"done: {step} steps ({steps_timed} in {seconds:.0f} s{rate}), checkpoint {out / 'ckpt.pt'} | "
          + peak_memory(device))


if __name__ == "__main__":
    sys.exit(run_main(main, interrupted=INTERRUPTED))
