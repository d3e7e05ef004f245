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
Both run dflash_generate's loop here, its round's draft and judge steps replaced (`rule_steps`).
"""
import sys
import time

import torch

from tinydiff.ar import split_time
from tinydiff.checks import COUNT, PROBABILITY, UserError
from tinydiff.dflash import argmax_drafts, draft_block, match, start_decoding
from tinydiff.io.checkpoint import AR_KINDS, drafter_from, load_checkpoint
from tinydiff.io.cli import run_main, story_parser, write_story
from tinydiff.model import wide
from tinydiff.sampling import next_token_probs, sample
from tinydiff.speculative import Tally, cut_at_stop, verify
from tinydiff.tokenizer import EOT


def sampled_drafts(logits, warp_args, generator=None):
    """The drafts (K,) sampled from q (K, V), the block logits' slots warped exactly like the target (one-hot at
    T = 0), and q itself, which the rejection rule reads."""
    q = next_token_probs(logits, *warp_args)
    return sample(q, generator), q


def reject(p, drafts, q, generator=None, greedy=False):
    """Speculation's rule for sampled drafts; a round without drafts commits the target's one sample."""
    if len(drafts):
        return verify(p, q, drafts, generator)
    return match(p, drafts, generator, greedy)


def confident_prefix(logits, drafts, min_confidence: float) -> int:
    """DSpark's verify length: the drafts before the first slot whose predicted acceptance (the drafter's own
    unwarped probability of its draft, rows logits (K, V)) is under min_confidence; at least one (the drafter
    forward is paid already, and a verify of two tokens costs about what one costs)."""
    confidence = next_token_probs(logits.to(wide(logits.dtype)), 1.0).gather(-1, drafts[:, None])[:, 0]  # (K,)
    low = (confidence < min_confidence).nonzero()
    return max(1, int(low[0])) if len(low) else len(drafts)


def drafted_rows(drafter, logits, first_token, drafts):
    """The rows (K, V) the drafts were read from: a Markov drafter's biased by the draft before each slot."""
    head = getattr(drafter, "markov", None)
    if head is None or not len(drafts):
        return logits
    previous = torch.cat([torch.tensor([int(first_token)], device=drafts.device), drafts[:-1]])  # (K,)
    return logits + head(previous).to(logits.dtype)


def rule_steps(rule: str, drafter, warp_args, generator=None, propose=None, min_confidence=None):
    """A round's two steps under `rule`: draw(logits (K, V), first_token) -> (drafts (K,), q (K, V) or None) and
    judge(p (K+1, V), drafts, q) -> (n, token). propose(drafter, logits, first_token, warp_args, generator) ->
    (drafts, q): the draws of a drafter that drafts its own way (markov_head.markov_drafts); min_confidence:
    the drafts cut at DSpark's verify length."""
    greedy = warp_args[0] == 0

    def draw(logits, first_token):
        if propose is not None:
            drafts, q = propose(drafter, logits, first_token, warp_args, generator)
        elif rule == "reject":
            drafts, q = sampled_drafts(logits, warp_args, generator)
        else:
            drafts, q = argmax_drafts(logits), None
        if min_confidence is None:
            return drafts, q
        m = confident_prefix(drafted_rows(drafter, logits, first_token, drafts), drafts, min_confidence)
        return drafts[:m], None if q is None else q[:m]

    def judge(p, drafts, q):
        if rule == "reject":
            return reject(p, drafts, q, generator, greedy)
        return match(p, drafts, generator, greedy)
    return draw, judge


def drafts_per_round(k, drafter):
    """--k as a block size for the loops (None: the drafter's own block). A drafter drafts at most its block - 1 a
    round, so a larger --k does what that does: clamped to it, with a one-line notice on stderr."""
    if k is None:
        return None
    most = drafter.config.block_size - 1
    if k > most:
        print(f"notice: --k {k} is more than this drafter's {most} drafts a round (trained with blocks of "
              f"{most + 1}); drafting at most {most} a round", file=sys.stderr)
    return min(k, most) + 1


RULES = ("match", "reject")  # DFlash's argmax drafts matched; sampled drafts and the rejection rule


@torch.no_grad()
def dflash_reject_generate(target, drafter, prompt, max_new_tokens, block_size=None, temperature=1.0, top_k=None,
                           top_p=None, generator=None, stop_token=EOT, on_round=None, rule="reject",
                           min_confidence=None, propose=None):
    """dflash_generate's arguments and result, the drafts sampled and judged by the rejection rule
    (rule="reject") or DFlash's argmax drafts matched (rule="match"), with min_confidence (None: every
    draft verified) DSpark's verify length. propose: the sampled or argmax drafts of another drafter
    (markov_head.markov_drafts). dflash_generate's loop, its round's draw and judge `rule_steps`'."""
    if rule not in RULES:
        raise UserError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    if min_confidence is not None:
        PROBABILITY.check("min_confidence", min_confidence)
    warp_args = (temperature, top_k, top_p)
    device = target.embed.weight.device
    draw, judge = rule_steps(rule, drafter, warp_args, generator, propose, min_confidence)
    n_new, B, target_cache, draft_cache, prefill = start_decoding(target, drafter, prompt, max_new_tokens, block_size,
                                                                  warp_args)
    seq = list(prompt)
    out = []
    tally = Tally(B - 1, prefill=prefill)
    while len(out) < n_new:
        n_drafts = min(B - 1, n_new - len(out) - 1)  # a full acceptance plus the bonus lands on n_new
        t0 = time.perf_counter()
        drafts = torch.empty(0, dtype=torch.long, device=device)
        q = None
        if n_drafts:  # draft: ONE drafter forward for the block
            drafts, q = draw(draft_block(drafter, draft_cache, seq[-1], block_size=B)[:n_drafts], seq[-1])
        t1 = split_time(device)
        x = torch.cat([torch.tensor([seq[-1]], device=device), drafts])[None]  # (1, K+1)
        logits, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)  # verify
        n, token = judge(next_token_probs(logits[0], *warp_args), drafts, q)
        tally.clock(t0, t1, time.perf_counter())
        tokens, stopped = cut_at_stop(drafts.tolist()[:n] + [token], stop_token)  # commit
        seq += tokens
        out += tokens
        target_cache.crop(len(seq) - 1)  # the newest token is read next round
        drafter.extend(draft_cache, [h[:, :len(tokens)] for h in hidden])
        tally.add(n, len(drafts), int(n_drafts > 0))  # one drafter forward per round that drafted
        if on_round is not None:
            on_round({"drafts": drafts.tolist(), "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    return out, tally.result(out, device)


def main(argv=None):
    """python -m tinydiff.extras.dflash_reject: DFlash with sampled drafts and the rejection rule, or a verify length."""
    p = story_parser("python -m tinydiff.extras.dflash_reject", "DFlash decoding with the rejection rule (sampled "
                     "drafts) or DSpark's confidence-scheduled verify length.")
    p.add_argument("--draft", required=True, help="the DFlash drafter (train.py --model dflash)")
    p.add_argument("--k", type=COUNT, help="drafts per round (default: the drafter's block - 1)")
    p.add_argument("--rule", choices=RULES, default="reject", help="reject: sampled drafts, the rejection "
                   "rule; match: DFlash's argmax drafts")
    p.add_argument("--min-confidence", type=PROBABILITY, help="verify only the drafts before the first the "
                   "drafter gives under this probability")
    args = p.parse_args(argv)

    def decode(target, prompt, generator):
        drafter = drafter_from(load_checkpoint(args.draft, kinds=("dflash",)), target, args.draft)
        block = drafts_per_round(args.k, drafter)
        return dflash_reject_generate(target, drafter, prompt, args.max_new_tokens, block,
                                      0.8 if args.temperature is None else args.temperature, None, None, generator,
                                      rule=args.rule, min_confidence=args.min_confidence)
    write_story(args, AR_KINDS, decode)


if __name__ == "__main__":
    sys.exit(run_main(main))
