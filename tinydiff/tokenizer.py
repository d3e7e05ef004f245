"""GPT-2 BPE through tiktoken, with one extra id for the diffusion MASK token.

GPT-2's encoding is tiktoken's `r50k_base` (the `gpt2` name has the same ranks but needs two
extra files). Its 50,257 ids end with <|endoftext|> = 50256 (EOT); we append MASK = 50257, so
every model here has a 50,258-row vocabulary. Leaves out: training a BPE, other encodings.

User text is always encoded as plain text: "<|endoftext|>" or "<MASK>" typed by a user become
ordinary BPE pieces, never the special ids, unless the caller passes `allow_special=True`.
"""
import re

from tinydiff.checks import UserError

EOT = 50256          # <|endoftext|>: separates stories, and starts every prompt
MASK = 50257         # absorbing state of masked diffusion; never produced by `encode`
VOCAB_SIZE = 50258   # GPT-2's 50,257 ids + MASK
MASK_TEXT = "░"      # how `decode` shows a MASK: visible, one character, not a BPE piece of stories

_SPECIAL = re.compile(r"(<\|endoftext\|>|<MASK>)")


class Tokenizer:
    """GPT-2 BPE + MASK. `encode` -> list of ids, `decode` -> text."""

    def __init__(self):
        import tiktoken
        try:
            self.bpe = tiktoken.get_encoding("r50k_base")
        except Exception as e:  # tiktoken raises network and file errors of many types
            raise UserError(
                "could not load GPT-2's BPE ranks (r50k_base): no network and no tiktoken cache. "
                "Set TIKTOKEN_CACHE_DIR to a folder holding the cached ranks "
                f"(in this repo's workspace: ../shared/tiktoken-cache). Cause: {type(e).__name__}"
            ) from None
        assert self.bpe.eot_token == EOT and self.bpe.n_vocab == EOT + 1

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> ids. With allow_special, "<|endoftext|>" -> EOT and "<MASK>" -> MASK."""
        if not isinstance(text, str):
            raise UserError(f"encode takes a str, got {type(text).__name__}")
        if not allow_special:
            return self.bpe.encode_ordinary(text)
        ids = []
        for piece in _SPECIAL.split(text):
            if piece == "<|endoftext|>":
                ids.append(EOT)
            elif piece == "<MASK>":
                ids.append(MASK)
            elif piece:
                ids.extend(self.bpe.encode_ordinary(piece))
        return ids

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Many texts at once, in tiktoken's native threads (plain text, no special ids)."""
        return self.bpe.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids) -> str:
        """Ids -> text; MASK shows as MASK_TEXT, EOT as "<|endoftext|>"."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary [0, {VOCAB_SIZE})")
        out, run = [], []
        for i in ids + [MASK]:  # a trailing MASK flushes the last run
            if i == MASK:
                if run:
                    out.append(self.bpe.decode(run))
                    run = []
                out.append(MASK_TEXT)
            else:
                run.append(i)
        return "".join(out[:-1])
