"""What a training run learns from: each kind's loss, and the batches train.py's loop draws.

OBJECTIVES maps a model kind to its loss, (model, windows, generator) -> (loss, stats), and the
tokens a window holds beyond the context (1 for an AR model: the next token of the last position).
`training_data` gives the loop its loss, draw(step) -> batch (from (seed, step) alone, so a resumed
run draws the same batches) and fixed validation windows: corpus windows, the stories the target
regenerated (--regenerate), or a teacher's trajectories (--distill). The research variants' losses
and data (tinydiff/extras/) are imported only by the runs that use them.
"""
import functools

from tinydiff.checks import UserError
from tinydiff.data import eval_windows, load_tokens, sample_windows
from tinydiff.dflash import dflash_loss
from tinydiff.dmoe import mdlm_moe_loss
from tinydiff.eagle3 import eagle_loss
from tinydiff.extras.markov_head import markov_loss
from tinydiff.io.tokens import tokens_digest
from tinydiff.train.fused_loss import ar_loss, diffusion_loss
from tinydiff.train.run_config import DRAFTERS
from tinydiff.train.run_model import load_target


def ar_moe_loss(model, windows, generator=None):
    from tinydiff.extras.ar_moe import ar_moe_loss as loss  # the AR MoE is a variant (extras/ar_moe.py)
    return loss(model, windows, generator, base=ar_loss)


# kind -> (loss(model, windows, generator) -> (loss, stats), extra tokens per window beyond the context)
OBJECTIVES = {"mdlm": (diffusion_loss, 0), "ar": (ar_loss, 1),
              "mdlm-moe": (functools.partial(mdlm_moe_loss, base=diffusion_loss), 0),
              "ar-moe": (ar_moe_loss, 1), "dflash": (dflash_loss, 0), "eagle3": (eagle_loss, 0)}


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


def training_data(run: dict, model, out, token_paths, device):
    """(loss, draw(step) -> batch, validation batch) for the run."""
    loss_fn, extra = OBJECTIVES[run["model"]]
    if getattr(model.config, "markov_rank", 0):  # slot k's logits biased by the token before it (DSpark's head)
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
        from tinydiff.extras.regenerate import FILES, load_or_regenerate, trim_loops, validation_stories
        train_file, val_file = (out / name for name in FILES)
        text = load_or_regenerate(train_file, target, train_tokens, run["regenerate"], run["seed"],
                                  run["openings"] == "target", temperature or 0.0, "target writes training stories")
        train_tokens = trim_loops(text)
        print(f"regenerated text: {len(text):,} tokens, {len(train_tokens):,} with its loops cut")
        val_tokens = load_or_regenerate(val_file, target, val_tokens, validation_stories(run["regenerate"]),
                                        run["seed"], temperature=temperature or 0.0,
                                        desc="target writes validation stories")
    if temperature is not None and (run["model"] != "ar" or target.config.causal):  # labels: the target's
        # distribution at the temperature it will be sampled at. A diffusion target's left-to-right
        # conditionals would cost a forward per position: its sampled stories are the labels.
        from tinydiff.extras.soft_labels import soft_ar_loss
        loss_fn = functools.partial(soft_ar_loss, target=target, temperature=temperature) if run["model"] == "ar" else \
            functools.partial(loss_fn, temperature=temperature)
    if run["qat"] is not None and run["target"]:  # labels: the full-precision model's distribution
        from tinydiff.extras import qat
        loss_fn = qat.matching_loss(load_target(run, device, context=model.config.context))
    if run["distill"]:  # the teacher's stories and the states inside them replace the windows
        from tinydiff.extras import distill
        return distill.distill_run(run, out, train_tokens, val_tokens, device, loss_fn)
    window = model.config.context + extra

    def draw(step: int):  # batch `step`, from (seed, step) alone
        return sample_windows(train_tokens, run["batch_size"], window, run["seed"], step).to(device)

    return loss_fn, draw, eval_windows(val_tokens, run["eval_batches"] * run["batch_size"], window).to(device)
