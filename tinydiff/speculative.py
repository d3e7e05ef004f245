"""Speculative sampling: a small draft model proposes K tokens, the target verifies them in one pass.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative Sampling").
Each round:
  1. draft:  the draft samples x_1..x_K from its warped distributions q_1..q_K, one token at a time;
  2. verify: the target reads [newest committed token, x_1..x_K] in one forward: p_1..p_{K+1};
  3. accept: x_i is kept with probability min(1, p_i(x_i)/q_i(x_i)); the first rejected position
     is resampled from residual(p_i, q_i) = norm(max(0, p_i - q_i)); if all K pass, a bonus token
     is drawn from p_{K+1}. Every round commits between 1 and K+1 tokens.
The committed tokens are distributed exactly as the target's own samples, for any draft, as long
as p and q are warped the same way (temperature, top-k, top-p: `sampling.warp`). At temperature 0
both are one-hot, so the rule reads "accept while x_i == argmax p_i, then take the target's argmax":
plain greedy decoding of the target, token for token.

KV caches: after every round each cache holds the keys/values of every committed token except the
newest, which is the first input of the next round. Rejected drafts are dropped with `crop`. The
draft never reads its own last draft x_K, so after a full acceptance its cache is one token shorter
(it catches up by reading [x_K, bonus] at the start of the next round); a round without drafts
(only at the very end) leaves the draft cache alone.

The file reads in that order: the round's steps (draft_round, target_probs, verify, commit), the loop
(speculative_generate), then what the loops report (Speculated, Tally) and Leviathan's predictions.
Leaves out: batches, tree drafts (see ddtree.py), adapting K on the fly, a draft on another device.
"""
import time
from dataclasses import dataclass, field

import torch

from tinydiff.ar import Decoded, check_prompt, elapsed, split_time
from tinydiff.checks import UserError
from tinydiff.sampling import check_warp_args, next_token_probs, residual, sample
from tinydiff.tokenizer import EOT


def draft_round(draft, cache, seq, n_drafts, warp_args, generator=None):
    """Sample n_drafts tokens from the draft after the committed sequence seq (list of ids).

    K forwards: the committed tokens its cache lacks (1, or 2 after a full acceptance) give q_1,
    then x_1..x_{K-1} give q_2..q_K; x_K itself is never read. Returns drafts (K,) and q (K, V).
    """
    device = draft.embed.weight.device
    x = torch.tensor([seq[cache.length:]], device=device)  # (1, 1 or 2), then (1, 1)
    drafts, qs = [], []
    for _ in range(n_drafts):
        q = next_token_probs(draft(x, cache=cache, causal=True)[0, -1], *warp_args)  # (V,)
        token = sample(q, generator)  # ()
        drafts.append(token)
        qs.append(q)
        x = token.view(1, 1)
    if not drafts:  # the last round may have no room for drafts: the target alone adds one token
        return torch.empty(0, dtype=torch.long, device=device), torch.empty(0, draft.config.vocab_size, device=device)
    return torch.stack(drafts), torch.stack(qs)  # (K,), (K, V)


def target_probs(target, cache, seq, drafts, warp_args):
    """The target's warped distributions p (K+1, V) after seq, seq + x_1, ..., seq + x_1..x_K: one forward."""
    device = target.embed.weight.device
    x = torch.cat([torch.tensor(seq[cache.length:], device=device), drafts])[None]  # (1, T), T >= K+1
    logits = target(x, cache=cache, causal=True)[0, -(len(drafts) + 1):]  # (K+1, V)
    return next_token_probs(logits, *warp_args)


def verify(p, q, drafts, generator=None):
    """Leviathan's acceptance rule. p (K+1, V) target, q (K, V) draft, drafts (K,) drawn from q.

    Returns (n, token): the first n drafts are accepted, then `token` is committed: a draw from
    residual(p_n, q_n) after a rejection, or the bonus from p_{K+1} when all K pass.
    """
    K = len(drafts)
    rows = torch.arange(K, device=p.device)
    px, qx = p[rows, drafts], q[rows, drafts]  # (K,) each; qx > 0 since x was drawn from q
    u = torch.rand(K, generator=generator, device=p.device)  # (K,)
    accept = u * qx < px  # probability min(1, px / qx), and never when px == 0
    n = int(accept.long().cumprod(0).sum())  # length of the accepted prefix
    last = residual(p[n], q[n]) if n < K else p[K]  # (V,)
    return n, int(sample(last, generator))


def commit(seq: list, out: list, tokens: list, stop_token, target_cache, draft_cache) -> tuple[list, bool]:
    """A round's tokens (kept drafts, then the target's own) onto seq and out, cut after the stop token;
    both caches rolled back: rejected drafts dropped, the newest token left for the next round to read.
    Returns (the tokens committed, whether the stop token came)."""
    tokens, stopped = cut_at_stop(tokens, stop_token)
    seq += tokens
    out += tokens
    target_cache.crop(len(seq) - 1)
    draft_cache.crop(min(draft_cache.length, len(seq) - 1))
    return tokens, stopped


def cut_at_stop(tokens: list[int], stop_token) -> tuple[list[int], bool]:
    """A round's committed tokens up to and including the first stop token; and whether it came."""
    if stop_token in tokens:
        return tokens[:tokens.index(stop_token) + 1], True
    return tokens, False


@torch.no_grad()
def speculative_generate(target, draft, prompt, max_new_tokens, k, temperature=1.0, top_k=None,
                         top_p=None, generator=None, stop_token=EOT, on_round=None, propose=draft_round):
    """Decode after `prompt` (list of ids) with `draft` proposing up to k tokens per target forward.

    Stops after max_new_tokens (None: until the target's context is full) or after emitting
    stop_token (None: never); tokens a round commits after the stop token are dropped.
    A round never proposes more drafts than would overshoot what remains: min(k, remaining - 1).
    on_round(info), if given, is called after every round with a dict: drafts (list of ids),
    accepted (n), tokens (what the round committed), seq (prompt + everything committed),
    target_cache, draft_cache (the caches, already rolled back; see the module docstring).
    propose: the draft step, draft_round's arguments and returns (frequent_vocab.subset_draft_round
    for a draft that scores a subset of the vocabulary).

    Returns (new ids, Speculated): one target forward per round (the prompt's prefill rides
    along with the first), one draft forward per draft, and the time spent drafting and verifying.
    """
    if not isinstance(k, int) or k < 1:
        raise UserError(f"k (drafts per round) must be an integer >= 1, got {k!r}")
    check_warp_args(temperature, top_k, top_p)
    n_new = check_prompt(prompt, target.config.context, max_new_tokens)
    check_models(target, draft, len(prompt) + n_new)
    warp_args = (temperature, top_k, top_p)
    target_cache, draft_cache = target.new_cache(1), draft.new_cache(1)
    seq, out = list(prompt), []
    device = target.embed.weight.device
    tally = Tally(k)
    while len(out) < n_new:
        n_drafts = min(k, n_new - len(out) - 1)  # a full acceptance plus the bonus lands exactly on n_new
        t0 = time.perf_counter()
        drafts, q = propose(draft, draft_cache, seq, n_drafts, warp_args, generator)
        t1 = split_time(device)  # so the draft's queued work is not billed to the verify
        p = target_probs(target, target_cache, seq, drafts, warp_args)
        n, token = verify(p, q, drafts, generator)  # int(): waits for the GPU
        tally.clock(t0, t1, time.perf_counter())
        tokens, stopped = commit(seq, out, drafts[:n].tolist() + [token], stop_token, target_cache, draft_cache)
        tally.add(n, n_drafts, n_drafts)  # one draft forward per draft
        if on_round is not None:
            on_round({"drafts": drafts.tolist(), "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    return out, tally.result(out, device)


def check_models(target, draft, need: int):
    """Draft and target must speak the same vocabulary and the draft must fit `need` tokens."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise UserError(f"the draft's vocabulary ({draft.config.vocab_size} ids) differs from the target's "
                        f"({target.config.vocab_size}); train the draft with the target's tokenizer")
    if draft.config.context < need:
        raise UserError(f"the draft's context ({draft.config.context}) is shorter than the {need} tokens "
                        "this run needs (prompt + new tokens); lower max_new_tokens or use a longer-context draft")
    if draft.embed.weight.device != target.embed.weight.device:
        raise UserError(f"the draft is on {draft.embed.weight.device} but the target on "
                        f"{target.embed.weight.device}; move both to one device")


@dataclass(frozen=True, kw_only=True)
class Speculated(Decoded):
    accepted: list  # accepted[n]: rounds that accepted n drafts, n = 0..k (forwards = rounds + a prefill)
    proposed: int  # drafts (tree nodes) proposed over all rounds
    rejected: int | None  # rounds that rejected a draft (at most one each); None for trees
    draft_forwards: int
    slot_judged: list  # slot_judged[j]: rounds that offered slot j+1 (a draft at depth j+1) with slots 1..j kept
    slot_kept: list  # slot_kept[j]: those of them that kept it
    draft_seconds: float | None = None  # the chain loops (speculative, DFlash, DDTree): time drafting, and verifying
    verify_seconds: float | None = None
    graph_seconds: float | None = None  # the fused loops (a round one compiled graph): its calls to read-back
    DERIVED = Decoded.DERIVED + ("rounds", "tau", "alpha", "nodes_per_round", "acceptance_by_slot")

    @property
    def rounds(self) -> int:
        return sum(self.accepted)

    @property
    def tau(self) -> float:
        """New tokens per round (per verifying forward), the bonus/corrected token included: 1..k+1."""
        return self.new_tokens / self.rounds

    @property
    def alpha(self) -> float | None:
        """Leviathan's acceptance rate: the share of the drafts the target judged that it kept. Drafts
        after a rejection are never judged; counting them would make alpha fall with k for the same
        draft. None for trees (no single rate) and where nothing was judged."""
        kept = sum(n * count for n, count in enumerate(self.accepted))
        judged = kept + (self.rejected or 0)
        return kept / judged if self.rejected is not None and judged else None

    @property
    def acceptance_by_slot(self) -> list:
        """Slot k's acceptance given slots < k were accepted, k = 1..K (DSpark's per-position curve): for a
        tree, the chance that the accepted path goes one deeper. None where no round judged the slot."""
        return acceptance_by_slot(self.slot_kept, self.slot_judged)

    @property
    def nodes_per_round(self) -> float | None:
        """A tree's proposed nodes per round (None for chains)."""
        return self.proposed / self.rounds if self.rejected is None else None


def acceptance_by_slot(kept: list, judged: list) -> list:
    """kept / judged per slot, None where no round judged it (Speculated's, and the bench's sums)."""
    return [k / n if n else None for k, n in zip(kept, judged)]


@dataclass
class Tally:
    """What every draft/verify loop counts, one `add` per round. A loop that verifies trees passes
    chain=False: a tree has no single acceptance rate. `start` is when the loop's clock started."""
    k: int  # the most drafts a round can accept
    chain: bool = True
    prefill: int = 0  # 1 when a separate target forward read the prompt before the first round
    proposed: int = 0
    rejected: int = 0
    draft_forwards: int = 0
    hist: list = field(init=False)
    judged: list = field(init=False)  # per slot, see Speculated.slot_judged / slot_kept
    kept: list = field(init=False)
    start: float = field(init=False)
    draft_seconds: float | None = None  # summed by `clock` where a loop times its rounds' stages
    verify_seconds: float | None = None

    def __post_init__(self):
        self.hist = [0] * (self.k + 1)
        self.judged, self.kept = [0] * self.k, [0] * self.k
        self.start = time.perf_counter()

    def add(self, accepted: int, proposed: int, draft_forwards: int, depth: int | None = None):
        """One round: `accepted` drafts kept of `proposed` drafts (tree nodes), the drafts `depth` deep
        (a chain's depth is its length, the default; a tree passes its own)."""
        depth = proposed if depth is None else depth
        self.hist[accepted] += 1
        self.proposed += proposed
        self.rejected += self.chain and accepted < proposed
        self.draft_forwards += draft_forwards
        for j in range(min(accepted + 1, depth)):  # slot j+1 was judged: slots 1..j were kept
            self.judged[j] += 1
            self.kept[j] += j < accepted

    def clock(self, round_start: float, drafted: float, verified: float):
        """One round's stages, from split_time()s: drafting from round_start to drafted, verifying (the
        target's forward and the acceptance rule) from drafted to verified. The rest is the loop's own."""
        self.draft_seconds = (self.draft_seconds or 0.0) + drafted - round_start
        self.verify_seconds = (self.verify_seconds or 0.0) + verified - drafted

    def result(self, out, device, kind=Speculated, **more) -> Speculated:
        return kind(new_tokens=len(out), forwards=sum(self.hist) + self.prefill, seconds=elapsed(self.start, device),
                    accepted=list(self.hist), proposed=self.proposed, rejected=self.rejected if self.chain else None,
                    draft_forwards=self.draft_forwards, slot_judged=list(self.judged), slot_kept=list(self.kept),
                    draft_seconds=self.draft_seconds, verify_seconds=self.verify_seconds, **more)


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Leviathan's E[tokens per target forward] = (1 - alpha^(k+1)) / (1 - alpha), k + 1 at alpha = 1.

    Assumes each draft is accepted independently with probability alpha.
    """
    if not 0 <= alpha <= 1 or k < 0:
        raise UserError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Predicted walltime speedup over plain decoding: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)).

    c = cost of one draft forward / cost of one target forward; each round costs k draft forwards
    and one target forward (assumed to cost as much as one plain decoding step).
    """
    if c < 0:
        raise UserError(f"c (draft/target forward cost) must be >= 0, got {c}")
    return expected_tokens_per_round(alpha, k) / (k * c + 1)
