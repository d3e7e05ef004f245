"""Token files -> random training windows: what a training step reads.

A corpus is one flat uint16 file of GPT-2 ids, each story followed by EOT (tinydiff/io/tokens.py
writes it once from TinyStories, a local file or Hugging Face's, and caches it). A window is any
`length` consecutive tokens of it, at a uniformly random start, across story boundaries:
the model learns where stories end from the EOTs inside its windows. `sample_windows` draws batch
`index` from (seed, index) alone, so a resumed run sees exactly the batches it would have seen;
`eval_windows` are evenly spaced and the same every time.
Leaves out: document-aligned windows, packing masks, shuffling stories, other datasets.
"""
from pathlib import Path

import numpy as np
import torch

from tinydiff.checks import UserError
from tinydiff.tokenizer import EOT


def load_tokens(path) -> np.ndarray:
    """A read-only uint16 memmap of a token file (io/tokens.prepare_tokens writes them)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"token file {path} does not exist; run train.py (io/tokens.prepare_tokens) first")
    size = path.stat().st_size
    if size == 0 or size % 2:
        raise UserError(f"token file {path} is empty or truncated ({size} bytes); delete it and "
                        "its .tokens.json so it is rebuilt")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    top = int(tokens.max())  # one pass over the file: an id past GPT-2's last would index past the embedding
    if top > EOT:
        raise UserError(f"token file {path} holds id {top}, past GPT-2's last ({EOT}): it is damaged or not a "
                        "token file; delete it so it is made again")
    return tokens


def sample_windows(tokens, batch_size: int, length: int, seed: int, index: int) -> torch.Tensor:
    """Batch `index`: B windows of `length` tokens at uniform random starts. (B, length) int64."""
    _check_windows(tokens, batch_size, length, "batch_size")
    # Seeded from (seed, index) only, never from a running generator: resuming at step `index`
    # replays the same batches without replaying the ones before it.
    g = torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**64)
    starts = torch.randint(0, len(tokens) - length + 1, (batch_size,), generator=g).tolist()
    return _gather(tokens, starts, length)


def eval_windows(tokens, count: int, length: int) -> torch.Tensor:
    """`count` windows at evenly spaced starts from 0 to the last possible one. (count, length)."""
    _check_windows(tokens, count, length, "count")
    starts = np.linspace(0, len(tokens) - length, count).round().astype(np.int64).tolist()
    return _gather(tokens, starts, length)


def _check_windows(tokens, n: int, length: int, name: str):
    if n < 1 or length < 1:
        raise UserError(f"{name} and length must be >= 1, got {name}={n}, length={length}")
    if len(tokens) < length:
        raise UserError(f"the split has {len(tokens)} tokens but windows need {length}; "
                        "use more text (a bigger data file, more --regenerate stories) or a smaller context")


def _gather(tokens, starts: list[int], length: int) -> torch.Tensor:
    rows = [np.asarray(tokens[s:s + length]) for s in starts]
    return torch.from_numpy(np.stack(rows).astype(np.int64))  # (B, length)
