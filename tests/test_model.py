"""Spec: one Transformer. Causal vs bidirectional attention, explicit masks and positions,
KV-cached decoding, crop and keep, hidden-state taps, parameter counts of the presets, the padded
vocabulary that no decoding method reads."""
import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from stats_helpers import (
    assert_same,
    float64,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
)

from tinydiff.checks import UserError
from tinydiff.model import PRESETS, ModelConfig, Transformer, padded_vocab, preset
from tinydiff.tokenizer import EOT, VOCAB_SIZE


@pytest.fixture
def model64(tiny_model):
    """tiny_model in float64, for the tests that compare two code paths (cached and uncached, a tree
    and its path): they sum the same terms in different orders, so they agree to float64 rounding."""
    return float64(tiny_model)[0]


def tokens(B, T, seed=0):
    return torch.randint(0, 50257, (B, T), generator=torch.Generator().manual_seed(seed))


def expected_params(c):
    per_layer = 4 * c.d_model ** 2 + 3 * c.d_model * c.d_ff + 2 * c.d_model  # attn, SwiGLU, 2 norms
    return c.vocab_size * c.d_model + c.n_layer * per_layer + c.d_model     # + tied embedding, final norm


@pytest.mark.parametrize("name", list(PRESETS))
def test_parameter_counts_match_the_architecture(name):
    model = Transformer(preset(name))
    assert model.num_params() == expected_params(model.config)
    assert model.num_params(embedding=False) == model.num_params() - model.config.vocab_size * model.config.d_model


def test_13m_preset_is_about_13m():
    assert 12.5e6 < Transformer(preset("13m")).num_params() < 13.5e6


def test_bad_preset_and_shapes_fail_clearly():
    with pytest.raises(UserError, match="unknown preset"):
        preset("huge")
    with pytest.raises(UserError, match="heads"):
        Transformer(preset("tiny", d_model=130))


@torch.no_grad()
def test_causal_change_at_j_never_reaches_before_j(tiny_model):
    x = tokens(2, 20)
    for j in (0, 7, 19):
        y = x.clone()
        y[:, j] = (y[:, j] + 1) % 50257
        a, b = tiny_model(x, causal=True), tiny_model(y, causal=True)
        assert torch.equal(a[:, :j], b[:, :j])
        assert not torch.allclose(a[:, j:], b[:, j:])


@torch.no_grad()
def test_bidirectional_change_at_j_reaches_every_position(tiny_model):
    x = tokens(1, 20)
    y = x.clone()
    y[:, 15] = (y[:, 15] + 1) % 50257
    a, b = tiny_model(x, causal=False), tiny_model(y, causal=False)
    assert (a - b).abs().amax(-1).min() > 1e-6  # every position, including those before 15


@torch.no_grad()
def test_explicit_causal_mask_equals_causal(tiny_model):
    x = tokens(2, 24)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    assert torch.equal(tiny_model(x, causal=True), tiny_model(x, mask=causal))
    assert torch.equal(tiny_model(x, causal=True), tiny_model(x, mask=causal.expand(2, 24, 24)))
    full = torch.ones(24, 24, dtype=torch.bool)
    assert torch.equal(tiny_model(x, causal=False), tiny_model(x, mask=full))


@torch.no_grad()
def test_kv_cached_decoding_equals_full_forward(model64):
    x = tokens(2, 30)
    full = model64(x, causal=True)
    cache = model64.new_cache(2)
    assert cache.k[0].dtype == torch.float64  # the weights' dtype
    parts = [model64(x[:, :9], cache=cache, causal=True)]
    for t in range(9, 30, 4):  # chunks of several tokens, then the last odd one
        parts.append(model64(x[:, t:t + 4], cache=cache, causal=True))
    assert cache.length == 30
    assert_same(torch.cat(parts, 1), full)


def cache_rows(cache, n):
    return [t[:, :, :n] for t in cache.k + cache.v]


@torch.no_grad()
def test_crop_equals_recomputing_the_prefix(model64):
    x = tokens(1, 20)
    cache = model64.new_cache()
    model64(x[:, :12], cache=cache, causal=True)
    model64(tokens(1, 5, seed=1), cache=cache, causal=True)  # a rejected draft
    cache.crop(12)
    fresh = model64.new_cache()
    model64(x[:, :12], cache=fresh, causal=True)
    for a, b in zip(cache_rows(cache, 12), cache_rows(fresh, 12)):
        assert_same(a, b)
    # and decoding continues as if the draft never happened
    assert_same(model64(x[:, 12:], cache=cache, causal=True), model64(x, causal=True)[:, 12:])
    with pytest.raises(ValueError):
        cache.crop(cache.length + 1)


@torch.no_grad()
def test_keep_rows_of_a_tree_equals_recomputing_the_path(model64):
    """Prefix of 10, then two sibling branches [a1, a2] and [b1, b2] at positions 10, 11 in one
    forward with an ancestor mask; keeping prefix + branch b equals a cache of prefix + b."""
    prefix, a, b = tokens(1, 10), tokens(1, 2, seed=1), tokens(1, 2, seed=2)
    cache = model64.new_cache()
    model64(prefix, cache=cache, causal=True)
    tree = torch.cat([a, b], 1)  # nodes: a1 a2 b1 b2
    sees = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 10, dtype=torch.bool), sees], 1)  # (4, 14)
    tree_logits = model64(tree, mask=mask, pos=torch.tensor([10, 11, 10, 11]), cache=cache)
    cache.keep(list(range(10)) + [12, 13])
    fresh = model64.new_cache()
    path_logits = model64(torch.cat([prefix, b], 1), cache=fresh, causal=True)
    assert cache.length == fresh.length == 12
    for x, y in zip(cache_rows(cache, 12), cache_rows(fresh, 12)):
        assert_same(x, y)
    assert_same(tree_logits[:, 2:], path_logits[:, 10:])


@torch.no_grad()
def test_positions_enter_only_through_relative_rope(model64):
    x = tokens(2, 8)
    base = model64(x, causal=True)
    shifted = model64(x, pos=torch.arange(3, 11), causal=True)
    assert torch.equal(shifted, model64(x, pos=torch.arange(3, 11).expand(2, 8), causal=True))
    # RoPE scores depend on distances only: a uniform shift changes nothing but (float64) rounding,
    assert_same(shifted, base)
    # while moving the last token away from the others changes what it sees, by far more.
    moved = model64(x, pos=torch.tensor([0, 1, 2, 3, 4, 5, 6, 20]), causal=True)
    assert (moved[:, -1] - base[:, -1]).abs().max() > 1e-4 * base.abs().max()  # 1e-3 of it here


@torch.no_grad()
def test_hidden_layers_are_the_residual_stream(model64):
    x = tokens(1, 6)
    logits, (h2, h0, h1) = model64(x, hidden_layers=[2, 0, 1])
    assert_same(h0, model64.embed(x))
    assert_same(logits, F.linear(model64.norm(h2), model64.embed.weight[:model64.config.vocab_size]))
    assert_same(h2, model64.blocks[1](h1, *rope(model64, 6), None, True, None, None, 1))


@torch.no_grad()
def test_head_from_gives_the_same_logits_for_the_later_positions(model64):
    x = tokens(2, 10)
    assert_same(model64(x, head_from=4), model64(x)[:, 4:])


def rope(model, T):
    return model.rope_cos[:T].view(1, 1, T, -1), model.rope_sin[:T].view(1, 1, T, -1)


def test_context_overflow_and_bad_mask_fail_clearly(tiny_model):
    with pytest.raises(UserError, match="exceeds the model's context"):
        tiny_model(tokens(1, 33))
    tiny_model(tokens(1, 64), pos=torch.arange(32).repeat(2))  # given positions: a window may be read twice
    with pytest.raises(UserError, match="position ids must lie in"):
        tiny_model(tokens(1, 2), pos=torch.tensor([0, 32]))
    with pytest.raises(ValueError, match="mask must end in shape"):
        tiny_model(tokens(1, 4), mask=torch.ones(4, 5, dtype=torch.bool))


# ---- the vocabulary padded to a multiple of 64 rows (model.padded_vocab), the padding never read

def with_garbage_padding(model, seed=9):
    """A copy of `model` whose padding rows hold large random numbers (logits of about +-500 if they were
    read): a method that samples, scores, counts or drafts them would decode differently."""
    twin = copy.deepcopy(model)
    with torch.no_grad():
        rows = twin.embed.weight[twin.config.vocab_size:]
        rows.copy_(100 * torch.randn(rows.shape, generator=torch.Generator().manual_seed(seed)))
    return twin


def test_the_embedding_is_padded_with_zero_rows_that_the_logits_leave_out():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=100, context=8, n_layer=1, n_head=2, d_model=16, d_ff=32))
    assert padded_vocab(100) == 128 and padded_vocab(VOCAB_SIZE) == 50_304 and padded_vocab(128) == 128
    assert model.embed.weight.shape == (128, 16) and not model.embed.weight[100:].any()
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 100)
    assert model.num_params() == sum(p.numel() for p in model.parameters()) - 28 * 16  # the padding not counted


def decoders():
    """Every core decoding method, (name, models -> (ids, result)), sampled at temperature 1 where it samples."""
    from eagle_models import random_head
    from stats_helpers import random_drafter

    from tinydiff.ar import ar_generate
    from tinydiff.ddtree import ddtree_generate
    from tinydiff.dflash import dflash_generate
    from tinydiff.eagle3 import eagle_generate
    from tinydiff.sampler import generate, generate_cached
    from tinydiff.speculative import speculative_generate
    from tinydiff.ssd import ssd_generate

    def g():
        return torch.Generator().manual_seed(5)
    drafter = partial(random_drafter, seed=1, n_layer=1, block_size=6, n_features=2)
    prompt = [EOT, 464, 3290]
    return {
        "ar": lambda t, d, m: ar_generate(t, prompt, 10, 1.0, generator=g()),
        "spec": lambda t, d, m: speculative_generate(t, d, prompt, 10, 3, 1.0, generator=g()),
        "ssd": lambda t, d, m: ssd_generate(t, d, prompt, 10, 3, 2, 1.0, generator=g()),
        "dflash": lambda t, d, m: dflash_generate(t, drafter(t), prompt, 10, None, 1.0, generator=g()),
        "ddtree": lambda t, d, m: ddtree_generate(t, drafter(t), prompt, 10, None, 8, 0.0),
        "eagle3 chain": lambda t, d, m: eagle_generate(t, random_head(t, seed=1), prompt, 10, 3, None, 4, 1.0,
                                                       generator=g()),
        "eagle3 tree": lambda t, d, m: eagle_generate(t, random_head(t, seed=1), prompt, 10, 3, 8, 4, 0.0),
        "diffusion": lambda t, d, m: generate(m, prompt, 16, 16, 8, 1.0, generator=g()),
        "diffusion, entropy bound": lambda t, d, m: generate(m, prompt, 16, 16, 8, 1.0, generator=g(),
                                                             entropy_bound=0.5),
        "diffusion-cached, threshold": lambda t, d, m: generate_cached(m, prompt, 16, 16, 8, 1.0, threshold=0.5,
                                                                       generator=g()),
    }


@torch.no_grad()
def test_no_decoding_method_reads_the_padding_rows():
    """Every method decodes the same tokens, with the same counts, whatever the padding rows hold: the one cut
    (model.tied_head) keeps them from every logit a target, draft, drafter or head makes."""
    from stats_helpers import random_model
    target = random_model(ModelConfig(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    draft = random_model(ModelConfig(context=40, n_layer=1, n_head=2, d_model=16, d_ff=32), seed=1)
    mdlm = random_model(ModelConfig(context=40, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False), seed=2)
    clean, dirty = (target, draft, mdlm), tuple(map(with_garbage_padding, (target, draft, mdlm)))
    for name, decode in decoders().items():
        (ids, result), (ids2, result2) = decode(*clean), decode(*dirty)
        counts, counts2 = ({k: v for k, v in r.row().items() if "seconds" not in k and not k.endswith("_s")}
                           for r in (result, result2))  # the timings left out
        assert ids == ids2 and counts == counts2, name
        assert ids and max(ids) < VOCAB_SIZE, name
