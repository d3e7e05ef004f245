"""Spec: where compiled steps replay CUDA graphs, a wrapper (compiled.StaticModel, StaticDrafter) gives
every story the same cache buffers, emptied (Wrapped.static_cache): a CUDA graph replays fixed
addresses, and inductor's graph trees record a graph again whenever a static input moves. What a
story leaves in the buffers never reaches the next one: on reused buffers, filled with junk between
stories, every loop commits the eager loop's tokens. A cache whose buffers went to a newer story is
refused, so one wrapper can never serve two roles at once. Without CUDA graphs each cache is new.
No GPU here: the tests tell the wrappers they replay CUDA graphs (the buffers are what changes; the
graphs are CUDA's). The models are float64, as in the other path-equality tests."""
import pytest
import torch
from stats_helpers import float64, one_thread, random_drafter, random_model  # noqa: F401 (one_thread: autouse)

from tinydiff.ar import ar_generate
from tinydiff.compiled import StaticDrafter, StaticModel, Wrapped
from tinydiff.dflash_decode import dflash_generate
from tinydiff.errors import UserError
from tinydiff.fused_dflash import FusedDFlash, fused_dflash_generate
from tinydiff.fused_steps import FusedSteps, multi_step_generate
from tinydiff.model import ModelConfig
from tinydiff.speculative import speculative_generate

STORIES = [([3, 1, 4, 1, 5], 20, 0), ([7], 12, 1), ([2, 7, 1, 8, 2, 8, 1], 16, 2)]  # prompt, new tokens, seed


@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    draft = random_model(ModelConfig(vocab_size=64, context=40, n_layer=1, n_head=2, d_model=16, d_ff=32), seed=1)
    drafter = random_drafter(target, seed=2, n_layer=1, block_size=4, n_features=1)
    (target, drafter), (draft,) = float64(target, drafter), float64(draft)
    return target, draft, drafter


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(Wrapped, "replays_cuda_graphs", lambda self, weight: True)


def junk(*wrappers):
    """Finite junk in every row of the wrappers' buffers, as a longer story might leave."""
    g = torch.Generator().manual_seed(9)
    for wrapper in wrappers:
        for t in wrapper.cache_buffers.k + wrapper.cache_buffers.v:
            t.copy_(10 * torch.randn(t.shape, generator=g, dtype=t.dtype))


def decoders(target, draft, drafter):
    """(name, the loop on wrappers, the eager loop, the wrappers) for each way a story meets the buffers."""
    static = lambda m: StaticModel(m, (), compile=False)  # noqa: E731
    steps = FusedSteps(static(target), 3, compile=False)
    spec_target, spec_draft = static(target), static(draft)
    dflash = FusedDFlash(static(target), StaticDrafter(drafter, (), compile=False), compile=False)
    dflash_target, dflash_drafter = static(target), StaticDrafter(drafter, (), compile=False)
    return [
        ("fused ar steps", lambda p, n, g: multi_step_generate(steps, p, n, 1.0, generator=g, stop_token=None),
         lambda p, n, g: ar_generate(target, p, n, 1.0, generator=g, stop_token=None), [steps.model]),
        ("speculative", lambda p, n, g: speculative_generate(spec_target, spec_draft, p, n, 3, 1.0, generator=g,
                                                             stop_token=None),
         lambda p, n, g: speculative_generate(target, draft, p, n, 3, 1.0, generator=g, stop_token=None),
         [spec_target, spec_draft]),
        ("fused dflash", lambda p, n, g: fused_dflash_generate(dflash, p, n, 1.0, generator=g, stop_token=None),
         lambda p, n, g: dflash_generate(target, drafter, p, n, None, 1.0, generator=g, stop_token=None),
         [dflash.target, dflash.drafter]),
        ("dflash", lambda p, n, g: dflash_generate(dflash_target, dflash_drafter, p, n, None, 1.0, generator=g,
                                                   stop_token=None),
         lambda p, n, g: dflash_generate(target, drafter, p, n, None, 1.0, generator=g, stop_token=None),
         [dflash_target, dflash_drafter]),
    ]


def test_every_story_decodes_on_the_same_buffers_and_commits_the_eager_tokens(models, graphs):
    for name, ours, theirs, wrappers in decoders(*models):
        buffers = None
        for prompt, new, seed in STORIES:
            tokens = ours(prompt, new, torch.Generator().manual_seed(seed))[0]
            assert tokens == theirs(prompt, new, torch.Generator().manual_seed(seed))[0], name
            now = [w.cache_buffers.k[0].data_ptr() for w in wrappers]
            assert buffers in (None, now), name  # the same tensors every story
            assert all(w.newest_cache.k is w.cache_buffers.k for w in wrappers)
            buffers = now
            junk(*wrappers)


def test_a_cache_whose_buffers_went_to_a_newer_story_is_refused(models, graphs):
    target, draft, _ = models
    model = StaticModel(target, (), compile=False)
    old, new = model.new_cache(1), model.new_cache(1)
    model(torch.tensor([[1, 2]]), cache=new, causal=True)
    with pytest.raises(UserError, match="newer story.*wrap the model once per role"):
        model(torch.tensor([[1, 2]]), cache=old, causal=True)
    with pytest.raises(UserError, match="once per role"):  # one wrapper as target and draft
        speculative_generate(model, model, [1, 2, 3], 8, 3, 1.0)


def test_without_cuda_graphs_every_cache_is_new(models):
    model = StaticModel(models[0], (), compile=False)
    first, second = model.new_cache(1), model.new_cache(1)
    assert first.k[0] is not second.k[0] and model.cache_buffers is None
