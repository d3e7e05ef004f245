"""Spec: GPT-2 BPE + MASK. Round trips, MASK never from user text, clear error when offline."""
import pytest
from conftest import SHARED, STORIES

from tinydiff.checks import UserError
from tinydiff.tokenizer import EOT, MASK, MASK_TEXT, VOCAB_SIZE, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


def test_ids_and_vocabulary(tok):
    assert (EOT, MASK, VOCAB_SIZE) == (50256, 50257, 50258)
    assert tok.bpe.n_vocab == MASK == VOCAB_SIZE - 1  # MASK is the one id appended to GPT-2's
    assert tok.encode("<|endoftext|>", allow_special=True) == [EOT]


@pytest.mark.parametrize("text", STORIES + ["", " leading space", "émoji 🐻 and tabs\t\n", "a<MASK>b"])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_round_trip_every_shared_story(tok):
    path = SHARED / "data" / "tinystories-sample.txt"
    if not path.exists():
        pytest.skip("no ../shared sample here; the carried stories above still run")
    stories = [s.strip() for s in path.read_text(encoding="utf-8").split("<|endoftext|>") if s.strip()]
    assert len(stories) > 1000
    for ids, story in zip(tok.encode_batch(stories, num_threads=2), stories):
        assert MASK not in ids and EOT not in ids
        assert tok.decode(ids) == story


def test_user_text_never_becomes_special(tok):
    for text in ["<MASK>", "<|endoftext|>", "x <MASK><MASK> <|endoftext|> y"]:
        ids = tok.encode(text)
        assert MASK not in ids and EOT not in ids
        assert tok.decode(ids) == text
    assert tok.encode("a <MASK> b <|endoftext|>", allow_special=True).count(MASK) == 1


def test_decode_shows_mask_as_placeholder(tok):
    ids = tok.encode("The cat") + [MASK, MASK] + tok.encode(" sat.")
    assert tok.decode(ids) == f"The cat{MASK_TEXT}{MASK_TEXT} sat."
    assert tok.decode([MASK]) == MASK_TEXT


def test_decode_rejects_ids_outside_vocabulary(tok):
    with pytest.raises(UserError, match="outside the vocabulary"):
        tok.decode([1, VOCAB_SIZE])
    with pytest.raises(UserError, match="takes a str"):
        tok.encode(b"bytes")


def test_offline_without_cache_names_the_env_var(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(UserError, match="TIKTOKEN_CACHE_DIR"):
        Tokenizer()
