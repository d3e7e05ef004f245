"""Lesson 01: tokens. GPT-2's byte-pair encoding, the MASK id we append, and why 50,258.

Run: python lessons/01_tokens.py [--quick]
Read next: lessons/02_transformer.py (what the model does with these ids).

Every model in tinydiff reads and writes GPT-2 token ids. The masked-diffusion LM also needs
one id that GPT-2 never had: MASK, the "not decided yet" state of a position. We append it after
GPT-2's last id, so the vocabulary grows from 50,257 to 50,258 and every GPT-2 id keeps its meaning.
"""
import os
from pathlib import Path

import common  # the repository on sys.path, the offline tokenizer cache, the flags (lessons/common.py)

from tinydiff.tokenizer import EOT, MASK, MASK_TEXT, VOCAB_SIZE, Tokenizer

args = common.setup(__doc__, "skip measuring a whole story file",
                    data=([common.STORIES], "a TinyStories text file to measure"))
tok = Tokenizer()

print("1. BPE splits text into pieces it learned from web text; common words are one piece.")
text = "Once upon a time, there was a little girl named Lily."
ids = tok.encode(text)
print(f"   {text!r}\n   -> {len(ids)} ids: {ids}")
print("   pieces:", " | ".join(repr(tok.decode([i])) for i in ids))
print("   A leading space belongs to the piece after it: ' upon' and ' time' are single ids.\n")

print("2. GPT-2 has 50,257 ids, 0..50256. The last one, <|endoftext|> (EOT), separates stories.")
print(f"   EOT = {EOT}. We append MASK = {MASK}, so models here have {VOCAB_SIZE:,} rows of embedding.")
print("   Appending (rather than reusing a rare id) keeps every GPT-2 id meaning what it meant.\n")

print("3. Text a user types is always plain text: '<MASK>' in a prompt is not the MASK id.")
typed = tok.encode("a <MASK> b <|endoftext|>")
print(f"   encode('a <MASK> b <|endoftext|>') = {typed}  (MASK in it: {MASK in typed})")
print(f"   only when the caller allows it: {tok.encode('a <MASK> b', allow_special=True)}\n")

print(f"4. decode shows MASK as {MASK_TEXT!r}: this is how a diffusion canvas looks mid-way.")
canvas = list(ids)
for i in range(2, len(canvas), 2):
    canvas[i] = MASK
print(f"   {tok.decode(canvas)!r}")
print("   The diffusion LM starts from all-MASK and fills positions in, in any order.\n")

print("5. Why not characters? Fewer positions per story means a shorter context does more.")
if args.data is None:
    sample = text + " She loved to play outside with her friends."
    print(f"   {len(sample.encode())} bytes -> {len(tok.encode(sample))} tokens "
          f"({len(sample.encode()) / len(tok.encode(sample)):.2f} bytes per token) on one sentence")
else:
    stories = [s.strip() for s in Path(args.data).read_text(encoding="utf-8").split("<|endoftext|>") if s.strip()]
    n_tokens = sum(len(i) for i in tok.encode_batch(stories, num_threads=os.cpu_count() or 1))
    n_bytes = sum(len(s.encode()) for s in stories)
    print(f"   {len(stories):,} stories: {n_bytes:,} bytes -> {n_tokens:,} tokens "
          f"({n_bytes / n_tokens:.2f} bytes per token, {n_tokens / len(stories):.0f} tokens per story)")
print("   A 256-token context holds a whole typical TinyStories story.")
