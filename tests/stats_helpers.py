"""Shared helpers for the speculative-decoding tests (test_speculative, test_ssd, test_dflash_decode,
test_ddtree): random models and drafters, on_round recorders, the chi-square quantile and power
approximations, and the exact joint of a tiny vocabulary's continuations and their binning. The
table-lookup test doubles are in table_models.py. Not a test file: the tests import from it.
"""
import copy
import itertools
import math

import pytest
import torch

from tinydiff.checks import UserError
from tinydiff.dflash import DFlashConfig, DFlashDrafter
from tinydiff.model import ModelConfig, Transformer, rope_table
from tinydiff.sampling import warp
from tinydiff.tokenizer import EOT, MASK


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small run fastest on one thread, and stay fast when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_model(config, seed, embed_std=0.3, std=0.5, build=Transformer):
    """A random Transformer (or `build`'s model, e.g. dmoe.MoETransformer: routers and experts drawn
    alike) whose blocks matter. With the default init (std 0.02) the tied head mostly predicts the
    input token back, so greedy decoding would repeat one token forever."""
    torch.manual_seed(seed)
    model = build(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                live(model, name, p).normal_(0, embed_std if name == "embed.weight" else std)
    return model


def live(model, name, p):
    """p, or for the embedding its true vocabulary's rows: the padding rows (model.padded_vocab) stay zero, and
    the random draws are the same as an unpadded model's."""
    return p[:model.config.vocab_size] if name == "embed.weight" else p


def perturbed(model, seed, noise):
    """A draft that mostly agrees with `model`: its weights plus Gaussian noise."""
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p = live(model, name, p)
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
    error, scale = float((ours - theirs).detach().abs().max()), float(theirs.detach().abs().max())
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
    if overrides.get("markov_rank"):  # DSpark's Markov head: tinydiff/extras/markov_head.py
        from tinydiff.extras.markov_head import MarkovConfig, MarkovDrafter
        drafter = MarkovDrafter(MarkovConfig.for_target(target.config, **overrides), target).eval()
    else:
        overrides.pop("markov_rank", None)
        drafter = DFlashDrafter(DFlashConfig.for_target(target.config, **overrides), target).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() == 2 or name == "mask_embed":
                p.normal_(0, std)
    return drafter.to(target.embed.weight.dtype)


def recorded_with_caches(decode, *args, oracle=None, prompt=None, **kwargs):
    """decode's tokens, result and per round (drafts or None, accepted, tokens, and per cache (the
    target's, the drafter's) its length and a copy of its valid rows), the oracle (reset to `prompt`
    first) told of every round: test_fused_dflash's and test_fused_ddtree's record of two loops."""
    rounds = []

    def on_round(info):
        if oracle is not None:
            oracle.on_round(info)
        caches = [(c.length, [t[:, :, :c.length].clone() for t in c.k + c.v])
                  for c in (info["target_cache"], info["draft_cache"])]
        rounds.append((info.get("drafts"), info["accepted"], info["tokens"], caches))
    if oracle is not None:
        oracle.reset(prompt)
    out, result = decode(*args, on_round=on_round, **kwargs)
    return out, result, rounds


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
    """test_dflash_decode's and test_ddtree's common stats checks: the stats agree with each other and with
    the rounds (histogram, tokens, forwards, alpha) and tau never exceeds B."""
    assert len(stats.accepted) == B and sum(stats.accepted) == stats.rounds == len(rounds)
    assert [t for r in rounds for t in r["tokens"]] == out and stats.new_tokens == len(out)
    assert stats.forwards == stats.rounds + (prompt_length > 1)
    accepted = sum(r["accepted"] for r in rounds)
    assert accepted == sum(n * c for n, c in enumerate(stats.accepted))
    assert_acceptance(stats, rounds, accepted)
    assert stats.tau == len(out) / stats.rounds and 1 <= stats.tau <= B


def assert_refuses_what_block_drafting_refuses(decode, target, drafter):
    """test_dflash_decode's and test_ddtree's common refusals, each a UserError: a block size the drafter
    cannot fill, a drafter that is not a DFlashDrafter, an empty prompt, MASK in the prompt, a negative
    temperature. decode is dflash_generate or ddtree_generate."""
    for B in (1, 9, 4.0):
        with pytest.raises(UserError, match="block size"):
            decode(target, drafter, [1, 2], 5, block_size=B)
    with pytest.raises(UserError, match="DFlashDrafter"):
        decode(target, target, [1, 2], 5)
    with pytest.raises(UserError, match="empty"):
        decode(target, drafter, [], 5)
    with pytest.raises(UserError, match="MASK"):
        decode(target, drafter, [EOT, MASK], 5)
    with pytest.raises(UserError, match="temperature"):
        decode(target, drafter, [1, 2], 5, temperature=-1)


def assert_acceptance(stats, rounds, accepted):
    """Chain drafts: alpha = accepted / judged, a round judging its drafts up to the first rejection.
    Trees (rounds without "drafts") have no single acceptance rate. Per slot, recounted from the
    rounds: slot j+1 was judged in a round whose drafts reach depth j+1 and kept slots 1..j."""
    chain = all("drafts" in r for r in rounds)
    rejected = sum(r["accepted"] < len(r["drafts"]) for r in rounds) if chain else None
    assert stats.rejected == rejected
    judged = accepted + (rejected or 0)
    assert stats.alpha == (accepted / judged if chain and judged else None)
    depths = [len(r["drafts"]) if chain else int(r["tree"].depths.max()) for r in rounds]
    slots = range(len(stats.slot_judged))
    assert len(stats.slot_judged) == len(stats.accepted) - 1 and max(depths, default=0) <= len(slots)
    assert stats.slot_judged == [sum(j < d and r["accepted"] >= j for r, d in zip(rounds, depths)) for j in slots]
    assert stats.slot_kept == [sum(j < d and r["accepted"] > j for r, d in zip(rounds, depths)) for j in slots]
    assert stats.acceptance_by_slot == [k / n if n else None for k, n in zip(stats.slot_kept, stats.slot_judged)]


def assert_caches_equal(*pairs):
    """Each (ours, theirs) pair of float64 KV caches holds the same K and V in ours' first `length`
    rows, up to float64 rounding (assert_same)."""
    for ours, theirs in pairs:
        for a, b in zip(ours.k + ours.v, theirs.k + theirs.v):
            assert_same(a[:, :, :ours.length], b[:, :, :ours.length])


# Distribution: at temperature > 0 the committed tokens must follow the target's joint exactly.
V, NEW, PROMPT = 6, 3, [1, 2]      # 6^3 = 216 possible continuations of a 2-token prompt
DIST_CONFIG = ModelConfig(vocab_size=V, context=8, n_layer=1, n_head=2, d_model=16, d_ff=32)
# test_dflash_decode's and test_ddtree's target: two layers (its feature layer is [1]).
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
        hist = [a + b for a, b in zip(hist, stats.accepted)]
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
