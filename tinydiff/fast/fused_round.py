"""A speculative round as one compiled graph: the drafts, the verify and Leviathan's verdict; and what
every fused loop shares (the prompt's prefill, the draws made before a graph runs).

compiled.py compiles each model's forward and leaves the loop around it eager: the target's warp,
the acceptance rule, the draws, and one call into a compiled step per model per round, each of which
checks its guards. On a CPU that host work costs about as much as a small draft's forward
(dev/LOG.md). vLLM and SGLang capture a whole round instead; so does this file:
`speculative_round` is FR-Spec's k drafts (`draft_chain`: frequent_vocab.subset_draft_round unrolled, each
forward followed by its warp and draw, the next reading the token just drawn; a plain draft runs as the
subset of every id, frequent_vocab.every_id: the same draws), the target's forward of the newest token
and the drafts, its warp, Leviathan's rule (`verdict`; at a plain temperature `sampled_verdict`, which
writes out one row of probabilities, not k + 1) and the committed token's draw. The host reads back
one small tensor a round: the drafts, the accepted count, the token.
The graph's uniforms are drawn before it runs, from the loop's generator and in the eager loop's
order (the drafts', the k acceptance tests', the last draw's), so it commits the eager loop's tokens
(with a CPU generator: CUDA's Philox gives numbers drawn together other values than as many drawn one
at a time, so on a GPU a seed gives other samples than the eager loop's, as exact).
One exception: `sampling.sample` spends no number on an exactly one-hot row at T > 0 (a tempered float32
softmax can be one) and the graph always spends one; both stay exact draws.
`fused_speculative_generate` is speculative_generate on this graph. It reads the prompt but its
newest token first (`prefill`: forwards of a fixed chunk, so the prompt compiles once whatever its
length, counted as target forwards); then every round is one call into one graph, a story's last
rounds too (the graph drafts k, the verdict reads the drafts there is room for), but for rounds at
the context's end, which run the eager round (subset_draft_round, speculative.verify) on static models.

Leaves out: trees, EAGLE-3 (the same verdict would serve it), and batches.
AR decoding's step with its draw is fused_steps.py's, DFlash's round fused_dflash.py's.
"""
import torch

from tinydiff.ar import check_prompt
from tinydiff.checks import UserError
from tinydiff.fast.compiled import Compiled, compile_seconds, compiled, forward_at
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, every_id, in_vocab, subset_draft_round
from tinydiff.kernels import kernels_enabled
from tinydiff.sampling import check_warp_args, draftable, inverse_cdf, next_token_probs, residual, warp
from tinydiff.speculative import Tally, check_models, commit, target_probs, verify
from tinydiff.tokenizer import EOT

PREFILL_CHUNK = 8  # tokens a prefill forward reads: a bench prompt is EOT + an 8-token opening, read but its last


def verdict(p, q, drafts, u_accept, u_last, greedy: bool, live=None):
    """speculative.verify with its uniforms given, and no host synchronisation.

    p (K+1, V), q (K, V), drafts (K,) as there; u_accept (K,) the acceptance tests' uniforms, u_last
    (1, 1) float64 the committed token's (unread when greedy). live (K,) bool, a prefix of True: the
    slots that hold drafts (None: all); the round is then verify's on the live drafts alone, the rest
    never accepted and the bonus read from the row after the last live one. Returns n and the token,
    0-d tensors.
    """
    K = len(drafts)
    rows = torch.arange(K, device=p.device)
    live = torch.ones(K, dtype=torch.bool, device=p.device) if live is None else live
    n = ((u_accept * q[rows, drafts] < p[rows, drafts]) & live).long().cumprod(0).sum()  # (): the accepted prefix
    at = n.clamp_max(K - 1).view(1)  # (1,): the rejected slot, when there is one
    rejected = n < live.sum()  # (): else all live drafts passed and row n is the bonus's
    last = torch.where(rejected, residual(p.index_select(0, at), q.index_select(0, at)), p.index_select(0, n.view(1)))
    token = last.argmax(-1) if greedy else inverse_cdf(last, u_last)  # (1,)
    return n, token[0]


def sampled_verdict(logits, small, picks, ids, drafts, u_accept, u_last, temperature: float, live=None):
    """`verdict` at a plain temperature (no top-k, no top-p), read from the target's logits and the draft's
    probabilities over its subset, without writing the (K + 1, V) or (K, V) probabilities.

    logits (K+1, V); small (K, N) over ids (N,), drafts (K,) = ids[picks]. An acceptance test needs one
    probability per row, so each row gets its maximum and sum of exponentials (reads only); one row
    is then written out in full: the rejected slot's, its residual p - q formed in place on the subset,
    or after a full acceptance the bonus row's. inverse_cdf draws from any scale, so the residual stays
    unnormalised. live as in verdict. The same numbers as verdict's but for rounding;
    tests/test_fused_round.py checks both give one decision."""
    K = len(drafts)
    x = draftable(logits) / temperature  # (K+1, V): MASK at -inf, as next_token_probs
    top = x.amax(-1, keepdim=True)  # (K+1, 1)
    total = (x - top).exp().sum(-1, keepdim=True)  # (K+1, 1)
    rows = torch.arange(K, device=x.device)
    live = torch.ones(K, dtype=torch.bool, device=x.device) if live is None else live
    p_drafts = (x[rows, drafts] - top[:K, 0]).exp() / total[:K, 0]  # (K,): p of each draft
    n = ((u_accept * small[rows, picks] < p_drafts) & live).long().cumprod(0).sum()  # (): the accepted prefix
    at = n.clamp_max(K - 1).view(1)  # (1,): the rejected slot, when there is one
    row = n.view(1)  # (1,): the row the committed token comes from, the rejected slot's or the bonus's
    p = (x.index_select(0, row) - top.index_select(0, row)).exp() / total.index_select(0, row)  # (1, V)
    q = small.index_select(0, at) * (n < live.sum())  # (1, N): zero after every live draft passed
    r = p.index_add(1, ids, -q).clamp_min(0)  # (1, V): max(0, p - q), or p itself
    last = torch.where(r.sum(-1, keepdim=True) > 0, r, p)  # residual's rule where p == q
    return n, inverse_cdf(last, u_last)[0]


def draft_chain(model, head, ids, cache, idx, rows, u, n_drafts: int, warp_args):
    """subset_draft_round's n_drafts forwards after idx (1, T0) at rows (T0,), in one graph.

    model: the draft Transformer, head (N, D) its pruned head rows, ids (N,) their vocabulary ids;
    u (n_drafts, 1) float64 uniforms (unread at temperature 0). Returns drafts (K,), their places in
    the subset (K,) and the draft's probabilities over the subset (K, N) (`in_vocab` widens them to
    the vocabulary). The cache rows are the positions: the chain reads T0 + K - 1 tokens.
    """
    greedy = warp_args[0] == 0
    drafts, picks, qs = [], [], []
    for j in range(n_drafts):
        logits, _ = forward_at(model, cache, idx, rows, rows, head=head)  # (1, T, N)
        q = warp(logits[0, -1], *warp_args)  # (N,)
        if greedy:
            pick = q.argmax().view(1)  # (1,)
        else:  # sampling.sample's inverse CDF, with the uniform it would draw
            pick = inverse_cdf(q[None], u[j:j + 1])  # (1,)
        token = ids.index_select(0, pick)  # (1,): a tensor index, never a host integer
        drafts.append(token)
        picks.append(pick)
        qs.append(q)
        idx, rows = token.view(1, 1), rows[-1:] + 1  # (1, 1), (1,)
    return torch.cat(drafts), torch.cat(picks), torch.stack(qs)  # (K,), (K,), (K, N)


def speculative_round(target, draft, head, ids, target_cache, draft_cache, idx, rows, u_draft, u_accept, u_last,
                      live, k: int, warp_args):
    """One round of speculative_generate with FR-Spec's draft (model `draft`, head rows (N, D) for `ids` (N,)).

    idx (1, T0): the committed tokens the draft's cache lacks (1, or 2 after a full acceptance; the
    token before them too, at its own row, when the caller keeps one shape) at rows (T0,); the target's
    cache lacks only the newest, idx[0, -1]. u_draft (k, 1) float64, u_accept (k,), u_last (1, 1)
    float64; live (k,) bool, the slots the round verifies (a story's last rounds verify fewer: the
    graph still drafts k, and the rest are never accepted; `verdict`). Returns (k + 2,): the k drafts,
    the accepted count n, the committed token.
    """
    # drafts (K,), their places in the subset (K,), the draft's probabilities over it (K, N)
    drafts, picks, small = draft_chain(draft, head, ids, draft_cache, idx, rows, u_draft, k, warp_args)
    x = torch.cat([idx[0, -1:], drafts])[None]  # (1, K + 1): the newest token, then the drafts
    at = rows[-1] + torch.arange(k + 1, device=idx.device)  # (K + 1,): positions, and cache rows
    logits, _ = forward_at(target, target_cache, x, at, at)  # (1, K + 1, V)
    temperature, top_k, top_p = warp_args
    if temperature > 0 and top_k is None and top_p is None:
        n, token = sampled_verdict(logits[0], small, picks, ids, drafts, u_accept, u_last, temperature, live)
    else:
        q = in_vocab(small, ids, logits.shape[-1])  # (K, V)
        n, token = verdict(next_token_probs(logits[0], *warp_args), q, drafts, u_accept, u_last, temperature == 0,
                           live)
    return torch.cat([drafts, n.view(1), token.view(1)])


def prefill(model, cache, tokens: list, chunk: int = PREFILL_CHUNK):
    """Read tokens (a list of ids) into the empty static cache in forwards of `chunk` tokens, the last one
    padded (with copies of the last token) to the full chunk where the context leaves room: the prompt
    then compiles once, whatever its length, where a compiled model compiles `chunk`. The padding's rows
    lie past the cache's length, where the next tokens overwrite them before anything reads them.
    Returns the last token's logits (1, V) and the number of forwards."""
    device = model.embed.weight.device
    forwards = 0
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        if start + chunk <= cache.capacity:
            piece = piece + piece[-1:] * (chunk - len(piece))
        logits = model(torch.tensor([piece], device=device), cache=cache, causal=True)  # (1, T, V)
        forwards += 1
    last = len(tokens) - 1 - start  # the last token's place in the last piece
    cache.crop(len(tokens))
    return logits[:, last], forwards


def uniforms(shape, greedy: bool, generator, device, dtype=torch.float64):
    """The numbers a sampled draw spends (zeros, none drawn, when greedy)."""
    if greedy:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.rand(shape, generator=generator, device=device, dtype=dtype)


def padded(u, rows: int):
    """u (R, ...) with zero rows after it, to `rows` rows: a graph's fixed shape, the zeros never read."""
    return torch.cat([u, u.new_zeros((rows - len(u),) + u.shape[1:])])


def generator_of(generator, device) -> torch.Generator:
    """The generator torch.rand draws from on `device` when given `generator` (None: the device's default)."""
    if generator is not None:
        return generator
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


class RewindableDraws:
    """Uniforms for a graph that learns only as it runs how many of them the eager loop would have spent
    (a judge that stops at its first mismatch, a walk down a tree, a story that stops): `draw` them all
    before the graph runs, then `spend(count)` rewinds the generator and spends `count`, one per number
    the eager loop drew. Greedy: nothing drawn (zeros), nothing spent."""

    def __init__(self, generator, device, greedy: bool):
        self.device, self.greedy = device, greedy
        self.generator = None if greedy else generator_of(generator, device)
        self.state = None if greedy else self.generator.get_state()

    def draw(self, shape):
        return uniforms(shape, self.greedy, self.generator, self.device)

    def spend(self, count: int):
        if not self.greedy:
            self.generator.set_state(self.state)
            torch.rand(count, 1, generator=self.generator, device=self.device, dtype=torch.float64)


class FusedSpeculation:
    """A target and FR-Spec's draft for fused_speculative_generate: rounds of k drafts run as one compiled
    speculative_round, a story's last rounds (fewer drafts verified) too. The draft reads the token before
    its newest again when it lacks only one, so every round after a 1-token prompt's first has one shape
    and one graph: with two, a round often follows the other's, and each graph holds its own frozen
    copy of the target's head, which the switch reads from memory again. `target` (compiled.compiled) and
    the pruned draft's forward, compiled alike, read the prompt in chunks and run the rounds at the
    context's end, where k drafts have no room, with the eager round."""

    def __init__(self, target, module, draft: FrequentVocabDraft, k: int, compile=True):
        if not isinstance(draft, FrequentVocabDraft):
            raise UserError("a fused speculative round needs FR-Spec's pruned draft (FrequentVocabDraft; "
                            "frequent_vocab.every_id makes one of a plain draft)")
        self.target, self.k = target, k
        self.draft = FrequentVocabDraft(compiled(draft.draft, (PREFILL_CHUNK,), compile), draft.ids)
        self.draft.rows = draft.rows  # the head's rows: the pruned draft's own buffer, not a second copy
        self.round = Compiled(lambda *a: speculative_round(module, draft.draft, draft.rows, draft.ids, *a),
                              target.embed.weight.device, (1, 2), compile)
        slots = torch.arange(k, device=target.embed.weight.device)
        self.live = [slots < m for m in range(k + 1)]  # (k,) each: the first m slots verified

    @property
    def compile_seconds(self) -> float:
        return compile_seconds([self.target, self.draft.draft]) + self.round.compile_seconds

    def fits(self, target_cache, draft_cache, seq) -> bool:
        """Whether a round after seq has room in both caches: the target writes k + 1 rows, the draft k."""
        return len(seq) + self.k <= min(target_cache.capacity, draft_cache.capacity)

    def run_round(self, target_cache, draft_cache, seq, warp_args, generator, n_drafts=None):
        """One round after seq that verifies the first n_drafts (default k) of the graph's k drafts; both
        caches advanced as the eager round's, and the same random numbers drawn. Returns (drafts, n,
        token) as host values, drafts the n_drafts verified."""
        device, k, greedy = self.draft.embed.weight.device, self.k, warp_args[0] == 0
        m = k if n_drafts is None else n_drafts
        T0 = len(seq) - draft_cache.length  # 1, or 2 after a full acceptance
        start = len(seq) - 2 if T0 == 1 and len(seq) > 1 else draft_cache.length  # one shape: 2 tokens
        idx = torch.tensor([seq[start:]], device=device)  # (1, T)
        rows = torch.arange(start, len(seq), device=device)  # (T,)
        u_draft = uniforms((m, 1), greedy, generator, device)
        u_accept = torch.rand(m, generator=generator, device=device)  # verify draws them at T = 0 too
        u_last = uniforms((1, 1), greedy, generator, device)
        if m < k:  # the slots past the verified ones draft from zeros; nothing reads them
            u_draft, u_accept = padded(u_draft, k), padded(u_accept, k)
        with kernels_enabled(False):
            *drafts, n, token = self.round.read_back(  # the round's one read-back
                idx.shape[1], (idx.shape[1], warp_args), target_cache, draft_cache, idx, rows, u_draft, u_accept,
                u_last, self.live[m], k, warp_args)
        draft_cache.advance(T0 + m - 1 if m else 0)  # the rows an eager round of m drafts writes
        target_cache.advance(m + 1)
        return drafts[:m], n, token


def fused_speculation(target, draft, k: int, compile=True) -> FusedSpeculation:
    """FusedSpeculation for a target and a draft (FR-Spec's FrequentVocabDraft, or a plain draft, which runs
    as the subset of every id: the same tokens) of k drafts a round, compiled with `compile`; both wrappers
    read the prompt in compiled chunks."""
    subset = draft if isinstance(draft, FrequentVocabDraft) else every_id(draft)
    return FusedSpeculation(compiled(target, (PREFILL_CHUNK,), compile), target, subset, k, compile)


@torch.no_grad()
def fused_speculative_generate(fused: FusedSpeculation, prompt, max_new_tokens, temperature=1.0, top_k=None,
                               top_p=None, generator=None, stop_token=EOT, on_round=None):
    """speculative.speculative_generate with fused.k drafts a round, each full round one compiled graph:
    the same arguments (k and the models are fused's), tokens and counts. A fused round is not split
    into drafting and verifying (draft_seconds and verify_seconds stay None); graph_seconds is the time
    from its graphs' calls to their read-backs, the rest of the loop's the host's."""
    check_warp_args(temperature, top_k, top_p)
    target, draft, k, warp_args = fused.target, fused.draft, fused.k, (temperature, top_k, top_p)
    n_new = check_prompt(prompt, target.config.context, max_new_tokens)
    check_models(target, draft, len(prompt) + n_new)
    target_cache, draft_cache = target.new_cache(1), draft.new_cache(1)
    seq, out, tally, graph_start = list(prompt), [], Tally(k), fused.round.read_seconds
    if len(prompt) > 1:  # both models read the prompt but its newest token, which the first round reads
        tally.prefill = prefill(target, target_cache, prompt[:-1])[1]
        prefill(draft, draft_cache, prompt[:-1])
    while len(out) < n_new:
        n_drafts = min(k, n_new - len(out) - 1)  # as speculative_generate: never past n_new
        if fused.fits(target_cache, draft_cache, seq):
            drafts, n, token = fused.run_round(target_cache, draft_cache, seq, warp_args, generator, n_drafts)
        else:  # at the context's end: speculative_generate's pieces
            drafts, q = subset_draft_round(draft, draft_cache, seq, n_drafts, warp_args, generator)
            n, token = verify(target_probs(target, target_cache, seq, drafts, warp_args), q, drafts, generator)
            drafts = drafts.tolist()
        tokens, stopped = commit(seq, out, drafts[:n] + [token], stop_token, target_cache, draft_cache)
        tally.add(n, n_drafts, n_drafts)
        if on_round is not None:
            on_round({"drafts": drafts, "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    graph_seconds = fused.round.read_seconds - graph_start
    return out, tally.result(out, target.embed.weight.device, graph_seconds=graph_seconds)
