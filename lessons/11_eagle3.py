"""Lesson 11: EAGLE-3. A one-layer draft head, and why it must practise on its own guesses.

Run: python lessons/11_eagle3.py [--quick]
Read next: tinydiff/eagle3.py (this lesson's code: the head, the training-time test, chain and tree
decoding), tests/test_eagle3.py (the proof that training
sees what drafting sees) and tests/test_eagle3_decode.py (that the output is the target's); then
lessons/12_dmoe.py.

Lesson 09's drafter reads the target's hidden states and drafts a block in one pass. EAGLE
(Li et al.; EAGLE-3, 2025: "Scaling up Inference Acceleration of LLMs via Training-Time Test")
drafts one token at a time with a head of ONE Transformer layer. Row t of the head reads [the
embedding of token t+1, a feature of position t] and guesses token t+2. For the first draft the
feature is the target's own: its residual streams after a low, a mid and a high layer, fused by a
Linear(3D -> D). For the second draft there is no target feature yet (the target has not read the
first draft), so the head feeds its own output hidden state instead, and so on.

That swap is the catch: a head trained only on target features (one step) meets its own,
different-looking features from the second draft on, and guesses badly there. EAGLE-3's fix is the
"training-time test": unroll the head K steps during training, on its own features, exactly as it
will draft. This lesson trains one head each way, for the same number of steps, and measures tau.
"""
import math
import time

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.ar import ar_generate, ar_loss
from tinydiff.eagle3 import (
    EagleConfig,
    EagleHead,
    eagle_generate,
    eagle_layers,
    eagle_loss,
    unroll_mask,
    unrolled_logits,
)
from tinydiff.model import ModelConfig, Transformer

args = common.setup(__doc__, "fewer training steps (about 20 s on one CPU core)")
generator = torch.Generator().manual_seed(args.seed)
V, CONTEXT, NOISE = 16, 48, 0.1
TARGET_STEPS, HEAD_STEPS = (150, 100) if args.quick else (300, 200)

print("1. A toy language the target can learn in seconds: 16 token ids, and each token is fixed by the")
print(f"   two before it (a random table), except that {NOISE:.0%} of tokens are random noise:")
table = torch.randint(0, V, (V, V), generator=generator)


def stories(n, T):
    """(n, T) token ids of the toy language."""
    x = torch.randint(0, V, (n, T), generator=generator)
    for t in range(2, T):
        follow = torch.rand(n, generator=generator) >= NOISE
        x[:, t] = torch.where(follow, table[x[:, t - 2], x[:, t - 1]], x[:, t])
    return x


print(f"   {stories(1, 16)[0].tolist()}")
target = Transformer(ModelConfig(vocab_size=V, context=CONTEXT, n_layer=4, n_head=4, d_model=64, d_ff=128))
start = time.perf_counter()
loss, _ = common.train(target, lambda step: ar_loss(target, stories(16, CONTEXT + 1)), TARGET_STEPS, 3e-3,
                       weight_decay=0.0)  # lesson 04's loop
keep = 1 - NOISE + NOISE / V
floor = -keep * math.log(keep) - (V - 1) * (NOISE / V) * math.log(NOISE / V)
print(f"   A 4-layer target, {TARGET_STEPS} steps ({time.perf_counter() - start:.0f} s): next-token loss "
      f"{loss.item():.2f} nats (the noise alone costs {floor:.2f}).")
target.eval().requires_grad_(False)  # frozen from here on: the head reads it, never trains it

print("\n2. The head. Row t reads [embedding of token t+1, feature of position t] at position t+1 and guesses t+2.")
print(f"   Step 0's feature fuses the target's layers {eagle_layers(4)} (EAGLE-3 reads 2, L/2 and L-3 of a big")
print(f"   target: L = 32 gives {eagle_layers(32)}) through Linear(3D -> D). Then Linear(2D -> D), one causal block,")
print("   and the target's own (frozen) norm-and-LM-head path. The block's output is the next step's feature.")
print("   Training unrolls K steps. Row r of step i drafts after committed row c = r - i; it sees what draft")
print("   step i+1 sees at inference: step 0's rows up to c, then one row per later step (its own chain).")
print("   Six rows, step 2; columns = [step 0 | step 1 | step 2] rows, # = may attend:")
for r, row in enumerate(unroll_mask(6, 2).tolist()):
    marks = "".join("#" if m else "." for m in row)
    note = "   (no committed row: never in the loss)" if r < 2 else ""
    print(f"   row {r}  {marks[:6]} | {marks[6:12]} | {marks[12:]}{note}")
print("   The loss: cross-entropy against the target's own next-token distribution, step i weighted 0.8^i.\n")


def train_head(K):
    """A fresh head trained HEAD_STEPS steps with K unrolled steps (K = 1: no training-time test)."""
    torch.manual_seed(args.seed + 1)  # both heads start from the same weights
    head = EagleHead(EagleConfig.for_target(target.config, steps_ahead=K), target)
    common.train(head, lambda step: eagle_loss(head, stories(16, CONTEXT)), HEAD_STEPS, 3e-3, weight_decay=0.0)
    return head


DRAFTS = 4
prompts = stories(8, 4).tolist()
print(f"3. Two heads, {HEAD_STEPS} steps each, same data and start: K = 1 (only target features) and K = 3.")
print(f"   Accuracy at draft steps 1..{DRAFTS} (head's guess == target's pick, the earlier tokens right), and greedy")
print(f"   tau of chain decoding with {DRAFTS} drafts per round over {len(prompts)} prompts (at most {DRAFTS + 1}):")
held_out = stories(64, CONTEXT)
heads = {}
for K in (1, 3):
    start = time.perf_counter()
    heads[K] = head = train_head(K)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        logits, target_logits = unrolled_logits(head, held_out, DRAFTS)
        want = target_logits[:, 1:].argmax(-1)  # the target's pick for token r+2
        accuracy = [float((lg[:, i:].argmax(-1) == want[:, i:]).float().mean()) for i, lg in enumerate(logits)]
        runs = [eagle_generate(target, head, p, 40, k=DRAFTS, temperature=0, stop_token=None) for p in prompts]
    same = all(out == ar_generate(target, p, 40, temperature=0, stop_token=None)[0]
               for (out, _), p in zip(runs, prompts))
    tau = sum(stats.tau for _, stats in runs) / len(runs)
    print(f"   K = {K}: step accuracy {' '.join(f'{a:.2f}' for a in accuracy)} | tau {tau:.2f} | "
          f"{seconds:.0f} s to train | output == greedy target: {same}")
print("   Step 1 is equally good either way: both heads read the target's features there. From step 2 on")
print("   the K = 1 head reads features it never saw in training and mostly misses, so its rounds end after")
print("   one or two drafts; the K = 3 head practised exactly that and keeps going (even at step 4, which")
print("   it never trained: its own features now look like what it expects). Same head size, same cost per")
print("   draft: the only difference is what training showed it.\n")

print("4. A dynamic tree (EAGLE-2's): each depth, every frontier node offers its top `branch` children;")
print("   the `branch` best by cumulative log-prob grow further; the best `budget` nodes are verified in ONE")
print("   target forward with an ancestor-only mask (lesson 10's verify). tau per round, both heads, greedy and")
print("   at temperature 1 (sampled: those columns move by a few tenths from seed to seed):")
print(f"   {'':<22} {'K = 1, T 0':>10} {'K = 1, T 1':>10} {'K = 3, T 0':>10} {'K = 3, T 1':>10}")
with torch.no_grad():
    for budget, branch in ((None, 1), (8, 2), (16, 4)):
        taus = [sum(eagle_generate(target, heads[K], p, 40, k=DRAFTS, budget=budget, branch=branch, temperature=t,
                                   generator=generator, stop_token=None)[1].tau for p in prompts) / len(prompts)
                for K in (1, 3) for t in (0, 1.0)]
        name = "chain" if budget is None else f"tree of {budget}, branch {branch}"
        print(f"   {name:<22} " + " ".join(f"{tau:>10.2f}" for tau in taus))
print("   Every run is exact. A tree lets the target sample its own token at each node and step into the child")
print("   that carries it (lesson 10): a node is accepted with probability p(node). Trees pay off where the head")
print("   is unsure (K = 1): its second guesses get checked too, for rows in the same one verify forward (nearly")
print("   free on a GPU). At T 1 a good head's chain can beat its tree: the chain's drafts are SAMPLES accepted")
print("   with min(1, p/q) (lesson 07), which accepts almost always when the head's distribution matches the")
print("   target's, noise included; a tree's nodes are fixed top guesses (EAGLE's reference verifies them the")
print("   same way as here: its recursive rejection with q = 1 accepts a child with probability p(child)).")
