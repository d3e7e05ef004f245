"""A DFlash round as one compiled graph: the block drafted, verified, judged and the drafter's context extended.

dflash.py's loop calls into two compiled steps a round (compiled.compiled's drafter and target) and keeps the rest eager: the drafts' argmax or draws, the target's warp, the acceptance
rule with its read-backs, and the drafter's `extend`. vLLM and SGLang capture a draft + verify round
with a fixed block size as one graph; so does `dflash_round` here, for both rules of extras/dflash_reject.py:
  1. draft: the drafter fills [seq[-1], MASK x (B-1)] against its static context cache (rows past the
     committed ones hidden by a mask built from a device tensor), and picks its B - 1 drafts: the argmax
     ("match") or draws ("reject"), left to right through a Markov head if the drafter has one;
  2. verify: the target reads [seq[-1], d_1..d_{B-1}] at a tensor offset (compiled.forward_at);
  3. judge: "match": the target's samples y_0..y_{B-1}, the drafts kept while they equal them, y_n
     committed; "reject": Leviathan's rule (fused_round.verdict). A story's last rounds verify only their
     first m drafts (`live`): the graph still drafts B - 1, the rest are never kept;
  4. extend: the features of all B verified inputs go into the drafter's context cache at their rows.
     Only the first n + 1 are committed; the host's cache length hides the rest, and the next round's
     extend writes over them before any draft reads them.
The host reads back one small tensor a round: the drafts, n and the token.
Random numbers are drawn before the graph runs, in the eager loop's order, so a fused round commits the
eager round's tokens at every temperature. "match" spends one number per position it judges, n + 1, a
count the graph only learns: the loop draws B numbers, then rewinds the generator and spends n + 1.
(As in fused_round.py, `sampling.sample` spends none on an exactly one-hot row at T > 0, the graph
does; both are exact draws.)
Rounds whose B rows would pass the context run dflash.py's eager pieces.

Leaves out: DSpark's confidence-scheduled verify length (extras/dflash_reject.py, on compiled steps),
draft trees (ddtree.py), batches.
"""
from functools import partial

import torch

from tinydiff.checks import UserError
from tinydiff.dflash import check_drafter, draft_block, start_decoding
from tinydiff.extras.dflash_reject import RULES, rule_steps
from tinydiff.extras.markov_head import draft_left_to_right, markov_drafts
from tinydiff.fast.compiled import Compiled, compile_seconds, compiled, forward_at
from tinydiff.fast.fused_round import PREFILL_CHUNK, RewindableDraws, padded, uniforms, verdict
from tinydiff.kernels import kernels_enabled
from tinydiff.sampling import draftable, inverse_cdf, next_token_probs
from tinydiff.speculative import Tally, cut_at_stop
from tinydiff.tokenizer import EOT, MASK


def pick_drafts(logits, first, u, warp_args, markov=None):
    """The drafts (K,) from the block's logits (K, V) and their distributions q (K, V): warped by
    warp_args, the argmax at temperature 0, else inverse-CDF draws with the uniforms u (K, 1). With a
    Markov head, slot by slot, each row biased by the draft before it (slot 1: `first`, (1,) the newest
    committed token). extras.markov_head.markov_drafts (dflash.argmax_drafts, extras.dflash_reject.sampled_drafts
    without a head), without host synchronisation."""
    def pick(row, j):  # row (1, V) -> its draft (1,) and q (1, V)
        q = next_token_probs(row, *warp_args)
        return (q.argmax(-1) if warp_args[0] == 0 else inverse_cdf(q, u[j:j + 1])), q
    if markov is None:
        q = next_token_probs(logits, *warp_args)  # (K, V)
        return (q.argmax(-1) if warp_args[0] == 0 else inverse_cdf(q, u)), q
    slots = iter(range(len(logits)))
    drafts, rows = draft_left_to_right(markov, logits, first[0], lambda row: pick(row[None], next(slots))[0][0])
    return drafts, next_token_probs(rows, *warp_args)


def target_picks(logits, warp_args, u):
    """The target's sample at every row of logits (R, V), as `sampling.sample` draws it from
    next_token_probs with the uniforms u (R, 1) float64; at temperature 0 the argmax (MASK never), without
    writing out next_token_probs' one-hot rows. Returns (R,)."""
    if warp_args[0] == 0:
        return draftable(logits).argmax(-1)
    return inverse_cdf(next_token_probs(logits, *warp_args), u)


def match_verdict(y, drafts, live):
    """dflash.match given the target's samples y (K+1,) at every position (`target_picks`;
    only the first n + 1 are the eager loop's draws), drafts (K,), live (K,) as in fused_round.verdict.
    Returns n and the token, 0-d tensors."""
    n = ((y[:-1] == drafts) & live).long().cumprod(0).sum()  # (): drafts kept up to the first mismatch
    return n, y.index_select(0, n.view(1))[0]


def draft_block_static(drafter, draft_cache, idx, start, B: int):
    """dflash.draft_block against a static context cache, without host synchronisation: the drafter fills
    [idx, MASK x (B-1)] at positions start.. (idx, start (1,) each), reading the cache's rows before start.
    Returns the logits (B-1, V) of slots 1..B-1 and the block's positions (B,), which are also the rows
    its inputs take in both caches once verified."""
    C = draft_cache.capacity
    at = start + torch.arange(B, device=idx.device)  # (B,)
    block = torch.cat([idx, torch.full((B - 1,), MASK, dtype=idx.dtype, device=idx.device)])[None]  # (1, B)
    column = torch.arange(C + B, device=idx.device)
    mask = ((column < start) | (column >= C)).view(1, 1, 1, -1)  # the committed context, then the block itself
    return drafter(block, at, draft_cache.k, draft_cache.v, mask)[0, 1:], at


def dflash_round(target, drafter, target_cache, draft_cache, idx, start, u_draft, u_accept, u_last, live, rule: str,
                 warp_args):
    """One round of dflash_generate (the module docstring's four steps) after a sequence whose newest token
    is idx (1,) at position start (1,); both caches hold the rows before it.

    u_draft (B-1, 1) float64 the "reject" drafts' uniforms, u_accept (B-1,) its acceptance tests', u_last
    (B, 1) float64: the "match" judge's per position, or "reject"'s last draw in its first row (unread
    when greedy); live (B-1,) bool: the slots verified. Returns (B + 1,): the B - 1 drafts, n, the token.
    """
    logits, at = draft_block_static(drafter, draft_cache, idx, start, len(live) + 1)  # (B-1, V), (B,)
    greedy, match = warp_args[0] == 0, rule == "match"
    drafts, q = pick_drafts(logits, idx, u_draft, (0.0, None, None) if match else warp_args,
                            getattr(drafter, "markov", None))
    x = torch.cat([idx, drafts])[None]  # (1, B)
    logits, hidden = forward_at(target, target_cache, x, at, at)  # (1, B, V), L + 1 x (1, B, D)
    if match:
        n, token = match_verdict(target_picks(logits[0], warp_args, u_last), drafts, live)
    else:
        n, token = verdict(next_token_probs(logits[0], *warp_args), q, drafts, u_accept, u_last[:1], greedy, live)
    features = drafter.features([hidden[i] for i in drafter.config.taps])  # (1, B, D)
    for layer, (k, v) in enumerate(drafter.context_kv(features, at)):
        draft_cache.write(layer, at, k, v)
    return torch.cat([drafts, n.view(1), token.view(1)])


def eager_round(target, drafter, target_cache, draft_cache, seq, n_drafts, B, rule, warp_args, generator):
    """dflash_reject_generate's round, for the rounds at the context's end: (drafts, n, token, the verify's hidden)."""
    propose = None
    if getattr(drafter, "markov", None) is not None:
        propose = partial(markov_drafts, sampled=rule == "reject")
    draw, judge = rule_steps(rule, drafter, warp_args, generator, propose)
    device = target.embed.weight.device
    drafts, q = torch.empty(0, dtype=torch.long, device=device), None
    if n_drafts:
        logits = draft_block(drafter, draft_cache, seq[-1], block_size=B)[:n_drafts]  # (K, V)
        drafts, q = draw(logits, seq[-1])
    x = torch.cat([torch.tensor([seq[-1]], device=device), drafts])[None]  # (1, K+1)
    logits, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)
    n, token = judge(next_token_probs(logits[0], *warp_args), drafts, q)
    return drafts.tolist(), n, token, hidden


class FusedDFlash:
    """A target and a DFlash drafter whose rounds of a block of `block_size` (default the drafter's) run as
    one compiled dflash_round (with `compile`: True, a COMPILE_MODES name, or False for eager). The target,
    compiled for a prefill of PREFILL_CHUNK tokens, reads the prompt; both run the rounds at the context's end."""

    def __init__(self, target, drafter, block_size=None, compile=True):
        self.block_size = check_drafter(target, drafter, block_size)
        self.target, self.drafter = compiled(target, (PREFILL_CHUNK,), compile), compiled(drafter, (), compile)
        self.round = Compiled(lambda *a: dflash_round(target, drafter, *a), target.embed.weight.device,
                              (self.block_size,), compile)
        slots = torch.arange(self.block_size - 1, device=target.embed.weight.device)
        self.live = [slots < m for m in range(self.block_size)]  # (B-1,) each: the first m slots verified

    @property
    def compile_seconds(self) -> float:
        return compile_seconds([self.target, self.drafter]) + self.round.compile_seconds
    def fits(self, target_cache, draft_cache, seq) -> bool:
        """Whether a round after seq has room for its B rows in both caches."""
        return len(seq) - 1 + self.block_size <= min(target_cache.capacity, draft_cache.capacity)

    def run_round(self, target_cache, draft_cache, seq, rule, warp_args, generator, n_drafts):
        """One round after seq that verifies the graph's first n_drafts drafts, drawing the eager round's
        random numbers. Both caches then hold the B rows the graph wrote (`commit` crops them). Returns
        (drafts, n, token) as host values, drafts the n_drafts verified."""
        device, B, m, greedy = self.target.embed.weight.device, self.block_size, n_drafts, warp_args[0] == 0
        idx, start = torch.tensor([seq[-1]], device=device), torch.tensor([len(seq) - 1], device=device)  # (1,) each
        draws = None
        if rule == "match":  # no draft draws; the judge spends n + 1 of the m + 1 drawn here
            u_draft, u_accept = uniforms((B - 1, 1), True, None, device), torch.zeros(B - 1, device=device)
            draws = RewindableDraws(generator, device, greedy)
            u_last = draws.draw((m + 1, 1))
        else:  # speculative.verify's draws: the drafts', the acceptance tests' (at T = 0 too), the last one
            u_draft = uniforms((m, 1), greedy, generator, device)
            u_accept = torch.rand(m, generator=generator, device=device) if m else torch.zeros(0, device=device)
            u_last = uniforms((1, 1), greedy, generator, device)
        with kernels_enabled(False):
            *drafts, n, token = self.round.read_back(  # the round's one read-back
                B, (B, rule, warp_args), target_cache, draft_cache, idx, start, padded(u_draft, B - 1),
                padded(u_accept, B - 1), padded(u_last, B), self.live[m], rule, warp_args)
        if draws is not None:  # spend what the eager judge spends: one number per position judged
            draws.spend(n + 1)
        target_cache.advance(B)
        draft_cache.advance(B)
        return drafts[:m], n, token


@torch.no_grad()
def fused_dflash_generate(fused: FusedDFlash, prompt, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                          generator=None, stop_token=EOT, on_round=None, rule="match"):
    """dflash.dflash_generate (extras.dflash_reject's with rule="reject") with each round one compiled graph:
    the same arguments (the models and the block size are fused's), tokens and counts. A fused round is not
    split into drafting and verifying (draft_seconds and verify_seconds stay None); graph_seconds is the time
    from its graphs' calls to their read-backs, the rest of the loop's the host's."""
    if rule not in RULES:
        raise UserError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    target, drafter, warp_args = fused.target, fused.drafter, (temperature, top_k, top_p)
    n_new, B, target_cache, draft_cache, prefill = start_decoding(target, drafter, prompt, max_new_tokens,
                                                                  fused.block_size, warp_args)
    seq, out, tally, graph_start = list(prompt), [], Tally(B - 1, prefill=prefill), fused.round.read_seconds
    while len(out) < n_new:
        n_drafts = min(B - 1, n_new - len(out) - 1)  # as dflash_generate: never past n_new
        if fused.fits(target_cache, draft_cache, seq):
            drafts, n, token = fused.run_round(target_cache, draft_cache, seq, rule, warp_args, generator, n_drafts)
            hidden = None  # the graph extended the drafter's context
        else:  # at the context's end: dflash_generate's round
            drafts, n, token, hidden = eager_round(target, drafter, target_cache, draft_cache, seq, n_drafts, B, rule,
                                                   warp_args, generator)
        tokens, stopped = cut_at_stop(drafts[:n] + [token], stop_token)
        seq += tokens
        out += tokens
        target_cache.crop(len(seq) - 1)  # the newest token is read next round
        if hidden is None:
            draft_cache.crop(len(seq) - 1)
        else:
            drafter.extend(draft_cache, [h[:, :len(tokens)] for h in hidden])
        tally.add(n, len(drafts), int(n_drafts > 0))
        if on_round is not None:
            on_round({"drafts": drafts, "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    graph_seconds = fused.round.read_seconds - graph_start
    return out, tally.result(out, target.embed.weight.device, graph_seconds=graph_seconds)
