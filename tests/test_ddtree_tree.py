"""Spec: DDTree's tree (tinydiff/ddtree.py: build_tree, compile_tree, follow_tree; the Markov head's trees:
tinydiff/extras/markov_head.py's build_markov_tree).
The heap returns exactly the highest-scoring prefixes (against brute-force enumeration, with and
without DSpark's Markov bias; a zero head gives the plain tree), as a tree (ancestor-closed,
siblings distinct, min(budget, prefixes) nodes); the visibility matrix is exactly the
reflexive-transitive closure of the parent relation and every node sees the whole prefix; following
the tree walks while a child carries the target's sample; bad trees are clear errors.
"""
import itertools

import pytest
import torch
from tree_paths import children, prefix_of

from tinydiff.checks import UserError
from tinydiff.ddtree import build_tree, compile_tree, follow_tree
from tinydiff.extras.markov_head import MarkovHead, build_markov_tree
from tinydiff.tokenizer import MASK


def test_heap_returns_exactly_the_best_prefixes_as_a_tree():
    """Against brute force: every prefix of length 1..D over V tokens, scored by its per-depth
    float32 log-softmax values summed in order, sorted; the tree's prefixes are exactly the first
    min(budget, sum V^d) of them (random logits: no ties), each node's score is its prefix's."""
    g = torch.Generator().manual_seed(0)
    shapes_seen = {"deep": 0, "branching": 0}
    for V_, D, budget in itertools.product((2, 3, 5), (1, 2, 4), (1, 2, 7, 20, 400)):
        logits = torch.randn(D, V_, generator=g) * 2
        logp = torch.log_softmax(logits.float(), -1).tolist()
        everything = all_prefixes(V_, D, lambda depth, previous, token: logp[depth][token])
        tree = build_tree(logits, budget)
        assert_the_best_prefixes(tree, everything, budget, shapes_seen)
    assert min(shapes_seen.values()) > 0, shapes_seen


def test_markov_tree_returns_exactly_the_best_prefixes_under_the_bias():
    """The same brute force with DSpark's Markov head: a token's log-prob at depth d is read from
    log_softmax(logits_d + head(the token before it)), the root's token before depth 1. float64 on
    both sides, the same operations: scores equal exactly. The bias must change some trees."""
    g = torch.Generator().manual_seed(3)
    shapes_seen, changed, root = {"deep": 0, "branching": 0}, 0, 1
    for V_, D, budget in itertools.product((3, 5), (1, 3), (2, 7, 40)):
        head = MarkovHead(V_, 2).double()
        with torch.no_grad():
            for weight in head.parameters():
                weight.copy_(torch.randn(weight.shape, generator=g, dtype=torch.float64))
        logits = torch.randn(D, V_, generator=g, dtype=torch.float64) * 2

        def logp(depth, previous, token):
            return float(torch.log_softmax(logits[depth] + head(torch.tensor(previous)).detach(), -1)[token])
        tree = build_markov_tree(logits, head, root, budget)
        assert_the_best_prefixes(tree, all_prefixes(V_, D, logp, root), budget, shapes_seen)
        changed += tree_items(tree) != tree_items(build_tree(logits, budget))
    assert min(shapes_seen.values()) > 0 and changed > 0, (shapes_seen, changed)


def test_a_markov_tree_with_a_zero_head_is_the_plain_tree():
    g = torch.Generator().manual_seed(4)
    head = MarkovHead(MASK + 1, 3).zero_()
    for D, budget in ((1, 5), (4, 32), (6, 60)):
        logits = torch.randn(D, MASK + 1, generator=g) * 3
        assert tree_items(build_markov_tree(logits, head, 464, budget)) == tree_items(build_tree(logits, budget))
    assert build_markov_tree(torch.empty(0, 7), MarkovHead(7, 2), 3, 4).size == 0  # no depth: the root alone
    with pytest.raises(UserError, match="budget"):
        build_markov_tree(torch.randn(2, 7), MarkovHead(7, 2), 3, 0)


def tree_items(tree):
    return [t.tolist() for t in (tree.tokens, tree.depths, tree.parents, tree.scores, tree.visibility)]


def all_prefixes(V_, D, logp, root=-1) -> dict:
    """Every prefix of length 1..D -> its score, logp(depth, previous token, token) summed in order."""
    everything = {}
    for d in range(1, D + 1):
        for prefix in itertools.product(range(V_), repeat=d):
            score, previous = 0.0, root
            for depth, token in enumerate(prefix):
                score += logp(depth, previous, token)
                previous = token
            everything[prefix] = score
    return everything


def assert_the_best_prefixes(tree, everything: dict, budget: int, shapes_seen: dict):
    ranked = sorted(everything, key=everything.get, reverse=True)
    n = min(budget, len(everything))
    assert len(set(everything[p] for p in ranked[:n + 1])) == min(n + 1, len(ranked))  # no ties near the cut
    assert tree.size == n
    prefixes = [prefix_of(tree, i) for i in range(1, n + 1)]
    assert set(prefixes) == set(ranked[:n])
    assert [float(tree.scores[i]) for i in range(1, n + 1)] == [everything[p] for p in prefixes]
    assert int(tree.parents[0]) == -1 and int(tree.depths[0]) == 0 and float(tree.scores[0]) == 0
    for i in range(1, n + 1):  # ancestor-closed: the parent holds the prefix minus its last token
        parent = int(tree.parents[i])
        assert 0 <= parent < i and int(tree.depths[i]) == int(tree.depths[parent]) + 1
        assert prefixes[i - 1][:-1] == (prefix_of(tree, parent) if parent else ())
    for node in range(n + 1):  # a node's children carry distinct tokens
        tokens = [int(tree.tokens[c]) for c in children(tree, node)]
        assert len(tokens) == len(set(tokens))
        shapes_seen["branching"] += len(tokens) >= 2 and node > 0
    shapes_seen["deep"] += int(tree.depths.max()) >= 3


def test_visibility_is_the_ancestor_closure_and_the_mask_shows_the_whole_prefix():
    g = torch.Generator().manual_seed(1)
    for D, budget in ((3, 12), (5, 30), (1, 4)):
        tree = build_tree(torch.randn(D, 4, generator=g) * 2, budget)
        n = tree.size + 1
        step = torch.zeros(n, n, dtype=torch.bool)  # step[i, j]: j is i's parent
        for i in range(1, n):
            step[i, int(tree.parents[i])] = True
        closure = torch.eye(n, dtype=torch.bool)  # reflexive ...
        for _ in range(n):  # ... and transitive: add one more generation up each time
            closure = closure | (closure.int() @ step.int()).bool()
        assert torch.equal(tree.visibility, closure)
        for i, j in itertools.permutations(range(1, n), 2):
            if tree.parents[i] == tree.parents[j]:
                assert not tree.visibility[i, j]  # siblings never see each other
        for start in (0, 7):
            ids, pos, mask = compile_tree(tree, start, 42)
            assert ids.shape == (1, n) and int(ids[0, 0]) == 42 and torch.equal(ids[0, 1:], tree.tokens[1:])
            assert torch.equal(pos, start + tree.depths)
            assert mask.shape == (n, start + n) and mask[:, :start].all()
            assert torch.equal(mask[:, start:], tree.visibility)


def test_build_tree_edge_cases():
    logits = torch.randn(2, MASK + 1, generator=torch.Generator().manual_seed(2))
    logits[:, MASK] = 100.0  # the drafter loves MASK: it must still never be drafted
    logits[:, 7] = float("-inf")  # probability 0: never a node
    tree = build_tree(logits, 50)
    assert tree.size == 50 and MASK not in tree.tokens.tolist() and 7 not in tree.tokens.tolist()
    assert build_tree(torch.randn(2, 3), 100).size == 3 + 9  # every prefix
    tiny = torch.full((2, 3), float("-inf"))
    tiny[:, 1] = 0.0  # one possible token per depth: a chain of 2, however large the budget
    assert build_tree(tiny, 10).tokens.tolist() == [-1, 1, 1]
    root = build_tree(torch.empty(0, 5), 3)
    assert root.size == 0 and root.visibility.tolist() == [[True]]
    for budget in (0, 2.5, True):
        with pytest.raises(UserError, match="budget"):
            build_tree(torch.randn(2, 3), budget)
    with pytest.raises(UserError, match="shape"):
        build_tree(torch.randn(3), 4)


def test_follow_tree_walks_while_a_child_carries_the_sample():
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 1.0, 0.0]])
    tree = build_tree(logits, 4)  # heap order: (0,) -0.35, (0, 0) -0.52, (1,) -1.35, (1, 0) -1.52
    assert [prefix_of(tree, i) for i in range(1, 5)] == [(0,), (0, 0), (1,), (1, 0)]
    cases = {  # target samples at [root, 1:(0,), 2:(0, 0), 3:(1,), 4:(1, 0)] -> (path, bonus)
        (2, 9, 9, 9, 9): ([], 2), (0, 2, 9, 9, 9): ([1], 2), (0, 1, 9, 9, 9): ([1], 1),
        (0, 0, 5, 9, 9): ([1, 2], 5), (1, 9, 9, 0, 9): ([3, 4], 9), (1, 9, 9, 1, 9): ([3], 1)}
    for samples, expected in cases.items():
        assert follow_tree(tree, torch.tensor(samples)) == expected
        one_hot = torch.nn.functional.one_hot(torch.tensor(samples), 10).float()
        assert follow_tree(tree, one_hot) == expected == follow_tree(tree, lambda i: one_hot[i])
    with pytest.raises(UserError, match="root and all 4 nodes"):
        follow_tree(tree, torch.tensor([0, 0]))
