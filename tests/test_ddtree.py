"""Spec: DDTree verifies the best `budget` prefixes of one DFlash pass in one target forward, losslessly
(the tree itself: test_ddtree_tree.py).

The target's logits and hidden states at every tree node equal a plain causal forward on prefix + path;
compaction leaves the caches equal to a recomputation of the committed sequence; greedy output is
the target's greedy decoding token for token; sampled output follows the target's exact joint
(chi-square); tau never exceeds B, and a tree holding the target's path reaches tau == B where a
single path (DFlash) cannot; bad input is a clear error.
"""
import copy
import itertools

import pytest
import torch
from stats_helpers import (
    DFLASH_DIST_CONFIG,
    NEW,
    PROMPT,
    assert_caches_equal,
    assert_follows_the_joint,
    assert_refuses_what_block_drafting_refuses,
    assert_same,
    check_block_counts,
    exact_joint,
    float64,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
    recorded_run,
    sample_counts,
)
from table_models import Oracle, TreeOracle, TreeTableTarget
from tree_paths import children, prefix_of

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.ddtree import build_tree, compact_cache, compile_tree, ddtree_generate
from tinydiff.dflash import dflash_generate
from tinydiff.extras.markov_head import markov_ddtree_generate
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import EOT, MASK

# ---------------------------------------------------------------- the verify forward and the cache

@pytest.fixture(scope="module")
def models():
    """GPT-2's full vocabulary (and MASK). Five target layers: two feature layers, [1, 2]."""
    target = random_model(ModelConfig(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    return target, random_drafter(target, seed=1, n_layer=2, block_size=8, n_features=2)


@pytest.fixture(scope="module")
def models64(models):
    """The same in float64: tests that compare two code paths hold them to float64 rounding."""
    return float64(*models)


def verify_tree(target, seq, tree, layers):
    """One tree forward after a cache holding seq[:-1]: (logits (N+1, V), hidden, cache)."""
    cache = target.new_cache()
    if len(seq) > 1:
        target(torch.tensor([seq[:-1]]), cache=cache, causal=True)
    ids, pos, mask = compile_tree(tree, len(seq) - 1, seq[-1])
    logits, hidden = target(ids, pos=pos, mask=mask, cache=cache, hidden_layers=layers)
    return logits[0], [h[0] for h in hidden], cache


@torch.no_grad()
def test_tree_logits_equal_a_causal_forward_on_each_path(models64):
    """Catches mask, position and RoPE errors at once: every node's logits and hidden states (the
    drafter's next context features) are those of prefix + its path read causally (in float64: to
    float64 rounding)."""
    target, drafter = models64
    layers = drafter.config.taps
    g = torch.Generator().manual_seed(3)
    for seq in ([EOT], [EOT, 11, 12, 13, 14, 15]):
        tree = build_tree(torch.randn(5, 6, generator=g) * 2, 20)  # tokens 0..5, several branches
        assert int(tree.depths.max()) >= 3 and any(len(children(tree, i)) > 1 for i in range(1, tree.size + 1))
        logits, hidden, _ = verify_tree(target, seq, tree, layers)
        for i in range(tree.size + 1):
            full = torch.tensor([seq + list(prefix_of(tree, i))])
            ref_logits, ref_hidden = target(full, causal=True, hidden_layers=layers)
            for ours, ref in [(logits[i], ref_logits[0, -1])] + [(h[i], r[0, -1]) for h, r in zip(hidden, ref_hidden)]:
                assert_same(ours, ref)


@torch.no_grad()
def test_compaction_leaves_the_cache_of_the_committed_sequence(models64):
    """After compact_cache(path) the target cache equals a fresh causal forward over seq + the path's
    tokens (to float64 rounding), for every node's path (the root alone included)."""
    target, drafter = models64
    g = torch.Generator().manual_seed(4)
    seq = [EOT, 21, 22, 23]
    tree = build_tree(torch.randn(4, 5, generator=g) * 2, 12)
    for node in range(tree.size + 1):
        _, _, cache = verify_tree(target, seq, tree, drafter.config.taps)
        path = tree.path(node)
        compact_cache(cache, len(seq) - 1, path)
        committed = seq + list(prefix_of(tree, node))
        assert cache.length == len(committed)
        fresh = target.new_cache()
        target(torch.tensor([committed]), cache=fresh, causal=True)
        assert_caches_equal((cache, fresh))


# ---------------------------------------------------------------- the loop

def run(target, drafter, prompt, n, oracle=None, on_round=None, **kwargs):
    """ddtree_generate with every round's info recorded (caches left out), passed on to the oracle and on_round."""
    return recorded_run(ddtree_generate, target, drafter, prompt, n, oracle, on_round, **kwargs)


def check_counts(out, stats, rounds, B, budget, prompt_length):
    """The stats agree with each other and with the rounds; each round's path is a chain of the tree
    from the root, its tokens are what the round committed; no round commits more than B tokens."""
    check_block_counts(out, stats, rounds, B, prompt_length)
    assert stats.draft_forwards == sum(r["tree"].size > 0 for r in rounds)
    assert stats.proposed == sum(r["tree"].size for r in rounds)
    assert stats.nodes_per_round == stats.proposed / stats.rounds
    for r in rounds:
        tree, path = r["tree"], r["path"]
        assert tree.size <= budget and int(tree.depths.max()) <= B - 1 and r["accepted"] == len(path)
        assert [int(tree.parents[i]) for i in path] == [0, *path][:len(path)]
        assert r["tokens"][:len(path)] == tree.tokens[path].tolist()[:len(r["tokens"])]
        assert 1 <= len(r["tokens"]) <= len(path) + 1 <= B


def branch_steps(rounds):
    """Accepted nodes that are not their parent's first child: only a tree could have accepted them."""
    return sum(min(children(r["tree"], int(r["tree"].parents[i]))) != i for r in rounds for i in r["path"])


@pytest.fixture(scope="module")
def small_vocab():
    """A 64-token target: a random drafter's trees then often hold the target's picks, on branches too.
    In float64, as models64."""
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=5)
    return float64(target, random_drafter(target, seed=6, block_size=8, n_features=1, std=0.3))


@torch.no_grad()
def test_greedy_output_equals_the_targets_greedy_decoding(models64, small_vocab):
    """Token for token, for budgets 1 (a single depth-1 node), 3 and 6 (too small to hold every branch)
    and 32, blocks of 4 and 8, runs with and without a stop token emitted mid-way, and two drafters: the
    decoy oracle on GPT-2's vocabulary and a random drafter on 64 ids (trees that hit by chance)."""
    target, _ = models64
    oracle = TreeOracle(random_drafter(target, seed=2, block_size=8, n_features=2), target,
                        wrong=lambda position: position % 3 == 0)
    pairs = {"oracle": (target, oracle.drafter, oracle), "random, 64 ids": (*small_vocab, None)}
    seen = {"rejected": 0, "partial": 0, "full": 0, "branch": 0, "dropped_after_stop": 0}
    for seed, (B, budget), name, stop in itertools.product(range(2), ((4, 3), (8, 1), (8, 6), (8, 32)), pairs,
                                                           ("none", "mid")):
        model, drafter, orc = pairs[name]
        g = torch.Generator().manual_seed(seed)
        prompt = [1 + seed] + torch.randint(0, model.config.vocab_size - 1, (3 * seed,), generator=g).tolist()
        full, _ = ar_generate(model, prompt, 24, temperature=0, stop_token=None)
        stop_token = None if stop == "none" else full[13]
        expected, _ = ar_generate(model, prompt, 24, temperature=0, stop_token=stop_token)
        out, stats, rounds = run(model, drafter, prompt, 24, orc, block_size=B, budget=budget, temperature=0,
                                 stop_token=stop_token)
        assert out == expected, (seed, B, budget, name, stop)
        check_counts(out, stats, rounds, B, budget, len(prompt))
        seen["rejected"] += stats.accepted[0]
        seen["partial"] += sum(0 < r["accepted"] < int(r["tree"].depths.max()) for r in rounds)
        seen["full"] += sum(0 < r["accepted"] == int(r["tree"].depths.max()) for r in rounds)
        seen["branch"] += branch_steps(rounds)
        seen["dropped_after_stop"] += len(rounds[-1]["tokens"]) < rounds[-1]["accepted"] + 1
    assert min(seen.values()) > 0, seen  # the cases must include every kind of round, or prove nothing


@torch.no_grad()
def test_a_tree_holding_the_targets_path_gives_tau_equal_to_B(models64):
    """With a decoy ahead of the target's pick every third position, DFlash's single path stops at
    each decoy; a tree with room for both branches at every decoy accepts all B-1 depths."""
    target, _ = models64
    for B, prompt in itertools.product((4, 8), ([EOT], [EOT, 7, 8, 9])):
        oracle = TreeOracle(random_drafter(target, seed=3, block_size=8, n_features=2), target,
                            wrong=lambda position: position % 3 == 0)
        n = 3 * B  # three full rounds
        expected = ar_generate(target, prompt, n, temperature=0, stop_token=None)[0]
        out, stats, rounds = run(target, oracle.drafter, prompt, n, oracle, block_size=B, budget=32, temperature=0,
                                 stop_token=None)
        assert out == expected
        assert stats.accepted == [0] * (B - 1) + [3] and stats.tau == B
        assert stats.draft_forwards == 3 and stats.forwards == 3 + (len(prompt) > 1)
        assert 0 < stats.draft_seconds and 0 < stats.verify_seconds  # every round clocks both stages
        assert stats.draft_seconds + stats.verify_seconds <= stats.seconds  # inside the timed loop
        assert branch_steps(rounds) > 0
        check_counts(out, stats, rounds, B, 32, len(prompt))
        oracle.reset(prompt)
        single, dflash = dflash_generate(target, oracle.drafter, prompt, n, B, temperature=0, stop_token=None,
                                         on_round=oracle.on_round)
        assert single == expected and dflash.tau < B


@torch.no_grad()
def test_caches_hold_exactly_the_committed_context_after_every_round(models64, small_vocab):
    """After every round both caches hold the committed tokens but the newest: the target's K/V and the
    drafter's context K/V equal a recomputation from scratch over seq[:-1], to float64 rounding."""
    checked = {"full": 0, "partial": 0, "branch": 0, "stopped": 0}
    current = {}

    def check(info):
        target, drafter = current["models"]
        seq, tc, dc = info["seq"], info["target_cache"], info["draft_cache"]
        assert tc.length == dc.length == len(seq) - 1
        fresh_t, fresh_d = target.new_cache(), drafter.new_cache()
        _, hidden = target(torch.tensor([seq[:-1]]), cache=fresh_t, causal=True,
                           hidden_layers=drafter.config.taps)
        drafter.extend(fresh_d, hidden)
        assert_caches_equal((tc, fresh_t), (dc, fresh_d))
        full = info["tree"].size > 0 and info["accepted"] == int(info["tree"].depths.max())
        checked["full" if full else "partial"] += 1

    target, _ = models64
    oracle = TreeOracle(random_drafter(target, seed=3, block_size=8, n_features=2), target,
                        wrong=lambda position: position % 4 == 0)
    cases = [(target, oracle.drafter, oracle, 0, [EOT, 3, 4, 5], 12), (*small_vocab, None, 1.0, [EOT % 64], 32)]
    for model, drafter, orc, temperature, prompt, budget in cases:
        current["models"] = model, drafter
        generator = torch.Generator().manual_seed(0)
        stop = run(model, drafter, prompt, 20, orc, temperature=temperature, budget=budget, generator=generator,
                   stop_token=None)[0][9]
        generator.manual_seed(0)
        out, _, rounds = run(model, drafter, prompt, 20, orc, temperature=temperature, budget=budget,
                             generator=generator, stop_token=stop, on_round=check)
        checked["stopped"] += out[-1] == stop and len(out) < 20
        checked["branch"] += branch_steps(rounds)
    assert min(checked.values()) > 0, checked


@torch.no_grad()
def test_mask_never_comes_out_and_the_tree_fits_the_context(models):
    target, drafter = models

    def favour_mask(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        logits[..., MASK] += 100.0
    mask_target, mask_drafter = copy.deepcopy(target), copy.deepcopy(drafter)
    object.__setattr__(mask_drafter, "target", mask_target)
    for model in (mask_target, mask_drafter):
        model.register_forward_hook(favour_mask)
    for temperature in (0, 1.0):
        out, _, rounds = run(mask_target, mask_drafter, [EOT, 3], 12, temperature=temperature, stop_token=None,
                             generator=torch.Generator().manual_seed(0))
        assert len(out) == 12 and MASK not in out and all(MASK not in r["tree"].tokens.tolist() for r in rounds)
    prompt = list(range(1, 31))  # 30 of 40 positions: a 32-node tree must shrink to fit the cache
    out, _, rounds = run(target, drafter, prompt, None, budget=32, temperature=0, stop_token=None)
    assert out == ar_generate(target, prompt, None, temperature=0, stop_token=None)[0] and len(out) == 10
    assert all(len(r["seq"]) - len(r["tokens"]) + r["tree"].size <= 40 for r in rounds)


def test_bad_input_is_a_clear_error(models):
    target, drafter = models
    for budget in (0, -3, 2.5, None):
        with pytest.raises(UserError, match="budget"):
            ddtree_generate(target, drafter, [1, 2], 5, budget=budget)
    assert_refuses_what_block_drafting_refuses(ddtree_generate, target, drafter)
    with pytest.raises(UserError, match="max new tokens"):
        ddtree_generate(target, drafter, [1, 2], 39)


# ---------------------------------------------------------------- distribution at temperature > 0
# test_dflash_decode's design: V = 6, 3 new tokens after a 2-token prompt, chi-square against the enumerated
# joint at significance 1e-3, power asserted from the joint. The target is test_dflash_decode's (two layers,
# small embeddings: a flat joint), read through a table that also answers tree-masked forwards
# (TreeTableTarget in table_models).

DIST_CASES = {  # oracle drafter (else random), temperature, top_k, top_p, budget, samples, Markov head rank
    "random drafter, budget 4": (False, 1.0, None, None, 4, 5_500, 0),
    "oracle drafter, budget 3, T 0.7, top-p 0.9": (True, 0.7, None, 0.9, 3, 7_000, 0),
    "random drafter with a Markov head, budget 4": (False, 1.0, None, None, 4, 5_500, 3),
}


@pytest.mark.parametrize("case", DIST_CASES)
@torch.no_grad()
def test_sampled_tokens_follow_the_exact_target_distribution(case):
    """Chi-square goodness of fit of seeded generations against the enumerated joint.

    Significance 1e-3 (a correct implementation fails with probability 1e-3 per case if seeds or
    torch's random streams change). Power, as in test_speculative: one continuation off by DELTA =
    2 percentage points, the rest absorbing it in proportion, is caught with probability >= POWER
    = 0.9; the power is computed from the exact joint and asserted, so a weaker test fails loudly
    (here 40-43 bins, the heaviest 0.04-0.05: 5,500 and 7,000 samples give power 0.91 and 0.93).
    Each case must also see rejections at the root, full-depth acceptances and acceptances on a
    branch (a node that is not its parent's first child), or it proves nothing about them.
    """
    use_oracle, temperature, top_k, top_p, budget, n, markov_rank = DIST_CASES[case]
    model = random_model(DFLASH_DIST_CONFIG, seed=1, embed_std=0.1)
    drafter = random_drafter(model, seed=5, block_size=4, markov_rank=markov_rank)
    oracle = Oracle(drafter, model) if use_oracle else None
    # Both drafters are nearly uniform over these 6 ids (the target's joint is flat), so their trees
    # would be all siblings at depth 1: sharpen them (logits x 4) so that trees grow deep and branch.
    drafter.register_forward_hook(lambda module, args, logits: logits * 4)
    probs = exact_joint(model, temperature, top_k, top_p)  # (V^NEW,)
    target = TreeTableTarget(model, drafter.config.taps)
    rounds = []

    def on_round(info):
        rounds.append({"tree": info["tree"], "path": info["path"]})
        if oracle is not None:
            oracle.on_round(info)
    decode = markov_ddtree_generate if markov_rank else ddtree_generate  # trees whose children read the head
    counts, hist = sample_counts(lambda generator: decode(
        target, drafter, PROMPT, NEW, None, budget, temperature, top_k, top_p, generator, stop_token=None,
        on_round=on_round), n, oracle, seed=1234)
    assert hist[0] > 0 and hist[NEW - 1] > 0 and branch_steps(rounds) > 0, hist
    assert_follows_the_joint(probs, counts, n)
