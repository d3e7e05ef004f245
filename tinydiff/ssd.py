"""Speculative speculative decoding (SSD): the drafter prepares round t+1 while the target verifies round t.

Paper: Kumar, Dao and May, "Speculative Speculative Decoding" (SSD; its optimised algorithm is
called Saguaro), 2026. Published: up to 2x over optimised speculative decoding and up to 5x over
autoregressive decoding, with the draft on its own GPU.

In speculative decoding (speculative.py) the draft waits while the target verifies. Here, during
the verification of round t (committed seq S of L tokens, drafts x_1..x_n), the draft runs ahead:
  1. catch up: one forward over what its cache lacks up to x_n gives its logits after S + x_1..x_k
     for every k from the first that has branches to n, and the KV rows every branch below shares;
  2. predict the outcome: "k drafts accepted, then bonus b". For each k it takes the F_k likeliest
     tokens b of its own distribution at position k+1 (the target's p there is not known yet: the
     draft's q is the available proxy). For k < n, x_{k+1} itself is skipped: a rejected draft is
     never the correction, since residual(p, q) is 0 wherever q >= p, and rejection needs p < q.
     (At T > 0 the proxy is weak after a rejection: the residual lives where p > q, on tokens
     the draft under-rates; the paper's Saguaro sampling reshapes q to fix that, not done here);
  3. pre-draft: for every branch (k, b) sample the next round's drafts after S + x_1..x_k + b, all
     branches at once: one batched forward per draft position. Each batch row gets a copy of the
     shared prefix rows of the draft's cache; a boolean mask hides from row (k, b) the drafts
     x_{k+1}..x_n it did not accept, and its position ids continue from L + k;
  4. store {(k, b): (drafts, q)}: the speculation and the draft distributions it was sampled from.
After verification the outcome (n, token) is looked up: a hit hands the next round its speculation
at once; a miss drafts just in time (speculative.draft_round). Verification is speculative.verify,
unchanged, against the q the speculation was sampled with, so the output distribution is the
target's (at temperature 0: plain greedy decoding, token for token).

Fan-out: an int F prepares F bonus tokens for every accepted count, (K+1)F branches in all; the
simplest knob to plot a hit rate against, and with F >= V it covers every outcome. A list gives
F_k per k; `geometric_fan_out` spreads a budget the paper's way (capped geometric in k), which
pays when alpha is far from 1/2. Every branch is a batch row in each of the run-ahead's forwards:
nearly free on a GPU (memory-bound), but on a CPU the draft's 50,258-wide head makes a batched
forward cost about as much as its rows one by one, so there the run-ahead can outlast verification.
Randomness: verification and just-in-time drafting draw from `generator`, the run-ahead only from
`ahead_generator` (default: seeded by one draw of `generator` at the start, so every call gets a
fresh stream). Neither stream depends on when the other thread runs, so threaded and sequential
runs give the same tokens and counts for one seed. Near a full context (prompt + new tokens + K - 2
> the draft's context) the last run-aheads have no room for whole speculations: those lookups miss.

Two executions of the same algorithm (`threaded`): True, the real overlap (the run-ahead in a second
Python thread, torch releasing the GIL inside its ops: give each side a core; on a GPU a second CUDA
stream from that thread); False, the run-ahead inline (the same tokens and counts: the tests' way).
Each round reports its just-in-time and run-ahead forwards, from which the bench prices SSD with the
draft on its own device (tinydiff/bench/measure.py: `modelled_seconds`).
Caches: the target's as in speculative.py; the draft's holds a prefix of seq[:-1] between rounds,
and after a hit the hit branch's own K/V rows are copied in (`adopt`), so the next catch-up is one
token, as after drafting just in time.

The file reads in that order: the fan-out's allocation, the run-ahead's steps (branches_for, fork, adopt,
run_ahead, look_up), how it overlaps verification (Overlap), the loop (ssd_generate), then what it reports
(SsdDecoded) and its argument checks.
Leaves out: Saguaro sampling (down-weighting cached tokens in q to raise hits), a fast backup
speculator for misses, batches of prompts, running the draft on another device.
"""
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch

from tinydiff.ar import check_prompt
from tinydiff.checks import UserError
from tinydiff.sampling import check_warp_args, next_token_probs, sample
from tinydiff.speculative import Speculated, Tally, check_models, cut_at_stop, draft_round, target_probs, verify
from tinydiff.tokenizer import EOT, MASK


def geometric_fan_out(budget: int, k: int, alpha: float, r: float = 1.0, cap: int | None = None) -> list[int]:
    """Spread `budget` pre-drafted branches over accepted counts 0..k (the paper's allocation).

    Model: n drafts are accepted with P(n) = alpha^n (1 - alpha) for n < k and alpha^k for n = k
    (independent acceptances), and the bonus lies outside the draft's top F with probability
    (1 + F)^-r (the power law the paper measures). The hit rate sum_n P(n) (1 - (1 + F_n)^-r) under
    sum F_n = budget is maximised by 1 + F_n ~ P(n)^(1/(1+r)): geometric in n with ratio
    alpha^(1/(1+r)), a larger share at n = k, each F_n at most `cap`. Allocated greedily, one
    branch at a time where it adds the most hit probability (exact for this concave objective).
    """
    if not isinstance(budget, int) or budget < 1 or not 0 <= alpha <= 1 or r <= 0 or (cap is not None and cap < 1):
        raise UserError(f"need budget >= 1, 0 <= alpha <= 1, r > 0, cap >= 1; got {budget}, {alpha}, {r}, {cap}")
    chance = [alpha ** n * (1 - alpha) for n in range(k)] + [alpha ** k]  # P(n accepted)
    fan = [0] * (k + 1)
    for _ in range(budget):
        gain = [-1.0 if cap is not None and f >= cap else c * ((1 + f) ** -r - (2 + f) ** -r)
                for c, f in zip(chance, fan)]
        best = max(range(k + 1), key=gain.__getitem__)
        if gain[best] < 0:
            break  # every count is at its cap
        fan[best] += 1
    return fan


def branches_for(logits, drafts, fan_out, next_drafts, stop_token, first: int = 0):
    """The outcomes (k, bonus) worth preparing. logits (n+1-first, V): the draft's after S + x_1..x_k
    for k = first..n."""
    V = logits.shape[-1]
    out = []
    for k, row in enumerate(logits, start=first):
        if next_drafts[k] < 1 or fan_out[k] < 1 or stop_token in drafts[:k].tolist():
            continue  # no next round to prepare after this outcome
        excluded = ([MASK] if V > MASK else []) + ([int(drafts[k])] if k < len(drafts) else [])
        rank = row.float().nan_to_num(neginf=torch.finfo(torch.float32).min)  # -inf from hooks still ranks
        rank[excluded] = float("-inf")
        top = rank.topk(min(fan_out[k], V - len(excluded))).indices.tolist()
        out += [(k, b) for b in top if b != stop_token]
    return out


def fork(cache, branch_cache, rows: int):
    """Copy the first `rows` rows of a batch-1 cache into every batch row of branch_cache."""
    for dst, src in zip(branch_cache.k + branch_cache.v, cache.k + cache.v):
        dst[:, :, :rows] = src[:, :, :rows]
    branch_cache.crop(0)
    branch_cache.advance(rows)


def adopt(cache, at: int, count: int, branch_cache, row: int, shared: int):
    """After a hit: the hit branch's own rows (its bonus and the drafts it read, rows shared.. of batch
    row `row`) become rows at..at+count-1 of the batch-1 cache, so the next catch-up starts after them.
    Their keys were computed at positions at.. (the branch's position ids), which is where they land."""
    cache.crop(at)
    for dst, src in zip(cache.k + cache.v, branch_cache.k + branch_cache.v):
        dst[0, :, at:at + count] = src[row, :, shared:shared + count]
    cache.advance(count)


@torch.no_grad()
def run_ahead(draft, cache, seq, drafts, fan_out, next_drafts, warp_args, generator=None, stop_token=None,
              branch_caches=None):
    """Pre-draft the next round for the likely outcomes of this one (steps 1-4 of the docstring).

    seq: committed ids (L); drafts (n,) this round's speculation; fan_out: F_0..F_K;
    next_drafts[k]: drafts the next round proposes if k drafts are accepted (< 1: nothing to prepare).
    cache: holds a prefix of S + x_1..x_n (the rows the catch-up does not recompute).
    branch_caches: {batch size: KVCache} reused between calls. Leaves `cache` holding S + x_1..x_n.
    Returns ({(k, bonus): (drafts (m_k,), q (m_k, V), (branch cache, its row, shared rows))}, draft
    forwards run); the third item is what `adopt` needs after a hit.
    """
    device = drafts.device
    L, n = len(seq), len(drafts)
    worth = [k for k in range(n + 1) if fan_out[k] >= 1 and next_drafts[k] >= 1]
    if not worth:
        return {}, 0
    first = worth[0]  # the logits after S + x_1..x_k come from row L-1+k: only rows from L-1+first are needed
    cache.crop(min(cache.length, L - 1 + first))
    start = cache.length
    x = torch.cat([torch.tensor(seq[start:], device=device, dtype=torch.long), drafts[max(0, start - L):]])[None]
    # (1, L + n - start): only what the cache lacks, whether it ends inside seq or inside the drafts
    logits = draft(x, cache=cache, causal=True)[0, L - 1 + first - start:]  # (n+1-first, V)
    branches = branches_for(logits, drafts, fan_out, next_drafts, stop_token, first)
    P = L + n  # rows every branch shares a prefix of
    steps = min(max((next_drafts[k] for k, _ in branches), default=0), draft.config.context - P)
    if steps < 1:
        return {}, 1
    B = len(branches)
    branch_caches = {} if branch_caches is None else branch_caches
    if B not in branch_caches:
        branch_caches[B] = draft.new_cache(B)
    branch_cache = branch_caches[B]
    fork(cache, branch_cache, P)
    ends = torch.tensor([L + k for k, _ in branches], device=device)[:, None]  # (B, 1): prefix S + x_1..x_k
    cols = torch.arange(P + steps, device=device)  # (P + steps,)
    x = torch.tensor([[b] for _, b in branches], device=device)  # (B, 1): the bonus, then each new draft
    tokens, qs = [], []
    for j in range(steps):
        mask = (cols[:P + j + 1] < ends) | (cols[:P + j + 1] >= P)  # (B, S): own prefix + own branch rows
        logits = draft(x, pos=ends + j, mask=mask[:, None], cache=branch_cache)[:, -1]  # (B, V)
        q = next_token_probs(logits, *warp_args)  # (B, V)
        x = sample(q, generator)[:, None]  # (B, 1)
        tokens.append(x[:, 0])
        qs.append(q)
    tokens, qs = torch.stack(tokens, 1), torch.stack(qs, 1)  # (B, steps), (B, steps, V)
    entries = {(k, b): (tokens[i, :next_drafts[k]], qs[i, :next_drafts[k]], (branch_cache, i, P))
               for i, (k, b) in enumerate(branches)}
    return entries, 1 + steps


def look_up(entries, n: int, token: int, m: int, draft_cache, seq, hits, lookups):
    """The next round's speculation for the outcome (n accepted, then `token`), or None; a hit's own
    K/V rows join the draft's cache (no recomputing them next round). Returns (speculation, cached)."""
    if m < 1:
        return None, None
    found = entries.get((n, token))
    cached = found is not None and len(found[0]) == m  # shorter only where the context ran out
    lookups[n] += 1
    hits[n] += cached
    if cached:
        adopt(draft_cache, len(seq) - 1, len(found[0]), *found[2])
    return (found[:2] if cached else None), cached


class Overlap:
    """Runs a job inline (threaded=False) or in one worker thread, on a side CUDA stream on a GPU."""

    def __init__(self, threaded: bool, device):
        self.pool = ThreadPoolExecutor(max_workers=1) if threaded else None
        self.cuda = threaded and device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.main = torch.cuda.current_stream(device) if self.cuda else None

    def start(self, job):
        """Start job(); returns a function that waits for (its result, (start, end) times)."""
        def timed():
            if self.cuda:
                self.side.wait_stream(self.main)  # what the main stream wrote (drafts, cache) is ready
                with torch.cuda.stream(self.side):
                    begin, result = time.perf_counter(), job()
                    self.side.synchronize()
            else:
                begin, result = time.perf_counter(), job()
            return result, (begin, time.perf_counter())
        if self.pool is None:
            done = timed()
            return lambda: done
        future = self.pool.submit(timed)

        def wait():
            done = future.result()
            if self.cuda:
                self.main.wait_stream(self.side)
            return done
        return wait

    def close(self):
        if self.pool is not None:
            self.pool.shutdown()


@torch.no_grad()
def ssd_generate(target, draft, prompt, max_new_tokens, k, fan_out, temperature=0.0, top_k=None, top_p=None,
                 generator=None, stop_token=EOT, threaded=False, on_round=None, ahead_generator=None):
    """Speculative decoding whose draft pre-drafts the next round during verification (see above).

    Arguments as speculative_generate, plus fan_out (int or k+1 ints), threaded, and ahead_generator (the
    run-ahead's random stream). on_round(info) after every round: drafts, q, cached (this round's drafts
    came from the cache: True, after a miss: False, no lookup: None), accepted, tokens, seq, keys (the
    (k, bonus) the run-ahead stored), jit_forwards, ahead_forwards, times ({"jit", "verify", "ahead"}:
    (start, end) seconds into the run or None), target_cache, draft_cache.

    Returns (new ids, SsdDecoded).
    """
    warp_args = (temperature, top_k, top_p)
    fan_out, n_new, ahead_generator = check_ssd_args(target, draft, prompt, max_new_tokens, k, fan_out, warp_args,
                                                     generator, ahead_generator)
    device = target.embed.weight.device
    target_cache, draft_cache = target.new_cache(1), draft.new_cache(1)
    branch_caches = {}  # the run-ahead's batched caches, one per branch count, reused
    seq, out = list(prompt), []
    speculation = None  # this round's drafts and q, when the last run-ahead prepared them
    cached = None
    overlap = Overlap(threaded, device)
    tally = Tally(k)
    hits, lookups = [0] * (k + 1), [0] * (k + 1)  # per accepted count
    jit_total = ahead_total = branches = 0
    waiting = 0.0
    try:
        while len(out) < n_new:
            n_drafts = min(k, n_new - len(out) - 1)  # a full acceptance plus the bonus lands exactly on n_new
            t0 = time.perf_counter()  # draft: from the speculation cache, else just in time
            if speculation:
                drafts, q = speculation
                jit = 0
            else:
                drafts, q = draft_round(draft, draft_cache, seq, n_drafts, warp_args, generator)
                jit = n_drafts
            t1 = time.perf_counter()
            # After "i accepted, then a bonus", n_new - len(out) - i - 1 remain: the next round drafts one less.
            next_drafts = [min(k, n_new - len(out) - i - 2) if i <= n_drafts else 0 for i in range(k + 1)]
            ahead = None
            if max(next_drafts) >= 1:  # run ahead while ...
                ahead = overlap.start(partial(run_ahead, draft, draft_cache, list(seq), drafts, fan_out, next_drafts,
                                              warp_args, ahead_generator, stop_token, branch_caches))
            t2 = time.perf_counter()
            n, token = verify(target_probs(target, target_cache, seq, drafts, warp_args), q, drafts, generator)
            t3 = time.perf_counter()  # ... the target verifies
            entries, ahead_forwards, ahead_times = {}, 0, None
            if ahead:
                (entries, ahead_forwards), ahead_times = ahead()
                waiting += time.perf_counter() - t3 if threaded else ahead_times[1] - ahead_times[0]
            tokens, stopped = cut_at_stop(drafts[:n].tolist() + [token], stop_token)  # commit
            seq += tokens
            out += tokens
            target_cache.crop(len(seq) - 1)  # drop rejected drafts; the newest token is read next round
            draft_cache.crop(min(draft_cache.length, len(seq) - 1))
            tally.add(n, n_drafts, jit + ahead_forwards)
            jit_total += jit
            ahead_total += ahead_forwards
            branches += len(entries)
            if on_round is not None:
                start = tally.start
                spans = {"jit": (t0, t1) if jit else None, "verify": (t2, t3), "ahead": ahead_times}
                on_round({"drafts": drafts.tolist(), "q": q, "cached": cached, "accepted": n, "tokens": tokens,
                          "seq": list(seq), "keys": list(entries), "jit_forwards": jit,
                          "ahead_forwards": ahead_forwards, "target_cache": target_cache, "draft_cache": draft_cache,
                          "times": {key: span and (span[0] - start, span[1] - start) for key, span in spans.items()}})
            if stopped:
                break
            speculation, cached = look_up(entries, n, token, min(k, n_new - len(out) - 1), draft_cache, seq, hits,
                                          lookups)
    finally:
        overlap.close()
    return out, tally.result(out, device, SsdDecoded, hits=hits, lookups=lookups, jit_forwards=jit_total,
                             ahead_forwards=ahead_total, branches=branches, seconds_waiting=waiting,
                             threaded=threaded)


@dataclass(frozen=True, kw_only=True)
class SsdDecoded(Speculated):
    """draft_forwards = jit_forwards + ahead_forwards (a batched run-ahead forward counts once)."""
    hits: list  # speculation-cache lookups that hit, per accepted count (a lookup follows every round
    lookups: list  # that a round with drafts follows)
    jit_forwards: int  # draft forwards run just in time (a miss, or the first round)
    ahead_forwards: int  # run-ahead forwards
    branches: int  # speculations pre-drafted
    seconds_waiting: float  # the main thread waiting for the run-ahead after verification
    threaded: bool
    DERIVED = Speculated.DERIVED + ("hit_rate",)

    @property
    def hit_rate(self) -> float | None:
        return sum(self.hits) / sum(self.lookups) if sum(self.lookups) else None


def check_ssd_args(target, draft, prompt, max_new_tokens, k, fan_out, warp_args, generator, ahead_generator):
    """The checked arguments: (fan_out list, new tokens, the run-ahead's generator)."""
    if not isinstance(k, int) or k < 1:
        raise UserError(f"k (drafts per round) must be an integer >= 1, got {k!r}")
    fan_out = check_fan_out(fan_out, k)
    check_warp_args(*warp_args)
    n_new = check_prompt(prompt, target.config.context, max_new_tokens)
    check_models(target, draft, len(prompt) + n_new)
    if ahead_generator is None:  # one draw of the main stream seeds the run-ahead's own stream
        seed = torch.randint(2 ** 62, (), generator=generator, device=generator.device if generator else "cpu")
        ahead_generator = torch.Generator(target.embed.weight.device).manual_seed(int(seed))
    return fan_out, n_new, ahead_generator


def check_fan_out(fan_out, k: int) -> list[int]:
    """An int F (F bonus tokens for every accepted count) or k+1 ints F_0..F_k -> the list."""
    if isinstance(fan_out, int) and not isinstance(fan_out, bool):
        if fan_out < 1:
            raise UserError(f"fan-out must be an integer >= 1 (bonus tokens pre-drafted per accepted count), "
                            f"got {fan_out}")
        return [fan_out] * (k + 1)
    if (not isinstance(fan_out, (list, tuple)) or len(fan_out) != k + 1
            or not all(isinstance(f, int) and f >= 0 for f in fan_out) or sum(fan_out) < 1):
        raise UserError(f"fan-out must be an integer >= 1 or a list of k+1 = {k + 1} integers >= 0 "
                        f"(one per accepted count 0..k, not all 0), got {fan_out!r}")
    return list(fan_out)
