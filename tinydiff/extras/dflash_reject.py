"""DFlash at temperature > 0: sampled drafts judged by the rejection rule, and DSpark's verify length.

DFlash's own rule (dflash.match) keeps the drafter's argmax drafts while they equal the target's
samples: lossless for any draft, but at T > 0 an argmax guess matches a sample only as often as the
target's distribution puts its mass there. DSpark samples the drafts instead, x_k ~ q_k (the drafter's
slot distributions, warped exactly as the target's), and judges them by speculation's full rule
(speculative.verify: accept with min(1, p/q), resample the first rejection from norm(max(0, p - q)),
else a bonus from p): lossless too, and a drafter trained for sampling (train.py --draft-temperature)
keeps more of a block. At temperature 0 both rules are plain greedy decoding of the target.
DSpark's confidence-scheduled verify length (`min_confidence`): the target verifies only the drafts
before the first slot the drafter itself gives under that probability (at least one). A shorter verify
is still the rule on fewer drafts, so it stays lossless. DSpark predicts acceptance with a trained
confidence head; here the drafter's own probability of its draft stands in for it.
Both are dflash_generate with its `propose` and `judge` replaced.
"""
import sys

import torch

from tinydiff.checks import COUNT, PROBABILITY, UserError
from tinydiff.dflash import argmax_drafts, dflash_generate, match
from tinydiff.io.checkpoint import AR_KINDS, drafter_from, load_checkpoint
from tinydiff.io.cli import run_main, story_parser, write_story
from tinydiff.model import wide
from tinydiff.sampling import next_token_probs, sample
from tinydiff.speculative import verify
from tinydiff.tokenizer import EOT


def sampled_drafts(drafter, logits, first_token, warp_args, generator=None):
    """The drafts (K,) sampled from q (K, V), the slots warped exactly like the target (one-hot at T = 0),
    and q itself, which the rejection rule reads."""
    q = next_token_probs(logits, *warp_args)
    return sample(q, generator), q


def reject(p, drafts, q, generator=None, greedy=False):
    """Speculation's rule for sampled drafts; a round without drafts commits the target's one sample."""
    return verify(p, q, drafts, generator) if len(drafts) else match(p, drafts, q, generator, greedy)


def confident_prefix(logits, drafts, min_confidence: float) -> int:
    """DSpark's verify length: the drafts before the first slot whose predicted acceptance (the drafter's own
    unwarped probability of its draft, rows logits (K, V)) is under min_confidence; at least one (the drafter
    forward is paid already, and a verify of two tokens costs about what one costs)."""
    confidence = next_token_probs(logits.to(wide(logits.dtype)), 1.0).gather(-1, drafts[:, None])[:, 0]  # (K,)
    low = (confidence < min_confidence).nonzero()
    return max(1, int(low[0])) if len(low) else len(drafts)


def scheduled(propose, min_confidence: float):
    """`propose` whose drafts are cut at DSpark's verify length."""
    PROBABILITY.check("min_confidence", min_confidence)

    def cut(drafter, logits, first_token, warp_args, generator=None):
        drafts, q = propose(drafter, logits, first_token, warp_args, generator)
        head = getattr(drafter, "markov", None)  # a Markov drafter's rows: biased by the draft before each slot
        if head is not None and len(drafts):
            previous = torch.cat([torch.tensor([int(first_token)], device=drafts.device), drafts[:-1]])
            logits = logits + head(previous).to(logits.dtype)
        m = confident_prefix(logits, drafts, min_confidence)
        return drafts[:m], None if q is None else q[:m]
    return cut


RULES = {"match": (argmax_drafts, match), "reject": (sampled_drafts, reject)}  # rule -> (propose, judge)


@torch.no_grad()
def dflash_reject_generate(target, drafter, prompt, max_new_tokens, block_size=None, temperature=1.0, top_k=None,
                           top_p=None, generator=None, stop_token=EOT, on_round=None, rule="reject",
                           min_confidence=None, propose=None):
    """dflash_generate's arguments and result, the drafts sampled and judged by the rejection rule
    (rule="reject") or DFlash's argmax drafts matched (rule="match"), with min_confidence (None: every
    draft verified) DSpark's verify length. propose: the sampled or argmax drafts of another drafter
    (markov_head.markov_drafts)."""
    if rule not in RULES:
        raise UserError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    draw, judge = RULES[rule]
    if propose is not None:
        draw = propose
    if min_confidence is not None:
        draw = scheduled(draw, min_confidence)
    return dflash_generate(target, drafter, prompt, max_new_tokens, block_size, temperature, top_k, top_p, generator,
                           stop_token, on_round, propose=draw, judge=judge)


def main(argv=None):
    """python -m tinydiff.extras.dflash_reject: DFlash with sampled drafts and the rejection rule, or a verify length."""
    p = story_parser("python -m tinydiff.extras.dflash_reject", "DFlash decoding with the rejection rule (sampled "
                     "drafts) or DSpark's confidence-scheduled verify length.")
    p.add_argument("--draft", required=True, help="the DFlash drafter (train.py --model dflash)")
    p.add_argument("--k", type=COUNT, help="drafts per round (default: the drafter's block - 1)")
    p.add_argument("--rule", choices=list(RULES), default="reject", help="reject: sampled drafts, the rejection "
                   "rule; match: DFlash's argmax drafts")
    p.add_argument("--min-confidence", type=PROBABILITY, help="verify only the drafts before the first the "
                   "drafter gives under this probability")
    args = p.parse_args(argv)

    def decode(target, prompt, generator):
        drafter = drafter_from(load_checkpoint(args.draft, kinds=("dflash",)), target, args.draft)
        return dflash_reject_generate(target, drafter, prompt, args.max_new_tokens, args.k and args.k + 1,
                                      0.8 if args.temperature is None else args.temperature, None, None, generator,
                                      rule=args.rule, min_confidence=args.min_confidence)
    write_story(args, AR_KINDS, decode)


if __name__ == "__main__":
    sys.exit(run_main(main))
