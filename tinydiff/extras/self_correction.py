"""Self-correction for the diffusion sampler (DiffusionGemma-style): committed tokens may be revised.

The LLaDA sampler (tinydiff/sampler.py) never changes a committed token, so an early guess made with
little context stays, even once the finished block shows it was wrong. Here, after a block is full,
`revise` extra steps each re-mask the block's least confident token (the confidence recorded when it was
committed, or re-predicted) and predict it again with the whole finished block in view: one forward a
step. revise = 0 is sampler.generate exactly. Each event also names the positions re-masked (`revised`).
Leaves out: revising across blocks, the cached sampler (a revised token would change cached keys).
"""
import sys

import torch

from tinydiff.checks import COUNT, COUNT_OR_NONE, UserError
from tinydiff.io.checkpoint import DIFFUSION_KINDS
from tinydiff.io.cli import run_main, story_parser, write_story
from tinydiff.sampler import REMASKING, Trace, check_args, commit, diffusion_lengths, fill_block, start_canvas
from tinydiff.tokenizer import MASK


@torch.no_grad()
def generate_revising(model, prompt, gen_length=64, steps=64, block_length=32, revise=1, temperature=0.0,
                      remasking="low_confidence", generator=None, callback=None):
    """sampler.generate (uncached, no threshold) with `revise` self-correction steps after each block;
    returns (new ids, ar.Decoded): forwards counts the revising steps too."""
    blocks, block_steps = check_args(model, prompt, gen_length, steps, block_length, temperature, remasking, None)
    if not isinstance(revise, int) or revise < 0:
        raise UserError(f"revise must be an integer >= 0, got {revise!r}")
    if revise > block_length:  # each step is a forward: a count past the block's positions only runs long
        raise UserError(f"revise {revise} is more than a block's {block_length} positions; pass at most "
                        f"{block_length} (each revising step predicts one of them again)")
    P = len(prompt)
    canvas, confidences = start_canvas(model, prompt, gen_length)
    trace = Trace(callback)

    def block_logits(lo):
        trace.forwards += 1
        first = lo - model.config.shift  # the output that predicts position lo
        return model(canvas[None], causal=False)[0, first:first + block_length]  # (N, V)

    for b in range(blocks):
        lo = P + b * block_length
        fill_block(canvas, b, lo, block_length, block_logits, block_steps, trace, temperature, remasking, None,
                   None, generator, confidences)
        for _ in range(revise):  # re-mask the least confident token of the full block, predict it again
            worst = lo + int(confidences[lo:lo + block_length].argmin())
            canvas[worst] = MASK
            committed = commit(canvas, lo, block_logits(lo), 1, None, temperature, remasking, generator, confidences)
            trace.step(canvas, b, committed, revised=[worst])
    return canvas[P:].tolist(), trace.result(gen_length, canvas.device)


def main(argv=None):
    """python -m tinydiff.extras.self_correction: a diffusion LM's story, each block revised before the next."""
    p = story_parser("python -m tinydiff.extras.self_correction", "A diffusion LM's story with self-correction: "
                     "after each block, its least confident tokens predicted again.")
    p.add_argument("--revise", type=COUNT_OR_NONE, help="revising steps per block, at most its length (0: the LLaDA "
                   "sampler; default 4, or the block's length where it is shorter)")
    p.add_argument("--steps", type=COUNT, help="forwards before revising (default: one token per step)")
    p.add_argument("--block-length", type=COUNT, help="blocks filled left to right (default 32)")
    p.add_argument("--remasking", choices=REMASKING, default="low_confidence", help="which positions to commit")
    args = p.parse_args(argv)

    def decode(model, prompt, generator):
        new, block = diffusion_lengths(model, prompt, args.max_new_tokens, args.block_length)
        revise = min(4, block) if args.revise is None else args.revise
        return generate_revising(model, prompt, new, args.steps or new, block, revise, args.temperature or 0.0,
                                 args.remasking, generator)
    write_story(args, DIFFUSION_KINDS, decode)


if __name__ == "__main__":
    sys.exit(run_main(main))
