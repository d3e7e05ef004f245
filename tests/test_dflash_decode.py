"""Spec: DFlash decodes losslessly.

Greedy output equals the target's greedy decoding (the one-read-back greedy rule equals the
position-by-position walk); sampled output follows the target's exact joint (chi-square, both
acceptance rules); a drafter that knows the target's argmax reaches tau == B and tau never exceeds
B; special ids are committed or stop, never lost, MASK never comes out; after every round the
drafter's cache holds exactly the committed context; bad input is a clear error.
The drafter itself and its training: test_dflash.py.
"""
import copy
import itertools

import pytest
import torch
from dflash_models import MISMATCHED_TARGETS, models, models64, run  # noqa: F401 (fixtures)
from stats_helpers import (
    DFLASH_DIST_CONFIG,
    NEW,
    PROMPT,
    assert_caches_equal,
    assert_follows_the_joint,
    assert_refuses_what_block_drafting_refuses,
    check_block_counts,
    exact_joint,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
    sample_counts,
)
from table_models import Oracle, TableTarget

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.dflash import dflash_generate, match
from tinydiff.extras.dflash_reject import dflash_reject_generate
from tinydiff.tokenizer import EOT, MASK


def check_counts(out, stats, rounds, B, prompt_length):
    """The stats agree with each other and with the rounds; no round commits more than B tokens."""
    check_block_counts(out, stats, rounds, B, prompt_length)
    assert stats.draft_forwards == sum(len(r["drafts"]) > 0 for r in rounds)
    assert stats.proposed == sum(len(r["drafts"]) for r in rounds)
    assert all(1 <= len(r["tokens"]) <= r["accepted"] + 1 <= len(r["drafts"]) + 1 <= B for r in rounds)




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
            assert match(p, drafts, None, greedy=True) == walk(p, drafts)



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
    for other in MISMATCHED_TARGETS:
        with pytest.raises(UserError, match="drafter was built for a target"):
            dflash_generate(random_model(other, seed=0), drafter, [1, 2], 5)
    with pytest.raises(UserError, match="rule"):
        dflash_reject_generate(target, drafter, [1, 2], 5, rule="greedy")
    assert_refuses_what_block_drafting_refuses(dflash_generate, target, drafter)


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
    counts, hist = sample_counts(lambda generator: dflash_reject_generate(
        target, drafter, PROMPT, NEW, None, temperature, top_k, top_p, generator, stop_token=None, rule=rule,
        on_round=oracle and oracle.on_round), n, oracle, seed=1234)
    assert hist[0] > 0 and hist[NEW - 1] > 0, hist  # rejections, and full acceptances of 2 drafts
    assert_follows_the_joint(probs, counts, n)
