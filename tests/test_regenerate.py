"""The target's regenerated training text: batched, and the same stories one-at-a-time decoding writes."""
import numpy as np
import pytest
import torch

from tinydiff.ar import ar_generate
from tinydiff.errors import UserError
from tinydiff.regenerate import regenerate, story_openings
from tinydiff.tokenizer import EOT


class StopsEarly(torch.nn.Module):
    """The tiny model, but EOT comes next wherever token + position is a multiple of 9: stories end
    at different lengths before the context is full, so the batch must cut each row on its own."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.embed, self.new_cache = model, model.config, model.embed, model.new_cache

    def forward(self, x, **kw):
        pos = kw["cache"].length + torch.arange(x.shape[1])  # (T,): read before the forward advances it
        logits = self.model(x, **kw)  # (B, T, V)
        stop = ((x + pos) % 9 == 0)[..., None]  # (B, T, 1)
        return logits + 1e4 * torch.nn.functional.one_hot(torch.tensor(EOT), logits.shape[-1]) * stop


def corpus(n_stories=12, length=20):
    rng = np.random.default_rng(0)
    return np.concatenate([np.r_[EOT, rng.integers(0, 5000, length)] for _ in range(n_stories)]).astype(np.uint16)


def split_stories(text):
    """The regenerated array -> its stories (each EOT + opening + continuation, without the EOT)."""
    cuts = np.flatnonzero(text == EOT)
    return [text[a + 1:b].tolist() for a, b in zip(cuts[:-1], cuts[1:])]


@pytest.mark.parametrize("batch_size", [1, 3, 32])
def test_batched_regeneration_writes_what_greedy_decoding_writes(tiny_model, batch_size):
    target = StopsEarly(tiny_model).eval()
    tokens = corpus()
    text = regenerate(target, tokens, 7, seed=3, opening=4, batch_size=batch_size)
    stories = split_stories(text)
    openings = story_openings(tokens, 7, 4, 3)
    assert len(stories) == 7 and text[0] == EOT and text[-1] == EOT
    lengths = set()
    for story, opening in zip(stories, openings):
        ids, _ = ar_generate(target, [EOT] + opening, None, 0.0)  # one story, batch of one
        assert story == opening + [t for t in ids if t != EOT]
        lengths.add(len(story))
    assert len(lengths) > 1  # rows really did end at different steps


def test_regenerate_asks_for_at_least_one_story(tiny_model):
    with pytest.raises(UserError, match="--regenerate must be >= 1"):
        regenerate(tiny_model, corpus(), 0, seed=0)


def test_sampled_openings_are_sampled_then_continued_greedily(tiny_model):
    # The target samples each opening (never EOT), then writes what greedy decoding writes after it.
    target = StopsEarly(tiny_model).eval()
    text = regenerate(target, corpus(), 9, seed=5, opening=4, batch_size=4, sampled_openings=True)
    stories = split_stories(text)
    assert len(stories) == 9 and text[0] == EOT and text[-1] == EOT
    assert len({tuple(story[:4]) for story in stories}) == 9  # 9 distinct starts from one prompt
    for story in stories:
        ids, _ = ar_generate(target, [EOT] + story[:4], None, 0.0)
        assert story == story[:4] + [t for t in ids if t != EOT]
    again = regenerate(target, corpus(), 9, seed=5, opening=4, batch_size=4, sampled_openings=True)
    assert np.array_equal(text, again)
