"""Speculative sampling of a masked diffusion LM with an autoregressive draft: a small AR model
drafts the next tokens left to right, one batched forward of the diffusion model verifies them.

The target process is the cached block sampler at one token per step, left to right
(sampler.generate_cached(..., steps=gen_length, remasking="left_to_right")): at canvas C it commits
the block's first open position with a token drawn from p_C there. Read that way, a diffusion LM is
an AR model whose conditional at position i is its prediction with everything from i on masked, and
speculative sampling applies as it is (Leviathan et al. 2023; speculative.py). A round:
  1. draft: the AR draft reads the committed text (everything before the block's first open
     position, since the order is left to right) and samples d_1..d_n for the next n open positions
     from its warped q_1..q_n (speculative.draft_round, with its KV cache);
  2. verify: one forward of the n + 1 canvases C + d_<j (j = 0..n) as a batch, against the shared
     prefix cache, gives p_j: the diffusion model's distribution at the j-th open position;
  3. accept: Leviathan's rule (speculative.verify): d_j kept with probability min(1, p_j/q_j), the
     first rejection drawn from the residual, a bonus from p_{n+1} when all n are kept.
n is at most the block's open positions less one, so the bonus always has a position: every round
commits between 1 and n + 1 tokens, and the block's last position is always the target's own draw.
A round's forward also carries the finished block's rows into the cache (the block's first round),
so the forwards are the rounds and nothing else. This differs from self_speculative.py, whose drafts
come from the diffusion model's own distributions: a draft for position i + 1 made there is blind
to the token drawn at i, while the AR draft reads it. That is why this drafter can keep long runs.

Counting: as self_speculative.py, a batched forward counts once in `forwards` (the GPU's cost) and
its canvases in `canvases` (a CPU's); draft forwards are counted apart and not in `forwards`.
Leaves out: orders other than left to right (the AR draft reads a prefix), trees of drafts, drafts
across a block boundary (the next block's canvas needs this block finished), a stop token.
"""
import sys
import time

import torch

from tinydiff.ar import split_time
from tinydiff.checks import COUNT, UserError
from tinydiff.extras.self_speculative import SelfSpeculated, row_view
from tinydiff.io.checkpoint import DIFFUSION_KINDS, load_model
from tinydiff.io.cli import run_main, story_parser, write_story
from tinydiff.sampler import check_args, diffusion_lengths, prefix_block_mask
from tinydiff.sampling import next_token_probs
from tinydiff.speculative import Tally, check_models, draft_round, verify
from tinydiff.tokenizer import MASK


def logits_at(model, canvases, cache, lo: int, prompt_length: int, block_length: int, at):
    """sampler.prefix_cached_logits' logits (S, 1, V) for block position `at` only: an int, or (S,) one per
    canvas. The forward returns the last block's residual stream and no logits (head_from past the end), and
    the head runs on the S rows read: it is most of a small model's cost."""
    shift = int(model.config.shift)
    start = cache.length
    end = lo + block_length
    mask = prefix_block_mask(start, lo, prompt_length, block_length, canvases.device)  # (n, start + n)
    _, (h,) = model(canvases[:, start:end], mask=mask, cache=cache, hidden_layers=[model.config.n_layer],
                    head_from=end - start)  # h (S, n, D)
    cache.crop(lo - shift)  # keep the finished positions' rows, drop the block's
    row = lo - shift - start + at  # the output that predicts block position `at`
    if isinstance(row, int):
        return model.logits(h[:, row:row + 1])  # (S, 1, V)
    return model.logits(h[torch.arange(len(h), device=h.device), row][:, None])


def check_draft(model, draft, need: int, draft_positions: int):
    if draft.config.causal is not True:
        raise UserError("the draft of a diffusion model reads the committed text left to right: give an AR "
                        "checkpoint (--model ar), not a diffusion one")
    if not isinstance(draft_positions, int) or draft_positions < 1:
        raise UserError(f"draft positions must be an integer >= 1, got {draft_positions!r}")
    check_models(model, draft, need)


@torch.no_grad()
def ar_drafted_generate(model, draft, prompt, gen_length=64, block_length=32, temperature=0.0,
                        draft_positions=4, generator=None, on_round=None):
    """Sample `gen_length` tokens after `prompt` (list of ids) as generate_cached(..., steps=gen_length,
    remasking="left_to_right") does, `draft` (an AR model) drafting up to `draft_positions` tokens a
    round; returns (new ids, SelfSpeculated). on_round(info) sees each round's canvas after it, its
    drafts, the kept count and the committed tokens."""
    check_args(model, prompt, gen_length, gen_length, block_length, temperature, "left_to_right", None)
    P = len(prompt)
    check_draft(model, draft, P + gen_length, draft_positions)
    m = min(draft_positions, block_length)  # a round drafts among its block's open positions: fewer than all of them
    device = model.embed.weight.device
    warp = (temperature, None, None)
    canvas = torch.tensor(prompt + [MASK] * gen_length, device=device)  # (L,)
    rows = min(m, block_length - 1) + 1  # a block's first round runs all of them: each holds the prefix
    cache, draft_cache = model.new_cache(rows), draft.new_cache(1)  # rows 0..n: the verify batch
    tally, canvases = Tally(k=m), 0
    for lo in range(P, P + gen_length, block_length):
        while (canvas[lo:lo + block_length] == MASK).any():
            t0 = time.perf_counter()
            positions = lo + (canvas[lo:lo + block_length] == MASK).nonzero()[:, 0]  # (r,) open, in order
            n = min(m, len(positions) - 1)  # the bonus keeps a position
            seq = canvas[:int(positions[0])].tolist()  # everything committed: the order is left to right
            tokens, q = draft_round(draft, draft_cache, seq, n, warp, generator)  # (n,), (n, V)
            t1 = split_time(device)
            chain = canvas.repeat(n + 1, 1)  # (n + 1, L): C + d_<j, j = 0..n
            for j in range(n):
                chain[j + 1:, positions[j]] = tokens[j]
            view = row_view(cache, n + 1)
            logits = logits_at(model, chain, view, lo, P, block_length, positions[:n + 1] - lo)
            cache.length = view.length  # a block's first round adds the finished block's rows
            p = next_token_probs(logits[:, 0], *warp)  # (n + 1, V): canvas j's distribution at its open position
            kept, token = verify(p, q, tokens, generator)
            tally.clock(t0, t1, time.perf_counter())
            canvas = chain[kept].clone()
            canvas[positions[kept]] = token
            draft_cache.crop(min(draft_cache.length, len(seq) + kept))
            tally.add(kept, n, n)
            canvases += n + 1
            if on_round is not None:
                on_round({"canvas": canvas.clone(), "block_start": lo, "drafts": tokens.tolist(), "accepted": kept,
                          "committed": [(int(positions[j]), int(canvas[positions[j]])) for j in range(kept + 1)]})
    return canvas[P:].tolist(), tally.result(canvas[P:], device, SelfSpeculated, canvases=canvases)


def main(argv=None):
    """python -m tinydiff.extras.drafted_diffusion: a diffusion LM's left-to-right story, drafted by an AR model."""
    p = story_parser("python -m tinydiff.extras.drafted_diffusion", "A diffusion LM's story one token per step left "
                     "to right, k positions a round drafted by an AR draft and verified in one forward (lossless).")
    p.add_argument("--draft", required=True, help="the AR draft (train.py --model ar --target CKPT --regenerate N)")
    p.add_argument("--k", type=COUNT, default=8, help="positions drafted a round")
    p.add_argument("--block-length", type=COUNT, help="blocks filled left to right (default 32)")
    args = p.parse_args(argv)

    def decode(model, prompt, generator):
        draft, _ = load_model(args.draft, args.device, kinds=("ar",))
        new, block = diffusion_lengths(model, prompt, args.max_new_tokens, args.block_length)
        if args.k > block:
            print(f"notice: --k {args.k} is more than a block's {block} positions; drafting at most {block - 1} a "
                  "round (a block's last open position is the diffusion model's own draw)", file=sys.stderr)
        return ar_drafted_generate(model, draft, prompt, new, block, args.temperature or 0.0, min(args.k, block),
                                   generator)
    write_story(args, DIFFUSION_KINDS, decode)


if __name__ == "__main__":
    sys.exit(run_main(main))
