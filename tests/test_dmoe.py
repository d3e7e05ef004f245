"""Spec: dMoE. Block-level coresets (checked against brute force and plain loops), token routing
inside them, the MoE layer against a dense SwiGLU, the balance term, the loss and the sampler."""
from itertools import combinations

import pytest
import torch
from stats_helpers import assert_same

from tinydiff.bench.moe_stats import moe_stats, param_counts, reset_stats
from tinydiff.checks import UserError
from tinydiff.dmoe import (
    MoEConfig,
    MoEFeedForward,
    MoETransformer,
    balance_loss,
    block_mass,
    block_routing,
    mdlm_moe_loss,
    moe_config,
    moe_layers,
    route,
    set_routing,
    switch_balance,
    unique_experts,
)
from tinydiff.model import FeedForward, ModelConfig, Transformer, preset
from tinydiff.sampler import generate, generate_cached
from tinydiff.tokenizer import MASK


def random_scores(B, T, E, seed, sharp=3.0):
    g = torch.Generator().manual_seed(seed)
    return (sharp * torch.randn(B, T, E, generator=g)).softmax(-1)


def blocks_of(T, block_size):
    """Routing blocks counted back from the end, where the sampler's canvas blocks end."""
    return [range(max(0, hi - block_size), hi) for hi in range(T, 0, -block_size)][::-1]


def loop_mass(scores, b, block, top_k):
    """A block's distribution, one token at a time: its own top-k scores added in, then normalised."""
    mass = torch.zeros(scores.shape[-1], dtype=torch.float64)
    for t in block:
        for e in scores[b, t].topk(top_k).indices.tolist():
            mass[e] += float(scores[b, t, e])
    return mass / mass.sum()


def topk_sets(scores, b, block, top_k):
    return [set(scores[b, t].topk(top_k).indices.tolist()) for t in block]


CASES = [(E, k, bs, thr, guard) for E, k in [(8, 2), (16, 3)] for bs in (4, 7)
         for thr in (0.3, 0.6, 0.9, 1.0) for guard in sorted({1, k, k + 2})]


@pytest.mark.parametrize("E, k, bs, thr, guard", CASES)
def test_coreset_properties(E, k, bs, thr, guard):
    scores = random_scores(3, 13, E, seed=E * 100 + bs)  # 13: the last block is shorter
    coreset = block_routing(scores, k, bs, thr, guard)
    assert coreset.shape == (3, len(blocks_of(13, bs)), E) and coreset.dtype == torch.bool
    for b in range(3):
        for j, block in enumerate(blocks_of(13, bs)):
            chosen = set(coreset[b, j].nonzero().flatten().tolist())
            union = set().union(*topk_sets(scores, b, block, k))
            mass = loop_mass(scores, b, block, k)
            assert len(chosen) >= guard
            if guard <= k:  # the union holds >= k experts, so the guard needs none from outside it
                assert chosen <= union
            else:
                assert chosen <= union or union < chosen
            # The guard only adds experts, so the mass reaches the threshold in every case.
            assert mass[list(chosen)].sum() >= thr - 1e-6
            # A descending prefix: no expert left out outweighs one inside.
            outside = [mass[e] for e in range(E) if e not in chosen]
            assert not outside or max(outside) <= min(mass[e] for e in chosen)


@pytest.mark.parametrize("thr", [0.2, 0.5, 0.6, 0.75, 0.95])
@pytest.mark.parametrize("guard", [1, 2, 4])
def test_coreset_is_the_smallest_set_reaching_the_threshold(thr, guard):
    E, k, bs = 6, 2, 5
    scores = random_scores(4, 10, E, seed=int(thr * 100) + guard, sharp=1.5)
    coreset = block_routing(scores, k, bs, thr, guard)
    for b in range(4):
        for j, block in enumerate(blocks_of(10, bs)):
            mass = loop_mass(scores, b, block, k)
            smallest = min(n for n in range(1, E + 1)
                           for subset in combinations(range(E), n) if mass[list(subset)].sum() >= thr - 1e-9)
            assert int(coreset[b, j].sum()) == max(smallest, guard)


def test_reaching_the_threshold_exactly_stops_the_coreset():
    scores = torch.tensor([[[0.5, 0.25, 0.125, 0.125]]])  # one token, top_k = E: the mass is the scores
    members = lambda thr: block_routing(scores, 4, 4, thr, 1)[0, 0].nonzero().flatten().tolist()
    assert members(0.5) == [0] and members(0.75) == [0, 1] and members(0.7) == [0, 1]
    assert members(0.1) == [0] and members(1.0) == [0, 1, 2, 3]


def test_a_ragged_first_block_is_routed_on_its_own_tokens():
    scores = random_scores(2, 37, 16, seed=5)
    coreset = block_routing(scores, 3, 16, 0.6, 3)
    assert coreset.shape == (2, 3, 16)
    assert torch.equal(coreset[:, :1], block_routing(scores[:, :5], 3, 16, 0.6, 3))
    assert torch.equal(coreset[:, 1:], block_routing(scores[:, 5:], 3, 16, 0.6, 3))


def test_tokens_choose_their_top_k_inside_their_blocks_coreset():
    scores = random_scores(2, 21, 12, seed=7)
    coreset = block_routing(scores, 3, 8, 0.5, 3)
    weights, experts = route(scores, 3, coreset, 8)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 21))
    for b in range(2):
        for t in range(21):
            allowed = coreset[b, (t + 3) // 8].nonzero().flatten().tolist()  # 21 + 3: whole blocks
            best = sorted(allowed, key=lambda e: -float(scores[b, t, e]))[:3]
            assert sorted(experts[b, t].tolist()) == sorted(best)
            assert torch.allclose(weights[b, t], scores[b, t, experts[b, t]] / scores[b, t, best].sum())


def test_a_vote_of_n_counts_as_n_copies_of_the_token():
    """An integer vote adds the token's top-k scores in that many times: the block's mass and its
    coresets are those of a block that holds that many copies of the token."""
    scores = random_scores(1, 6, 8, seed=11, sharp=1.5)
    votes = torch.tensor([[1.0, 1.0, 3.0, 1.0, 2.0, 1.0]])
    copies = scores[:, [0, 1, 2, 2, 2, 3, 4, 4, 5]]  # (1, 9, 8)
    torch.testing.assert_close(block_mass(scores, 2, 6, votes), block_mass(copies, 2, 9))
    thresholds = [i / 20 for i in range(1, 21)]
    for thr in thresholds:
        assert torch.equal(block_routing(scores, 2, 6, thr, 1, votes), block_routing(copies, 2, 9, thr, 1))
    assert any(not torch.equal(block_routing(scores, 2, 6, thr, 1, votes), block_routing(scores, 2, 6, thr, 1))
               for thr in thresholds)  # the votes did move a coreset
    same = torch.full((1, 6), 5.0)  # everyone's vote scaled alike: the paper's rule
    torch.testing.assert_close(block_mass(scores, 2, 3, same), block_mass(scores, 2, 3))


@torch.no_grad()
def test_mask_votes_reach_every_layer_and_spare_blocks_without_masks():
    model = tiny_moe(routing="block", route_threshold=0.5, route_mask_vote=6.0)
    for layer in moe_layers(model):
        torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(3))  # 3 routing blocks
    x[:, 9:14] = MASK  # block 0 holds no MASK, nor does row 1's block 2
    x[0, 20] = MASK
    model(x)
    votes = torch.where(x == MASK, 6.0, 1.0)
    moved = 0
    for layer in moe_layers(model):
        scores, coreset = layer.last["scores"], layer.last["coreset"]
        assert torch.equal(coreset, block_routing(scores, 2, 8, 0.5, 2, votes))
        by_paper = block_routing(scores, 2, 8, 0.5, 2)
        assert torch.equal(coreset[:, 0], by_paper[:, 0]) and torch.equal(coreset[1, 2], by_paper[1, 2])
        moved += int((coreset != by_paper).any())
    assert moved  # the votes changed some layer's coresets


def tiny_moe(**overrides):
    torch.manual_seed(0)
    config = MoEConfig(**{"context": 64, "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64,
                          "causal": False, "n_experts": 8, "moe_top_k": 2, "route_block": 8,
                          "route_guard": 2, **overrides})
    return MoETransformer(config).eval()


@torch.no_grad()
def test_block_routing_touches_no_more_experts_than_token_routing():
    model = tiny_moe()
    x = torch.randint(0, 50257, (3, 45))  # 45: not a multiple of the routing block 8
    model(x)
    token = [unique_experts(layer.last["experts"], 8, 8) for layer in moe_layers(model)]
    for layer in moe_layers(model):  # the real router outputs of every layer, routed both ways
        scores = layer.last["scores"]
        _, by_token = route(scores, 2)
        coreset = block_routing(scores, 2, 8, 0.6, 2)
        _, by_block = route(scores, 2, coreset, 8)
        for b in range(3):
            for block in blocks_of(45, 8):
                assert set(by_block[b, block].flatten().tolist()) <= set(by_token[b, block].flatten().tolist())
    set_routing(model, "block", threshold=0.6)
    model(x)
    first = moe_layers(model)[0]  # same input as under token routing: the counts compare block by block
    unique = unique_experts(first.last["experts"], 8, 8)  # (3, n_blocks)
    assert (unique <= token[0]).all() and (unique < token[0]).any()
    for b in range(3):  # the layer's own count is the number of distinct experts its tokens used
        for j, block in enumerate(blocks_of(45, 8)):
            assert int(unique[b, j]) == len(set(first.last["experts"][b, block].flatten().tolist()))
            assert set(first.last["experts"][b, block].flatten().tolist()) <= \
                set(first.last["coreset"][b, j].nonzero().flatten().tolist())


@torch.no_grad()
@pytest.mark.parametrize("shared", [False, True])
def test_threshold_one_with_guard_E_is_token_routing(shared):
    layer = MoEFeedForward(MoEConfig(d_model=32, d_ff=64, n_experts=8, moe_top_k=2, route_block=8,
                                     route_guard=2, shared_expert=shared)).eval()
    torch.nn.init.normal_(layer.router.weight, std=1.0)
    x = torch.randn(2, 21, 32)
    by_token = layer(x)
    layer.routing, layer.threshold, layer.guard = "block", 1.0, 8
    assert torch.equal(layer(x), by_token)
    layer.threshold, layer.guard = 0.5, 2  # a real coreset: the same tokens now mix fewer experts
    assert not torch.equal(layer(x), by_token)


@torch.no_grad()
@pytest.mark.parametrize("routing", ["token", "block"])
def test_the_layer_mixes_each_tokens_experts_by_its_weights(routing):
    layer = MoEFeedForward(MoEConfig(d_model=16, d_ff=32, n_experts=6, moe_top_k=2, routing=routing,
                                     route_block=4, route_guard=2)).eval().double()  # float64: exact paths
    torch.nn.init.normal_(layer.router.weight, std=1.0)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    out = layer(x)
    weights, experts = layer.last["weights"], layer.last["experts"]
    probs = layer.router(x).softmax(-1)
    for b in range(2):
        for t in range(9):
            assert_same(weights[b, t], probs[b, t, experts[b, t]] / probs[b, t, experts[b, t]].sum())
            ref = layer.shared(x[b, t]) + sum(w * layer.experts[e](x[b, t])
                                              for w, e in zip(weights[b, t], experts[b, t].tolist()))
            assert_same(out[b, t], ref)


@torch.no_grad()
@pytest.mark.parametrize("routing", ["token", "block"])
def test_one_expert_top_1_is_a_dense_swiglu(routing):
    torch.manual_seed(1)
    dense = FeedForward(ModelConfig(d_model=32, d_ff=48))
    layer = MoEFeedForward(MoEConfig(d_model=32, d_ff=48, n_experts=1, moe_top_k=1, shared_expert=False,
                                     expert_d_ff=48, routing=routing, route_block=8, route_guard=1))
    layer.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(3, 19, 32)
    assert torch.equal(layer(x), dense(x))


def test_balance_term_is_one_for_uniform_routing_and_E_when_collapsed():
    E, T = 4, 8
    uniform = torch.full((1, T, E), 1 / E)
    spread = (torch.arange(T) % E).view(1, T, 1)  # each expert gets the same number of tokens
    assert switch_balance(uniform, spread, E).item() == pytest.approx(1.0, abs=1e-6)
    collapsed = torch.zeros(1, T, E)
    collapsed[..., 0] = 1.0
    assert switch_balance(collapsed, torch.zeros(1, T, 1, dtype=torch.long), E).item() == pytest.approx(E)
    # Through the layer: tokens that are the router's rows, so each prefers its own expert equally.
    layer = MoEFeedForward(MoEConfig(d_model=E, d_ff=8, n_experts=E, moe_top_k=1, route_guard=1))
    with torch.no_grad():
        layer.router.weight.copy_(5 * torch.eye(E))
        layer(torch.eye(E).repeat(2, 1)[None])  # (1, 2E, E)
    assert layer.balance_loss.item() == pytest.approx(1.0, abs=1e-6)


def test_mdlm_moe_loss_is_differentiable_and_adds_the_balance_term():
    model = tiny_moe().train()
    x = torch.randint(0, 50257, (2, 32))
    loss, stats = mdlm_moe_loss(model, x, torch.Generator().manual_seed(0))
    assert {"elbo", "masked_ce", "balance"} <= set(stats)
    expected = stats["elbo"] + model.config.balance_coef * balance_loss(model).detach()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert stats["balance"].item() == pytest.approx(balance_loss(model).item() / 2, rel=1e-6)
    loss.backward()
    router = moe_layers(model)[0].router.weight.grad
    assert router is not None and torch.isfinite(router).all() and router.abs().sum() > 0
    set_routing(model, "block")
    loss, _ = mdlm_moe_loss(model, x, torch.Generator().manual_seed(0))
    loss.backward()


@pytest.mark.parametrize("routing", ["token", "block"])
def test_the_sampler_runs_on_a_moe_model(routing):
    model = tiny_moe()
    set_routing(model, routing, threshold=0.6, guard=2)
    reset_stats(model)
    ids, stats = generate(model, [50256, 464, 3797], gen_length=16, steps=8, block_length=8)
    assert len(ids) == 16 and MASK not in ids
    s = moe_stats(model)
    assert s["forwards"] == stats.forwards and s["routing"] == routing
    assert 2 <= s["unique_experts_per_block"] <= 8 and 0 < s["expert_bytes_per_forward"] <= s["expert_bytes_all"]
    if routing == "block":  # the routing blocks are the canvas's blocks: positions 3-10 and 11-18
        last = moe_layers(model)[0].last
        assert last["coreset"].shape[1] == 3  # the 3 prompt tokens, then the 2 canvas blocks
        for j, lo in ((1, 3), (2, 11)):
            assert torch.equal(last["coreset"][:, j], block_routing(last["scores"][:, lo:lo + 8], 2, 8, 0.6, 2)[:, 0])
    ids2, _ = generate_cached(model, [50256, 464, 3797], gen_length=16, steps=8, block_length=8)
    assert len(ids2) == 16 and MASK not in ids2


def test_moe_presets_keep_the_dense_active_size():
    for name in ("tiny", "13m"):
        config = moe_config(name)
        assert config.expert_d_ff * (config.moe_top_k + config.shared_expert) == config.d_ff
        counts = param_counts(MoETransformer(config))
        dense = Transformer(preset(name)).num_params()
        # Active = the dense model plus the routers (D x E per layer); the idle experts are the rest.
        assert counts["active"] == dense + config.n_layer * config.d_model * config.n_experts
        assert counts["total"] > 1.5 * counts["active"]


def test_bad_settings_fail_with_a_message():
    with pytest.raises(UserError, match="guard"):
        moe_config("tiny", route_guard=2)  # below top_k = 3
    with pytest.raises(UserError, match="routing"):
        set_routing(tiny_moe(), "expert")
    with pytest.raises(UserError, match="threshold"):
        set_routing(tiny_moe(), "block", threshold=1.5)
    for vote in (0.0, -1.0, float("inf")):
        with pytest.raises(UserError, match="route_mask_vote must be a finite number > 0"):
            set_routing(tiny_moe(), "block", mask_vote=vote)
    with pytest.raises(UserError):
        block_routing(torch.rand(2, 8, 4), 2, 4, 0.0, 2)
    with pytest.raises(UserError, match="MoE"):
        balance_loss(Transformer(ModelConfig(n_layer=1, d_model=32, n_head=2, d_ff=64)))
    model = tiny_moe()
    config = set_routing(model, "block", threshold=0.7, guard=3, block_size=16, mask_vote=2.5)
    assert model.config is config and (config.routing, config.route_threshold, config.route_guard,
                                       config.route_block, config.route_mask_vote) == ("block", 0.7, 3, 16, 2.5)
    assert all((l.routing, l.threshold, l.guard, l.block_size) == ("block", 0.7, 3, 16) for l in moe_layers(model))
