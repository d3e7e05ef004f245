"""Spec for tinydiff/io/tokens.py: story files -> cached uint16 token files, never trusted half-written, nor
damaged in place (a recorded sha256), nor holding an id past the vocabulary (data.load_tokens)."""
import hashlib
import json
import os
import re
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from tinydiff.checks import UserError
from tinydiff.data import load_tokens
from tinydiff.io import tokens as io_tokens
from tinydiff.tokenizer import EOT, Tokenizer

SAMPLE = Path(__file__).parents[3] / "shared/data/tinystories-sample.txt"


def write_stories(path: Path, stories: list[str]) -> Path:
    """The TinyStories-train.txt layout: each story, then a line that is exactly <|endoftext|>."""
    path.write_text("".join(f"{s}\n<|endoftext|>\n" for s in stories), encoding="utf-8")
    return path


def parse_stories(text: str) -> list[str]:
    """An independent reading of the format, for comparison."""
    parts = re.split(r"^<\|endoftext\|>\r?$", text, flags=re.M)
    return [p.strip() for p in parts if p.strip()]


def decode_stories(path: Path) -> list[str]:
    """Split a token file on EOT; every story must end with one."""
    ids = load_tokens(path).tolist()
    assert ids and ids[-1] == EOT
    tok, out, run = Tokenizer(), [], []
    for i in ids:
        if i == EOT:
            out.append(tok.decode(run))
            run = []
        else:
            run.append(i)
    return out


def stories(n: int, tag: str = "") -> list[str]:
    return [f"Story {i}{tag}: a cat named Tom saw {i} birds.\nThe end." for i in range(n)]


def fail_tokenizer(monkeypatch):
    class Boom:
        def __init__(self):
            raise AssertionError("tokenised again although the cache was valid")
    monkeypatch.setattr(io_tokens, "Tokenizer", Boom)


# ---- prepare_tokens on a local file

def test_round_trip_order_and_split(tmp_path):
    raw = stories(38) + ["  padded story \n\n", "", "   ",
                         "Ünïcödé 🐱 story, <|endoftext|> inline."]
    src = tmp_path / "stories.txt"
    src.write_text("".join(f"{s}\n<|endoftext|>\n" for s in raw) + "trailing story\n",
                   encoding="utf-8")
    expected = parse_stories(src.read_text(encoding="utf-8"))
    assert len(expected) == 41  # blanks dropped; text after the last separator is a story too

    train, val = io_tokens.prepare_tokens(str(src), cache_dir=str(tmp_path / "cache"))
    assert train.parent == val.parent == tmp_path  # cache lives next to the data
    got_train, got_val = decode_stories(train), decode_stories(val)
    assert got_train + got_val == expected  # stripped stories, in order, train first
    assert got_val == expected[-len(got_val):] and 1 <= len(got_val) <= 3  # val = last ~5%


def test_two_stories_split_one_and_one(tmp_path):
    src = write_stories(tmp_path / "two.txt", ["First.", "Second."])
    train, val = io_tokens.prepare_tokens(src, cache_dir=tmp_path / "cache")
    assert decode_stories(train) == ["First."] and decode_stories(val) == ["Second."]


def test_cache_reused_when_unchanged_rebuilt_when_changed(tmp_path, monkeypatch):
    src = write_stories(tmp_path / "s.txt", stories(20))
    train, val = io_tokens.prepare_tokens(src, tmp_path / "cache")
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (train, val)]

    with monkeypatch.context() as m:
        fail_tokenizer(m)
        assert io_tokens.prepare_tokens(src, tmp_path / "cache") == (train, val)
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in (train, val)] == before

    old = decode_stories(train) + decode_stories(val)
    write_stories(src, stories(20, tag=" changed"))
    train2, val2 = io_tokens.prepare_tokens(src, tmp_path / "cache")
    new = decode_stories(train2) + decode_stories(val2)
    assert new != old and new == parse_stories(src.read_text())


def test_interrupted_write_leaves_no_trusted_cache(tmp_path, monkeypatch):
    src = write_stories(tmp_path / "s.txt", stories(20))
    io_tokens.prepare_tokens(src, tmp_path / "cache")
    write_stories(src, stories(20, tag=" v2"))  # the old cache is now stale

    real_replace, calls = os.replace, []

    def replace_once_then_die(a, b):
        calls.append(b)
        if len(calls) == 2:  # train already swapped in, val not yet: the worst moment
            raise KeyboardInterrupt
        real_replace(a, b)

    monkeypatch.setattr(io_tokens.os, "replace", replace_once_then_die)
    with pytest.raises(KeyboardInterrupt):
        io_tokens.prepare_tokens(src, tmp_path / "cache")
    monkeypatch.undo()
    assert not list(tmp_path.glob("*.tmp"))  # temp files cleaned up
    assert not (tmp_path / "s.txt.tokens.json").exists()  # no stamp vouches for the mixed pair

    train, val = io_tokens.prepare_tokens(src, tmp_path / "cache")
    assert decode_stories(train) + decode_stories(val) == parse_stories(src.read_text())


def test_encoder_failure_mid_way_leaves_nothing(tmp_path, monkeypatch):
    src = write_stories(tmp_path / "s.txt", stories(3000))  # several chunks
    monkeypatch.setattr(io_tokens, "CHUNK", 1000)
    real, n = Tokenizer.encode_batch, []

    def encode_then_die(self, texts, num_threads=1):
        n.append(1)
        if len(n) == 2:
            raise RuntimeError("killed")
        return real(self, texts, num_threads)

    monkeypatch.setattr(Tokenizer, "encode_batch", encode_then_die)
    with pytest.raises(RuntimeError):
        io_tokens.prepare_tokens(src, tmp_path / "cache")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.txt"]
    train, val = io_tokens.prepare_tokens(src, tmp_path / "cache")
    assert decode_stories(train) + decode_stories(val) == parse_stories(src.read_text())


def test_falls_back_to_cache_dir_when_data_dir_not_writable(tmp_path, monkeypatch):
    ro = tmp_path / "readonly"
    ro.mkdir()
    src = write_stories(ro / "s.txt", stories(20))
    real_temp = io_tokens.temp_beside

    def temp_beside(path):  # as root, a folder's mode bits stop no write: the refusal is simulated
        if path.parent == ro:
            raise PermissionError(13, "Permission denied", str(path))
        return real_temp(path)

    monkeypatch.setattr(io_tokens, "temp_beside", temp_beside)
    cache = tmp_path / "cache"
    train, val = io_tokens.prepare_tokens(str(src), str(cache))
    assert train.parent == val.parent == cache and train.name.startswith("s.txt-")
    assert sorted(p.name for p in ro.iterdir()) == ["s.txt"]
    assert decode_stories(train) + decode_stories(val) == stories(20)

    fail_tokenizer(monkeypatch)  # the fallback cache is found and reused too
    assert io_tokens.prepare_tokens(str(src), str(cache)) == (train, val)


@pytest.mark.skipif(not SAMPLE.exists(), reason="shared TinyStories sample not present")
def test_shared_sample(tmp_path):
    src = tmp_path / SAMPLE.name
    shutil.copyfile(SAMPLE, src)
    train, val = io_tokens.prepare_tokens(src, tmp_path / "cache")
    expected = parse_stories(src.read_text(encoding="utf-8"))
    got_train, got_val = decode_stories(train), decode_stories(val)
    assert got_train + got_val == expected
    assert abs(len(got_val) / len(expected) - 0.05) < 0.01


# ---- bad inputs: one UserError that names the problem

def test_bad_local_files(tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match="does not exist.*--data"):
        io_tokens.prepare_tokens(str(tmp_path / "missing.txt"), cache)
    with pytest.raises(UserError, match="is a directory"):
        io_tokens.prepare_tokens(str(tmp_path), cache)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="empty.txt holds no stories"):
        io_tokens.prepare_tokens(tmp_path / "empty.txt", cache)
    (tmp_path / "blank.txt").write_text("\n  \n<|endoftext|>\n\n<|endoftext|>\n")
    with pytest.raises(UserError, match="holds no stories"):
        io_tokens.prepare_tokens(tmp_path / "blank.txt", cache)
    (tmp_path / "latin1.txt").write_bytes(b"A story.\n<|endoftext|>\nCaf\xe9 story.\n")
    with pytest.raises(UserError, match=r"latin1.txt is not UTF-8 text \(line 3\)"):
        io_tokens.prepare_tokens(tmp_path / "latin1.txt", cache)
    write_stories(tmp_path / "one.txt", ["Only one."])
    with pytest.raises(UserError, match="at least 2 stories"):
        io_tokens.prepare_tokens(tmp_path / "one.txt", cache)
    # failures leave neither temp files nor caches behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "blank.txt", "empty.txt", "latin1.txt", "one.txt"]


def test_crlf_line_endings_and_a_utf8_byte_order_mark_read_as_plain_text(tmp_path):
    text = "\ufeff" + "".join(f"{s}\n<|endoftext|>\n" for s in stories(4))  # as Windows' Notepad saves it
    src = tmp_path / "crlf.txt"
    src.write_bytes(text.replace("\n", "\r\n").encode("utf-8"))
    train, val = io_tokens.prepare_tokens(src, cache_dir=tmp_path / "cache")
    assert decode_stories(train) + decode_stories(val) == stories(4)  # no "\r", no mark, each story whole


def test_what_is_not_a_text_file_is_refused_in_one_line_before_any_work(tmp_path, monkeypatch):
    """A FIFO (what /dev/stdin is under a pipe) would block, /dev/zero never end: --data must be a regular
    file. UTF-16, binary bytes and endless lines are refused by what they are, not trained on as noise."""
    import signal
    cache = tmp_path / "cache"
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "zeros.txt").symlink_to("/dev/zero")
    write_stories(tmp_path / "utf16.txt", stories(3))
    (tmp_path / "utf16.txt").write_bytes((tmp_path / "utf16.txt").read_text().encode("utf-16"))
    (tmp_path / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "long.txt").write_text("A story." * 100 + "\n<|endoftext|>\nAnother.\n")
    monkeypatch.setattr(io_tokens, "MAX_LINE", 512)  # the rule at a small size: 1 MiB in use
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("blocked reading --data"))
    signal.alarm(30)
    try:
        for name, message in [("pipe", "pipe is not a regular file"), ("zeros.txt", "not a regular file"),
                              ("utf16.txt", "is UTF-16 text"), ("binary.bin", r"holds NUL bytes \(line 1\)"),
                              ("long.txt", r"has a line over 512 bytes \(line 1\)")]:
            with pytest.raises(UserError, match=message):
                io_tokens.prepare_tokens(tmp_path / name, cache)
    finally:
        signal.alarm(0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # nothing written: no cache, no temp file
        "binary.bin", "long.txt", "pipe", "utf16.txt", "zeros.txt"]


def test_nowhere_writable(tmp_path, monkeypatch):
    src = write_stories(tmp_path / "s.txt", stories(4))

    def temp_beside(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(io_tokens, "temp_beside", temp_beside)
    with pytest.raises(UserError, match="PermissionError.*writable --cache-dir"):
        io_tokens.prepare_tokens(src, tmp_path / "cache")

def test_hf_without_datasets_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(UserError, match="pip install datasets.*--data"):
        io_tokens.prepare_tokens(None, tmp_path)


def test_hf_unreachable(tmp_path, monkeypatch):
    fake = types.ModuleType("datasets")

    def load_dataset(name):
        raise ConnectionError("no network")

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(UserError, match=r"\(ConnectionError\); pass --data FILE") as e:
        io_tokens.prepare_tokens(None, tmp_path)
    assert "\n" not in str(e.value)


def test_hf_tokenises_both_splits_then_reuses(tmp_path, monkeypatch):
    class Split:  # the slice of a datasets.Dataset is a dict of columns
        def __init__(self, texts):
            self.texts = texts

        def __len__(self):
            return len(self.texts)

        def __getitem__(self, s):
            return {"text": self.texts[s]}

    splits = {"train": Split(stories(30)), "validation": Split([" Val one. ", "", "Val two."])}
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name: splits if name == "roneneldan/TinyStories" else None
    monkeypatch.setitem(sys.modules, "datasets", fake)
    train, val = io_tokens.prepare_tokens(None, tmp_path)
    assert train == tmp_path / "tinystories-hf" / "train.u16"
    assert val == tmp_path / "tinystories-hf" / "val.u16"
    assert decode_stories(train) == stories(30)
    assert decode_stories(val) == ["Val one.", "Val two."]

    monkeypatch.setitem(sys.modules, "datasets", None)  # a valid cache needs no download
    assert io_tokens.prepare_tokens(None, tmp_path) == (train, val)


def damaged(train: Path, how: str):
    """train.u16 overwritten in place, its size kept: 0xFF bytes (ids out of range, as a disk error or a foreign
    file leaves them), its own ids in reverse order (in range, other text), or cut short by one token."""
    data = train.read_bytes()
    if how == "0xff":
        train.write_bytes(b"\xff" * len(data))
    elif how == "other text":
        ids = np.frombuffer(data, dtype=np.uint16)
        train.write_bytes(ids[::-1].tobytes())
    else:
        train.write_bytes(data[:-2])


@pytest.mark.parametrize("how", ["0xff", "other text", "cut short"])
def test_a_cache_damaged_in_place_is_tokenised_again(tmp_path, capsys, how):
    """Its recorded size catches a cut; its recorded sha256 catches the rest: the cache is rebuilt from the
    text, with a one-line notice where the size alone would have passed, and holds the text's stories again."""
    src = write_stories(tmp_path / "s.txt", stories(20))
    train, val = io_tokens.prepare_tokens(src, tmp_path / "cache")
    damaged(train, how)
    capsys.readouterr()
    assert io_tokens.prepare_tokens(src, tmp_path / "cache") == (train, val)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice:")]
    same_size = how != "cut short"
    assert notices == ([f"notice: the token cache {tmp_path / 's.txt.'}* does not match the checksum it was "
                        "written with; tokenising again"] if same_size else [])
    assert decode_stories(train) + decode_stories(val) == parse_stories(src.read_text())


def test_a_cache_from_before_checksums_is_tokenised_again(tmp_path, capsys):
    src = write_stories(tmp_path / "s.txt", stories(20))
    train, val = io_tokens.prepare_tokens(src, tmp_path / "cache")
    stamp_path = tmp_path / "s.txt.tokens.json"
    stamp = json.loads(stamp_path.read_text())
    del stamp["sha256"]
    stamp_path.write_text(json.dumps(stamp))
    capsys.readouterr()
    io_tokens.prepare_tokens(src, tmp_path / "cache")
    assert "predates its checksum; tokenising again" in capsys.readouterr().err
    digest = hashlib.sha256(train.read_bytes() + val.read_bytes()).hexdigest()
    assert json.loads(stamp_path.read_text())["sha256"] == digest == io_tokens.recorded_sha256(train)


def test_a_token_file_with_ids_past_the_vocabulary_is_refused_naming_it(tmp_path):
    """Every token file read (the cache, a run's regenerated stories) meets the range check too: one pass, no stamp."""
    path = tmp_path / "regenerated.u16"
    np.array([1, EOT, EOT + 1], dtype=np.uint16).tofile(path)
    with pytest.raises(UserError, match=f"token file {path} holds id {EOT + 1}, past GPT-2's last"):
        load_tokens(path)
