"""Spec: fused_ddtree.py's round (the tree built, verified, followed and compacted in one graph) decides
exactly what ddtree_generate decides. `build_tree_static` is ddtree.build_tree node for node (tokens,
depths, parents, visibility) for any logits, ties and exhausted candidates included, at every depth
limit; the fused loop, run here uncompiled (compile=False: the same functions, eagerly;
tests/test_compiled.py runs it compiled), commits ddtree_generate's tokens from the same seeds at every
warp, with the same counts and the same cache rows after every round, deep paths included (an oracle
drafter), after a one-token prompt and up to the context's end, stops where it stops, and refuses what
it refuses. The models are float64: two paths differ by float64 rounding only."""
import pytest
import torch
from stats_helpers import (
    float64,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
    recorded_with_caches,
)
from table_models import TreeOracle

from tinydiff.checks import UserError
from tinydiff.ddtree import build_tree, ddtree_generate
from tinydiff.fast.compiled import StaticDrafter, StaticModel
from tinydiff.fast.fused_ddtree import FusedDDTree, build_tree_static, fused_ddtree_generate
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import MASK

PROMPT, NEW, B, BUDGET = [3, 1, 4, 1, 5], 20, 4, 6
WARPS = [(0.0, None, None), (1.0, None, None), (0.8, 5, None), (1.3, None, 0.9)]


def fused(target, drafter, budget=BUDGET):
    """FusedDDTree on uncompiled wrappers: the graph's functions run eagerly."""
    return FusedDDTree(StaticModel(target, (), compile=False), StaticDrafter(drafter, (), compile=False), budget,
                       compile=False)


@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=0)
    plain = random_drafter(target, seed=2, n_layer=1, block_size=B, n_features=1)
    # Drafts from the target itself (a hook on the drafter), sure of them, a decoy ranked first at every
    # seventh position: paths down to the block's depth.
    knowing = random_drafter(target, seed=5, n_layer=1, block_size=B, n_features=1)
    target, plain, knowing = float64(target, plain, knowing)
    return target, plain, TreeOracle(knowing, target, wrong=lambda position: position % 7 == 0)


@pytest.mark.parametrize("V", [3, 5, 40, MASK + 1])
def test_the_static_build_is_build_tree_node_for_node(V):
    """Random logits, some rows with tied values (the heap's push order breaks ties), a vocabulary too
    small for the budget (the search runs out: the rest are invalid nodes), MASK never drafted."""
    g = torch.Generator().manual_seed(V)
    D = 5
    for trial in range(40 if V < MASK else 4):
        logits = torch.randn(D, V, generator=g, dtype=torch.float64)
        if trial % 3 == 0:  # ties: whole rows of one value, and one row copied
            logits[1] = 0.5
            logits[3] = logits[2]
        if V > MASK:
            logits[:, MASK] = 30.0  # the likeliest id, never drafted
        budget, depth = 1 + trial % 9, trial % (D + 1)
        tree = build_tree(logits[:depth], budget)
        tokens, depths, parents, valid, visibility = build_tree_static(logits, budget, torch.tensor(depth))
        n = tree.size + 1
        assert valid.tolist() == [True] * n + [False] * (budget + 1 - n)
        assert tokens[1:n].tolist() == tree.tokens[1:].tolist() and depths[:n].tolist() == tree.depths.tolist()
        assert parents[1:n].tolist() == tree.parents[1:].tolist()
        assert torch.equal(visibility[:n, :n], tree.visibility)
        assert torch.equal(visibility[n:], torch.eye(budget + 1, dtype=torch.bool)[n:])  # invalid: seen by none
        assert MASK not in tokens[1:n].tolist()


@pytest.mark.parametrize("budget", [2, BUDGET, 12])
@pytest.mark.parametrize("drafter", ["plain", "oracle"])
def test_the_fused_round_commits_ddtree_generates_tokens_counts_and_caches(models, drafter, budget):
    target, plain, oracle = models
    drafter, oracle = (plain, None) if drafter == "plain" else (oracle.drafter, oracle)
    deepest = 0
    for warp in WARPS:
        for seed in range(2):
            common = {"generator": torch.Generator().manual_seed(seed), "stop_token": None, "oracle": oracle,
                      "prompt": PROMPT}
            ours, ours_result, ours_rounds = recorded_with_caches(fused_ddtree_generate, fused(target, drafter, budget),
                                                                  PROMPT, NEW, *warp, **common)
            common["generator"] = torch.Generator().manual_seed(seed)
            theirs, result, rounds = recorded_with_caches(ddtree_generate, target, drafter, PROMPT, NEW, None, budget,
                                                          *warp, **common)
            assert ours == theirs and len(ours) == NEW
            assert ours_result.accepted == result.accepted and ours_result.proposed == result.proposed
            assert ours_result.slot_judged == result.slot_judged and ours_result.slot_kept == result.slot_kept
            assert ours_result.forwards == result.forwards and ours_result.draft_forwards == result.draft_forwards
            assert ours_result.draft_seconds is None  # a fused round has no stages to clock
            assert 0 < ours_result.graph_seconds < ours_result.seconds  # its graphs' calls, inside the timed loop
            for (_, n, tokens, caches), (_, m, their_tokens, reference) in zip(ours_rounds, rounds, strict=True):
                assert (n, tokens) == (m, their_tokens)
                for (length, rows), (reference_length, reference_rows) in zip(caches, reference):
                    assert length == reference_length
                    for a, b in zip(rows, reference_rows):
                        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
            deepest = max(deepest, max(n for _, n, _, _ in ours_rounds))
    assert deepest == min(B - 1, budget) or oracle is None  # with the oracle, paths as deep as a tree may reach


def test_the_fused_loop_stops_and_reaches_the_context_where_the_eager_loop_does(models, monkeypatch):
    """A stop token, a one-token prompt (no prefill), and stories that fill the context, whose last rounds
    have no room for the graph's rows and run the eager pieces. (The plain drafter: the oracle's hook
    sees only module calls, and the wrappers' eager rounds call the drafter's forward.)"""
    target, drafter, _ = models
    ours = fused(target, drafter)
    graph_rounds, run_round = [], ours.run_round
    monkeypatch.setattr(ours, "run_round", lambda *a: graph_rounds.append(1) or run_round(*a))
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    story = ddtree_generate(target, drafter, PROMPT, NEW, None, BUDGET, 1.0, generator=g(), stop_token=None)[0]
    stop = story[NEW // 2]
    stopped = fused_ddtree_generate(ours, PROMPT, NEW, 1.0, generator=g(), stop_token=stop)[0]
    assert stopped == ddtree_generate(target, drafter, PROMPT, NEW, None, BUDGET, 1.0, generator=g(),
                                      stop_token=stop)[0] == story[:story.index(stop) + 1]
    eager_rounds = 0
    for prompt, new in (([7], NEW), (PROMPT, target.config.context - len(PROMPT))):
        for temperature in (0.0, 1.0):
            graph_rounds.clear()
            out, result = fused_ddtree_generate(ours, prompt, new, temperature, generator=g(), stop_token=None)
            theirs, their_result = ddtree_generate(target, drafter, prompt, new, None, BUDGET, temperature,
                                                   generator=g(), stop_token=None)
            assert out == theirs and len(out) == new and result.accepted == their_result.accepted
            eager_rounds += result.rounds - len(graph_rounds)
    assert eager_rounds > 0  # the context's end was reached inside a round


def test_bad_input_is_a_one_line_error(models):
    target, drafter, _ = models
    ours = fused(target, drafter)
    for prompt, n, kwargs, message in (([], 4, {}, "empty"), (PROMPT, 4, {"temperature": -1.0}, "temperature"),
                                       (PROMPT, 1000, {}, "max new tokens"), ([1, MASK], 4, {}, "MASK")):
        with pytest.raises(UserError, match=message):
            fused_ddtree_generate(ours, prompt, n, **kwargs)
    with pytest.raises(UserError, match="StaticModel"):
        FusedDDTree(target, StaticDrafter(drafter, (), compile=False), compile=False)
    with pytest.raises(UserError, match="budget"):
        fused(target, drafter, budget=0)
    markov = random_drafter(target, seed=3, n_layer=1, block_size=B, n_features=1, markov_rank=2)
    with pytest.raises(UserError, match="Markov head"):
        fused(target, markov)
