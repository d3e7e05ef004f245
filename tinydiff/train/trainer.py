"""train.py's program: the run's settings from the flags or the checkpoint, the model, the data
(corpus windows, the target's regenerated stories, or a teacher's trajectories), and the loop.

AdamW with linear warmup and cosine decay, gradient clipping, mixed precision by hardware
(tinydiff/train/precision.py: bf16 where the GPU has bf16 units, fp16 with a gradient scaler where not).
Checkpoints go to OUT/ckpt.pt every --ckpt-every steps, at the end, and on Ctrl-C or SIGTERM.
A run resumed from a checkpoint ends with the same weights as one never interrupted: batch i is
drawn from (seed, i) alone and the checkpoint carries optimizer, step and RNG states. Progress bars
come from tinydiff.io.progress, so a tool running several trainings (the report) can route them.
"""
import functools
import math
import os
import sys
import time
from contextlib import closing, nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from tinydiff.ar import ar_generate, ar_loss
from tinydiff.checks import COUNT, UserError, brief_error
from tinydiff.data import eval_windows, load_tokens, prepare_tokens, sample_windows, tokens_digest
from tinydiff.dflash import dflash_generate, dflash_loss
from tinydiff.diffusion import diffusion_loss
from tinydiff.dmoe import mdlm_moe_loss
from tinydiff.eagle3 import eagle_generate, eagle_loss
from tinydiff.extras.ar_moe import ar_moe_loss
from tinydiff.extras.distill import distill_run
from tinydiff.extras.markov_head import MarkovDrafter, markov_dflash_generate, markov_loss
from tinydiff.extras.qat import matching_loss
from tinydiff.extras.regenerate import FILES as REGENERATED
from tinydiff.extras.regenerate import load_or_regenerate, trim_loops, validation_stories
from tinydiff.extras.soft_labels import soft_ar_loss
from tinydiff.io import progress
from tinydiff.io.checkpoint import StopOnSignal, load_checkpoint, save_checkpoint
from tinydiff.io.cli import add_device, check_device, make_parser
from tinydiff.io.files import check_run_folder, claim_run_folder
from tinydiff.sampler import generate, generate_cached
from tinydiff.tokenizer import EOT, Tokenizer
from tinydiff.train.distributed import Ranks
from tinydiff.train.precision import DTYPES, MixedPrecision, choose_dtype
from tinydiff.train.run_config import DRAFTERS, STUDENT_SHAPE, add_flags, flag, given_settings, migrate, new_run
from tinydiff.train.run_model import build_model, load_target
from tinydiff.train.training import evaluate, lr_at, make_optimizer

# kind -> (loss(model, windows, generator) -> (loss, stats), extra tokens per window beyond the context)
OBJECTIVES = {"mdlm": (diffusion_loss, 0), "ar": (ar_loss, 1), "mdlm-moe": (mdlm_moe_loss, 0),
              "ar-moe": (ar_moe_loss, 1), "dflash": (dflash_loss, 0), "eagle3": (eagle_loss, 0)}


def parse_args(argv=None):
    p = make_parser("python train.py", "Train a tinydiff model on TinyStories.")
    add_flags(p)  # the run settings (tinydiff/train/run_config.py); below, how to run it
    p.add_argument("--cache-dir", default="data", help="token cache when the data's folder is not writable, and for Hugging Face")
    p.add_argument("--out", help="run folder for ckpt.pt (default: out/MODEL-PRESET)")
    p.add_argument("--ckpt-every", type=COUNT, default=250, help="checkpoint every N steps")
    add_device(p)
    p.add_argument("--dtype", choices=DTYPES,
                   help="training precision (default: the resumed run's own, else auto: bf16 on a GPU with bf16 units, "
                        "fp16 with a gradient scaler on one without (T4, V100, P100), fp32 on a CPU)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    return p.parse_args(argv)


def default_preset(device: str) -> str:
    return "13m" if device.startswith("cuda") else "tiny"


def defaults(args, device: str) -> dict:
    """A new run's settings: the flags given, RunConfig's defaults for the rest."""
    run = new_run(args, default_preset(device))
    if args.preset is None and run["preset"] == "tiny" and not device.startswith("cuda"):
        print("notice: no GPU, so training the 'tiny' preset (pass --preset 13m to train the full model on CPU)")
    given = [flag(key) for key in STUDENT_SHAPE if getattr(args, key) is not None]
    if run["distill"] and given:
        raise UserError(f"a student has its teacher's shape and objective: drop {', '.join(given)}")
    given = [flag(key) for key in ("preset", "context") if getattr(args, key) is not None]
    if run["init"] and not run["distill"] and given:
        raise UserError(f"--init {run['init']} continues that model, in its shape: drop {', '.join(given)}")
    if run["target_layers"] and given:
        raise UserError(f"--target-layers takes the draft's shape from --target: drop {', '.join(given)}")
    if run["model"] in DRAFTERS and given:
        raise UserError(f"a {run['model']} drafter takes its dimensions from --target: drop {', '.join(given)}")
    return run


def resumed_settings(args, ckpt: dict, path) -> dict:
    """The checkpoint's run settings; a flag that contradicts them is an error, not a silent change."""
    run = migrate(ckpt["args"], path)
    for key, given in given_settings(args).items():
        if given != run[key]:
            raise UserError(f"{flag(key)} {given} differs from the run in {path} "
                            f"({run[key]}); drop the flag to resume, or start a new run with another --out")
    return run


@torch.no_grad()
def sample_story(model, kind: str, tokenizer, seed: int) -> str:
    """A short story from the model as it is now: the same prompt and seed at every evaluation."""
    model.eval()
    prompt = [EOT] + tokenizer.encode("Once upon a time")
    n = min(48, model.config.context - len(prompt))  # RunConfig's least context leaves room for 11
    block = model.config.noise_block if kind.startswith("mdlm") else 0
    if block and n < block:
        model.train()
        return f"(none: a block of {block} does not fit after the prompt in a context of {model.config.context})"
    if kind in DRAFTERS:  # a drafter's worth is its acceptance: greedy tau on this prompt (EAGLE-3: 4-token chains)
        decode, chain = (dflash_generate, {}) if kind == "dflash" else (eagle_generate, {"k": 4})
        if isinstance(model, MarkovDrafter):
            decode = markov_dflash_generate
        ids, result = decode(model.target, model, prompt, n, stop_token=None, **chain)
        model.train()
        return f"tau {result.tau:.2f} (accepted {result.accepted}): Once upon a time{tokenizer.decode(ids)}"
    generator = torch.Generator(model.embed.weight.device).manual_seed(seed)
    if block:  # sampled as it was trained: block by block
        n -= n % block
        ids, _ = generate_cached(model, prompt, gen_length=n, steps=n, block_length=block, generator=generator)
    elif kind.startswith("mdlm"):
        ids, _ = generate(model, prompt, gen_length=n, steps=n, block_length=n, generator=generator)
    else:
        ids, _ = ar_generate(model, prompt, n, temperature=0.8, top_k=50, generator=generator)
    model.train()
    return "Once upon a time" + tokenizer.decode(ids[:ids.index(EOT)] if EOT in ids else ids)


def run_settings(args):
    """(run settings, run folder, checkpoint or None): a resumed run's from its checkpoint, a new
    run's from the flags; a new run never overwrites a checkpoint."""
    check_device(args.device)
    out = Path(args.out) if args.out else None
    if args.resume:
        if out is None:
            raise UserError("--resume needs --out, the folder of the run to continue")
        check_run_folder(out)
        ckpt = load_checkpoint(out / "ckpt.pt")
        if not all(key in ckpt for key in ("optimizer", "args", "step", "rng")):
            raise UserError(f"{out / 'ckpt.pt'} holds weights but no training state, so it cannot be resumed")
        return resumed_settings(args, ckpt, out / "ckpt.pt"), out, ckpt
    run = defaults(args, args.device)
    name = run["preset"] or ("distilled" if run["distill"] else "init" if run["init"] else
                             f"exit{run['target_layers']}" if run["target_layers"] else default_preset(args.device))
    out = out or Path("out") / f"{run['model']}-{name}"
    check_run_folder(out)
    check_new(out)
    return run, out, None


def check_new(out: Path):
    if (out / "ckpt.pt").exists():
        raise UserError(f"{out / 'ckpt.pt'} exists; pass --resume to continue it, or another --out")


def describe(model, run: dict):
    config = model.config
    if run["model"] in DRAFTERS:
        shape = f"B {config.block_size}" if run["model"] == "dflash" else f"K {config.steps_ahead}"
        print(f"model: {run['model']} drafter ({shape}, features {config.feature_layers}) for {run['target']} | "
              f"params {sum(p.numel() for p in model.parameters()):,} (the target's embedding and head are borrowed)")
    else:
        name = f"student of {run['distill']}" if run["distill"] else f"from {run['init']}" if run["init"] \
            else f"from the first {run['target_layers']} layers of {run['target']}" if run["target_layers"] \
            else run["preset"]
        print(f"model: {run['model']} {name} | params {model.num_params():,} "
              f"({model.num_params(embedding=False):,} without the embedding) | context {config.context}")


def same_data(ckpt, token_paths, path) -> str:
    """The sha256 of the run's token files; a resumed run's must be the one its checkpoint recorded."""
    digest = tokens_digest(*token_paths)
    if ckpt is not None:
        stored = ckpt.get("data", {}).get("tokens")
        if stored is None:
            print(f"notice: {path} was written before runs recorded their data, so whether --data is the same "
                  "cannot be checked")
        elif stored != digest:
            raise UserError(f"this data (tokens sha256 {digest[:12]}) is not the data the run in {path} started "
                            f"with ({stored[:12]}); resume with the same --data, or start a new run with another --out")
    return digest


def training_data(run: dict, model, out: Path, token_paths, device):
    """(loss, draw(step) -> batch, validation batch): corpus windows, windows of the text the target
    regenerated (--regenerate), or the states of a teacher's trajectories (--distill)."""
    loss_fn, extra = OBJECTIVES[run["model"]]
    if isinstance(model, MarkovDrafter):  # slot k's logits biased by the token before it (DSpark's head)
        loss_fn = markov_loss
    train_tokens, val_tokens = (load_tokens(p) for p in token_paths)
    temperature = run["draft_temperature"]  # None: greedy stories, hard labels
    if run["regenerate"] is not None and run["model"] not in (*DRAFTERS, "ar"):
        raise UserError("--regenerate trains a draft on its target's text: use --model dflash, eagle3 or ar "
                        "with --target")
    needs_target = run["regenerate"] is not None or (temperature is not None and run["model"] == "ar")
    reads = model.config.context if temperature is not None else 0  # the AR draft's windows go through the target
    target = (model.target if run["model"] in DRAFTERS else load_target(run, device, reads)) if needs_target else None
    if target is not None and not target.config.causal and run["regenerate"] is None:
        raise UserError("an AR draft learns a diffusion --target from the stories it writes: add --regenerate N")
    if run["regenerate"] is not None:  # a draft learns the target's own text: what it will be asked to guess
        train_file, val_file = (out / name for name in REGENERATED)
        text = load_or_regenerate(train_file, target, train_tokens, run["regenerate"], run["seed"],
                                  run["openings"] == "target", temperature or 0.0)
        train_tokens = trim_loops(text)
        print(f"regenerated text: {len(text):,} tokens, {len(train_tokens):,} with its loops cut")
        val_tokens = load_or_regenerate(val_file, target, val_tokens, validation_stories(run["regenerate"]),
                                        run["seed"], temperature=temperature or 0.0)
    if temperature is not None and (run["model"] != "ar" or target.config.causal):  # labels: the target's
        # distribution at the temperature it will be sampled at. A diffusion target's left-to-right
        # conditionals would cost a forward per position: its sampled stories are the labels.
        loss_fn = functools.partial(soft_ar_loss, target=target, temperature=temperature) if run["model"] == "ar" else \
            functools.partial(loss_fn, temperature=temperature)
    if run["qat"] is not None and run["target"]:  # labels: the full-precision model's distribution
        loss_fn = matching_loss(load_target(run, device, context=model.config.context))
    if run["distill"]:  # the teacher's stories and the states inside them replace the windows
        return distill_run(run, out, train_tokens, val_tokens, device, loss_fn)
    window = model.config.context + extra

    def draw(step: int):  # batch `step`, from (seed, step) alone
        return sample_windows(train_tokens, run["batch_size"], window, run["seed"], step).to(device)

    return loss_fn, draw, eval_windows(val_tokens, run["eval_batches"] * run["batch_size"], window).to(device)


def restore(optimizer, precision, ckpt, out: Path) -> int:
    """A resumed run's optimizer, gradient-scaler and RNG states; returns the step to continue from (0
    for a new run)."""
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


INTERRUPTED = ("before training started; what was finished (token caches, the target's or teacher's stories, "
               "the last checkpoint) is kept: run the same command again")


def main(argv=None):
    args, ranks = parse_args(argv), Ranks()
    run, out, ckpt = run_settings(args)
    ranks.check(run)
    stored = (ckpt or {}).get("precision", {}).get("dtype")  # a resumed run keeps its precision
    precision = MixedPrecision(choose_dtype(args.dtype or stored or "auto", args.device), args.device)
    device = ranks.start(args.device)
    quiet = not ranks.main  # rank 0 alone prints, draws bars and writes
    with open(os.devnull, "w") if quiet else nullcontext(sys.stdout) as stdout, \
            progress.routed_to(functools.partial(tqdm, disable=True)) if quiet else nullcontext():
        sys.stdout, before, finished = stdout, sys.stdout, False
        try:
            train(args, ranks, run, out, ckpt, precision, device)
            finished = True
        finally:
            sys.stdout = before
            ranks.stop(finished)


def train(args, ranks, run: dict, out: Path, ckpt, precision, device: str):
    torch.manual_seed(run["seed"])  # every rank builds the same initial weights
    model = build_model(run, device, ckpt, out / "ckpt.pt")
    describe(model, run)
    print(f"precision: {precision.describe()}" + (f" | {ranks.world} ranks" if ranks.world > 1 else ""))
    with claim_run_folder(out) if ranks.main else nullcontext():  # from here on this folder is this run's alone
        if ckpt is None and ranks.main:
            check_new(out)  # another run may have finished here since the first look
        with ranks.first():  # rank 0 tokenises; the others then read its cache
            token_paths = prepare_tokens(run["data"], args.cache_dir)
        data_id = same_data(ckpt, token_paths, out / "ckpt.pt")
        loss_fn, draw, val_windows = training_data(run, model, out, token_paths, device)
        optimizer = make_optimizer(model, run)
        step = restore(optimizer, precision, ckpt, out)
        train_loop(run, model, optimizer, precision, loss_fn, lambda i: ranks.share(draw(i)), val_windows, step,
                   out, args.ckpt_every, device, data_id, ranks)


def train_loop(run: dict, model, optimizer, precision, loss_fn, draw, val_windows, step: int, out: Path,
               ckpt_every: int, device: str, data_id: str, ranks: Ranks):
    """Steps from `step` to max_steps: validation and a sample every eval_every, a checkpoint every
    ckpt_every, at the end and on Ctrl-C / SIGTERM (then it returns, saved)."""
    config, tokenizer, autocast = model.config, Tokenizer(), precision.autocast

    def save():
        if not ranks.main:
            return
        rng = {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() else {})}
        save_checkpoint(out / "ckpt.pt", kind=run["model"], config=config, model=model,
                        optimizer=optimizer.state_dict(), precision=precision.state_dict(), step=step, rng=rng,
                        data={"seed": run["seed"], "index": step, "tokens": data_id}, args=run)

    bar = progress.bar(total=run["max_steps"], initial=step, desc="train", unit="step", dynamic_ncols=True)
    with StopOnSignal() as stop, closing(bar):  # closed on any exit, so an error's line is the last one
        tokens_per_step = run["batch_size"] * config.context
        steps_timed, seconds = 0, 0.0  # this process's training steps, evaluation excluded
        model.train()
        while step < run["max_steps"]:
            t0 = time.perf_counter()
            lr = lr_at(step, run)
            for group in optimizer.param_groups:
                group["lr"] = lr
            windows = draw(step)
            # The noise of step i comes from (seed, i) alone, like its batch: resuming replays it.
            noise = torch.Generator(device).manual_seed(run["seed"] * 998_244_353 + step)
            with autocast:
                loss, _ = loss_fn(model, windows, noise)
            optimizer.zero_grad(set_to_none=True)
            precision.step(loss, optimizer, model.parameters(), run["grad_clip"], ranks.average_gradients)
            step += 1
            steps_timed, seconds = steps_timed + 1, seconds + time.perf_counter() - t0
            tok_s = steps_timed * tokens_per_step / seconds  # running mean: steadier than one step
            bar.update(1)
            skipped = f" | skipped {precision.skipped}" if precision.scaler is not None else ""  # fp16's inf steps
            bar.set_postfix_str(f"loss {loss.item():.3f} | lr {lr:.2e} | tok/s {tok_s:,.0f}{skipped}")
            if ranks.main and (step % run["eval_every"] == 0 or step == run["max_steps"]):
                stats = evaluate(model, loss_fn, val_windows, run["batch_size"], autocast)
                if "elbo" in stats:  # the bound's exp bounds the perplexity; masked_ce's does not
                    stats["ppl<="] = math.exp(stats["elbo"])
                bar.write(f"step {step} | " + " | ".join(f"val {k} {v:.4f}" for k, v in stats.items())
                          + f" | lr {lr:.2e} | tok/s {tok_s:,.0f}")
                bar.write("sample: " + sample_story(model, run["model"], tokenizer, run["seed"]).replace("\n", " "))
            if step % ckpt_every == 0 or step == run["max_steps"]:
                save()
            if ranks.anyone(stop.requested):
                save()
                bar.close()
                print(f"interrupted: saved step {step} to {out / 'ckpt.pt'}; continue with "
                      f"python train.py --out {out} --resume")
                return
    bar.close()
    rate = f" at {steps_timed * tokens_per_step / seconds:,.0f} tok/s" if steps_timed else ""
    print(f"done: {step} steps ({steps_timed} in {seconds:.0f} s{rate}), checkpoint {out / 'ckpt.pt'}")
