"""The research variants' way into a training run: one hook each, in its own file, applied in one step.

train.py trains a kind's loss (its LOSSES) on windows of the corpus (its get_batch). A variant changes
the loss, the text, or both, through the hook its file owns:

    train_hook(run, model, target, loss_fn, train_tokens, val_tokens, out) -> (loss_fn, train_tokens, val_tokens)

target: the frozen model the run reads (a drafter's own, or --target loaded once here), or None. In the
order they apply, the loss's before the text's:
    markov_head   DSpark's head on a DFlash drafter: the drafter's loss with the head's bias (--markov-rank)
    soft_labels   the labels: the target's distribution at --draft-temperature
    qat           an ar-moe QAT run with --target: the labels are the full-precision model's distribution
    regenerate    the text: the stories the target writes from the corpus's openings (--regenerate N)
Distillation (extras/distill.py) trains on its teacher's stories, not on windows: train.py calls its hook,
distill_run, for the batches themselves. A run imports only the variants it uses.
"""
import importlib

from tinydiff.train.run_config import DRAFTERS
from tinydiff.train.run_model import load_target


def variants(run: dict, model) -> list[str]:
    """The variants (tinydiff/extras/ file names) the run uses, in the order their hooks apply."""
    uses = {"markov_head": getattr(model.config, "markov_rank", 0) > 0,  # a drafter built with the head
            "soft_labels": run["draft_temperature"] is not None,
            "qat": run["qat"] is not None and bool(run["target"]),  # without --target QAT trains on the corpus
            "regenerate": run["regenerate"] is not None}
    return [name for name, used in uses.items() if used]


def with_variants(run: dict, model, loss_fn, train_tokens, val_tokens, out, device: str):
    """(loss_fn, train_tokens, val_tokens) after the hook of each variant the run uses."""
    names = variants(run, model)
    target = None
    if {"soft_labels", "qat", "regenerate"} & set(names):
        # soft labels and QAT's labels come from the target reading the run's windows: it must hold them
        reads = model.config.context if {"soft_labels", "qat"} & set(names) else 0
        target = model.target if run["model"] in DRAFTERS else load_target(run, device, reads)
    for name in names:
        hook = importlib.import_module(f"tinydiff.extras.{name}").train_hook
        loss_fn, train_tokens, val_tokens = hook(run, model, target, loss_fn, train_tokens, val_tokens, out)
    return loss_fn, train_tokens, val_tokens

