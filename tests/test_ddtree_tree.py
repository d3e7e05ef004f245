"""Spec: DDTree's tree (tinydiff/ddtree.py: build_tree, compile_tree, follow_tree). The heap returns
exactly the highest-scoring prefixes (against brute-force enumeration), as a tree (ancestor-closed,
siblings distinct, min(budget, prefixes) nodes); the visibility matrix is exactly the
reflexive-transitive closure of the parent relation and every node sees the whole prefix; following
the tree walks while a child carries the target's sample; bad trees are clear errors.
"""
import itertools

import pytest
import torch
from tree_paths import children, prefix_of

from tinydiff.ddtree import build_tree, compile_tree, follow_tree
from tinydiff.errors import UserError
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
        everything = {}
        for d in range(1, D + 1):
            for prefix in itertools.product(range(V_), repeat=d):
                score = 0.0
                for depth, token in enumerate(prefix):
                    score += logp[depth][token]
                everything[prefix] = score
        ranked = sorted(everything, key=everything.get, reverse=True)
        n = min(budget, len(everything))
        assert len(set(everything[p] for p in ranked[:n + 1])) == min(n + 1, len(ranked))  # no ties near the cut

        tree = build_tree(logits, budget)
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
    assert min(shapes_seen.values()) > 0, shapes_seen


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
