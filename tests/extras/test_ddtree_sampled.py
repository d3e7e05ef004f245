"""Spec: DDTree with sampled children, judged by recursive rejection sampling (tinydiff/extras/ddtree_sampled.py).

Children are draws without replacement from q (the pairs' exact law, chi-square); one node's walk
commits a token of p's law for any q, even a q that misses ids p needs or proposes ids p rules out
(chi-square); the tree's shape reads ranks only, never the tokens drawn, and is the `budget` best
prefixes under the rank rates; the rank counts are what the walks tested; the whole loop follows the
target's exact joint (chi-square, with branch acceptances seen) with and without a Markov head; at
T = 0 it is ddtree_generate; bad input is a clear error.
"""
import itertools
import math

import pytest
import torch
from stats_helpers import (
    DFLASH_DIST_CONFIG,
    NEW,
    PROMPT,
    assert_follows_the_joint,
    assert_same,
    exact_joint,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
    sample_counts,
)
from table_models import TreeTableTarget
from tree_paths import children

from tinydiff.checks import UserError
from tinydiff.ddtree import ddtree_generate
from tinydiff.extras.ddtree_sampled import (
    RankAcceptance,
    build_sampled_tree,
    ddtree_sampled_generate,
    draws_without_replacement,
    fill,
    follow_sampled_tree,
    node_distributions,
    rank_shape,
)
from tinydiff.extras.markov_head import MarkovHead
from tinydiff.model import ModelConfig
from tinydiff.sampling import next_token_probs

P = torch.tensor([0.11, 0.11, 0.105, 0.105, 0.1, 0.1, 0.1, 0.095, 0.095, 0.08, 0.0], dtype=torch.float64)
# the target at one node: flat over 10 ids (its heaviest 0.11), so that 11,500 walks reach the power
Q_CASES = {  # the drafter's q at that node: each one stresses the residual differently
    "close to p": torch.tensor([0.13, 0.09, 0.12, 0.09, 0.1, 0.08, 0.1, 0.1, 0.09, 0.07, 0.03], dtype=torch.float64),
    "misses ids p needs": torch.tensor([0, 0, 0, 0, 0.3, 0.2, 0.2, 0.1, 0.1, 0.1, 0], dtype=torch.float64),
    "sure of an id p rules out": torch.tensor([0.01] * 10 + [0.9], dtype=torch.float64),
}


def test_draws_are_a_sample_without_replacement():
    """The first two draws' joint is q(a) q(b) / (1 - q(a)) (chi-square, significance 1e-3, power
    asserted); draws never repeat, never take an id of q = 0, and stop at q's support."""
    q = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    n, counts = 20_000, torch.zeros(36, dtype=torch.long)
    for _ in range(n):
        a, b = draws_without_replacement(q, 2, g)
        counts[a * 6 + b] += 1
    joint = torch.tensor([0.0 if a == b else float(q[a] * q[b] / (1 - q[a]))
                          for a, b in itertools.product(range(6), repeat=2)], dtype=torch.float64)
    assert_follows_the_joint(joint, counts, n)
    for _ in range(50):
        draws = draws_without_replacement(Q_CASES["misses ids p needs"], 11, g)
        assert sorted(draws) == [4, 5, 6, 7, 8, 9]  # the whole support, once each


def one_node_tree(q, n_children, generator):
    """The root and n_children depth-1 children drawn from q."""
    return fill(rank_shape([math.log(0.5)] * n_children, 1, n_children), lambda depth, token: q, generator)


@pytest.mark.parametrize("case", Q_CASES)
def test_one_node_commits_a_token_of_the_targets_law_for_any_q(case, n_children=3):
    """The walk's first committed token (the accepted child's, else the bonus) follows p: chi-square,
    significance 1e-3, power asserted. p's zero id never comes out; bonuses are seen, and acceptances of
    later children (ranks > 0) where q lets a residual reach them."""
    q, g = Q_CASES[case], torch.Generator().manual_seed(1)
    n, counts, ranks = 11_500, torch.zeros(len(P), dtype=torch.long), [0] * (n_children + 1)
    for _ in range(n):
        tree = one_node_tree(q, n_children, g)
        path, bonus = follow_sampled_tree(tree, lambda node: P, lambda depth, token: q, g)
        counts[int(tree.tokens[path[0]]) if path else bonus] += 1
        ranks[path[0] - 1 if path else n_children] += 1  # children are nodes 1..n in draw order
    assert_follows_the_joint(P, counts, n)
    assert ranks[-1] > 0, ranks
    if case != "misses ids p needs":  # there, after one rejection R lives where q is 0
        assert sum(ranks[1:-1]) > 0, ranks


def test_the_shape_reads_ranks_never_tokens():
    """Two trees from different draws (and a Markov-like q that depends on the parent's token) have
    the same parents and depths; that shape holds exactly the `budget` best rank sequences under the
    products of the rates (brute force), each node's score the sum of its ranks' log rates."""
    rates = [0.6, 0.2, 0.1]

    def q(depth, token):  # depends on the parent's token, as a Markov head's does
        return torch.softmax(torch.arange(6.0, dtype=torch.float64) * (token % 3 - 1), -1)
    for budget, depth in ((1, 3), (5, 2), (12, 4), (40, 3)):
        trees = [build_sampled_tree(q, [math.log(r) for r in rates], depth, budget, torch.Generator().manual_seed(s))
                 for s in (0, 1)]
        assert torch.equal(trees[0].parents, trees[1].parents) and torch.equal(trees[0].depths, trees[1].depths)
        tree = trees[0]
        rank_paths = {0: ()}  # node -> its ranks from the root
        for i in range(1, tree.size + 1):
            parent = int(tree.parents[i])
            rank_paths[i] = rank_paths[parent] + (children(tree, parent).index(i),)
        every = [r for d in range(1, depth + 1) for r in itertools.product(range(len(rates)), repeat=d)]
        score = {r: sum(math.log(rates[k]) for k in r) for r in every}
        best = sorted(every, key=lambda r: -score[r])
        chosen = sorted(score[r] for r in list(rank_paths.values())[1:])
        assert tree.size == min(budget, len(every))
        assert chosen == pytest.approx(sorted(score[r] for r in best[:tree.size]), abs=1e-12)
        for i in range(1, tree.size + 1):
            assert float(tree.scores[i]) == pytest.approx(score[rank_paths[i]], abs=1e-12)
            assert len({int(tree.tokens[c]) for c in children(tree, i)}) == len(children(tree, i))  # distinct draws


def test_children_past_qs_support_are_dropped_with_their_subtrees():
    """Where q gives fewer ids than the shape has children, the tree keeps one child per id (the
    whole support) and drops the rest with everything under them; what remains is a tree: parents
    first, visibility exactly each node's ancestors and itself."""
    two = torch.tensor([0.0, 0.7, 0.0, 0.3, 0.0, 0.0], dtype=torch.float64)
    log_rates = [math.log(0.4), math.log(0.3), math.log(0.2)]
    shape = build_sampled_tree(lambda depth, token: Q_CASES["close to p"], log_rates, 3, 20, torch.Generator())
    tree = build_sampled_tree(lambda depth, token: two, log_rates, 3, 20, torch.Generator().manual_seed(0))
    assert len(children(shape, 0)) == 3 and tree.size < shape.size
    assert sorted(int(tree.tokens[c]) for c in children(tree, 0)) == [1, 3]
    for node in range(tree.size + 1):
        kids = [int(tree.tokens[c]) for c in children(tree, node)]
        assert len(set(kids)) == len(kids) and set(kids) <= {1, 3}
        assert int(tree.parents[node]) < node and tree.path(node) == [i for i in range(1, tree.size + 1)
                                                                       if bool(tree.visibility[node, i])]


def test_a_nodes_q_is_its_depths_row_biased_by_its_own_token():
    """node_distributions: the warped row of the node's depth plus the head's bias of the node's token
    (the root's: root_token); without a head, or with a zero one, the depth's row alone."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 7, generator=g, dtype=torch.float64)
    warp_args = (0.8, None, None)
    for depth, token, previous in ((0, -1, 5), (1, 3, 3), (2, 0, 0)):
        head = MarkovHead(7, 2).double()
        q = node_distributions(logits, head, 5, warp_args)
        biased = logits[depth] + head(torch.tensor(previous)).detach()
        assert torch.equal(q(depth, token), next_token_probs(biased, *warp_args))
        plain = node_distributions(logits, None, 5, warp_args)(depth, token)
        assert torch.equal(plain, next_token_probs(logits[depth], *warp_args))
        assert_same(node_distributions(logits, head.zero_(), 5, warp_args)(depth, token), plain)


def test_rank_counts_are_what_the_walk_tested():
    """A hand-made walk: the root tests children 1 and 2 and accepts 2; that child tests its first
    child and accepts it; the leaf tests nothing. The rates start flat (1/2, 1/4, ..) and sum under 1."""
    acceptance = RankAcceptance(3)
    assert acceptance.log_rates() == pytest.approx([math.log(0.5), math.log(0.25), math.log(0.125)], abs=1e-15)
    tree = one_node_tree(Q_CASES["close to p"], 3, torch.Generator().manual_seed(0))
    grown = build_sampled_tree(lambda depth, token: Q_CASES["close to p"], [math.log(0.3), math.log(0.6)], 2, 4,
                               torch.Generator().manual_seed(0))  # rank 1 beats rank 0: root's 2nd child has kids
    second = children(grown, 0)[1]
    assert children(grown, second)  # the walk below needs a grandchild on the second branch
    acceptance.update(grown, [second, children(grown, second)[0]])
    assert acceptance.tested == [2, 1, 0] and acceptance.accepted == [1, 1, 0]
    acceptance.update(tree, [])  # all three rejected
    assert acceptance.tested == [3, 2, 1] and acceptance.accepted == [1, 1, 0]
    rates = [math.exp(a) for a in acceptance.log_rates()]
    # b = (accepted + 1) / (tested + 2) = 2/5, 2/4, 1/3; a_k = b_k times the chance ranks before k all failed
    assert rates == pytest.approx([2 / 5, 3 / 5 * 1 / 2, 3 / 5 * 1 / 2 * 1 / 3], abs=1e-15) and sum(rates) < 1


def test_rank_rates_past_a_floats_range_still_order_a_tree():
    """Under the flat prior a_k = 2^-(k+1): past rank 1,074 that is below the smallest float, so the rates are
    kept in logs; a 2,000-rank tree still holds its ranks in order, each node's score its exact log rate."""
    log_rates = RankAcceptance(2000).log_rates()
    assert log_rates == pytest.approx([-(k + 1) * math.log(2) for k in range(2000)], rel=1e-12)
    tree = rank_shape(log_rates, 1, 2000)
    assert tree.size == 2000 and tree.tokens[1:].tolist() == list(range(2000))
    assert tree.scores[1:].tolist() == pytest.approx(log_rates, rel=1e-12)


# ---------------------------------------------------------------- the loop: test_ddtree's design
@torch.no_grad()
def test_sampled_tokens_follow_the_exact_target_distribution():
    """test_ddtree's chi-square (significance 1e-3, power asserted) of seeded generations against the
    enumerated joint, for a random drafter with a Markov head (each node's q reads its own token) at
    T = 1 (q with a smaller support than p: the one-node test above). It must see rejections at the root, full-depth acceptances and acceptances on a
    branch (a node that is not its parent's first child), or it proves nothing about them. (One case:
    a drafter without a head reads the same q for every node of a depth, a special case of this one.)"""
    temperature, top_k, top_p, budget, n, markov_rank = 1.0, None, None, 4, 5_500, 3
    model = random_model(DFLASH_DIST_CONFIG, seed=1, embed_std=0.1)
    drafter = random_drafter(model, seed=5, block_size=4, markov_rank=markov_rank)
    drafter.register_forward_hook(lambda module, args, logits: logits * 4)  # as test_ddtree: trees grow deep
    probs = exact_joint(model, temperature, top_k, top_p)
    target, branch_steps = TreeTableTarget(model, drafter.config.taps), [0]

    def on_round(info):
        tree = info["tree"]
        branch_steps[0] += sum(min(children(tree, int(tree.parents[i]))) != i for i in info["path"])
    counts, hist = sample_counts(lambda generator: ddtree_sampled_generate(
        target, drafter, PROMPT, NEW, None, budget, temperature, top_k, top_p, generator, stop_token=None,
        on_round=on_round), n, None, seed=4321)
    assert hist[0] > 0 and hist[NEW - 1] > 0 and branch_steps[0] > 0, (hist, branch_steps)
    assert_follows_the_joint(probs, counts, n)


@torch.no_grad()
def test_temperature_zero_is_ddtree_generate():
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=5)
    drafter = random_drafter(target, seed=6, block_size=8, n_features=1, std=0.3)
    for budget in (3, 16):
        ours = ddtree_sampled_generate(target, drafter, [1, 2, 3], 30, budget=budget, temperature=0, stop_token=None)
        theirs = ddtree_generate(target, drafter, [1, 2, 3], 30, budget=budget, temperature=0, stop_token=None)
        assert ours[0] == theirs[0] and ours[1].accepted == theirs[1].accepted


def test_bad_input_is_a_clear_error():
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=5)
    drafter = random_drafter(target, seed=6, block_size=4, n_features=1)
    q = Q_CASES["close to p"]
    with pytest.raises(UserError, match="budget"):
        build_sampled_tree(lambda depth, token: q, [math.log(0.5)], 2, 0)
    with pytest.raises(UserError, match="acceptance must be a RankAcceptance"):
        ddtree_sampled_generate(target, drafter, [1, 2], 4, temperature=1.0, acceptance=[0.5])
    with pytest.raises(UserError, match="temperature"):
        ddtree_sampled_generate(target, drafter, [1, 2], 4, temperature=-1.0)
