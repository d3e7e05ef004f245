"""Lesson 09: DFlash. A drafter that fills a whole block of MASKs in one pass, reading the target's mind.

Run: python lessons/09_dflash.py [--quick] [--target CKPT --drafter CKPT]
Read next: tinydiff/dflash.py (this lesson's code: the drafter, its training loss, the loop),
tests/test_dflash_decode.py (the proof that it is lossless) and tests/test_dflash.py
(that it trains on what it sees); then lessons/10_ddtree.py.

Lesson 07's draft guesses K tokens with K forwards of a small AR model, one after another. DFlash
("Block Diffusion for Flash Speculative Decoding", 2026) drafts the whole block at once: a small
block-diffusion model reads [last committed token, MASK, MASK, ...] and fills every MASK in ONE
forward. It can be tiny because it does not think for itself: it reads the target's hidden states
(the "context features") and borrows the target's embedding and LM head. The target then verifies
the block in one forward, exactly as in speculative decoding, so nothing is lost.
"""
import math

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.ar import ar_generate
from tinydiff.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_input,
    dflash_generate,
    draft_block,
    dflash_loss,
    feature_layers,
    match,
    training_mask,
)
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import EOT, Tokenizer

args = common.setup(__doc__, "a tiny random target, fewer tokens", needs={"drafter": "target"},
                    target=(["out/ar-tiny/ckpt.pt", "out/tour-ar/ckpt.pt"], "an AR target"),
                    drafter=(["out/dflash-tiny/ckpt.pt", "out/tour-dflash/ckpt.pt"], "a trained DFlash drafter for it"))
generator = torch.Generator().manual_seed(args.seed)
tok = Tokenizer()
B = 8  # block size: slot 0 = the last committed token, 7 MASKs to fill

if args.target:
    target = common.load(args.target, ("ar",), "target")
else:  # a random target whose blocks matter (lessons/common.py)
    target = common.random_target()
    print("target: a tiny random Transformer (train out/ar-tiny for real stories)")
trained = common.load_drafter(args.drafter, target) if args.target and args.drafter else None
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
      f"{target.config.vocab_size * target.config.d_model:,}-weight embedding and head are borrowed, frozen.\n")

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
if trained:
    drafter, B = trained, trained.config.block_size
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
    print("   (dflash.match); tinydiff/extras/dflash_reject.py samples the drafts instead and judges them by")
    print("   lesson 07's rejection rule.")
