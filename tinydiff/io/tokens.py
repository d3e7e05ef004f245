"""TinyStories -> cached uint16 token files, written once and never trusted half-written.

`prepare_tokens` tokenises TinyStories once (from Hugging Face, or from a local file in the
`TinyStories-train.txt` format: stories separated by lines that are exactly `<|endoftext|>`)
into two flat uint16 files, train and val, each story followed by EOT (what tinydiff/data.py's
windows read). The last 5% of a local file's stories are the validation split. Writes are atomic
(temp file + `os.replace`, the stamp last), so an interrupted run never leaves a cache that a later
run trusts; a local file's cache sits beside it, or in --cache-dir where that folder is read-only.
"""
import hashlib
import json
import os
import stat
import sys
from array import array
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tinydiff.checks import UserError
from tinydiff.io.files import remove_stale_temps, sha256_of, temp_beside
from tinydiff.tokenizer import EOT, Tokenizer

SEPARATOR = "<|endoftext|>"   # a line exactly this (bar its line ending) ends a story
VAL_FRACTION = 0.05           # share of a local file's stories, taken from its end
CHUNK = 1024                  # stories per encode_batch call
MAX_LINE = 1 << 20            # bytes: no line of text is longer (a binary file's may be endless)
HF_NAME = "roneneldan/TinyStories"
FORMAT = 1                    # bump when the token file layout changes, invalidating caches


def prepare_tokens(data: str | None, cache_dir: str = "data") -> tuple[Path, Path]:
    """Return (train_path, val_path): uint16 token files, tokenising once and reusing the cache."""
    if data is None:
        return _prepare_hf(Path(cache_dir))
    return _prepare_local(data, Path(cache_dir))


# ---- the cache: (train.u16, val.u16, tokens.json), the json written last as the "done" stamp

def recorded_sha256(train_path) -> str:
    """The sha256 of (train, val) that the cache's stamp recorded: what identifies a run's data. Read, not
    computed again: prepare_tokens has just checked it against the files."""
    stamp = Path(str(train_path).removesuffix("train.u16") + "tokens.json")
    return json.loads(stamp.read_text())["sha256"]


def _cache_paths(directory: Path, stem: str) -> tuple[Path, Path, Path]:
    return (directory / f"{stem}train.u16", directory / f"{stem}val.u16",
            directory / f"{stem}tokens.json")


def _reusable(paths, expected: dict) -> bool:
    """Whether the cache holds what `expected` describes: its stamp agrees, and its files have the sizes and the
    sha256 the stamp recorded when they were written. A file overwritten in place (a disk error, another
    program) keeps its size but not its checksum: it is tokenised again, with a notice."""
    train, val, meta = paths
    try:
        stamp = json.loads(meta.read_text())
        if not (all(stamp.get(k) == v for k, v in expected.items())
                and train.stat().st_size == 2 * stamp["train_tokens"]
                and val.stat().st_size == 2 * stamp["val_tokens"]):
            return False
        if stamp.get("sha256") == sha256_of(train, val):
            return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    why = "does not match the checksum it was written with" if "sha256" in stamp else "predates its checksum"
    print(f"notice: the token cache {train.parent / train.name.removesuffix('train.u16')}* {why}; tokenising again",
          file=sys.stderr)
    return False


def _temps(paths) -> list[Path]:
    """Empty temp files beside the targets (same filesystem, so os.replace is atomic); the ones a
    killed tokeniser left there go first."""
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(paths[0].parent)
    temps = []
    try:
        for p in paths:
            temps.append(temp_beside(p))
            temps[-1].write_bytes(b"")
    except OSError:
        for t in temps:
            t.unlink(missing_ok=True)
        raise
    return temps


def _cache_temps(paths, cache_dir: Path) -> list[Path]:
    try:
        return _temps(paths)
    except OSError as e:
        raise UserError(f"cannot write the token cache in {cache_dir} ({type(e).__name__}); "
                        "pass a writable --cache-dir") from None


def _commit(temps, paths, stamp: dict):
    # A stale stamp must never vouch for a half-replaced pair, so it goes first and comes back last.
    paths[2].unlink(missing_ok=True)
    stamp = {**stamp, "sha256": sha256_of(temps[0], temps[1])}  # what _reusable checks the files against
    os.replace(temps[0], paths[0])
    os.replace(temps[1], paths[1])
    temps[2].write_text(json.dumps(stamp))
    os.replace(temps[2], paths[2])


def _write_stories(f, tok: Tokenizer, chunks) -> array:
    """Encode each chunk of stories into f, EOT after each; return cumulative token ends."""
    ends, total = array("q"), 0  # 8 bytes per story: the full TinyStories has ~2M of them
    for stories in chunks:
        flat = []
        for ids in tok.encode_batch(stories, num_threads=os.cpu_count() or 1):
            flat.extend(ids)
            flat.append(EOT)
            total += len(ids) + 1
            ends.append(total)
        arr = np.array(flat, dtype=np.int64)
        assert arr.size == 0 or arr.max() < 2**16, "token id does not fit in uint16"
        arr.astype(np.uint16).tofile(f)
    return ends


# ---- a local TinyStories-train.txt-format file

def text_file(data) -> Path:
    """The regular file --data names, resolved: a missing path, a folder, a pipe or a device is one line."""
    src = Path(data).expanduser()
    if not src.exists():
        raise UserError(f"data file {data} does not exist; pass --data with a TinyStories-train.txt"
                        "-format text file, or leave --data out to download TinyStories")
    if src.is_dir():
        raise UserError(f"--data {data} is a directory; pass the text file inside it "
                        f"(TinyStories format: stories separated by {SEPARATOR} lines)")
    src = src.resolve()
    if not stat.S_ISREG(src.stat().st_mode):  # a FIFO (/dev/stdin) would block, /dev/zero never end
        raise UserError(f"--data {data} is not a regular file (a pipe, a device or a socket); save the "
                        "stories to a text file and pass that")
    return src


def _prepare_local(data, cache_dir: Path) -> tuple[Path, Path]:
    src = text_file(data)
    st = src.stat()
    expected = {"format": FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    digest = hashlib.sha256(str(src).encode()).hexdigest()[:10]
    homes = [_cache_paths(src.parent, src.name + "."),
             _cache_paths(cache_dir, f"{src.name}-{digest}.")]
    for paths in homes:
        if _reusable(paths, expected):
            return paths[0], paths[1]
    tok = Tokenizer()
    try:
        paths, temps = homes[0], _temps(homes[0])
    except OSError:  # the data's folder may be read-only (a shared data set): use cache_dir
        paths, temps = homes[1], _cache_temps(homes[1], cache_dir)
    try:
        n_train, n_val = _tokenise_local(src, data, tok, temps)
        _commit(temps, paths, {**expected, "train_tokens": n_train, "val_tokens": n_val})
    finally:
        for t in temps:
            t.unlink(missing_ok=True)
    return paths[0], paths[1]


def _tokenise_local(src: Path, data, tok: Tokenizer, temps) -> tuple[int, int]:
    """All stories into temps[0], then its tail (the val stories) moved into temps[1]."""
    with open(temps[0], "wb") as f, tqdm(total=src.stat().st_size, unit="B", unit_scale=True,
                                         desc=f"tokenising {src.name}") as bar:
        ends = _write_stories(f, tok, read_stories(src, data, bar))
    if not ends:
        raise UserError(f"data file {data} holds no stories; pass a TinyStories-train.txt-format "
                        f"file: stories separated by lines that are exactly {SEPARATOR}")
    if len(ends) < 2:
        raise UserError(f"data file {data} holds 1 story; it needs at least 2 stories (the last "
                        f"{VAL_FRACTION:.0%} form the validation split)")
    n_val = max(1, round(len(ends) * VAL_FRACTION))
    split = ends[-n_val - 1]  # tokens in the train stories
    # The val tail is 5% of the tokens: small enough to hold while the train file is cut short.
    np.fromfile(temps[0], dtype=np.uint16, offset=2 * split).tofile(temps[1])
    os.truncate(temps[0], 2 * split)
    return split, ends[-1] - split


def read_stories(src: Path, data, bar):
    """Yield chunks of stripped, non-empty stories, reading one line at a time."""
    chunk, lines, nbytes = [], [], 0
    try:
        f = open(src, "rb")  # bytes, so the bar can count them; each line decoded strictly below
    except OSError as e:
        raise UserError(f"cannot read data file {data} ({type(e).__name__}); "
                        "pass a readable TinyStories-train.txt-format file") from None
    with f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE), b""), 1):
            nbytes += len(raw)
            if lineno == 1 and raw.startswith((b"\xff\xfe", b"\xfe\xff")):
                raise UserError(f"data file {data} is UTF-16 text (it starts with UTF-16's byte-order mark); "
                                "save it as UTF-8 and pass that")
            if b"\0" in raw:
                raise UserError(f"data file {data} holds NUL bytes (line {lineno}): a binary file, or UTF-16 "
                                "text; pass a UTF-8 TinyStories-train.txt-format file")
            if len(raw) == MAX_LINE and not raw.endswith(b"\n"):
                raise UserError(f"data file {data} has a line over {MAX_LINE:,} bytes (line {lineno}): not "
                                "TinyStories text; pass a UTF-8 TinyStories-train.txt-format file")
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").replace("\r\n", "\n")  # CRLF as LF
            except UnicodeDecodeError:
                raise UserError(f"data file {data} is not UTF-8 text (line {lineno}); pass a UTF-8 "
                                "TinyStories-train.txt-format file") from None
            if line.rstrip("\n") != SEPARATOR:
                lines.append(line)
                continue
            chunk.append("".join(lines).strip())
            lines = []
            if len(chunk) >= CHUNK:
                yield [s for s in chunk if s]
                bar.update(nbytes)
                chunk, nbytes = [], 0
    chunk.append("".join(lines).strip())  # the text after the last separator, usually empty
    yield [s for s in chunk if s]
    bar.update(nbytes)


# ---- Hugging Face roneneldan/TinyStories

def _prepare_hf(cache_dir: Path) -> tuple[Path, Path]:
    paths = _cache_paths(cache_dir / "tinystories-hf", "")
    expected = {"format": FORMAT, "source": HF_NAME}
    if _reusable(paths, expected):
        return paths[0], paths[1]
    try:
        import datasets  # lazily: only this branch needs it, and some machines lack it
    except ImportError:
        raise UserError("downloading TinyStories needs the `datasets` package: pip install "
                        "datasets, or pass --data FILE with a local TinyStories-train.txt-format "
                        "file") from None
    try:
        ds = datasets.load_dataset(HF_NAME)
    except Exception as e:  # offline, hub down, auth, cache errors: all mean "use a local file"
        raise UserError(f"could not download TinyStories from Hugging Face ({type(e).__name__}); "
                        "pass --data FILE with a local TinyStories-train.txt-format file "
                        "(e.g. ../shared/data/tinystories-sample.txt)") from None
    tok = Tokenizer()
    temps = _cache_temps(paths, cache_dir)
    try:
        counts = []
        for split, temp in (("train", temps[0]), ("validation", temps[1])):
            rows = ds[split]
            with open(temp, "wb") as f, tqdm(total=len(rows), unit="stories",
                                             desc=f"tokenising {split}") as bar:
                ends = _write_stories(f, tok, _hf_chunks(rows, bar))
            counts.append(ends[-1] if ends else 0)
        _commit(temps, paths, {**expected, "train_tokens": counts[0], "val_tokens": counts[1]})
    finally:
        for t in temps:
            t.unlink(missing_ok=True)
    return paths[0], paths[1]


def _hf_chunks(rows, bar):
    for i in range(0, len(rows), CHUNK):
        texts = rows[i:i + CHUNK]["text"]
        yield [s for s in (t.strip() for t in texts) if s]
        bar.update(len(texts))
