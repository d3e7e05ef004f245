"""Spec: where compiled steps replay CUDA graphs, a compiled model (fast/compiled.compiled) gives every story
the same cache buffers, emptied: a CUDA graph replays fixed addresses, and inductor's graph trees record a
graph again whenever a static input moves. What a
story leaves in the buffers never reaches the next one: on reused buffers, filled with junk between
stories, every method's `--compile` loop (tests/compiled_loops.py) commits the eager loop's tokens and
accepts as many drafts each round (a draft that read junk rows changes the counts, not the tokens). A
cache whose buffers went to a newer story is refused, so one compiled model can never serve two roles at once.
Without CUDA graphs each cache is new.
No GPU here: the loops run on their models uncompiled, which are told they replay CUDA graphs (the
buffers are what changes; the graphs are CUDA's). The models are float64, as in the other
path-equality tests."""
import pytest
import torch
from compiled_loops import METHODS, Loop, compiled_loops, eager_loops, models
from stats_helpers import one_thread  # noqa: F401 (autouse)

from tinydiff.checks import UserError
from tinydiff.fast import compiled as fast
from tinydiff.speculative import speculative_generate

# prompt, new tokens, seed: a short story after a long one, a 1-token prompt, one that reaches the context's end
STORIES = [([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 20, 0), ([7], 12, 1), ([2, 7, 1, 8, 2, 8, 1], 30, 2)]


@pytest.fixture(scope="module")
def loops():
    """Every method's --compile loop on its models, uncompiled, and its eager twin; float64 models. Built where
    the models are told they replay CUDA graphs, so each shares one set of cache buffers among its caches."""
    m = models(dtype=torch.float64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast, "replays_cuda_graphs", lambda step, weight: True)
        return m, compiled_loops(m, compile=False), eager_loops(m)


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(fast, "replays_cuda_graphs", lambda step, weight: True)


def junk(*wrappers):
    """Finite junk in every row of the wrappers' buffers, as a longer story might leave."""
    g = torch.Generator().manual_seed(9)
    for wrapper in wrappers:
        for t in wrapper.cache_buffers.k + wrapper.cache_buffers.v:
            t.copy_(10 * torch.randn(t.shape, generator=g, dtype=t.dtype))


@pytest.mark.parametrize("method", METHODS)
def test_every_story_decodes_on_the_same_buffers_and_commits_the_eager_tokens(loops, graphs, method):
    ours: Loop = loops[1][method]
    theirs = loops[2][method]
    buffers = None
    for prompt, new, seed in STORIES:
        tokens, stats = ours.decode(1.0, torch.Generator().manual_seed(seed), prompt, new)
        eager_tokens, eager_stats = theirs(1.0, torch.Generator().manual_seed(seed), prompt, new)
        assert tokens == eager_tokens
        # the drafts too: a draft that read junk can change the accepted counts but not the tokens
        assert getattr(stats, "accepted", None) == getattr(eager_stats, "accepted", None)
        now = [w.cache_buffers.k[0].data_ptr() for w in ours.wrappers]
        assert buffers in (None, now)  # the same tensors every story
        buffers = now
        junk(*ours.wrappers)


def test_a_cache_whose_buffers_went_to_a_newer_story_is_refused(loops, graphs):
    target = loops[0]["target"]
    model = fast.compiled(target, (), compile=False)
    old, new = model.new_cache(1), model.new_cache(1)
    model(torch.tensor([[1, 2]]), cache=new, causal=True)
    with pytest.raises(UserError, match="newer story.*compile the model once per role"):
        model(torch.tensor([[1, 2]]), cache=old, causal=True)
    with pytest.raises(UserError, match="once per role"):  # one wrapper as target and draft
        speculative_generate(model, model, [1, 2, 3], 8, 3, 1.0)


def test_without_cuda_graphs_every_cache_is_new(loops):
    model = fast.compiled(loops[0]["target"], (), compile=False)
    first, second = model.new_cache(1), model.new_cache(1)
    assert first.k[0] is not second.k[0] and model.cache_buffers is None
