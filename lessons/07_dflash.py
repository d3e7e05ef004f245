"""Lesson 07: DFlash. A drafter that fills a whole block of MASKs in one pass, reading the target's mind.

Run: python lessons/07_dflash.py [--quick]
Read next: lessons/08_ddtree.py; for this lesson's code tinydiff/dflash.py (drafter, training loss),
tinydiff/dflash.py (the loop), tests/test_dflash_decode.py (the proof that it is lossless)
and tests/test_dflash.py (that it trains on what it sees).

Lesson 06's draft guesses K tokens with K forwards of a small AR model, one after another. DFlash
("Block Diffusion for Flash Speculative Decoding", 2026) drafts the whole block at once: a small
block-diffusion model reads [last committed token, MASK, MASK, ...] and fills every MASK in ONE
forward. It can be tiny because it does not think for itself: it reads the target's hidden states
(the "context features") and borrows the target's embedding and LM head. The target then verifies
the block in one forward, exactly as in speculative decoding, so nothing is lost.
"""
import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHARED = Path(__file__).resolve().parents[2] / "shared"
if not os.environ.get("TIKTOKEN_CACHE_DIR") and (SHARED / "tiktoken-cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken-cache")  # offline workspaces

from tinydiff.ar import ar_generate  # noqa: E402
from tinydiff.io.checkpoint import load_checkpoint  # noqa: E402
from tinydiff.io.checkpoint import load_model  # noqa: E402
from tinydiff.dflash import (DFlashConfig, DFlashDrafter, block_input, dflash_generate, dflash_loss,  # noqa: E402
                             draft_block, feature_layers, match, training_mask)
from tinydiff.io.checkpoint import drafter_from
from tinydiff.model import ModelConfig, Transformer  # noqa: E402
from tinydiff.speculative import next_token_probs  # noqa: E402
from tinydiff.tokenizer import EOT, Tokenizer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="a tiny random target, fewer tokens")
parser.add_argument("--target", default="out/ar-tiny/ckpt.pt", help="an AR checkpoint, used when present")
parser.add_argument("--drafter", default="out/dflash-tiny/ckpt.pt", help="a trained drafter, used when present")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
torch.manual_seed(args.seed)
torch.set_num_threads(1)  # small models: one thread is fastest and keeps timings steady on shared cores
generator = torch.Generator().manual_seed(args.seed)
tok = Tokenizer()
B = 8  # block size: slot 0 = the last committed token, 7 MASKs to fill

if not args.quick and Path(args.target).exists():
    target, _ = load_model(args.target, kinds=("ar",))
    print(f"target: {args.target}")
else:
    # No trained target: a random one whose blocks matter (lesson 06 explains the larger weights).
    target = Transformer(ModelConfig(context=128, n_layer=4, n_head=2, d_model=64, d_ff=192)).eval()
    with torch.no_grad():
        for name, w in target.named_parameters():
            if w.dim() == 2:
                w.normal_(0, 0.3 if name == "embed.weight" else 0.5)
    print("target: a tiny random Transformer (train out/ar-tiny for real stories)")
for p in target.parameters():
    p.requires_grad_(False)  # frozen: the drafter reads it, never trains it
L = target.config.n_layer

print("\n1. What the drafter reads: the target's residual stream after a few of its layers.")
print(f"   Ids evenly spaced from 1 to L-3 (N = 1: L//2). L = 36, N = 5: {feature_layers(36, 5)};"
      f" L = 8, N = 2: {feature_layers(8, 2)}.")
config = DFlashConfig.for_target(target.config, n_layer=1, block_size=B, anchors=16)
drafter = DFlashDrafter(config, target)
print(f"   This target has L = {L}: the drafter reads the outputs of blocks {config.feature_layers} (0-indexed), "
      f"concatenates them (N*D = {config.n_features * config.d_model}),\n   projects them to D = {config.d_model} "
      "and normalises: one context vector per committed position. Every drafter layer")
print("   turns those vectors into extra keys/values with its own projections; queries come only from the block.")
n_own = sum(p.numel() for p in drafter.parameters())
print(f"   The drafter: {config.n_layer} layer, {n_own:,} parameters of its own; the target's "
      f"{target.embed.weight.numel():,}-weight embedding and head are borrowed, frozen.\n")

prompt = [EOT] + tok.encode("Once upon a time, there was a")
block = block_input(prompt[-1], B)[0].tolist()
print(f"2. The block for the prompt {tok.decode(prompt[1:])!r}: {block}")
print(f"   = {[tok.decode([t]) for t in block]}")
print(f"   Slot 0 is the last committed token (position {len(prompt) - 1}); slot k guesses position "
      f"{len(prompt) - 1} + k. The context (features of positions 0..{len(prompt) - 2}) sits in the drafter's cache.")
print("   Slot 0 goes in through the target's embedding; the MASK slots through one learned vector of the")
print("   drafter's own (an AR target never reads MASK, so its MASK row means nothing useful as an input).\n")

print("3. Training packs many blocks into one forward. A window of 12 tokens, blocks of 4 at anchors 2, 7, 4:")
mask = training_mask(torch.tensor([[2, 7, 4]]), 4, 12)[0]
print("   rows = block slots; columns = 12 context features | 3 blocks x 4 slots   (# = may attend)")
for r, row in enumerate(mask.tolist()):
    marks = "".join("#" if m else "." for m in row)
    print(f"   block {r // 4} slot {r % 4}  {marks[:12]} | {marks[12:16]} {marks[16:20]} {marks[20:]}")
print("   A block sees the context strictly before its anchor and itself (bidirectionally), nothing else:")
print("   exactly what it sees at inference. Labels: slot k -> the token at anchor + k; loss weights")
print(f"   exp(-(k-1)/g) favour the early slots (g = {config.loss_decay:g} for B = {B}), which decide acceptance.\n")

windows = torch.tensor([p + ar_generate(target, p, 32 - len(p), temperature=0, stop_token=None)[0]
                        for p in ([EOT] + tok.encode("One day"), [EOT] + tok.encode("Tom had a"))])  # (2, 32)
loss, stats = dflash_loss(drafter, windows, generator)  # what train.py --model dflash minimises
print(f"4. The loss on 2 windows of 32 tokens the target wrote ({min(config.anchors, 32 - B)} anchors each, "
      "one drafter forward):")
print(f"   ce {stats['ce']:.2f} | slot-1 acc {stats['acc']:.2f} | tau proxy {stats['tau_proxy']:.2f}. Untrained, it "
      f"guesses blindly (a uniform guess scores ln V = {math.log(config.vocab_size):.2f}).")
print("   `train.py --model dflash --target CKPT` minimises it on TinyStories (better: on text the target")
print("   regenerates, so the drafter imitates the target rather than the corpus), the target frozen.\n")
if not args.quick and Path(args.drafter).exists():
    drafter = drafter_from(load_checkpoint(args.drafter), target, args.drafter)
    B = drafter.config.block_size
    print(f"   From here on: the trained drafter {args.drafter} (B = {B}).\n")
drafter.eval()

with torch.no_grad():
    seq = prompt
    ar_out, _ = ar_generate(target, seq, B - 1, temperature=0, stop_token=None)  # the target's own picks

    def one_round(name, drafts):
        """Verify `drafts` after seq with one target forward, from caches holding seq[:-1]."""
        target_cache = target.new_cache()
        target(torch.tensor([seq[:-1]]), cache=target_cache)
        x = torch.cat([torch.tensor(seq[-1:]), drafts])[None]  # (1, B): [last committed, drafts]
        p = next_token_probs(target(x, cache=target_cache)[0], 0, None, None)  # (B, V), greedy
        n, bonus = match(p, drafts, None, greedy=True)
        print(f"   {name:<8} drafts {[tok.decode([t]) for t in drafts.tolist()]}")
        print(f"            target {[tok.decode([t]) for t in p.argmax(-1).tolist()]}  (its pick after each prefix)")
        print(f"            {n} accepted + the bonus {tok.decode([bonus])!r}: "
              f"{n + 1} token{'s' * (n > 0)} from one target forward")

    print(f"5. One round by hand after {tok.decode(seq[1:])!r}. The prefill gives the context features;")
    cache = drafter.new_cache()
    _, hidden = target(torch.tensor([seq[:-1]]), hidden_layers=drafter.config.taps)
    logits = draft_block(drafter, cache, seq[-1], hidden)  # (B-1, V): ONE drafter forward for the block
    print(f"   the drafter's cache now holds {cache.length} context positions; one forward fills the {B - 1} MASKs.")
    one_round("drafter", next_token_probs(logits, 0, None, None).argmax(-1))  # argmax draft, never MASK
    one_round("perfect", torch.tensor(ar_out))
    print("   Verification accepts while the draft equals the target's own pick, then commits the target's")
    print("   next pick as the bonus, so each round commits 1..B tokens: tau. A drafter that guessed like")
    print(f"   the target ('perfect', built here by decoding the target {B - 1} times) reaches tau = B. The")
    print("   features of the newly committed positions join the drafter's context; both caches are cropped.\n")

    n_new = 48 if args.quick else min(120, target.config.context - len(prompt))  # what the context holds
    ar_out, ar_stats = ar_generate(target, prompt, n_new, temperature=0, stop_token=None)
    print(f"6. The loop, greedy, {n_new} tokens after {tok.decode(prompt[1:])!r}:")
    print(f"   ar      : {ar_stats.tokens_per_s:6.0f} tokens/s, {ar_stats.forwards} target forwards")
    for b in sorted({min(4, B), B}):
        out, st = dflash_generate(target, drafter, prompt, n_new, block_size=b, temperature=0, stop_token=None)
        print(f"   dflash B={b}: {st.tokens_per_s:6.0f} tokens/s, {st.forwards} target forwards, "
              f"tau {st.tau:.2f}, accepted per round {st.accepted}, same as ar: {out == ar_out}")
    print(f"   {tok.decode(out)!r}")
    print("   Same tokens as greedy ar, always. Untrained, the drafter is pure overhead (tau ~ 1 and an extra")
    print("   forward per round); trained, each round commits several tokens for one target forward")
    print("   (its target forwards also count the prefill over the prompt). At temperature > 0 the loop stays")
    print("   exact: the target samples every position itself and a draft only decides how far it gets")
    print("   (rule='match'), or a sampled draft goes through lesson 06's rejection rule (rule='reject').")
