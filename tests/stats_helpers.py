"""Shared helpers for the speculative-decoding tests (test_speculative, test_ssd, test_dflash,
test_ddtree): random models and drafters, on_round recorders, the chi-square quantile and power
approximations, the exact joint of a tiny vocabulary's continuations and their binning, and the
table-lookup test doubles (TableModel, TableTarget and their caches) with the DFlash oracles.
Not a test file: the tests import from it.
"""
import copy
import itertools
import math

import pytest
import torch

from tinydiff.dflash import DFlashConfig, DFlashDrafter
from tinydiff.model import ModelConfig, Transformer, rope_table
from tinydiff.sampling import warp
from tinydiff.speculative import next_token_probs
from tinydiff.tokenizer import MASK


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small run fastest on one thread, and stay fast when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_model(config, seed, embed_std=0.3, std=0.5):
    """A random Transformer whose blocks matter. With the default init (std 0.02) the tied head
    mostly predicts the input token back, so greedy decoding would repeat one token forever."""
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, embed_std if name == "embed.weight" else std)
    return model


def perturbed(model, seed, noise):
    """A draft that mostly agrees with `model`: its weights plus Gaussian noise."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return model


def float64(target, *built_on):
    """float64 copies of a target and of the drafters or heads built on it (each copy holds the
    target's copy; RoPE tables recomputed in float64), for tests that compare two code paths: in
    float64 another summation order moves a result by ~1e-14 of its scale, so such a test can hold
    a bound (EXACT) that no real bug passes. The originals are left as they are."""
    wide = copy.deepcopy(target).double()
    models = (wide, *(copy.deepcopy(m, {id(target): wide}).double() for m in built_on))
    for m in (sub for model in models for sub in model.modules()):
        if hasattr(m, "rope_cos"):
            context, half = m.rope_cos.shape
            m.rope_cos, m.rope_sin = rope_table(context, 2 * half, m.config.rope_base, torch.float64)
    return models


# float64 paths' bound, relative to the largest magnitude: ~100x the largest float64 rounding
# measured (1.9e-14, test_eagle's unroll through five random layers; most paths 1e-16 to 1e-14).
# float32's rounding there is ~1e-5 (4e-6 on an EPYC, 1.2e-5 on a Xeon); any real bug, or a 1e-9
# change to one path, exceeds it.
EXACT = 2e-12


def assert_same(ours, theirs, bound=EXACT):
    """Two float64 paths agree within bound x theirs' largest magnitude (float64 rounding only)."""
    assert ours.dtype == theirs.dtype == torch.float64, (ours.dtype, theirs.dtype)
    error, scale = float((ours - theirs).abs().max()), float(theirs.abs().max())
    assert error <= bound * scale, f"max |diff| {error:.3g} > {bound:g} x {scale:.3g}"


def one_hot(model):
    """A temperature-0 draft: all of its mass on its argmax, whatever the warping."""
    model.register_forward_hook(lambda module, inputs, logits: torch.full_like(logits, float("-inf"))
                                .scatter_(-1, logits.argmax(-1, keepdim=True), 0.0))
    return model


@pytest.fixture(scope="module")
def greedy_models():
    """test_speculative's and test_ssd's greedy models: GPT-2's full vocabulary (and MASK), a target
    and two drafts (close: the target plus small noise; small: another, smaller random model). In
    float64: their tests compare two code paths (token for token, caches), and float64 rounding
    cannot flip a near-tie between them as float32's, different on every CPU, might."""
    target = random_model(ModelConfig(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    small = random_model(ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32), seed=1)
    target, close, small = float64(target, perturbed(target, seed=2, noise=0.01), small)
    return target, {"close": close, "small": small}


def random_drafter(target, seed, std=0.5, **overrides):
    """An untrained drafter whose layers matter (default init barely moves the block's embeddings),
    in the target's dtype (a float64 target's drafter holds the float32 one's weights, widened)."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig.for_target(target.config, **overrides), target).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2 or name == "mask_embed":
                p.normal_(0, std)
    return drafter.to(target.embed.weight.dtype)


def recorder(*callbacks):
    """An on_round callback that keeps each round's info (without the caches) and passes the info on
    to each of `callbacks` that is not None."""
    rounds = []

    def on_round(info):
        rounds.append({key: value for key, value in info.items() if not key.endswith("cache")})
        for callback in callbacks:
            if callback:
                callback(info)
    return rounds, on_round


def recorded_run(generate, target, drafter, prompt, n, oracle=None, on_round=None, **kwargs):
    """generate (dflash_generate, ddtree_generate) with every round's info recorded (caches left out),
    also passed to the oracle and to on_round: (out, stats, rounds)."""
    rounds, record = recorder(oracle and oracle.on_round, on_round)
    if oracle is not None:
        oracle.reset(prompt)
    out, stats = generate(target, drafter, prompt, n, on_round=record, **kwargs)
    return out, stats, rounds


def check_block_counts(out, stats, rounds, B, prompt_length):
    """test_dflash's and test_ddtree's common stats checks: the stats agree with each other and with
    the rounds (histogram, tokens, forwards, alpha) and tau never exceeds B."""
    assert len(stats["accepted"]) == B and sum(stats["accepted"]) == stats["rounds"] == len(rounds)
    assert [t for r in rounds for t in r["tokens"]] == out and stats["new_tokens"] == len(out)
    assert stats["target_forwards"] == stats["rounds"] + (prompt_length > 1)
    accepted = sum(r["accepted"] for r in rounds)
    assert accepted == sum(n * c for n, c in enumerate(stats["accepted"]))
    assert_alpha(stats, rounds, accepted)
    assert stats["tau"] == len(out) / stats["rounds"] and 1 <= stats["tau"] <= B


def assert_alpha(stats, rounds, accepted):
    """Chain drafts: alpha = accepted / judged, a round judging its drafts up to the first rejection.
    Trees (rounds without "drafts") have no single acceptance rate."""
    chain = all("drafts" in r for r in rounds)
    rejected = sum(r["accepted"] < len(r["drafts"]) for r in rounds) if chain else None
    assert stats["rejected"] == rejected
    judged = accepted + (rejected or 0)
    assert stats["alpha"] == (accepted / judged if chain and judged else None)


def assert_caches_equal(*pairs):
    """Each (ours, theirs) pair of float64 KV caches holds the same K and V in ours' first `length`
    rows, up to float64 rounding (assert_same)."""
    for ours, theirs in pairs:
        for a, b in zip(ours.k + ours.v, theirs.k + theirs.v):
            assert_same(a[:, :, :ours.length], b[:, :, :ours.length])


# Distribution: at temperature > 0 the committed tokens must follow the target's joint exactly.
V, NEW, PROMPT = 6, 3, [1, 2]      # 6^3 = 216 possible continuations of a 2-token prompt
DIST_CONFIG = ModelConfig(vocab_size=V, context=8, n_layer=1, n_head=2, d_model=16, d_ff=32)
# test_dflash's and test_ddtree's target: two layers (its feature layer is [1]).
DFLASH_DIST_CONFIG = ModelConfig(vocab_size=V, context=8, n_layer=2, n_head=2, d_model=16, d_ff=32)
Z_ALPHA = 3.090232306167813        # standard normal 0.999 quantile: fail at significance 1e-3
DELTA, POWER = 0.02, 0.9           # catch one continuation off by DELTA at least POWER of the time
BIN_MASS = 0.02                    # rare continuations share bins of at least this mass


def chi2_sf(x, df):
    """P(chi2_df > x) by Wilson-Hilferty ((chi2/df)^(1/3) is nearly normal); off by < 10% at 1e-3."""
    s = math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(((x / df) ** (1 / 3) - 1 + s * s) / (s * math.sqrt(2)))


def chi2_quantile(df, z):
    """The chi2_df value that a standard normal quantile z maps to under Wilson-Hilferty."""
    s = math.sqrt(2 / (9 * df))
    return df * (1 - s * s + z * s) ** 3


def noncentral_chi2_sf(x, df, lam):
    """P(chi2_df(lam) > x) by Patnaik (c * chi2_h with matched mean and variance); within 0.02 of
    the exact value for the df and lam used here (checked against scipy.stats.ncx2 once)."""
    h, c = (df + lam) ** 2 / (df + 2 * lam), (df + 2 * lam) / (df + lam)
    return chi2_sf(x / c, h)


def prefix_seqs(v=V, new=NEW, prompt=PROMPT):
    """Every (new-1)-token prefix in itertools.product order, (M, new-1), and prompt + it, (M, T)."""
    prefixes = torch.tensor(list(itertools.product(range(v), repeat=new - 1)))  # (M, NEW-1)
    return prefixes, torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), prefixes], 1)  # (M, T)


@torch.no_grad()
def exact_joint(target, temperature, top_k, top_p, v=V, new=NEW, prompt=PROMPT):
    """P(x_1..x_NEW | PROMPT) for all V^NEW continuations, in itertools.product order: products of
    the warped target conditionals from one full forward (no cache, no speculation)."""
    prefixes, x = prefix_seqs(v, new, prompt)
    p = warp(target(x, causal=True)[:, len(prompt) - 1:], temperature, top_k, top_p)  # (M, NEW, V)
    path = p[:, :-1].gather(-1, prefixes[..., None]).prod(1)  # (M, 1): P(prefix)
    return (path * p[:, -1]).flatten()  # (M * V,) = (V^NEW,)


def chi_square_bins(probs, counts):
    """Group continuations, rarest first, into bins of mass >= BIN_MASS (a leftover joins the last
    bin): every bin is expected >= 5 times and the degrees of freedom stay few."""
    bins_p, bins_o, p_run, o_run = [], [], 0.0, 0
    for i in probs.argsort().tolist():
        p_run, o_run = p_run + float(probs[i]), o_run + int(counts[i])
        if p_run >= BIN_MASS:
            bins_p.append(p_run)
            bins_o.append(o_run)
            p_run, o_run = 0.0, 0
    bins_p[-1] += p_run
    bins_o[-1] += o_run
    return bins_p, bins_o


def sample_counts(generate, n, oracle, seed):
    """n generations by generate(generator) -> (out, stats), one generator seeded with `seed`, the
    oracle (if any) reset to PROMPT before each: (counts per continuation (V^NEW,), the summed
    acceptance histogram over the first 4 slots)."""
    counts, hist = torch.zeros(V ** NEW, dtype=torch.long), [0] * 4
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        if oracle is not None:
            oracle.reset(PROMPT)
        out, stats = generate(generator)
        hist = [a + b for a, b in zip(hist, stats["accepted"])]
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(out))] += 1
    return counts, hist


def assert_follows_the_joint(probs, counts, n):
    """The chi-square check of n seeded generations' counts against the exact joint probs: no
    continuation the target rules out, power >= POWER against a DELTA error (computed from the joint
    and asserted), and the statistic under the significance-Z_ALPHA critical value."""
    assert counts[probs == 0].sum() == 0  # never a continuation the target rules out
    bins_p, bins_o = chi_square_bins(probs[probs > 0], counts[probs > 0])
    df = len(bins_p) - 1
    stat = sum((o - n * p) ** 2 / (n * p) for p, o in zip(bins_p, bins_o))
    critical = chi2_quantile(df, Z_ALPHA)
    heaviest = max(bins_p)
    power = noncentral_chi2_sf(critical, df, n * DELTA ** 2 * (1 - heaviest) / heaviest)
    assert power >= POWER, f"{n} samples catch a {DELTA} error with probability {power:.2f} only"
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f} on {df} df: not the target's distribution"


class TokenCache:
    """What `TableModel` remembers: the tokens it has read, with KVCache's `length` and `crop`."""

    def __init__(self):
        self.tokens, self.length = [], 0

    def crop(self, n):
        assert 0 <= n <= self.length
        del self.tokens[n:]
        self.length = n


class TreeTokenCache(TokenCache):
    def keep(self, rows):
        self.tokens = [self.tokens[r] for r in rows]
        self.length = len(self.tokens)


class TableModel(torch.nn.Module):
    """A Transformer's conditionals after PROMPT, computed once with full forwards and then looked
    up by the tokens the cache has read, so a generation costs ~0.2 ms instead of ~1 ms and a
    powerful test fits in seconds. It answers exactly as the Transformer would for whatever
    speculative_generate feeds it, so wrong inputs or a wrong crop still show up as a wrong
    distribution; the real KV cache is proven separately (greedy and cache tests)."""

    def __init__(self, model, v=V, new=NEW, prompt=PROMPT):
        super().__init__()
        self.config, self.embed = model.config, model.embed
        _, seqs = prefix_seqs(v, new, prompt)
        with torch.no_grad():
            logits = model(seqs, causal=True)  # (M, T, V)
        self.table = {tuple(seq[:t + 1]): row[t] for seq, row in zip(seqs.tolist(), logits)
                      for t in range(seqs.shape[1])}

    def new_cache(self, batch_size=1):
        return TokenCache()

    def forward(self, x, cache, causal=True):
        start = cache.length
        cache.tokens += x[0].tolist()
        cache.length = len(cache.tokens)
        return torch.stack([self.table[tuple(cache.tokens[:t + 1])] for t in range(start, cache.length)])[None]


class TableTarget(torch.nn.Module):
    """TableModel for a target read with hidden_layers: the logits and hidden states of every
    prefix of PROMPT + (NEW - 1) tokens from full forwards, looked up by the tokens its cache has
    read, so a generation costs a fraction of a millisecond. It answers exactly as the Transformer
    would for whatever dflash_generate feeds it; its KV cache is proven by the cache test."""

    def __init__(self, model, layers):
        super().__init__()
        self.config, self.embed, self.layers = model.config, model.embed, layers
        _, seqs = prefix_seqs()
        logits, hidden = model(seqs, causal=True, hidden_layers=layers)  # (M, T, V), N x (M, T, D)
        self.table = {tuple(seq[:t + 1]): (logits[m, t], [h[m, t] for h in hidden])
                      for m, seq in enumerate(seqs.tolist()) for t in range(seqs.shape[1])}

    def new_cache(self, batch_size=1):
        return TokenCache()

    def forward(self, x, cache, causal=True, hidden_layers=None):
        assert causal and hidden_layers == self.layers
        start = cache.length
        cache.tokens += x[0].tolist()
        cache.length = len(cache.tokens)
        rows = [self.table[tuple(cache.tokens[:t + 1])] for t in range(start, cache.length)]
        hidden = [torch.stack([r[1][i] for r in rows])[None] for i in range(len(self.layers))]
        return torch.stack([r[0] for r in rows])[None], hidden


class TreeTableTarget(TableTarget):
    """TableTarget for tree forwards: row i answers as the Transformer does for the tokens it may see
    (the cached ones and the new ones its mask allows, in order), and its position id must be the
    last of those; the cache keeps rows like KVCache.keep. The real mask, positions and cache are
    proven by test_ddtree's other tests; this proves the walk, the sampling and the bookkeeping."""

    def new_cache(self, batch_size=1):
        return TreeTokenCache()

    def forward(self, x, pos=None, mask=None, cache=None, causal=True, hidden_layers=None):
        assert hidden_layers == self.layers
        start, T = cache.length, x.shape[1]
        if mask is None:
            assert causal and pos is None
            mask = torch.ones(T, start + T, dtype=torch.bool).tril(start)
        cache.tokens += x[0].tolist()
        cache.length = len(cache.tokens)
        rows = []
        for i in range(T):
            seen = [t for t, visible in zip(cache.tokens, mask[i].tolist()) if visible]
            assert mask[i, start + i] and (pos is None or int(pos[i]) == len(seen) - 1)
            rows.append(self.table[tuple(seen)])
        hidden = [torch.stack([r[1][j] for r in rows])[None] for j in range(len(self.layers))]
        return torch.stack([r[0] for r in rows])[None], hidden


class Oracle:
    """Makes a drafter draft from the target itself: slot k gets the target's logits for position
    start + k after the committed sequence followed by the target's own greedy continuation, so at
    temperature 0 every draft is the target's argmax. `wrong(position)` marks slots to corrupt (their
    argmax moves to another token). It learns the committed sequence from on_round; call
    reset(prompt) before each generation. It also checks that each block starts at the newest token."""

    def __init__(self, drafter, target, wrong=lambda position: False):
        self.drafter, self.target, self.wrong, self.memo, self.seq = drafter, target, wrong, {}, None
        drafter.register_forward_hook(self.hook)

    def reset(self, prompt):
        self.seq = list(prompt)
        return self

    def on_round(self, info):
        self.seq = info["seq"]

    def chain(self, n):
        key = (tuple(self.seq), n)
        if key not in self.memo:
            seq, rows = list(self.seq), []
            for _ in range(n):
                rows.append(self.target(torch.tensor([seq]), causal=True, head_from=len(seq) - 1)[0, -1])
                seq.append(int(next_token_probs(rows[-1].clone(), 0, None, None).argmax()))
            self.memo[key] = torch.stack(rows), seq[len(self.seq):]
        return self.memo[key]

    def hook(self, module, args, output):
        block, pos = args[0], args[1]
        start = len(self.seq) - 1
        assert pos.tolist() == list(range(start, start + block.shape[1])) and block[0, 0] == self.seq[-1]
        rows, tokens = self.chain(block.shape[1] - 1)
        out = output.clone()
        out[0, 1:] = rows
        for k, token in enumerate(tokens, 1):
            if self.wrong(start + k):
                out[0, k, (token + 1) % min(out.shape[-1], MASK)] = rows[k - 1].max() + 10.0
        return out


class TreeOracle(Oracle):
    """Oracle (slot k: the target's logits after its own greedy continuation), made sure of itself
    for trees: the target's pick gets +SHARP, so the greedy path outscores every other prefix by
    ~SHARP nats. Where wrong(position), a decoy gets the pick's logit + 1 instead: the target's pick
    is rank 1 there, so a single path (DFlash) stops at the decoy and a tree that keeps both
    branches (2^decoys paths down to depth B-1) holds the target's whole path."""
    SHARP = 20.0

    def hook(self, module, args, output):
        out = super().hook(module, args, output)  # the plain oracle, decoys at +10 (replaced here)
        start = len(self.seq) - 1
        rows, tokens = self.chain(args[0].shape[1] - 1)
        out[0, 1:] = rows
        for k, token in enumerate(tokens, 1):
            out[0, k, token] += self.SHARP
            if self.wrong(start + k):
                out[0, k, (token + 1) % min(out.shape[-1], MASK)] = out[0, k, token] + 1
        return out
