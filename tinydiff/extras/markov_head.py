"""DSpark's Markov head for DFlash: each slot's logits also depend on the token drafted one slot before.

DFlash drafts a block in one drafter forward, every slot from its own marginal given the context:
slot k cannot know which of its candidates slot k-1 picked, so the block's later drafts disagree
with its earlier ones. DSpark adds a cheap low-rank bias from the previous slot's token,

    logits_k = drafter_logits_k + W2 W1[x_{k-1}]        W1: (V, r) lookup, W2: (r, V), rank r

where x_0 is the newest committed token (the block's slot 0) and x_{k-1} the draft at slot k-1. The
drafter still runs ONE forward per block; the drafts then come left to right through the head
alone, a lookup and an (r x V) product per slot (`draft_left_to_right`). Training teaches W1, W2
beside the drafter with the text's own previous token (teacher forcing, dflash.dflash_loss).
W2 starts at zero, so a new head is plain DFlash until training moves it, and a head of rank 0 or
with W2 = 0 is exactly plain DFlash (the tests hold both).
DDTree reads the head too (ddtree.build_markov_tree): a tree's depth has many previous tokens, so
each node's children get the bias of that node's own token.
DSpark's confidence-scheduled verify length is in dflash_decode.py (`min_confidence`).
"""
import torch
import torch.nn as nn


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


def draft_left_to_right(head: MarkovHead, logits, first_token: int, pick):
    """Drafts (K,) and the biased logits (K, V) of the block's logits (K, V): slot k's row gets the
    bias of the token `pick` chose at slot k-1 (slot 1: first_token, the newest committed one).
    pick(row (V,)) -> a 0-dim long tensor: the argmax, or a sample. first_token may be a 0-dim tensor
    (fused_dflash.py's graph, which never reads a value back)."""
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
