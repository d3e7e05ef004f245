"""Lesson 07: speculative decoding. A cheap draft guesses K tokens; the target checks them all at once.

Run: python lessons/07_speculative.py [--quick] [--target CKPT --draft CKPT]
Read next: tinydiff/speculative.py (this lesson's code: draft, verify, the loop), tests/test_speculative.py
(the proof it is lossless); then lessons/08_ssd.py.

Decoding one token costs one target forward, and on small batches that forward is mostly reading
weights, so scoring K+1 positions costs about as much as scoring one. Speculative sampling
(Leviathan et al. 2023; Chen et al. 2023) lets a small draft model propose K tokens and the target
score them in one forward. An acceptance rule keeps a prefix of the guesses and fixes the first
wrong one, such that the output has exactly the target's distribution: faster, and nothing lost.
"""
import time

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.ar import ar_generate
from tinydiff.sampling import residual
from tinydiff.speculative import expected_tokens_per_round, leviathan_speedup, speculative_generate, verify
from tinydiff.tokenizer import EOT, Tokenizer

args = common.setup(__doc__, "fewer samples and tokens", needs={"target": "draft", "draft": "target"},
                    target=(["out/ar-tiny/ckpt.pt", "out/tour-ar/ckpt.pt"], "an AR target, used with --draft"),
                    draft=(["out/ar-draft/ckpt.pt", "out/tour-draft/ckpt.pt"], "its AR draft"))
generator = torch.Generator().manual_seed(args.seed)
if args.target and args.draft:
    target, draft = common.load(args.target, ("ar",), "target"), common.load(args.draft, ("ar",), "draft")
    prompt = [EOT] + Tokenizer().encode("Once upon a time")
else:
    # No trained pair: a random target whose later layers only nudge the residual stream, and a draft
    # that is its first layer (a LayerSkip-style draft), so the two mostly agree (lessons/common.py).
    target, draft = common.random_pair()
    prompt = [1, 2, 3]
    print("target and draft: random, 12 layers and its first layer (no trained pair)")
print()

print("1. One draft token, by hand. The target's next-token distribution p, the draft's q:")
words = ["the", "cat", "sat", "on", "mat"]
p = torch.tensor([0.10, 0.50, 0.20, 0.15, 0.05])
q = torch.tensor([0.30, 0.30, 0.30, 0.05, 0.05])
r = residual(p, q)
print("   token    q     p   accept min(1, p/q)   residual norm(max(0, p - q))")
for w, qi, pi, ri in zip(words, q, p, r):
    print(f"   {w:>5}  {qi:.2f}  {pi:.2f}   {min(1.0, float(pi / qi)):10.2f}          {ri:10.2f}")
accepted = torch.minimum(p, q)  # P(draft x and keep it) = q(x) min(1, p(x)/q(x))
print(f"   The draft is kept with probability sum(min(p, q)) = {accepted.sum():.2f}. Over-proposed tokens")
print("   ('the', 'sat') are sometimes thrown back; the residual then puts the missing mass where q")
print(f"   under-proposed ('cat', 'on'). min(p, q) + {1 - accepted.sum():.2f} * residual = "
      f"{[round(float(x), 2) for x in accepted + (1 - accepted.sum()) * r]} = p.\n")

n = 4000 if args.quick else 40000
print(f"2. Check it by sampling {n:,} times: draw x ~ q, run the rule (tinydiff.speculative.verify).")
counts = torch.zeros(len(words))
for _ in range(n):
    x = torch.multinomial(q, 1, generator=generator)  # (1,): K = 1 draft
    kept, token = verify(torch.stack([p, p]), q[None], x, generator)  # p for the draft, then the bonus
    counts[x if kept else token] += 1  # the first committed token
print(f"   committed token frequencies {[round(float(c), 3) for c in counts / n]}")
print(f"   target distribution p       {[round(float(c), 3) for c in p]}")
print("   At temperature 0, p and q are one-hot: keep the guess iff it is the target's argmax, else")
print("   take the target's argmax. That is plain greedy decoding of the target, token for token.\n")

print("3. The real loop: draft K tokens, one target forward over them, keep a prefix, add one token.")
print(f"   target {target.num_params():,} parameters, draft {draft.num_params():,}")


@torch.no_grad()
def forward_seconds(model, width=1, reps=20):
    """Seconds per cached forward over `width` new positions after the prompt."""
    cache = model.new_cache(1)
    model(torch.tensor([prompt]), cache=cache)
    x = torch.tensor([prompt[-1:] * width])  # (1, width)
    start = time.perf_counter()
    for _ in range(reps):
        model(x, cache=cache)
        cache.crop(len(prompt))
    return (time.perf_counter() - start) / reps


new = 48 if args.quick else 160
step = forward_seconds(target)
c = forward_seconds(draft) / step
ar_out, ar_stats = ar_generate(target, prompt, new, temperature=0, stop_token=None)
print(f"   greedy AR: {new} tokens at {ar_stats.tokens_per_s:.0f} tokens/s. "
      f"Measured cost ratio c = draft/target forward = {c:.2f}")
print("    k  same as AR   tau  predicted   alpha  accepted per round (0..k)  speedup  predicted  + verify cost")
for k in ((2, 4) if args.quick else (1, 2, 4, 8)):
    out, st = speculative_generate(target, draft, prompt, new, k, temperature=0, stop_token=None)
    verify_cost = forward_seconds(target, k + 1) / step  # one target forward over k+1 positions
    print(f"   {k:2d}  {str(out == ar_out):>9}  {st.tau:4.2f}  {expected_tokens_per_round(st.alpha, k):9.2f}"
          f"   {st.alpha:5.2f}  {str(st.accepted):<25}  {st.tokens_per_s / ar_stats.tokens_per_s:6.2f}x"
          f"  {leviathan_speedup(st.alpha, k, c):8.2f}x"
          f"  {expected_tokens_per_round(st.alpha, k) / (k * c + verify_cost):12.2f}x")
print("   tau counts every committed token per target forward, the corrected or bonus token included.")
print("   Leviathan's formula assumes each guess is kept independently with probability alpha, and a")
print("   target forward over k+1 positions costing as much as over one: tau = (1 - alpha^(k+1)) /")
print("   (1 - alpha), speedup = tau / (k c + 1). Acceptances come in streaks, so tau strays a little;")
print("   the speedup strays more on a CPU, where k+1 positions cost more than one (the 50,258-row head")
print("   is computed per position). The last column divides by k c + (that measured cost) instead;")
print("   what remains is per-token work speculation does not remove (sampling among 50,258 ids)")
print("   and the loop's bookkeeping. On a GPU, small batches are bound by reading weights and the")
print("   verify forward costs about one step: there the formula is the one to check against.\n")

out, st = speculative_generate(target, draft, prompt, new, 4, temperature=1.0, generator=generator,
                               stop_token=None)
print(f"4. At temperature 1 (k = 4): alpha {st.alpha:.2f}, tau {st.tau:.2f}. The tokens now differ from")
print("   any single AR run, but their distribution is the target's: tests/test_speculative.py checks")
print("   that with a chi-square test against the exact joint distribution of a tiny model.")
