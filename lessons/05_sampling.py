"""Lesson 05: watch the sampler fill the canvas: LLaDA's schedule, threshold decoding, self-correction.

Run: python lessons/05_sampling.py [--quick] [--ckpt out/mdlm-tiny/ckpt.pt]
Read next: lessons/06_speculative.py; for this lesson's code tinydiff/sampler.py (each rule below
is a few lines there).

The canvas starts as the prompt followed by MASKs. Each step is one forward pass: the model
proposes a token for every masked position with a confidence, and the sampler commits the most
confident ones in the current block. With a trained checkpoint the text is a story; without one
(an untrained model) the words are noise but every rule is the same.
"""
import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHARED = Path(__file__).resolve().parents[2] / "shared"
if not os.environ.get("TIKTOKEN_CACHE_DIR") and (SHARED / "tiktoken-cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken-cache")  # offline workspaces

from tinydiff.io.checkpoint import load_model  # noqa: E402
from tinydiff.model import preset, Transformer  # noqa: E402
from tinydiff.extras.self_correction import generate_revising  # noqa: E402
from tinydiff.sampler import commit_schedule, generate  # noqa: E402
from tinydiff.tokenizer import EOT, Tokenizer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="an untrained model, fewer tokens")
parser.add_argument("--ckpt", help="a masked-diffusion checkpoint (default: out/mdlm-*/ckpt.pt if present)")
args = parser.parse_args()
tok = Tokenizer()
found = sorted(Path("out").glob("mdlm-*/ckpt.pt"))
path = args.ckpt or (None if args.quick or not found else found[0])
if path:
    model, _ = load_model(path, kinds=("mdlm",))
    print(f"model: {path}")
else:
    torch.manual_seed(0)
    model = Transformer(preset("tiny", causal=False)).eval()
    print("model: untrained (pass --ckpt for real text)")
prompt = [EOT] + tok.encode("Once upon a time")
n = 16 if args.quick else 32


def show(title, sampler=generate, **kwargs):
    print(f"\n{title}")

    def frame(event):
        canvas = tok.decode(event["canvas"][len(prompt):].tolist())
        note = f" (revised {event['revised']})" if event.get("revised") else ""
        print(f"   fwd {event['forward']:2d} block {event['block']} +{len(event['committed'])}{note}: {canvas}")
    ids, stats = sampler(model, prompt, callback=frame, **kwargs)
    print(f"   {stats.forwards} forwards for {stats.new_tokens} tokens "
          f"({stats.tokens_per_forward:.2f} per forward)")


print(f"1. LLaDA's schedule: {n} tokens in blocks of {n // 2}, {n // 2} steps in all, so each block gets")
print(f"   {n // 4} steps committing {commit_schedule(n // 2, n // 4)} tokens. The second block waits for the first.")
show("   low_confidence remasking, temperature 0:", gen_length=n, steps=n // 2, block_length=n // 2)

print("\n2. Threshold decoding (Fast-dLLM): commit every position the model is at least 90% sure of,")
print("   and always the most confident one. Easy stretches go many tokens per forward.")
show("   threshold 0.9:", gen_length=n, steps=n, block_length=n // 2, threshold=0.9)

print("\n3. Self-correction: once a block is full, re-mask its least confident token and predict it")
print("   again, now that the whole block is in view. Two extra forwards per block here.")
show("   revise 2 (tinydiff/extras/self_correction.py):", generate_revising, gen_length=n, steps=n,
     block_length=n // 2, revise=2)
