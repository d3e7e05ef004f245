"""Spec: an AR draft for a diffusion LM (tinydiff/extras/drafted_diffusion.py) samples exactly the cached
left-to-right one-token-per-step sampler, only with fewer forwards. At temperature 0 token for token
(float64 models, shifted or not, any number of drafts); at temperature 1.5 its samples follow that
sampler's exact joint, enumerated with plain uncached forwards (chi-square with its power
asserted); the counts are the forwards and canvases the model really ran; the head's one-position
path gives the full forward's logits. (The stories such a draft trains on: test_regenerate.py.)"""
import pytest
import torch
from diffusion_joint import NEW, SMALL_PROMPT, SmallVocab, V, exact_joint
from stats_helpers import (
    assert_follows_the_joint,
    assert_same,
    one_thread,  # noqa: F401 (autouse fixture)
    random_model,
)

from tinydiff.checks import UserError
from tinydiff.extras.drafted_diffusion import ar_drafted_generate, logits_at
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampler import generate_cached, prefix_cached_logits
from tinydiff.tokenizer import MASK

PROMPT = [50256, 464, 3797, 318]


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "shifted"])
def peaked(request):
    """Random float64 diffusion weights whose entropies spread, so drafts are kept and rejected."""
    config = ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False, shift=request.param)
    return random_model(config, 0, embed_std=2.0).double()


@pytest.fixture(scope="module")
def draft():
    return random_model(ModelConfig(context=64, n_layer=1, n_head=2, d_model=32, d_ff=64), 5, embed_std=2.0).double()


def counting(model):
    """The batch size of every forward the model runs."""
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    return calls


@pytest.mark.parametrize("drafts", [1, 3, 8])
def test_greedy_tokens_equal_the_left_to_right_sampler(peaked, draft, drafts):
    want, base = generate_cached(peaked, PROMPT, 16, 16, 8, 0.0, "left_to_right")
    rounds = []
    got, stats = ar_drafted_generate(peaked, draft, PROMPT, 16, 8, 0.0, drafts, on_round=rounds.append)
    assert got == want
    committed = [t for r in rounds for t in r["committed"]]
    assert committed == [(len(PROMPT) + i, t) for i, t in enumerate(want)]  # each position once, left to right
    assert all(1 <= len(r["committed"]) <= drafts + 1 for r in rounds)
    assert stats.forwards == stats.rounds <= base.forwards


def test_a_draft_that_is_always_right_fills_a_block_in_one_forward_per_drafts_plus_one(peaked):
    """A draft that writes the target's greedy text is kept whole: ceil(N / (k + 1)) forwards a block."""
    want, _ = generate_cached(peaked, PROMPT, 16, 16, 8, 0.0, "left_to_right")
    text = PROMPT + want

    class Oracle(torch.nn.Module):  # an AR model whose argmax after any prefix of `text` is the next token
        def __init__(self):
            super().__init__()
            self.config, self.embed = ModelConfig(context=64), torch.nn.Embedding(1, 1)

        def new_cache(self, batch_size=1):
            return Transformer(ModelConfig(context=64, n_layer=1, n_head=1, d_model=2, d_ff=2)).new_cache(batch_size)

        def forward(self, x, cache, causal):
            start = cache.length
            cache.advance(x.shape[1])
            nxt = torch.tensor(text[start + 1:start + 1 + x.shape[1]])
            return 50.0 * torch.nn.functional.one_hot(nxt, 50258)[None].double()

    for drafts, per_block in ((3, 2), (7, 1)):
        got, stats = ar_drafted_generate(peaked, Oracle(), PROMPT, 16, 8, 0.0, drafts)
        assert got == want and stats.forwards == 2 * per_block and stats.rejected == 0


def test_counts_are_the_forwards_and_canvases_run():
    model, draft = SmallVocab(True, 3), SmallVocab(False, 8, causal=True)  # 6 ids: drafts are often kept
    calls, draft_calls = counting(model), counting(draft)
    generator, hist, rejected = torch.Generator().manual_seed(0), torch.zeros(4, dtype=torch.long), 0
    for _ in range(20):
        calls.clear(), draft_calls.clear()
        out, stats = ar_drafted_generate(model, draft, SMALL_PROMPT, NEW, NEW, 1.0, 3, generator=generator)
        assert stats.forwards == len(calls) == stats.rounds and stats.canvases == sum(calls)
        assert stats.draft_forwards == len(draft_calls) and calls[0] == 3 + 1  # the first round drafts 3
        assert stats.new_tokens == len(out) == NEW and stats.canvases_per_token == stats.canvases / NEW
        hist, rejected = hist + torch.tensor(stats.accepted), rejected + stats.rejected
    assert rejected > 0 and hist[3] > 0  # both branches of the rule ran: a rejection, and all 3 kept (the bonus)


CASES = {"plain, two blocks": (False, 2, 2), "shifted, one block": (True, 4, 3)}  # shift, block, drafts
TEMPERATURE, SAMPLES = 1.5, 5_000


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_samples_follow_the_left_to_right_joint(case):
    """Chi-square of seeded generations against the enumerated joint at significance 1e-3, with power
    >= 0.9 against one continuation off by 2 points (stats_helpers.assert_follows_the_joint). A random
    draft: drafts are kept, rejected, and kept whole (the bonus drawn)."""
    shifted, block, drafts = CASES[case]
    model, draft = SmallVocab(shifted, 3), SmallVocab(False, 8, causal=True)
    probs = exact_joint(model, "left_to_right", TEMPERATURE, block)
    counts = torch.zeros(V ** NEW, dtype=torch.long)
    generator, kept = torch.Generator().manual_seed(1234), []
    for _ in range(SAMPLES):
        out, _ = ar_drafted_generate(model, draft, SMALL_PROMPT, NEW, block, TEMPERATURE, drafts, generator=generator,
                                     on_round=lambda info: kept.append((info["accepted"], len(info["drafts"]))))
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(out))] += 1
    assert_follows_the_joint(probs, counts, SAMPLES)
    assert any(a < n for a, n in kept) and any(a == n > 0 for a, n in kept)


@torch.no_grad()
def test_logits_at_one_position_per_canvas_is_the_full_forward_s(peaked):
    P, lo, N = len(PROMPT), len(PROMPT) + 8, 8
    canvases = torch.tensor(PROMPT + list(range(7, 15)) + [MASK] * N).repeat(3, 1)  # (3, L): block 2 open
    canvases[1, lo:lo + 2] = torch.tensor([5, 6])
    full = prefix_cached_logits(peaked, canvases, peaked.new_cache(3), lo, P, N)  # (3, N, V)
    at = torch.tensor([0, 2, 5])
    assert_same(logits_at(peaked, canvases, peaked.new_cache(3), lo, P, N, at)[:, 0], full[[0, 1, 2], at])
    assert_same(logits_at(peaked, canvases, peaked.new_cache(3), lo, P, N, 4)[:, 0], full[:, 4])


def test_bad_input_gets_a_one_line_error(draft):
    model = Transformer(ModelConfig(context=64, n_layer=1, n_head=2, d_model=16, d_ff=32, causal=False)).eval()
    with pytest.raises(UserError, match="reads the committed text left to right"):
        ar_drafted_generate(model, model, PROMPT, 8, 8, 1.0, 2)
    with pytest.raises(UserError, match="draft positions must be an integer >= 1"):
        ar_drafted_generate(model, draft.float(), PROMPT, 8, 8, 1.0, 0)
    short = Transformer(ModelConfig(context=8, n_layer=1, n_head=2, d_model=16, d_ff=32)).eval()
    with pytest.raises(UserError, match="context"):
        ar_drafted_generate(model, short, PROMPT, 8, 8, 1.0, 2)
    with pytest.raises(UserError, match="multiple of the block length"):
        ar_drafted_generate(model, draft.float(), PROMPT, 10, 8, 1.0, 2)
