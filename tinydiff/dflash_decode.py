"""DFlash decoding: one drafter forward drafts a block, one target forward verifies it.

Paper: "DFlash: Block Diffusion for Flash Speculative Decoding" (2026). The drafter is
tinydiff/dflash.py. Each round, with committed sequence seq (S tokens):
  1. draft:  the drafter fills [seq[-1], MASK x (B-1)] at positions S-1..S+B-2 in ONE forward
             (no iterative denoising), reading the context features of positions 0..S-2;
  2. verify: the target reads [seq[-1], d_1..d_K] (K = B-1, fewer at the end) in one forward that
             also returns its hidden states at the feature layers;
  3. accept, by one of two rules (the `rule` argument; RULES pairs each one's draft and judge):
       "match"  (default; DFlash's rule) the drafts are the drafter's argmax; the target samples
                y_0..y_K from its own warped distributions; accept while d_i == y_{i-1}, then commit
                y_n as the bonus. Every committed token is a target sample given its committed
                prefix, so the output is the target's distribution for any draft (with a one-hot
                draft this is exactly the rejection rule: accept x with probability p(x)).
       "reject" the drafts are sampled from the drafter's warped per-slot distributions q_k, then
                speculation's full rule (speculative.verify: accept with min(1, p/q), resample the
                first rejection from the residual). Use it with a sampling draft at T > 0.
     At temperature 0 both rules are plain greedy decoding of the target, token for token.
  4. commit: crop the target cache to the committed length and append the features of the newly
     committed positions to the drafter's context cache.
Caches: after every round both hold exactly the committed tokens but the newest (seq[:-1]); the
newest is slot 0 of the next block. Before the first round a prefill forward of the target over
prompt[:-1] fills both (skipped for a one-token prompt): target_forwards = rounds + that prefill.

A drafter with DSpark's Markov head (tinydiff/markov_head.py) drafts the same one forward, then
picks its slots left to right through the head: argmax, or sampled for "reject".
DSpark's confidence-scheduled verify length (`min_confidence`): the target verifies only the drafts
before the first slot the drafter itself gives under that probability (at least one). A shorter
verify is still the rule above on fewer drafts, so it stays lossless; DSpark predicts acceptance
with a trained confidence head, here the drafter's own probability of its draft stands in for it.
Leaves out: batches, draft trees (see ddtree.py), iterative refinement of the block.
"""

import time

import torch

from tinydiff.ar import check_prompt
from tinydiff.checks import PROBABILITY
from tinydiff.dflash import DFlashDrafter, draft_block
from tinydiff.drafter import check_target
from tinydiff.errors import UserError
from tinydiff.markov_head import draft_left_to_right
from tinydiff.model import wide
from tinydiff.sampling import check_warp_args, next_token_probs, sample
from tinydiff.speculative import cut_at_stop, verify
from tinydiff.tally import Tally, split_time
from tinydiff.tokenizer import EOT, MASK


def sample_and_match(p, drafts, generator=None, greedy=False):
    """p (K+1, V) the target's warped distributions, drafts (K,) -> (n, token).

    The target draws y_i ~ p_i position by position; drafts are accepted while drafts[i] == y_i;
    `token` = y_n, the target's own sample after the accepted prefix. Draws stop at the first
    mismatch (later ones would be thrown away). greedy: p is one-hot, so its sample is its argmax.
    """
    if greedy:
        return greedy_match(p, drafts)
    for i in range(len(drafts) + 1):
        y = int(sample(p[i], generator))
        if i == len(drafts) or y != int(drafts[i]):
            return i, y


def greedy_match(p, drafts):
    """sample_and_match at temperature 0, every position at once: the target's argmax at each, the
    drafts kept up to the first that differs. One read-back of the GPU, not two per position."""
    y = p.argmax(-1)  # (K+1,)
    kept = (y[:-1] == drafts).cumprod(0).sum()  # () drafts before the first mismatch
    n, token = torch.stack([kept, y[kept]]).tolist()
    return n, token


def argmax_drafts(logits, warp_args, generator=None, markov=None, first_token=None):
    """The "match" rule's drafts (K,): the drafter's argmax per slot (never MASK); no q is needed.
    With a Markov head, the argmax chain of the biased logits, left to right from first_token.
    Returns (drafts, q = None, the rows (K, V) the drafts were picked from)."""
    if markov is not None:
        drafts, rows = draft_left_to_right(markov, logits, first_token, lambda row: argmax_drafts(row, warp_args)[0])
        return drafts, None, rows
    return next_token_probs(logits, 0, None, None).argmax(-1), None, logits


def sampled_drafts(logits, warp_args, generator=None, markov=None, first_token=None):
    """The "reject" rule's drafts (K,), sampled from q (K, V), the slots warped exactly like the target
    (one-hot q at T = 0), and q itself, which the rejection rule needs. With a Markov head each slot
    is sampled from its row biased by the draft before it, and q holds those rows' distributions.
    Returns (drafts, q, the rows (K, V) the drafts were drawn from)."""
    if markov is not None:
        drafts, rows = draft_left_to_right(markov, logits, first_token,
                                           lambda row: sampled_drafts(row, warp_args, generator)[0])
        return drafts, next_token_probs(rows, *warp_args), rows
    q = next_token_probs(logits, *warp_args)
    return (sample(q, generator) if warp_args[0] > 0 else q.argmax(-1)), q, logits


def confident_prefix(rows, drafts, min_confidence: float) -> int:
    """DSpark's verify length: how many drafts come before the first slot whose predicted acceptance,
    the drafter's own unwarped probability of its draft, is under min_confidence. At least one: the
    drafter forward is paid already, and a verify of two tokens costs about what one costs."""
    confidence = next_token_probs(rows.to(wide(rows.dtype)), 1.0).gather(-1, drafts[:, None])[:, 0]  # (K,)
    low = (confidence < min_confidence).nonzero()
    return max(1, int(low[0])) if len(low) else len(drafts)


def match(p, drafts, q, generator=None, greedy=False):
    """DFlash's rule: the target samples each position, a draft is kept while it equals the sample."""
    return sample_and_match(p, drafts, generator, greedy)


def reject(p, drafts, q, generator=None, greedy=False):
    """Speculation's rule (speculative.verify) for sampled drafts; a round without drafts commits the
    target's one sample."""
    return verify(p, q, drafts, generator) if len(drafts) else sample_and_match(p, drafts, generator, greedy)


RULES = {"match": (argmax_drafts, match), "reject": (sampled_drafts, reject)}  # rule -> (draft, judge)


def check_drafter(target, drafter, block_size) -> int:
    """The drafter must be a DFlashDrafter built for this target's dimensions; returns the block size."""
    if not isinstance(drafter, DFlashDrafter):
        raise UserError(f"the drafter is a {type(drafter).__name__}; build one with tinydiff.dflash.DFlashDrafter "
                        "or load a DFlash drafter checkpoint")
    check_target(drafter.config, target)
    block_size = drafter.config.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 2 <= block_size <= drafter.config.block_size:
        raise UserError(f"block size must be an integer in [2, {drafter.config.block_size}] for this drafter "
                        f"(trained with blocks of {drafter.config.block_size}), got {block_size!r}")
    if drafter.fc.weight.device != target.embed.weight.device:
        raise UserError(f"the drafter is on {drafter.fc.weight.device} but the target on "
                        f"{target.embed.weight.device}; move both to one device")
    return block_size


def prefill_caches(target, drafter, prompt, target_cache, draft_cache) -> int:
    """Read all but the prompt's newest token into the target's cache and their features into the
    drafter's context cache; returns the target forwards spent (0 for a one-token prompt)."""
    if len(prompt) < 2:
        return 0
    x = torch.tensor([prompt[:-1]], device=target.embed.weight.device)
    _, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)
    drafter.extend(draft_cache, hidden)
    return 1


def start_decoding(target, drafter, prompt, max_new_tokens, block_size, warp_args):
    """What every loop of a block drafter (DFlash, DDTree, their fused rounds) checks and does before its
    first round: the warp, the prompt (MASK would read as a MASK slot: the drafter embeds MASK with its
    own vector), the drafter and block size; then both caches, and the prefill. Returns (new tokens to
    decode, B, target_cache, draft_cache, prefill forwards)."""
    check_warp_args(*warp_args)
    n_new = check_prompt(prompt, target.config.context, max_new_tokens)
    if MASK in prompt:
        raise UserError(f"the prompt holds the MASK id {MASK}; pass text (MASK is only for diffusion canvases)")
    B = check_drafter(target, drafter, block_size)
    target_cache, draft_cache = target.new_cache(1), drafter.new_cache(1)
    return n_new, B, target_cache, draft_cache, prefill_caches(target, drafter, prompt, target_cache, draft_cache)


def draft_and_verify(target, drafter, target_cache, draft_cache, seq, n_drafts, B, rule, warp_args, generator=None,
                     min_confidence=None, tally=None):
    """One round's drafting and verifying after seq: ONE drafter forward for the block (none when n_drafts
    is 0), ONE target forward for [seq[-1], drafts], the rule's judgement. The target's cache then holds
    the verified rows, the drafter's is unchanged (`commit` settles both). tally, if given, clocks the
    stages. Returns (drafts (K,), n accepted, the committed token, the verify's hidden states N x (1, K+1, D))."""
    draw, judge = RULES[rule]
    device = target.embed.weight.device
    drafts, q = torch.empty(0, dtype=torch.long, device=device), None
    t0 = time.perf_counter()
    if n_drafts:  # draft: ONE drafter forward for the block
        logits = draft_block(drafter, draft_cache, seq[-1], block_size=B)[:n_drafts]  # (K, V)
        drafts, q, rows = draw(logits, warp_args, generator, drafter.markov, seq[-1])
        if min_confidence is not None:  # verify only the drafts the drafter is sure enough of
            m = confident_prefix(rows, drafts, min_confidence)
            drafts, q = drafts[:m], None if q is None else q[:m]
    t1 = split_time(device)
    x = torch.cat([torch.tensor([seq[-1]], device=device), drafts])[None]  # (1, K+1)
    # verify: ONE forward, which also returns the features of the inputs it reads
    logits, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)
    n, token = judge(next_token_probs(logits[0], *warp_args), drafts, q, generator, warp_args[0] == 0)
    if tally is not None:
        tally.clock(t0, t1, time.perf_counter())  # judge's int() waited for the GPU
    return drafts, n, token, hidden


def commit(seq, out, tokens, stop_token, target_cache, drafter, draft_cache, hidden=None):
    """The round's tokens (the accepted drafts, then the target's token) cut after stop_token, appended to
    seq and out; both caches left holding seq[:-1]: the target's cropped (its rejected rows dropped), the
    drafter's context extended with the features (hidden) of the inputs now committed, or, where a
    fused round wrote every verified row already (hidden None), cropped as well. Returns (tokens, stopped)."""
    tokens, stopped = cut_at_stop(tokens, stop_token)
    seq += tokens
    out += tokens
    target_cache.crop(len(seq) - 1)  # the newest token is read next round
    if hidden is None:
        draft_cache.crop(len(seq) - 1)
    else:
        drafter.extend(draft_cache, [h[:, :len(tokens)] for h in hidden])
    return tokens, stopped


@torch.no_grad()
def dflash_generate(target, drafter, prompt, max_new_tokens, block_size=None, temperature=0.0, top_k=None,
                    top_p=None, generator=None, stop_token=EOT, on_round=None, rule="match",
                    min_confidence=None):
    """Decode after `prompt` (list of ids); each round drafts a block of block_size (default the
    drafter's B) and commits 1..B tokens. Stops after max_new_tokens (None: fill the context) or
    after emitting stop_token (None: never; tokens after it in the same round are dropped).
    on_round(info) is called after every round with: drafts, accepted (n), tokens (committed this
    round), seq (prompt + everything committed), target_cache, draft_cache (both rolled back).
    min_confidence (None: verify every draft): DSpark's confidence-scheduled verify length.

    Returns (new ids, tally.Speculated): accepted over n = 0..B-1, forwards = rounds + the prefill,
    one draft forward per round that drafted.
    """
    if rule not in RULES:
        raise UserError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    if min_confidence is not None:
        PROBABILITY.check("min_confidence", min_confidence)
    warp_args, device = (temperature, top_k, top_p), target.embed.weight.device
    n_new, B, target_cache, draft_cache, prefill = start_decoding(target, drafter, prompt, max_new_tokens, block_size,
                                                                  warp_args)
    seq, out = list(prompt), []
    tally = Tally(B - 1)
    tally.prefill = prefill
    while len(out) < n_new:
        n_drafts = min(B - 1, n_new - len(out) - 1)  # a full acceptance plus the bonus lands on n_new
        drafts, n, token, hidden = draft_and_verify(target, drafter, target_cache, draft_cache, seq, n_drafts, B, rule,
                                                    warp_args, generator, min_confidence, tally)
        tokens, stopped = commit(seq, out, drafts.tolist()[:n] + [token], stop_token, target_cache, drafter,
                                 draft_cache, hidden)
        tally.add(n, len(drafts), int(n_drafts > 0))  # one drafter forward per round that drafted
        if on_round is not None:
            on_round({"drafts": drafts.tolist(), "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    return out, tally.result(out, device)
