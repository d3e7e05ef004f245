"""Spec: self-speculative sampling of a diffusion LM (tinydiff/extras/self_speculative.py) is the cached
one-token-per-step sampler in the same order, only with fewer forwards. At temperature 0 token
for token (float64 models, both orders, shifted or not, any number of drafts); at temperature 1.5
its samples follow the exact joint of that sampler, enumerated with plain uncached forwards
(chi-square with its power asserted, stats_helpers); a batched verify forward gives each canvas
its own logits; the counts are the forwards and canvases the model really ran."""
import json

import pytest
import torch
from diffusion_joint import NEW, SMALL_PROMPT, SmallVocab, V, exact_joint
from hostile import run_capped
from stats_helpers import (
    assert_follows_the_joint,
    assert_same,
    one_thread,  # noqa: F401 (autouse fixture)
    random_model,
)

from tinydiff.checks import UserError
from tinydiff.extras.self_speculative import row_view, self_speculative_generate
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampler import generate_cached, prefix_cached_logits
from tinydiff.tokenizer import MASK

PROMPT = [50256, 464, 3797, 318]
ORDERS = ("left_to_right", "low_entropy")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "shifted"])
def peaked(request):
    """Random float64 weights whose blocks matter and whose entropies spread (0.01 to a few nats), so
    that drafts are kept and rejected; GPT-2's vocabulary and MASK."""
    config = ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False, shift=request.param)
    return random_model(config, 0, embed_std=2.0).double()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("drafts", [1, 2, 5])
def test_greedy_tokens_equal_the_one_token_per_step_sampler(peaked, order, drafts):
    want, base = generate_cached(peaked, PROMPT, 16, 16, 8, 0.0, order)
    rounds = []
    got, stats = self_speculative_generate(peaked, PROMPT, 16, 8, 0.0, order, drafts, on_round=rounds.append)
    assert got == want
    committed = [t for r in rounds for t in r["committed"]]
    assert sorted(committed) == [(len(PROMPT) + i, t) for i, t in enumerate(want)]  # each position once
    assert all(1 <= len(r["committed"]) <= drafts for r in rounds)
    if drafts == 1:  # the target's own step every round: generate_cached's forwards exactly
        assert stats.forwards == base.forwards == stats.canvases == 16
    assert stats.forwards <= base.forwards


@torch.no_grad()
def test_a_batch_of_canvases_reads_each_canvas_own_logits(peaked):
    """The verify forward: S canvases that share a cached prefix, as one batch through row views of one
    cache, give each canvas the block logits it gets alone (float64: rounding only)."""
    P, lo, N = len(PROMPT), len(PROMPT) + 8, 8
    canvases = torch.tensor(PROMPT + [7, 8, 9, 10, 11, 12, 13, 14] + [MASK] * N).repeat(3, 1)  # (3, L): block 2 open
    canvases[1, lo] = 5
    canvases[2, lo:lo + 3] = torch.tensor([5, 6, 40])
    cache = peaked.new_cache(4)
    first = row_view(cache, 1)
    prefix_cached_logits(peaked, canvases[:1], first, lo, P, N)  # the prefix, then block 2 of canvas 0
    for t in cache.k + cache.v:
        t[1:, :, :first.length] = t[:1, :, :first.length]
    cache.length = first.length
    batched = prefix_cached_logits(peaked, canvases, row_view(cache, 3), lo, P, N)  # (3, N, V)
    for i in range(3):
        alone = prefix_cached_logits(peaked, canvases[i:i + 1], peaked.new_cache(1), lo, P, N)[0]
        assert_same(batched[i], alone)


def counting(model):
    """The batch size of every forward the model runs."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    return calls


@pytest.mark.parametrize("order", ORDERS)
def test_counts_are_the_forwards_and_canvases_run(order):
    config = ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False)
    model = random_model(config, 1, embed_std=2.0).double()
    calls = counting(model)
    out, stats = self_speculative_generate(model, PROMPT, 24, 8, 1.0, order, 3,
                                           generator=torch.Generator().manual_seed(0))
    blocks = 3
    assert stats.forwards == len(calls) and stats.canvases == sum(calls)
    assert calls.count(1) >= blocks and max(calls) <= 3 + 1
    assert stats.new_tokens == len(out) == 24 and stats.rounds == sum(stats.accepted)
    assert stats.forwards <= stats.rounds + blocks
    assert stats.canvases_per_token == stats.canvases / 24
    assert stats.rejected > 0 and any(stats.accepted[2:])  # both branches of the rule ran


CASES = {  # name: (order, shifted, block, drafts, model seed, samples), at T 1.5: a flatter joint needs fewer
    "left to right, two blocks": ("left_to_right", False, 2, 2, 3, 5_000),  # samples for the same power
    "entropy order, shifted": ("low_entropy", True, 4, 3, 6, 5_000),  # room for the target to pick another position
}
TEMPERATURE = 1.5


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_samples_follow_the_one_token_per_step_joint(case):
    """Chi-square of seeded generations against the enumerated joint at significance 1e-3, with
    power >= 0.9 against one continuation off by 2 points (stats_helpers.assert_follows_the_joint
    computes and asserts it). The drafts must be kept and rejected in these runs, and in the entropy
    order also rejected for a position the target would not pick: every branch of the rule runs."""
    order, shifted, block, drafts, seed, n = CASES[case]
    model, temperature = SmallVocab(shifted, seed), TEMPERATURE
    probs = exact_joint(model, order, temperature, block)
    assert abs(float(probs.sum()) - 1) < 1e-9
    counts = torch.zeros(V ** NEW, dtype=torch.long)
    generator, kept, rejected, moved = torch.Generator().manual_seed(1234), [0] * (drafts + 1), 0, 0

    def on_round(info):
        nonlocal rejected, moved
        kept[info["accepted"]] += 1
        if info["accepted"] < len(info["positions"]):  # the target's own token: at the drafted position?
            rejected += 1
            moved += info["committed"][-1][0] != info["block_start"] + info["positions"][info["accepted"]]

    for _ in range(n):
        out, _ = self_speculative_generate(model, SMALL_PROMPT, NEW, block, temperature, order, drafts,
                                           generator=generator, on_round=on_round)
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(out))] += 1
    assert_follows_the_joint(probs, counts, n)
    assert rejected > 0 and sum(kept[2:]) > 0
    assert (moved > 0) == (order == "low_entropy")  # left to right, the target's position is the draft's


def test_bad_input_gets_a_one_line_error():
    model = Transformer(ModelConfig(context=64, n_layer=1, n_head=2, d_model=16, d_ff=32, causal=False)).eval()
    with pytest.raises(UserError, match="order chosen before the draw"):
        self_speculative_generate(model, PROMPT, 8, 8, 1.0, "low_confidence", 2)
    with pytest.raises(UserError, match="draft positions must be >= 1"):
        self_speculative_generate(model, PROMPT, 8, 8, 1.0, "left_to_right", 0)
    with pytest.raises(UserError, match="multiple of the block length"):
        self_speculative_generate(model, PROMPT, 10, 8, 1.0, "left_to_right", 2)


@pytest.mark.parametrize("k", [10**6, 10**9])
def test_a_draft_count_past_the_block_is_clamped_in_bounded_memory(tmp_path, k):
    """--k larger than a block's positions can draft no more than the block: the run clamps it, says so once,
    and writes its 8 tokens under a 4 GiB address-space cap (a batch cache of k + 1 rows took 18 GB)."""
    config = ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32, causal=False)
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=config, model=Transformer(config))
    res = run_capped(["-m", "tinydiff.extras.self_speculative", "--ckpt", tmp_path / "mdlm.pt", "--prompt",
                      "Once upon a time", "--max-new-tokens", "8", "--k", k, "--temperature", "1", "--json"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.count(f"notice: --k {k} is more than a block's 8 positions") == 1
    assert len(json.loads(res.stdout)["ids"]) == 8
