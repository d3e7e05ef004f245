"""Spec: the diffusion samplers, step by step. Every step is recorded through the callback and
checked against a recomputation of that step from the canvas before it: the LLaDA schedule,
argmax and threshold commits, self-correction, the entropy bound (a brute-force recomputation of
the longest run it allows), and the prefix-cached sampler against the block-causal one. At
temperature 1, one step of an order that does not read the draw commits a fair sample of the
position it picks (chi-square); the confidence order does not: it commits modes."""
import copy
from dataclasses import replace

import pytest
import torch
from stats_helpers import assert_follows_the_joint, random_model

from tinydiff.checks import UserError
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampler import commit, commit_schedule, generate, generate_cached, propose
from tinydiff.tokenizer import MASK

PROMPT = [50256, 464, 3797, 318]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False)).eval()


@pytest.fixture(scope="module")
def sharp():
    """Random weights whose blocks matter (the default init barely reads the context), in float64
    so that two paths that sum in other orders still pick the same argmax."""
    return random_model(ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False), 0).double()


@pytest.fixture(scope="module")
def peaked():
    """sharp with a larger embedding (the tied head): entropies from 0.01 to 2.3 nats, not all ~9."""
    return random_model(ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False), 0,
                        embed_std=2.0).double()


def run(model, **kwargs):
    events = []
    ids, stats = generate(model, PROMPT, callback=events.append, **kwargs)
    before = [torch.tensor(PROMPT + [MASK] * kwargs["gen_length"])] + [e["canvas"] for e in events[:-1]]
    return ids, stats, list(zip(before, events))


def test_commit_schedule_spreads_the_remainder_over_the_first_steps():
    assert commit_schedule(10, 4) == [3, 3, 2, 2]
    assert commit_schedule(8, 8) == [1] * 8 and commit_schedule(3, 5) == [1, 1, 1, 0, 0]
    for masks in range(1, 40):
        for steps in range(1, 12):
            plan = commit_schedule(masks, steps)
            assert sum(plan) == masks and max(plan) - min(plan) <= 1 and plan == sorted(plan, reverse=True)


@pytest.mark.parametrize("steps, block_length", [(16, 8), (8, 8), (4, 16), (16, 16)])
def test_llada_schedule_invariants(model, steps, block_length):
    ids, stats, trace = run(model, gen_length=16, steps=steps, block_length=block_length)
    blocks = 16 // block_length
    plan = commit_schedule(block_length, steps // blocks)
    done_blocks = -1
    for i, (before, event) in enumerate(trace):
        after, b = event["canvas"], event["block"]
        lo = len(PROMPT) + b * block_length
        changed = (before != after).nonzero().flatten().tolist()
        assert sorted(changed) == sorted(event["committed"])  # nothing else moved
        assert all(before[p] == MASK and lo <= p < lo + block_length for p in changed)  # only masks, only this block
        assert (after[:lo] != MASK).all()  # earlier blocks were finished before this one started
        assert (after[lo + block_length:] == MASK).all()  # later blocks untouched
        step_in_block = sum(1 for _, e in trace[:i] if e["block"] == b)
        assert len(changed) == plan[step_in_block]
        done_blocks = max(done_blocks, b)
    assert done_blocks == blocks - 1 and MASK not in ids and len(ids) == 16
    assert stats.forwards == len(trace) == steps


def test_temperature_zero_commits_the_most_confident_argmax(model):
    _, _, trace = run(model, gen_length=16, steps=8, block_length=8)
    for before, event in trace:
        lo = len(PROMPT) + event["block"] * 8
        logits = model(before[None], causal=False)[0, lo:lo + 8]
        candidates, confidence = propose(logits, 0.0, "low_confidence")
        confidence[before[lo:lo + 8] != MASK] = -1
        top = (lo + confidence.topk(len(event["committed"])).indices).tolist()
        assert sorted(top) == sorted(event["committed"])
        assert all(event["canvas"][p] == candidates[p - lo] for p in top)


@pytest.mark.parametrize("threshold", [0.9, 1e-5, 1e-6])
def test_threshold_commits_all_above_and_at_least_one(model, threshold):
    ids, stats, trace = run(model, gen_length=16, steps=16, block_length=8, threshold=threshold)
    for before, event in trace:
        lo = len(PROMPT) + event["block"] * 8
        _, confidence = propose(model(before[None], causal=False)[0, lo:lo + 8], 0.0, "low_confidence")
        masked = (before[lo:lo + 8] == MASK)
        above = (lo + ((confidence >= threshold) & masked).nonzero().flatten()).tolist()
        assert len(event["committed"]) == max(1, len(above))
        assert set(above) <= set(event["committed"])
    assert MASK not in ids and stats.forwards == len(trace) <= 16


def test_same_seed_same_tokens(model):
    def sample(seed, **kw):
        return generate(model, PROMPT, 16, 8, 8, temperature=1.0, generator=torch.Generator().manual_seed(seed), **kw)[0]
    for kw in ({}, {"remasking": "random"}, {"threshold": 0.5}, {"entropy_bound": 0.5}, {"remasking": "low_entropy"}):
        assert sample(1, **kw) == sample(1, **kw) != sample(2, **kw)


@pytest.fixture(scope="module")
def shifted(model):
    """The same weights read the way a model adapted from an AR one is: output i predicts i+1."""
    twin = copy.deepcopy(model)
    twin.config = replace(model.config, shift=True)
    return twin


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("steps, block_length, rule", [(16, 8, {}), (8, 4, {}), (4, 16, {}), (16, 8, {"threshold": 0.5}),
                                                       (16, 8, {"entropy_bound": 1.0})])
def test_cached_equals_uncached_block_causal(sharp, shift, steps, block_length, rule):
    """Token for token, with weights that read the context, a shifted twin included, and a prompt
    longer than a block (it is one block all the same)."""
    model = copy.deepcopy(sharp)
    model.config = replace(sharp.config, shift=shift)
    for prompt in (PROMPT, PROMPT * 3):
        a, sa = generate(model, prompt, 16, steps, block_length, block_causal=True, **rule)
        b, sb = generate_cached(model, prompt, 16, steps, block_length, **rule)
        assert a == b and sa.forwards == sb.forwards


def entropies(logits, temperature):
    """-sum p log p of softmax(logits / T) (T = 1 at T = 0), MASK left out: the plain formula."""
    logits = logits.double()[:, :MASK] / (temperature or 1.0)
    p = torch.softmax(logits, -1)
    return -(p * torch.log_softmax(logits, -1)).sum(-1)


def longest_run(entropy, bound):
    """The most tokens m of the ranked list with sum(H[:m]) - max(H[:m]) <= bound, by trying each m."""
    fits = [m for m in range(1, len(entropy) + 1) if sum(entropy[:m]) - max(entropy[:m]) <= bound]
    return max(fits) if fits else 1


@pytest.mark.parametrize("bound", [0.0, 0.3, 1.0, 1e9])
@pytest.mark.parametrize("temperature, remasking", [(0.0, "low_confidence"), (1.0, "low_entropy"), (1.0, "low_confidence"),
                                                    (1.0, "left_to_right")])
@torch.no_grad()
def test_entropy_bound_commits_the_longest_run_the_bound_allows(peaked, bound, temperature, remasking):
    """Every step commits >= 1 token, a set whose sum(H) - max(H) fits under the bound (unless it is
    one token), and, where the ranking does not depend on the draw, exactly the longest such run."""
    g = torch.Generator().manual_seed(3)
    ids, stats, trace = run(peaked, gen_length=16, steps=16, block_length=8, entropy_bound=bound,
                            temperature=temperature, remasking=remasking, generator=g)
    sizes = []
    for before, event in trace:
        lo = len(PROMPT) + event["block"] * 8
        logits = peaked(before[None], causal=False)[0, lo:lo + 8]
        h = entropies(logits, temperature).tolist()
        committed = [p - lo for p in event["committed"]]
        assert len(committed) >= 1
        sizes.append(len(committed))
        chosen = [h[i] for i in committed]
        assert len(chosen) == 1 or sum(chosen) - max(chosen) <= bound
        masked = [i for i in range(8) if before[lo + i] == MASK]
        if (temperature, remasking) == (1.0, "low_confidence"):
            continue  # ranked by the sampled tokens' probabilities: a recomputation would need the draw
        score = [-h[i] for i in masked] if remasking == "low_entropy" else [-i for i in masked] \
            if remasking == "left_to_right" else [float(torch.softmax(logits[i, :MASK].double(), -1).max()) for i in masked]
        ranked = [i for _, i in sorted(zip(score, masked), reverse=True)]
        assert sorted(committed) == sorted(ranked[:longest_run([h[i] for i in ranked], bound)])
    assert MASK not in ids and stats.forwards == len(trace)
    if bound == 1e9:
        assert stats.forwards == 2  # everything fits: one forward per block
    if bound == 1.0:
        assert 1 < max(sizes) < 8  # the bound binds: some steps commit several tokens, none a whole block


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_entropy_bound_zero_is_one_token_per_step(peaked, temperature):
    for sampler in (generate, generate_cached):
        outs = [sampler(peaked, PROMPT, 16, 16, 8, temperature, generator=torch.Generator().manual_seed(9), **rule)
                for rule in ({}, {"entropy_bound": 0.0})]
        assert outs[0][0] == outs[1][0] and outs[1][1].forwards == 16


@pytest.mark.parametrize("sampler", [generate, generate_cached])
def test_left_to_right_at_bound_zero_commits_the_leftmost_masked_position(peaked, sampler):
    trace = []
    sampler(peaked, PROMPT, 16, 16, 8, 1.0, remasking="left_to_right", entropy_bound=0.0,
            generator=torch.Generator().manual_seed(2), callback=trace.append)
    assert [event["committed"] for event in trace] == [[len(PROMPT) + i] for i in range(16)]  # AR order


class PositionEcho(torch.nn.Module):
    """Output j is sure of token 100 + j, whatever the input: shows which output the sampler reads."""

    def __init__(self, shift):
        super().__init__()
        self.config = ModelConfig(context=64, causal=False, shift=shift)
        self.embed = torch.nn.Embedding(1, 1)

    def forward(self, idx, causal=None, mask=None, cache=None):
        n = idx.shape[1]
        past = cache.length if cache is not None else 0
        if cache is not None:
            cache.length += n
        logits = torch.zeros(1, n, self.config.vocab_size)
        logits[0, torch.arange(n), 100 + past + torch.arange(n)] = 50.0
        return logits

    def new_cache(self, batch_size):
        return TokenCounter()


class TokenCounter:
    length = 0

    def crop(self, n):
        self.length = n


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("sampler", [generate, generate_cached])
def test_a_shifted_model_is_read_one_output_earlier(shift, sampler):
    ids, _ = sampler(PositionEcho(shift), PROMPT, 16, 8, 8)
    assert ids == [100 + i - shift for i in range(len(PROMPT), len(PROMPT) + 16)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen_length=10, block_length=4), "multiple of the block length"),
    (dict(steps=3), "multiple of the number of blocks"),
    (dict(remasking="best"), "remasking"),
    (dict(threshold=1.5), "threshold"),
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf"), threshold=0.5), "temperature"),
    (dict(entropy_bound=-0.1), "entropy bound"),
    (dict(entropy_bound=float("nan")), "entropy bound"),
    (dict(entropy_bound=0.1, threshold=0.9), "not both"),
    (dict(remasking="left_to_right", threshold=0.9), "left_to_right ranks by position"),
    (dict(gen_length=64), "max new tokens"),
])
def test_bad_arguments(model, kwargs, message):
    args = {"gen_length": 16, "steps": 8, "block_length": 8, **kwargs}
    with pytest.raises(UserError, match=message):
        generate(model, PROMPT, **args)
    with pytest.raises(UserError, match="empty"):
        generate_cached(model, [], 8, 8, 8)


# One step's four positions, three tokens each: their entropies differ (position 3 is the surest),
# and each position's mode has at most 0.7 of its mass.
STEP_PROBS = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.25, 0.15], [0.4, 0.4, 0.2], [0.7, 0.2, 0.1]], dtype=torch.float64)


def first_step(remasking, seed):
    """One step at temperature 1, one token: (committed position, its token, propose's draws (4,) from
    the same random numbers)."""
    g = torch.Generator().manual_seed(seed)
    drawn, _ = propose(STEP_PROBS.log(), 1.0, remasking, copy.deepcopy(g))
    canvas = torch.full((len(STEP_PROBS),), MASK)
    (position,) = commit(canvas, 0, STEP_PROBS.log(), 1, None, 1.0, remasking, g,
                         torch.full(canvas.shape, float("inf"), dtype=torch.float64))
    return position, int(canvas[position]), drawn


def test_propose_draws_each_position_from_its_softmax():
    """At temperature 1, propose's candidates follow softmax(logits) at every position: 50,000 draws
    of each of the four, chi-square against the exact joint (power asserted by the helper)."""
    n = 50_000
    drawn, _ = propose(STEP_PROBS.log().repeat(n, 1), 1.0, "low_entropy", torch.Generator().manual_seed(0))
    counts = torch.zeros(STEP_PROBS.shape, dtype=torch.long)
    counts.index_put_((torch.arange(len(STEP_PROBS)).repeat(n), drawn), torch.tensor(1), accumulate=True)
    assert_follows_the_joint((STEP_PROBS / len(STEP_PROBS)).flatten(), counts.flatten(), n * len(STEP_PROBS))


@pytest.mark.parametrize("remasking, position", [("low_entropy", 3), ("left_to_right", 0)])
def test_an_order_blind_to_the_draw_commits_a_fair_sample_of_its_position(remasking, position):
    """Entropy and position pick where to commit before the draw: over 50 seeds the step commits
    the same position, and there exactly the token propose drew (a fair sample, by the test above).
    Chained over steps, that is ancestral sampling in that order: the model's own distribution."""
    for seed in range(50):
        where, token, drawn = first_step(remasking, seed)
        assert where == position and token == drawn[position]


def test_the_confidence_order_commits_modes():
    """low_confidence ranks positions by the probability of the token each one drew, so it commits
    whichever position happened to draw a likely token: its mode about 96% of the time here, where a
    fair draw of any one position gives its mode at most 70%. This is why a student sure of many
    positions writes one story over and over (dev/LOG.md)."""
    committed = [first_step("low_confidence", seed)[:2] for seed in range(1_000)]
    modes = sum(token == int(STEP_PROBS[where].argmax()) for where, token in committed)
    assert modes / len(committed) > 0.9
