"""Spec for tinydiff/data.py: token files -> deterministic windows (batch i from (seed, i) alone)."""
import numpy as np
import pytest
import torch

from tinydiff import data
from tinydiff.checks import UserError
from tinydiff.io.tokens import prepare_tokens


def write_stories(path, stories: list[str]):
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories), encoding="utf-8")
    return path


def test_load_tokens_is_readonly_uint16_memmap(tmp_path):
    src = write_stories(tmp_path / "s.txt", [f"Story {i}: a cat." for i in range(4)])
    train, _ = prepare_tokens(src, tmp_path / "cache")
    t = data.load_tokens(train)
    assert isinstance(t, np.memmap) and t.dtype == np.uint16 and not t.flags.writeable
    with pytest.raises(UserError, match="does not exist"):
        data.load_tokens(tmp_path / "nope.u16")


def test_sample_windows_are_contiguous_slices(tmp_path):
    path = tmp_path / "t.u16"
    np.arange(1000, dtype=np.uint16).tofile(path)
    tokens = data.load_tokens(path)
    w = data.sample_windows(tokens, batch_size=8, length=64, seed=0, index=0)
    assert w.shape == (8, 64) and w.dtype == torch.int64
    assert (w[:, 1:] - w[:, :-1] == 1).all()  # arange tokens: a slice counts up by one
    assert ((w[:, 0] >= 0) & (w[:, -1] <= 999)).all()


def test_sample_windows_cover_every_start(tmp_path):
    tokens = np.arange(12, dtype=np.uint16)
    starts = {int(s) for i in range(50) for s in data.sample_windows(tokens, 4, 10, 1, i)[:, 0]}
    assert starts == {0, 1, 2}  # uniform over [0, len - length], both ends included


def test_sample_windows_depend_on_seed_and_index_only():
    tokens = np.arange(5000, dtype=np.uint16)
    a = data.sample_windows(tokens, 4, 32, seed=3, index=7)
    for i in range(5):  # other batches and the global RNG in between change nothing
        data.sample_windows(tokens, 4, 32, seed=3, index=i)
    torch.manual_seed(123)
    assert torch.equal(a, data.sample_windows(tokens, 4, 32, seed=3, index=7))
    assert not torch.equal(a, data.sample_windows(tokens, 4, 32, seed=3, index=8))
    assert not torch.equal(a, data.sample_windows(tokens, 4, 32, seed=4, index=7))


def test_eval_windows_fixed_and_spanning():
    tokens = np.arange(1000, dtype=np.uint16)
    w = data.eval_windows(tokens, count=5, length=100)
    assert w.shape == (5, 100) and w.dtype == torch.int64
    assert torch.equal(w, data.eval_windows(tokens, 5, 100))
    starts = w[:, 0].tolist()
    assert starts[0] == 0 and starts[-1] == 900 and starts == sorted(starts)
    assert (w[:, 1:] - w[:, :-1] == 1).all()
    assert data.eval_windows(tokens, 1, 1000)[0, 0] == 0


def test_windows_longer_than_split():
    tokens = np.arange(50, dtype=np.uint16)
    with pytest.raises(UserError, match="has 50 tokens but windows need 64"):
        data.sample_windows(tokens, 2, 64, 0, 0)
    with pytest.raises(UserError, match="has 50 tokens but windows need 64"):
        data.eval_windows(tokens, 2, 64)
    with pytest.raises(UserError, match="batch_size"):
        data.sample_windows(tokens, 0, 8, 0, 0)

