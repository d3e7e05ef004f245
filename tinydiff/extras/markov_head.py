"""DSpark's Markov head on a DFlash drafter: each slot's logits also depend on the token drafted one slot before.

DFlash (tinydiff/dflash.py) drafts a block in one drafter forward, every slot from its own marginal
given the context: slot k cannot know which of its candidates slot k-1 picked, so the block's later
drafts disagree with its earlier ones. DSpark adds a cheap low-rank bias from the previous slot's token,

    logits_k = drafter_logits_k + W2 W1[x_{k-1}]        W1: (V, r) lookup, W2: (r, V), rank r

where x_0 is the newest committed token (the block's slot 0) and x_{k-1} the draft at slot k-1. The
drafter still runs ONE forward per block; the drafts then come left to right through the head alone,
a lookup and an (r x V) product per slot (`draft_left_to_right`). Training teaches W1, W2 beside the
drafter with the text's own previous token (teacher forcing: `markov_loss`, DFlash's block loss biased).
W2 starts at zero, so a new head is plain DFlash until training moves it, and a head of rank 0 or with
W2 = 0 is exactly plain DFlash (the tests hold both).
Built from the core's pieces: `MarkovDrafter` is a DFlashDrafter with the head; its drafts go into
dflash_reject.py's loop as `propose` (argmax for DFlash's match rule, or sampled for the rejection rule),
its trees into ddtree_generate as `grow` (a node's children read the bias of that node's own token).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from tinydiff.checks import COUNT, Rule, UserError
from tinydiff.ddtree import Tree, best_first, check_tree_args, ddtree_generate, draft_logprobs
from tinydiff.dflash import (DFlashConfig, DFlashDrafter, block_loss, check_windows, packed_logits,
                             sample_anchors)
from tinydiff.extras.ddtree_sampled import tree_budget
from tinydiff.extras.dflash_reject import dflash_reject_generate, drafts_per_round
from tinydiff.io.checkpoint import AR_KINDS, dflash_config, load_checkpoint, rebuild_around
from tinydiff.io.checkpoint import drafter_from as plain_drafter_from
from tinydiff.io.cli import run_main, story_parser, write_story
from tinydiff.sampling import next_token_probs, sample
from tinydiff.tokenizer import EOT

RANK = Rule(integer=True, lo=0, hi=4096)  # a Markov head's rank, 0 = none


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.down = nn.Embedding(vocab_size, rank)  # W1: the previous token -> r numbers
        self.up = nn.Linear(rank, vocab_size, bias=False)  # W2: r numbers -> a bias on every logit

    def zero_(self):
        """W2 = 0: the bias vanishes, the drafter drafts as plain DFlash (how a new head starts)."""
        with torch.no_grad():
            self.up.weight.zero_()
        return self

    def forward(self, previous):
        """The bias (..., V) on the logits of the slots whose previous tokens are `previous` (...)."""
        return self.up(self.down(previous))


@dataclass
class MarkovConfig(DFlashConfig):
    markov_rank: int = 0  # the head's rank r (0: plain DFlash)

    def __post_init__(self):
        super().__post_init__()
        RANK.check("DFlash config markov_rank", self.markov_rank)


class MarkovDrafter(DFlashDrafter):
    """A DFlash drafter with a Markov head (`markov`, None at rank 0); a new head starts at W2 = 0."""

    def __init__(self, config: MarkovConfig, target):
        super().__init__(config, target)
        self.markov = None
        if config.markov_rank:
            self.markov = MarkovHead(config.vocab_size, config.markov_rank).to(self.fc.weight.device).zero_()


def markov_loss(drafter: DFlashDrafter, windows, generator=None, temperature: float | None = None):
    """dflash.dflash_loss for a MarkovDrafter: slot k's logits biased by the text's token at k - 1 (teacher
    forcing). Not chunked: its runs are small."""
    B = drafter.config.block_size
    check_windows(windows, B)
    Bw, T = windows.shape
    anchors = sample_anchors(Bw, T, B, drafter.config.anchors, generator, windows.device)  # (Bw, A)
    logits, target_logits = packed_logits(drafter, windows, anchors)  # (Bw, A, B-1, V)
    if getattr(drafter, "markov", None) is not None:  # a plain drafter's loss is DFlash's
        previous = (anchors[..., None] + torch.arange(B - 1, device=windows.device)).flatten(1)  # (Bw, A*(B-1))
        logits = logits + drafter.markov(windows.gather(1, previous).view(logits.shape[:-1])).to(logits.dtype)
    return block_loss(drafter, windows, anchors, logits, target_logits, temperature)


def train_hook(run: dict, model, target, loss_fn, train_tokens, val_tokens, out):
    """train.py's way in (train/batches.py): a drafter built with the head (--markov-rank) trains on
    markov_loss, the same windows."""
    return markov_loss, train_tokens, val_tokens


def draft_left_to_right(head: MarkovHead, logits, first_token: int, pick):
    """Drafts (K,) and the biased logits (K, V) of the block's logits (K, V): slot k's row gets the
    bias of the token `pick` chose at slot k-1 (slot 1: first_token, the newest committed one).
    pick(row (V,)) -> a 0-dim long tensor: the argmax, or a sample. first_token may be a 0-dim tensor
    (fast/fused_dflash.py's graph, which never reads a value back)."""
    if len(logits) == 0:
        return torch.empty(0, dtype=torch.long, device=logits.device), logits
    previous = torch.as_tensor(first_token, device=logits.device)
    drafts, rows = [], []
    for row in logits:
        row = row + head(previous).to(row.dtype)
        previous = pick(row)
        drafts.append(previous)
        rows.append(row)
    return torch.stack(drafts), torch.stack(rows)


def markov_drafts(drafter, logits, first_token, warp_args, generator=None, sampled=False):
    """dflash_reject_generate's `propose` for a MarkovDrafter: the argmax chain of the biased logits (q None,
    the match rule's), or with `sampled` each slot drawn from its biased row warped as the target (q: those
    rows' distributions, the rejection rule's)."""
    def pick(rows):  # (..., V) -> (...): a draw, or the argmax (never MASK)
        if sampled:
            return sample(next_token_probs(rows, *warp_args), generator)
        return next_token_probs(rows, 0).argmax(-1)

    head = getattr(drafter, "markov", None)
    if head is None:  # a plain drafter drafts as plain DFlash
        rows = logits
        drafts = pick(rows)
    else:
        drafts, rows = draft_left_to_right(head, logits, first_token, pick)
    if not sampled:
        return drafts, None
    return drafts, next_token_probs(rows, *warp_args)


@torch.no_grad()
def build_markov_tree(draft_logits, head, root_token: int, budget: int) -> Tree:
    """ddtree.build_tree with a node's children read from the next depth's logits plus the bias of the
    node's own token (the root's: root_token, the newest committed one), as the head drafts a chain left
    to right. A prefix scores the sum of its tokens' log-probs, each given the token before it. One head
    product (r x V) per node that gets children. With the head's W2 = 0 this is build_tree, tree for tree."""
    check_tree_args(draft_logits, budget)
    D, V = draft_logits.shape

    def children(depth, token):
        previous = torch.tensor(root_token if token < 0 else token, device=draft_logits.device)
        row = draft_logits[depth] + head(previous).to(draft_logits.dtype)  # (V,): the biased logits
        top = torch.topk(draft_logprobs(row), min(budget, V))
        return top.values.tolist(), top.indices.tolist()
    return best_first(budget, D, children)


def markov_dflash_generate(target, drafter, prompt, max_new_tokens, block_size=None, temperature=0.0, top_k=None,
                           top_p=None, generator=None, stop_token=EOT, on_round=None):
    """dflash_generate (its arguments and result) with the drafts read through the drafter's Markov head."""
    return dflash_reject_generate(target, drafter, prompt, max_new_tokens, block_size, temperature, top_k, top_p,
                                  generator, stop_token, on_round, rule="match", propose=markov_drafts)


def markov_ddtree_generate(target, drafter, *args, **kwargs):
    """ddtree_generate (its arguments and result) with trees whose children read the drafter's Markov head."""
    if getattr(drafter, "markov", None) is None:
        return ddtree_generate(target, drafter, *args, **kwargs)

    def grow(logits, root_token, n):
        return build_markov_tree(logits, drafter.markov, root_token, n)
    return ddtree_generate(target, drafter, *args, grow=grow, **kwargs)


def drafter_from(ckpt: dict, target, path="checkpoint") -> DFlashDrafter:
    """A DFlash drafter rebuilt around `target` from its checkpoint dict: a MarkovDrafter where it has a head."""
    config = dflash_config(ckpt, path)
    if not config.get("markov_rank"):
        return plain_drafter_from(ckpt, target, path)
    return rebuild_around(target, {**ckpt, "config": config}, MarkovConfig, MarkovDrafter, "a DFlash drafter", path)


def main(argv=None):
    """python -m tinydiff.extras.markov_head: DFlash or DDTree with a drafter that has DSpark's Markov head."""
    p = story_parser("python -m tinydiff.extras.markov_head", "DFlash or DDTree decoding with a drafter that has "
                     "DSpark's Markov head (train.py --model dflash --markov-rank R).")
    p.add_argument("--draft", required=True, help="the DFlash drafter with a Markov head")
    p.add_argument("--method", choices=["dflash", "ddtree"], default="dflash", help="a chain, or a tree")
    p.add_argument("--k", type=COUNT, help="drafts per round (default: the drafter's block - 1)")
    p.add_argument("--budget", type=COUNT, help="--method ddtree: tree nodes verified per round (default 32)")
    args = p.parse_args(argv)
    if args.budget is not None and args.method != "ddtree":
        raise UserError("--budget sizes DDTree's tree: add --method ddtree, or drop it")

    def decode(target, prompt, generator):
        drafter = drafter_from(load_checkpoint(args.draft, kinds=("dflash",)), target, args.draft)
        common = dict(temperature=0.8 if args.temperature is None else args.temperature, generator=generator)
        block = drafts_per_round(args.k, drafter)
        if args.method == "ddtree":
            return markov_ddtree_generate(target, drafter, prompt, args.max_new_tokens, block,
                                          tree_budget(args.budget, target, prompt), **common)
        return markov_dflash_generate(target, drafter, prompt, args.max_new_tokens, block, **common)
    write_story(args, AR_KINDS, decode)


if __name__ == "__main__":
    sys.exit(run_main(main))
