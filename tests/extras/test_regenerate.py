"""The target's regenerated training text: batched, and the same stories one-at-a-time decoding writes;
a diffusion target's, written by its left-to-right sampler (exact greedy text, and the sampler's joint)."""
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusion_joint import NEW, SMALL_PROMPT, SmallVocab, V, exact_joint
from stats_helpers import assert_follows_the_joint, random_model

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.extras.regenerate import (
    continue_diffusion_batch,
    first_repeat,
    load_or_regenerate,
    regenerate,
    story_openings,
    trim_loops,
)
from tinydiff.model import ModelConfig
from tinydiff.sampler import generate_cached
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


@pytest.mark.parametrize("damage", ["0xff", "other text", "cut", "other seed", "no stamp"])
def test_regenerated_stories_that_fail_their_stamp_are_written_again(tiny_model, tmp_path, capsys, damage):
    """A run's regenerated stories are read back only while their stamp holds: overwritten in place with 0xFF
    (ids past the vocabulary) or with the same ids reversed (the sha256), cut short, left by a run with
    another seed, or without a stamp, the target writes them again, with one notice naming the file."""
    path, source = tmp_path / "regenerated.u16", {"target": "target.pt", "data": "stories.txt"}
    target = StopsEarly(tiny_model).eval()
    good = load_or_regenerate(path, source, target, corpus(), 5, seed=1)
    assert np.array_equal(load_or_regenerate(path, source, target, corpus(), 5, seed=1), good)
    assert "notice" not in capsys.readouterr().err
    seed = 2 if damage == "other seed" else 1
    if damage == "0xff":
        path.write_bytes(b"\xff" * good.nbytes)
    elif damage == "other text":
        path.write_bytes(good[::-1].tobytes())
    elif damage == "cut":
        path.write_bytes(good[:-1].tobytes())
    elif damage == "no stamp":
        Path(f"{path}.stamp.json").unlink()
    again = load_or_regenerate(path, source, target, corpus(), 5, seed=seed)
    assert capsys.readouterr().err.count(f"notice: {path} ") == 1
    expected = regenerate(target, corpus(), 5, seed=seed)
    assert np.array_equal(again, expected) and np.array_equal(np.fromfile(path, dtype=np.uint16), expected)
    assert np.array_equal(again, good) == (seed == 1)


def test_first_repeat_ends_the_first_ngram_seen_before():
    assert first_repeat([1, 2, 3, 1, 2, 3, 1], 3) == 6  # (1, 2, 3) again at positions 3..5
    assert first_repeat([1, 2, 1, 2], 3) == 4 and first_repeat([1, 2, 3, 4], 2) == 4  # (1, 2) never ends a repeat of 3
    assert first_repeat([7, 7, 7], 2) == 3 and first_repeat([5], 8) == 1


def test_trim_loops_cuts_each_story_keep_tokens_past_its_first_repeat():
    loop = [10, 11, 12, 13] * 10  # first repeated 4-gram ends at 8
    plain = list(range(100, 130))  # no repeats: kept whole
    text = np.array([EOT, *loop, EOT, *plain, EOT, *loop[:9], EOT], dtype=np.uint16)
    trimmed = trim_loops(text, ngram=4, keep=3)
    assert trimmed.dtype == np.uint16
    assert split_stories(trimmed) == [loop[:8 + 3], plain, loop[:9]]  # the last runs out before keep does


def test_trim_loops_keeps_stories_prefixes_of_the_targets_own(tiny_model):
    text = regenerate(tiny_model.eval(), corpus(), 6, seed=1, opening=4)
    stories, trimmed = split_stories(text), split_stories(trim_loops(text, ngram=2, keep=1))
    assert len(trimmed) == len(stories) == 6
    for full, cut in zip(stories, trimmed):
        assert full[:len(cut)] == cut and len(cut) == min(len(full), first_repeat(full, 2) + 1)
    assert sum(map(len, trimmed)) < sum(map(len, stories))  # an untrained greedy model loops at once


TEMPERATURE, SAMPLES = 1.5, 5_000


@torch.no_grad()
def test_a_diffusion_target_writes_stories_from_its_left_to_right_joint():
    """Every story a row of one batch: chi-square against the enumerated joint of the left-to-right
    sampler at significance 1e-3, power >= 0.9 against one continuation off by 2 points."""
    model = SmallVocab(False, 3)
    model.config = ModelConfig(vocab_size=V + 1, context=len(SMALL_PROMPT) + NEW, n_layer=1, n_head=2, d_model=16,
                               d_ff=32, causal=False)  # the stories fill the context: NEW tokens
    probs = exact_joint(model, "left_to_right", TEMPERATURE, 2)
    rows = continue_diffusion_batch(model, [SMALL_PROMPT] * SAMPLES, TEMPERATURE, torch.Generator().manual_seed(7),
                                    block_length=2)
    counts = torch.zeros(V ** NEW, dtype=torch.long)
    for out in rows:
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(out))] += 1
    assert_follows_the_joint(probs, counts, SAMPLES)


@pytest.mark.parametrize("shift", [False, True])
def test_a_diffusion_target_writes_what_its_greedy_left_to_right_sampler_writes(shift):
    """Each row of a batch is generate_cached's left-to-right text after its prompt (float64: batched rows
    round as one), whole blocks up to the context, cut after the first EOT."""
    config = ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False, shift=shift)
    target = random_model(config, 0, embed_std=2.0).double()
    target.embed.weight.data[EOT] *= 2  # EOT comes up in some rows and not in others
    prompts = [[EOT, 464, 3797, 318], [EOT, 11, 12, 13], [EOT, 40, 41, 42]]
    rows = continue_diffusion_batch(target, prompts, 0.0, None, block_length=8)
    ended = 0
    for prompt, row in zip(prompts, rows):
        want, _ = generate_cached(target, prompt, 56, 56, 8, 0.0, "left_to_right")
        assert row == (want[:want.index(EOT) + 1] if EOT in want else want)
        ended += EOT in row
    assert 0 < ended < len(rows)  # rows cut on their own, and rows run to the context




def test_an_ar_draft_learns_a_diffusion_target_from_the_stories_it_writes(story_file, tmp_path):
    """train.py --model ar --target MDLM --regenerate N: the stories are the diffusion target's (whole
    blocks of 32 after each 8-token opening, as far as its context allows), and they are the labels."""
    import train
    from tinydiff.io.checkpoint import load_checkpoint, save_checkpoint
    from tinydiff.model import Transformer
    config = ModelConfig(context=48, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False)  # one block after 9
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=config, model=Transformer(config))
    common = ["--model", "ar", "--target", str(tmp_path / "mdlm.pt"), "--data", str(story_file), "--preset", "draft",
              "--context", "16", "--batch-size", "2", "--max-steps", "2", "--warmup", "1", "--eval-every", "2",
              "--eval-batches", "1", "--device", "cpu"]
    train.main([*common, "--regenerate", "3", "--draft-temperature", "1", "--out", str(tmp_path / "draft")])
    assert load_checkpoint(tmp_path / "draft" / "ckpt.pt")["kind"] == "ar"
    stories = split_stories(np.fromfile(tmp_path / "draft" / "regenerated.u16", dtype=np.uint16))
    assert len(stories) == 3 and all(8 < len(story) <= 8 + 32 for story in stories)
    with pytest.raises(UserError, match="learns a diffusion --target from the stories it writes: add --regenerate"):
        train.main([*common, "--draft-temperature", "1", "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match="holds a mdlm model; this needs ar or ar-moe"):
        train.main(["--model", "dflash", *common[2:6], "--regenerate", "2", "--out", str(tmp_path / "y")])
