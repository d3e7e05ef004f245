"""Self-speculative sampling of a masked diffusion LM: the model drafts from its own distributions,
and one batched forward verifies the whole chain (Spiffy's auto-speculation, Agrawal et al. 2025).

The target process is the cached block sampler at one token per step in an order that does not
read the draw (sampler.py: `left_to_right` or `low_entropy`): at canvas C it commits position
pos(C), the order's first open position of the block, with a token drawn from p_C(pos(C)). The
samples of this module follow that process exactly, for any model. A round:
  1. draft: from the distributions of a canvas R already run (R is C, or C less its newest token),
     rank the open positions of the block by the order, pi_1..pi_m, and draw d_j from p_R(pi_j);
  2. verify: one forward of the canvases C + d_1..d_j (j = 0..m) as a batch, against the shared
     prefix cache, gives each its own distributions (C itself is skipped when it is R);
  3. accept: at C + d_<j the target would commit pos* with p* = p_{C + d_<j}(pos*). Draft j, a
     (position, token) pair drawn from Q = q_j at pi_j, is kept with probability
     min(1, P(pi_j, d_j) / Q(pi_j, d_j)), P being p* at pos*: never when pi_j != pos*, else
     min(1, p*(d_j) / q_j(d_j)). The first rejection draws from the residual norm(max(0, P - Q)):
     p* itself when the positions differ, norm(max(0, p* - q_j)) otherwise. This is Leviathan's
     rule over (position, token) pairs, so it is lossless for any draft (speculative.py).
When a round keeps every draft, the last canvas's distributions are exact for the new canvas: the
next round's first draft is the target's own step, kept with probability one. After a rejection
the next round drafts from the canvas before it (one token stale) and verifies its first draft too.
At temperature 0 every distribution is one-hot: the rule reads "keep while the draft is the
target's argmax at the target's position", greedy decoding in that order, token for token.

Counting: a batched forward counts as one forward (what a GPU pays at these sizes, and how the
speculative loops count a verify of k + 1 tokens); `canvases` counts the canvases run, the work
a CPU pays. Each block's first forward (prefix rows, then the block) drafts nothing; a round whose
only draft fills the block runs none (its draft is the target's own step). So one draft a round
runs exactly generate_cached's forwards, one per token.
Leaves out: Spiffy's draft graphs (several candidates per step, calibrated offline; it accepts a
draft state on an exact match of the target's own draw, where one chain gains more from
Leviathan's rule), the confidence order (its position depends on the draws), thresholds.
"""
import copy
import sys
from dataclasses import dataclass

import torch

from tinydiff.checks import COUNT, UserError
from tinydiff.io.checkpoint import DIFFUSION_KINDS
from tinydiff.io.cli import run_main, story_parser, write_story
from tinydiff.sampler import check_args, diffusion_lengths, position_entropy, prefix_cached_logits
from tinydiff.sampling import next_token_probs, residual, sample
from tinydiff.speculative import Speculated, Tally
from tinydiff.tokenizer import MASK

ORDERS = ("left_to_right", "low_entropy")


def ranked_open(logits, canvas_block, order: str, temperature: float):
    """The block's open (MASK) positions (n,) in the order the target commits them, from the
    block's logits (N, V): by position, or by entropy (ties: the leftmost), as sampler.commit ranks."""
    open_ = (canvas_block == MASK).nonzero()[:, 0]
    if order == "left_to_right":
        return open_
    return open_[torch.argsort(position_entropy(logits[open_], temperature), stable=True)]


def draft(logits, canvas_block, order: str, m: int, temperature: float, generator=None):
    """Up to m drafts from one canvas's block logits (N, V): positions (n,) in the order's ranking,
    tokens (n,) drawn at them, and the distributions q (n, V) they were drawn from."""
    positions = ranked_open(logits, canvas_block, order, temperature)[:m]
    q = next_token_probs(logits[positions], temperature)  # (n, V)
    return positions, sample(q, generator), q


def verify(logits, blocks, positions, tokens, q, order: str, temperature: float, generator=None):
    """Leviathan's rule over (position, token) pairs. logits (n, N, V): the block logits of the canvases
    C + d_<j, j = 0..n-1; blocks (n, N) those canvases' blocks. Returns (kept, position, token): the
    first `kept` drafts are kept, then the target's own (position, token), None when all n are kept."""
    for j in range(len(tokens)):
        star = int(ranked_open(logits[j], blocks[j], order, temperature)[0])
        p = next_token_probs(logits[j, star], temperature)  # (V,)
        if star == int(positions[j]):
            if temperature == 0:  # one-hot p and q: p/q is 1 or 0, no random number needed
                keep = bool(p[tokens[j]] > 0)
            else:  # probability min(1, p/q), and never where p is 0
                keep = bool(torch.rand((), generator=generator, device=p.device) * q[j, tokens[j]] < p[tokens[j]])
            if keep:
                continue
            p = residual(p, q[j])
        return j, star, int(sample(p, generator))
    return len(tokens), None, None


def row_view(cache, rows: int):
    """The first `rows` rows of a batched KVCache, sharing its memory (its length is the view's own)."""
    view = copy.copy(cache)
    view.k, view.v = [t[:rows] for t in cache.k], [t[:rows] for t in cache.v]
    return view


def check_draft_args(order: str, draft_positions: int):
    if order not in ORDERS:
        raise UserError(f"self-speculative sampling commits in an order chosen before the draw: one of "
                        f"{', '.join(ORDERS)}, got {order!r}")
    if draft_positions < 1:
        raise UserError(f"draft positions must be >= 1 (1 = one token per forward), got {draft_positions}")


@torch.no_grad()
def self_speculative_generate(model, prompt, gen_length=64, block_length=32, temperature=0.0,
                              order="left_to_right", draft_positions=4, generator=None, on_round=None):
    """Sample `gen_length` tokens after `prompt` (list of ids) as generate_cached(..., steps=gen_length,
    remasking=order) does, drafting `draft_positions` tokens a round; returns (new ids, SelfSpeculated).
    on_round(info) sees each round's canvas after it, drafts, kept count and committed tokens."""
    check_args(model, prompt, gen_length, gen_length, block_length, temperature, order, None)
    check_draft_args(order, draft_positions)
    device = model.embed.weight.device
    P = len(prompt)
    m = min(draft_positions, block_length)  # a round drafts among its block's open positions: at most all of them
    canvas = torch.tensor(prompt + [MASK] * gen_length, device=device)  # (L,)
    cache = model.new_cache(m + 1)  # row 0 runs each block's first forward; rows 0..m the verify batch
    tally, forwards, canvases = Tally(k=m), 0, 0
    for lo in range(P, P + gen_length, block_length):
        first = row_view(cache, 1)
        logits = prefix_cached_logits(model, canvas[None], first, lo, P, block_length)  # (1, N, V)
        forwards, canvases = forwards + 1, canvases + 1
        for t in cache.k + cache.v:  # every row of the batch reads the same prefix
            t[1:, :, cache.length:first.length] = t[:1, :, cache.length:first.length]
        cache.length, ref_is_canvas = first.length, True
        while (canvas[lo:lo + block_length] == MASK).any():
            positions, tokens, q = draft(logits[0], canvas[lo:lo + block_length], order, m, temperature, generator)
            n = len(tokens)
            chain = canvas.repeat(n + 1, 1)  # (n + 1, L): C + d_<j, j = 0..n
            for j in range(n):
                chain[j + 1:, lo + positions[j]] = tokens[j]
            full = not (chain[-1, lo:lo + block_length] == MASK).any()  # nothing left there to predict
            run = chain[int(ref_is_canvas):n + (not full)]  # C's own logits are at hand when R = C
            if len(run):
                logits = torch.cat([logits[:int(ref_is_canvas)],
                                    prefix_cached_logits(model, run, row_view(cache, len(run)), lo, P, block_length)])
                forwards, canvases = forwards + 1, canvases + len(run)  # logits (n + (not full), N, V): canvas j's
            kept, position, token = verify(logits, chain[:, lo:lo + block_length], positions, tokens, q, order,
                                           temperature, generator)
            tally.add(kept, n, 0)
            canvas = chain[kept].clone()
            if position is None:  # every draft kept: the next round's first draft is the target's own step
                logits, ref_is_canvas = logits[n:n + 1], True
            else:  # the target's own token after the kept ones; the next drafts read the canvas before it
                canvas[lo + position] = token
                logits, ref_is_canvas = logits[kept:kept + 1], False
            if on_round is not None:
                committed = [(int(lo + positions[j]), int(tokens[j])) for j in range(kept)]
                on_round({"canvas": canvas.clone(), "block_start": lo, "positions": positions.tolist(),
                          "drafts": tokens.tolist(), "accepted": kept,
                          "committed": committed + ([(lo + position, token)] if position is not None else [])})
    tally.prefill = forwards - sum(tally.hist)  # each block's first forward, less the rounds that ran none
    return canvas[P:].tolist(), tally.result(canvas[P:], device, SelfSpeculated, canvases=canvases)


@dataclass(frozen=True, kw_only=True)
class SelfSpeculated(Speculated):
    """self_speculative.py's loop: a batched verify forward counts once in `forwards`, its canvases here."""
    canvases: int  # the canvases its forwards ran: a forward of S canvases costs a CPU about S
    DERIVED = Speculated.DERIVED + ("canvases_per_token",)

    @property
    def canvases_per_token(self) -> float:
        return self.canvases / self.new_tokens


def main(argv=None):
    """python -m tinydiff.extras.self_speculative: a diffusion LM's one-token-per-step story in fewer forwards."""
    p = story_parser("python -m tinydiff.extras.self_speculative", "A diffusion LM's story one token per step, "
                     "positions drafted from its own distributions and verified in batches (lossless).")
    p.add_argument("--k", type=COUNT, default=4, help="positions drafted a round")
    p.add_argument("--order", choices=ORDERS, default="left_to_right", help="the order positions are committed in")
    p.add_argument("--block-length", type=COUNT, help="blocks filled left to right (default 32)")
    args = p.parse_args(argv)

    def decode(model, prompt, generator):
        new, block = diffusion_lengths(model, prompt, args.max_new_tokens, args.block_length)
        if args.k > block:
            print(f"notice: --k {args.k} is more than a block's {block} positions; drafting at most {block} a round",
                  file=sys.stderr)
        return self_speculative_generate(model, prompt, new, block, args.temperature or 0.0, args.order,
                                         min(args.k, block), generator)
    write_story(args, DIFFUSION_KINDS, decode)


if __name__ == "__main__":
    sys.exit(run_main(main))
