"""Spec: DFlash drafts a block in one pass, is trained on exactly what it sees at inference, and
decodes losslessly.

The layer-id rule; the block is [committed token, MASK...]; the packed multi-anchor training forward
equals the inference path and the loss weights/labels are the documented ones; greedy output equals
the target's greedy decoding; sampled output follows the target's exact joint (chi-square, both
acceptance rules); a drafter that knows the target's argmax reaches tau == B and tau never exceeds
B; special ids are committed or stop, never lost, MASK never comes out; after every round the
drafter's cache holds exactly the committed context; the drafter borrows the target frozen.
"""
import copy
import itertools
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from stats_helpers import (DFLASH_DIST_CONFIG, EXACT, NEW, PROMPT, assert_caches_equal, assert_follows_the_joint,
                           assert_same, check_block_counts, exact_joint, float64, random_drafter, random_model,
                           recorded_run, sample_counts)
from stats_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from table_models import Oracle, TableTarget

from tinydiff.ar import ar_generate
from tinydiff.dflash import (DFlashConfig, DFlashDrafter, block_input, default_decay, dflash_loss, draft_block,
                             drafter_from, feature_layers, packed_logits, sample_anchors, training_mask)
from tinydiff.dflash_decode import dflash_generate, greedy_match
from tinydiff.errors import UserError
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import EOT, MASK


def run(target, drafter, prompt, n, oracle=None, on_round=None, **kwargs):
    """dflash_generate with every round's info recorded (caches left out), also passed to the oracle
    and to on_round."""
    return recorded_run(dflash_generate, target, drafter, prompt, n, oracle, on_round, **kwargs)


def check_counts(out, stats, rounds, B, prompt_length):
    """The stats agree with each other and with the rounds; no round commits more than B tokens."""
    check_block_counts(out, stats, rounds, B, prompt_length)
    assert stats.draft_forwards == sum(len(r["drafts"]) > 0 for r in rounds)
    assert stats.proposed == sum(len(r["drafts"]) for r in rounds)
    assert all(1 <= len(r["tokens"]) <= r["accepted"] + 1 <= len(r["drafts"]) + 1 <= B for r in rounds)


# Models with GPT-2's full vocabulary (and MASK). Five target layers: two feature layers, [1, 2].
@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    return target, random_drafter(target, seed=1, n_layer=2, block_size=8, n_features=2)


@pytest.fixture(scope="module")
def models64(models):  # the same in float64: tests that compare two code paths hold them to float64 rounding
    return float64(*models)


def test_greedy_match_is_the_position_by_position_rule():
    # The reference: walk the positions, keep each draft that is the target's argmax, stop at the first
    # that is not (or past the last draft) and commit the target's argmax there. Ties in p: the first max.
    def walk(p, drafts):
        for i in range(len(drafts) + 1):
            y = int(p[i].argmax())
            if i == len(drafts) or y != int(drafts[i]):
                return i, y

    g = torch.Generator().manual_seed(0)
    for K in (0, 1, 3, 15):
        for trial in range(40):
            p = torch.randint(0, 3, (K + 1, 6), generator=g).double()  # ties on purpose
            drafts = p.argmax(-1)[:K].clone()
            if K and trial % 4:  # break the chain at a random slot, or leave every draft right
                j = int(torch.randint(0, K, (1,), generator=g))
                drafts[j] = (drafts[j] + 1 + int(torch.randint(0, 5, (1,), generator=g))) % 6
            assert greedy_match(p, drafts) == walk(p, drafts)


def test_feature_layer_rule():
    assert feature_layers(36, 5) == [1, 9, 17, 25, 33] and feature_layers(8, 2) == [1, 5]
    assert feature_layers(36, 1) == [18] and feature_layers(8, 1) == [4] and feature_layers(4, 1) == [2]
    for L, N in itertools.product(range(5, 40), range(2, 8)):
        if N <= L - 3:
            ids = feature_layers(L, N)  # evenly spaced from 1 to L-3: ends fixed, gaps differ by <= 1
            gaps = [b - a for a, b in zip(ids, ids[1:])]
            assert len(ids) == N and ids[0] == 1 and ids[-1] == L - 3 and max(gaps) - min(gaps) <= 1 and min(gaps) >= 1
        else:
            with pytest.raises(UserError, match="n_features"):
                feature_layers(L, N)
    assert DFlashConfig.for_target(ModelConfig(n_layer=8)).feature_layers == [1, 2, 3, 4, 5]
    assert DFlashConfig.for_target(ModelConfig(n_layer=4)).feature_layers == [2]
    assert [default_decay(b) for b in (16, 10, 8)] == [7, 5, 4]
    assert DFlashConfig(block_size=16).loss_decay == 7 and DFlashConfig(block_size=8).loss_decay == 4


def test_drafter_borrows_the_target_frozen(models):
    target, drafter = models
    assert not any(k.startswith(("target", "embed")) for k in drafter.state_dict())
    assert "mask_embed" in drafter.state_dict()  # the MASK slots' input is the drafter's own
    assert not {id(p) for p in drafter.parameters()} & {id(p) for p in target.parameters()}
    assert all(p.requires_grad for p in target.parameters())  # frozen by detach, not by a flag
    windows = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(0))
    loss, stats = dflash_loss(drafter, windows, torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)
    assert set(stats) >= {"ce", "acc"} and all(float(v) == float(v) for v in stats.values())
    # The checkpoint plan: config as a dict, the drafter's state dict; rebuilt, it drafts the same.
    rebuilt = drafter_from({"config": asdict(drafter.config), "model": drafter.state_dict()}, target)
    cache_a, cache_b = drafter.new_cache(), rebuilt.new_cache()
    _, hidden = target(torch.tensor([[1, 2, 3]]), causal=True, hidden_layers=drafter.config.taps)
    with torch.no_grad():
        assert torch.equal(draft_block(drafter, cache_a, 4, hidden), draft_block(rebuilt, cache_b, 4, hidden))


@torch.no_grad()
def test_a_feature_layer_id_is_the_output_of_that_0_indexed_block(models):
    """docs/DESIGN.md's rule (z-lab/dflash reads hidden_states[id + 1]): id i reads what target block
    i writes. Hooks catch the blocks' outputs and the drafter's projection input in one decode."""
    target, drafter = models
    ids = drafter.config.feature_layers
    assert ids == [1, 2] and drafter.config.feature_ids == "block_output"
    outputs, seen = {}, []

    def keep_first(i):
        def hook(module, args, out):  # returns None: a hook that returns a value replaces the output
            outputs.setdefault(i, out)
        return hook

    hooks = [target.blocks[i].register_forward_hook(keep_first(i)) for i in ids]
    hooks.append(drafter.fc.register_forward_pre_hook(lambda m, a: seen.append(a[0])))
    try:
        dflash_generate(target, drafter, [EOT, 11, 12, 13], 2, temperature=0, stop_token=None)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(seen[0], torch.cat([outputs[i] for i in ids], -1))  # the prefill's features


@torch.no_grad()
def test_a_drafter_saved_before_feature_ids_keeps_reading_its_layers(models):
    """A checkpoint without the field meant "after i blocks": it loads with that meaning recorded and
    reads exactly the hidden states it was trained on; a new config's ids read one block later."""
    target, _ = models
    old = random_drafter(target, seed=1, n_layer=1, block_size=8, n_features=2, feature_ids="after_blocks")
    stored = {key: value for key, value in asdict(old.config).items() if key != "feature_ids"}
    rebuilt = drafter_from({"config": stored, "model": old.state_dict()}, target)
    assert rebuilt.config.feature_ids == "after_blocks" and rebuilt.config.taps == old.config.feature_layers
    new = DFlashConfig.for_target(target.config, n_features=2)
    assert new.feature_layers == old.config.feature_layers and new.taps == [i + 1 for i in new.feature_layers]
    prompt = [EOT, 11, 12, 13]
    assert dflash_generate(target, rebuilt, prompt, 12, temperature=0, stop_token=None)[0] == \
        dflash_generate(target, old, prompt, 12, temperature=0, stop_token=None)[0]
    for bad, message in (({"feature_ids": "after"}, "feature_ids"), ({"feature_layers": [1, 5]}, "<= 4, got 5")):
        with pytest.raises(UserError, match=message):
            DFlashConfig.for_target(target.config, **bad)
    assert DFlashConfig.for_target(target.config, feature_layers=[1, 5], feature_ids="after_blocks").taps == [1, 5]


@torch.no_grad()
def test_block_is_the_committed_token_then_masks(models):
    target, drafter = models
    assert block_input(123, 5).tolist() == [[123, MASK, MASK, MASK, MASK]]
    seen, seqs = [], []
    handle = drafter.register_forward_pre_hook(
        lambda module, args: seen.append((args[0][0].tolist(), args[1].tolist())))  # (block ids, positions)
    try:
        prompt = [EOT, 5, 6]
        run(target, drafter, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(0),
            stop_token=None, on_round=lambda info: seqs.append(info["seq"]))
    finally:
        handle.remove()
    before = [prompt] + seqs[:-1]  # the committed sequence at the start of each round
    assert len(seen) >= 2
    for (block, pos), seq in zip(seen, before):
        assert block == [seq[-1]] + [MASK] * 7 and pos == list(range(len(seq) - 1, len(seq) + 7))


@torch.no_grad()
def test_packed_training_forward_equals_the_inference_path(models64):
    """One packed forward of many overlapping blocks gives, for each block, the logits draft_block
    computes from a cache filled with the features of the tokens before its anchor alone (in float64:
    to float64 rounding)."""
    target, drafter = models64
    B, T = drafter.config.block_size, 24
    windows = torch.randint(0, 50257, (2, T), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[1, 5, 6, T - B], [9, 3, 2, 10]])  # overlapping blocks, both ends
    packed, _ = packed_logits(drafter, windows, anchors)  # (2, 4, B-1, V)
    for b, j in itertools.product(range(2), range(4)):
        a = int(anchors[b, j])
        _, hidden = target(windows[b:b + 1, :a], causal=True, hidden_layers=drafter.config.taps)
        alone = draft_block(drafter, drafter.new_cache(), int(windows[b, a]), hidden)  # (B-1, V)
        assert_same(packed[b, j], alone)
    mask = training_mask(anchors, B, T)[0]  # rows of block j: context before its anchor, and itself
    for j, a in enumerate(anchors[0].tolist()):
        row = mask[j * B]
        assert row[:T].tolist() == [c < a for c in range(T)]
        assert row[T:].tolist() == [j * B <= c < (j + 1) * B for c in range(4 * B)]
        assert (mask[j * B:(j + 1) * B] == row).all()


@torch.no_grad()
def test_loss_labels_weights_and_anchors(models64):
    """The loss is sum_k exp(-(k-1)/g) CE(slot k, token at anchor + k) / sum_k exp(-(k-1)/g), averaged
    over blocks, each computed here through the inference path (MASK's logit left out; in float64: to
    float64 rounding); anchors are distinct in [1, T-B]."""
    target, drafter = models64
    B, g, T = drafter.config.block_size, drafter.config.loss_decay, 20
    anchors = sample_anchors(3, T, B, 50, torch.Generator().manual_seed(2))
    assert anchors.shape == (3, T - B) and all(sorted(r) == list(range(1, T - B + 1)) for r in anchors.tolist())
    anchors = sample_anchors(3, T, B, 5, torch.Generator().manual_seed(2))
    assert anchors.shape == (3, 5)
    assert all(len(set(r)) == 5 and 1 <= min(r) and max(r) <= T - B for r in anchors.tolist())
    windows = torch.randint(0, 50257, (3, T), generator=torch.Generator().manual_seed(3))
    drafter.config.anchors = 5
    try:
        loss, stats = dflash_loss(drafter, windows, torch.Generator().manual_seed(2))
    finally:
        drafter.config.anchors = 32
    weights = torch.tensor([2.718281828459045 ** (-(k - 1) / g) for k in range(1, B)], dtype=torch.float64)
    total, first = 0.0, 0.0
    for b, a in itertools.product(range(3), range(5)):
        a = int(anchors[b, a])
        _, hidden = target(windows[b:b + 1, :a], causal=True, hidden_layers=drafter.config.taps)
        logits = draft_block(drafter, drafter.new_cache(), int(windows[b, a]), hidden)  # (B-1, V)
        logits[:, MASK] = float("-inf")  # never a label: the loss leaves it out, as inference does
        ce = F.cross_entropy(logits, windows[b, a + 1:a + B], reduction="none")  # slot k -> token a + k
        total += float((weights * ce).sum() / weights.sum())
        first += float(logits[0].argmax() == windows[b, a + 1])
    assert abs(float(loss) - total / 15) <= EXACT * total / 15 and float(stats["ce"]) == float(loss)
    assert float(stats["acc"]) == first / 15


@torch.no_grad()
def test_greedy_output_equals_the_targets_greedy_decoding(models64):
    target, drafter = models64
    seen = {"partial": 0, "full": 0, "dropped_after_stop": 0}
    for seed, B in itertools.product(range(3), (4, 8)):
        prompt = [EOT] + torch.randint(0, 50257, (3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        full, _ = ar_generate(target, prompt, 24, temperature=0, stop_token=None)
        oracle = Oracle(random_drafter(target, seed=2, n_layer=2, block_size=8, n_features=2), target,
                        wrong=lambda position: position % 5 == seed)
        for stop_token, rule in itertools.product((None, full[13]), ("match", "reject")):
            expected, _ = ar_generate(target, prompt, 24, temperature=0, stop_token=stop_token)
            for name, draft, orc in (("random", drafter, None), ("oracle", oracle.drafter, oracle)):
                out, stats, rounds = run(target, draft, prompt, 24, orc, block_size=B, temperature=0,
                                         stop_token=stop_token, rule=rule)
                assert out == expected, (seed, B, name, stop_token, rule)
                check_counts(out, stats, rounds, B, len(prompt))
                seen["partial"] += sum(0 < r["accepted"] < len(r["drafts"]) for r in rounds)
                seen["full"] += sum(0 < r["accepted"] == len(r["drafts"]) for r in rounds)
                seen["dropped_after_stop"] += len(rounds[-1]["tokens"]) < rounds[-1]["accepted"] + 1
    assert min(seen.values()) > 0, seen  # the cases must include all three, or prove nothing


@torch.no_grad()
def test_a_drafter_that_knows_the_targets_argmax_gives_tau_equal_to_B(models64):
    target, _ = models64
    for B, prompt in itertools.product((4, 8), ([EOT], [EOT, 7, 8, 9])):
        oracle = Oracle(random_drafter(target, seed=3, block_size=8, n_features=2), target)
        n = 3 * B  # three full rounds
        out, stats, rounds = run(target, oracle.drafter, prompt, n, oracle, block_size=B, temperature=0,
                                 stop_token=None)
        assert out == ar_generate(target, prompt, n, temperature=0, stop_token=None)[0]
        assert stats.accepted == [0] * (B - 1) + [3] and stats.tau == B and stats.alpha == 1
        assert stats.draft_forwards == 3 and stats.forwards == 3 + (len(prompt) > 1)
        assert 0 < stats.draft_seconds and 0 < stats.verify_seconds  # every round clocks both stages
        assert stats.draft_seconds + stats.verify_seconds <= stats.seconds  # inside the timed loop
        check_counts(out, stats, rounds, B, len(prompt))


@torch.no_grad()
def test_special_ids_are_committed_or_stop_never_lost(models64):
    """EOT sampled by the target (as the bonus) or drafted and accepted: it stops the run when it is
    the stop token and is committed like any token otherwise. MASK never comes out, even when both
    models favour it."""
    target, drafter = models64
    prompt = [EOT, 11, 12]
    trigger = ar_generate(target, prompt, 20, temperature=0, stop_token=None)[0][5]
    eot_target = copy.deepcopy(target)

    def favour_eot(module, args, output):  # EOT wins right after every `trigger` token
        logits = output[0] if isinstance(output, tuple) else output
        logits[..., EOT] += 1e3 * (args[0] == trigger)[:, args[0].shape[1] - logits.shape[1]:]  # (head_from)
    eot_target.register_forward_hook(favour_eot)
    oracle = Oracle(random_drafter(target, seed=3, block_size=8, n_features=2), eot_target,
                    wrong=lambda position: position % 4 == 0)
    seen = {"bonus": 0, "draft": 0}
    for stop_token, rule in itertools.product((EOT, None), ("match", "reject")):
        expected, _ = ar_generate(eot_target, prompt, 20, temperature=0, stop_token=stop_token)
        assert EOT in expected and (expected[-1] == EOT) == (stop_token == EOT)
        for draft, orc in ((drafter, None), (oracle.drafter, oracle)):
            out, stats, rounds = run(eot_target, draft, prompt, 20, orc, temperature=0, stop_token=stop_token,
                                     rule=rule)
            assert out == expected
            check_counts(out, stats, rounds, 8, len(prompt))
            for r in rounds:
                if EOT in r["tokens"]:
                    seen["draft" if EOT in r["drafts"][:r["accepted"]] else "bonus"] += 1
    assert seen["bonus"] > 0 and seen["draft"] > 0

    def favour_mask(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        logits[..., MASK] += 100.0
    mask_target, mask_drafter = copy.deepcopy(target), random_drafter(target, seed=4, block_size=8, n_features=2)
    for model in (mask_target, mask_drafter):
        model.register_forward_hook(favour_mask)
    for temperature, rule in itertools.product((0, 1.0), ("match", "reject")):
        out, _, _ = run(mask_target, mask_drafter, prompt, 20, temperature=temperature, rule=rule,
                        stop_token=None, generator=torch.Generator().manual_seed(0))
        assert len(out) == 20 and MASK not in out


@torch.no_grad()
def test_caches_hold_exactly_the_committed_context_after_every_round(models64):
    """After every round both caches hold the committed tokens but the newest: the target's K/V and the
    drafter's context K/V equal a recomputation from scratch over seq[:-1], to float64 rounding."""
    target, drafter = models64
    layers = drafter.config.taps
    checked = {"full": 0, "partial": 0, "stopped": 0}
    current = {}  # the drafter of the run being checked

    def check(info):
        seq, tc, dc = info["seq"], info["target_cache"], info["draft_cache"]
        assert tc.length == dc.length == len(seq) - 1
        fresh_t, fresh_d = target.new_cache(), current["drafter"].new_cache()
        if len(seq) > 1:
            _, hidden = target(torch.tensor([seq[:-1]]), cache=fresh_t, causal=True, hidden_layers=layers)
            current["drafter"].extend(fresh_d, hidden)
        assert_caches_equal((tc, fresh_t), (dc, fresh_d))
        full = len(info["drafts"]) > 0 and info["accepted"] == len(info["drafts"])
        checked["full" if full else "partial"] += 1

    oracle = Oracle(random_drafter(target, seed=3, block_size=8, n_features=2), target,
                    wrong=lambda position: position % 11 == 0)
    cases = [(drafter, None, 1.0, "match", [EOT]), (drafter, None, 1.0, "reject", [EOT, 3, 4, 5]),
             (oracle.drafter, oracle, 1.0, "reject", [EOT]), (oracle.drafter, oracle, 0, "match", [EOT, 3, 4, 5])]
    for draft, orc, temperature, rule, prompt in cases:
        current["drafter"] = draft
        generator = torch.Generator().manual_seed(0)
        stop = run(target, draft, prompt, 20, orc, temperature=temperature, generator=generator, stop_token=None,
                   rule=rule)[0][9]
        generator.manual_seed(0)
        out, _, rounds = run(target, draft, prompt, 20, orc, temperature=temperature, generator=generator,
                             stop_token=stop, rule=rule, on_round=check)
        checked["stopped"] += out[-1] == stop and len(out) < 20
    assert min(checked.values()) > 0, checked


def test_bad_input_is_a_clear_error(models):
    target, drafter = models
    for other in (ModelConfig(vocab_size=1000, context=40, n_layer=5, n_head=2, d_model=32, d_ff=64),
                  ModelConfig(context=40, n_layer=5, n_head=2, d_model=16, d_ff=64),
                  ModelConfig(context=40, n_layer=6, n_head=2, d_model=32, d_ff=64),
                  ModelConfig(context=64, n_layer=5, n_head=2, d_model=32, d_ff=64)):
        other_target = random_model(other, seed=0)
        with pytest.raises(UserError, match="drafter was built for a target"):
            dflash_generate(other_target, drafter, [1, 2], 5)
        with pytest.raises(UserError, match="drafter was built for a target"):
            DFlashDrafter(drafter.config, other_target)
    for B in (1, 9, 4.0):
        with pytest.raises(UserError, match="block size"):
            dflash_generate(target, drafter, [1, 2], 5, block_size=B)
    with pytest.raises(UserError, match="rule"):
        dflash_generate(target, drafter, [1, 2], 5, rule="greedy")
    with pytest.raises(UserError, match="DFlashDrafter"):
        dflash_generate(target, target, [1, 2], 5)
    with pytest.raises(UserError, match="empty"):
        dflash_generate(target, drafter, [], 5)
    with pytest.raises(UserError, match="MASK"):
        dflash_generate(target, drafter, [EOT, MASK], 5)
    with pytest.raises(UserError, match="temperature"):
        dflash_generate(target, drafter, [1, 2], 5, temperature=-1)
    with pytest.raises(UserError, match="n_features"):
        DFlashConfig.for_target(target.config, n_features=3)
    with pytest.raises(UserError, match="too short"):
        dflash_loss(drafter, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(UserError, match="not a DFlash drafter config"):
        drafter_from({"config": {"depth": 3}, "model": {}}, target)


# Distribution: at temperature > 0 the committed tokens must follow the target's exact joint.
# test_speculative's design: V = 6, 3 new tokens after a 2-token prompt, chi-square against the
# enumerated joint at significance 1e-3, power asserted from the joint. Here the target has two
# layers (its feature layer is [1]) and small embeddings, which makes its joint flat enough for
# ~5,500 samples. MASK = 50257 lies outside V: the drafter embeds MASK slots with its own vector.
# The target is DFLASH_DIST_CONFIG, read through TableTarget (table_models).
DIST_CASES = {  # rule, oracle drafter (else random), temperature, top_k, top_p, samples, table target
    "match, oracle drafter": ("match", True, 1.0, None, None, 5_500, True),
    "reject, random drafter": ("reject", False, 1.0, None, None, 5_500, True),
    "reject, oracle drafter, T 0.7": ("reject", True, 0.7, None, None, 6_000, True),
}


@pytest.mark.parametrize("case", DIST_CASES)
@torch.no_grad()
def test_sampled_tokens_follow_the_exact_target_distribution(case):
    """Chi-square goodness of fit of seeded generations against the enumerated joint.

    Significance 1e-3 (a correct implementation fails with probability 1e-3 per case if seeds or
    torch's random streams change). Power, as in test_speculative: one continuation off by DELTA =
    2 percentage points, the rest absorbing it in proportion, is caught with probability >= POWER
    = 0.9; the power is computed from the exact joint and asserted, so a weaker test fails loudly.
    Every case must also see rejections and full acceptances, or it proves nothing about either.
    """
    rule, use_oracle, temperature, top_k, top_p, n, table = DIST_CASES[case]
    target = random_model(DFLASH_DIST_CONFIG, seed=1, embed_std=0.1)
    drafter = random_drafter(target, seed=5, block_size=4)
    oracle = Oracle(drafter, target) if use_oracle else None
    probs = exact_joint(target, temperature, top_k, top_p)  # (V^NEW,)
    if table:
        target = TableTarget(target, drafter.config.taps)
    counts, hist = sample_counts(lambda generator: dflash_generate(
        target, drafter, PROMPT, NEW, None, temperature, top_k, top_p, generator, stop_token=None, rule=rule,
        on_round=oracle and oracle.on_round), n, oracle, seed=1234)
    assert hist[0] > 0 and hist[NEW - 1] > 0, hist  # rejections, and full acceptances of 2 drafts
    assert_follows_the_joint(probs, counts, n)
