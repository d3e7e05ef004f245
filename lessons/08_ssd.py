"""Lesson 08: speculative speculative decoding (SSD). The draft guesses ahead while the target checks.

Run: python lessons/08_ssd.py [--quick] [--target CKPT --draft CKPT]
Read next: tinydiff/ssd.py (this lesson's code: the speculation cache and the loop), tests/test_ssd.py
(the proof that nothing about the output changes); then lessons/09_dflash.py.

In lesson 07 the draft guesses K tokens, then sits idle while the target verifies them, and only
after the verdict starts guessing again. SSD (Kumar, Dao and May, "Speculative Speculative
Decoding", 2026) keeps the draft busy: during verification it guesses the verdict ("k of my
drafts will be accepted, then the target adds token b"), and for each likely verdict it already
drafts the next round. Those guesses sit in a cache keyed by (k, b). If the real verdict is in the
cache (a hit) the next round starts at once; if not (a miss) the draft drafts as before. The
verification rule is untouched, so the output is exactly what the target alone would produce.
"""
import time

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.ar import ar_generate
from tinydiff.speculative import speculative_generate
from tinydiff.ssd import geometric_fan_out, ssd_generate
from tinydiff.tokenizer import EOT, Tokenizer

# one torch thread (setup) per Python thread: the target on the main one, the run-ahead on a second
args = common.setup(__doc__, "tiny random models, fewer tokens", needs={"target": "draft", "draft": "target"},
                    target=(["out/ar-tiny/ckpt.pt", "out/tour-ar/ckpt.pt"], "an AR target, used with --draft"),
                    draft=(["out/ar-draft/ckpt.pt", "out/tour-draft/ckpt.pt"], "its AR draft"))
tok = Tokenizer()
K = 4

if args.target and args.draft:
    target, draft = common.load(args.target, ("ar",), "target"), common.load(args.draft, ("ar",), "draft")
else:  # lesson 07's random pair: a 12-layer target and its first layer as the draft, which often agree
    target, draft = common.random_pair()
    print("target and draft: random, 12 layers and its first layer (train out/ar-tiny and out/ar-draft "
          "for real stories)")
prompt = [EOT] + tok.encode("Once upon a time, there was a little girl named Lily.")


def forward_seconds(model, reps=5):
    """Median seconds of one cached single-token forward after the prompt: decoding's unit cost."""
    cache, times = model.new_cache(1), []
    model(torch.tensor([prompt]), cache=cache)
    for _ in range(reps):
        start = time.perf_counter()
        model(torch.tensor([prompt[-1:]]), cache=cache)
        times.append(time.perf_counter() - start)
        cache.crop(len(prompt))
    return sorted(times)[reps // 2]


def modelled_speedup(stats, rounds, draft_s, target_s):
    """SSD against plain speculative decoding at these forward costs, the draft on its own device (a batched
    forward costs one): SD pays a target forward per round and a draft forward per draft; SSD drafts only
    just in time (a miss), and its run-ahead costs only what outlasts the verification it overlaps."""
    sd = stats.rounds * target_s + stats.proposed * draft_s
    return sd / sum(r["jit_forwards"] * draft_s + max(target_s, r["ahead_forwards"] * draft_s) for r in rounds)


costs = (forward_seconds(draft), forward_seconds(target))
print(f"one cached forward: draft {costs[0] * 1e3:.2f} ms, target {costs[1] * 1e3:.2f} ms\n")


def words(ids):
    return [tok.decode([t]) for t in ids]


rounds = []
new = 32 if args.quick else 96
out, stats = ssd_generate(target, draft, prompt, new, K, 3, temperature=0, stop_token=None, threaded=True,
                          on_round=lambda info: rounds.append(info))
hit = next((i for i in range(1, len(rounds)) if rounds[i]["cached"] and rounds[i - 1]["keys"]), None)
miss = next((i for i in range(1, len(rounds)) if rounds[i]["cached"] is False), None)
shown = hit if hit is not None else miss
r, before = rounds[shown - 1], (prompt if shown == 1 else rounds[shown - 2]["seq"])

print(f"1. One round (round {shown} of {len(rounds)}; k = {K}, fan-out 3, temperature 0), after "
      f"...{tok.decode(before[-8:])!r}.")
print(f"   The drafts on the table: {words(r['drafts'])}")
print("   While the target verifies them, the draft runs ahead. Its cache of next speculations, by key")
print("   (k = drafts it bets will be accepted, b = the token it bets the target adds next):")
for k in range(len(r["drafts"]) + 1):
    bonuses = [b for kk, b in r["keys"] if kk == k]
    if bonuses:
        kept = "nothing" if k == 0 else repr(tok.decode(r["drafts"][:k]))
        skip = ""
        if k < len(r["drafts"]):
            skip = f"   (never {words(r['drafts'][k:k + 1])[0]!r}, the draft k+1)"
        print(f"     k = {k} (keep {kept}): b in {words(bonuses)}{skip}")
print("   After k < n accepted, the draft k+1 is left out: it was rejected, and a rejected token is never")
print("   the target's fix (the residual max(0, p - q) is 0 wherever rejection is possible, p < q).")
outcome = (r["accepted"], r["tokens"][-1])
print(f"   The verdict: {outcome[0]} accepted, then {words([outcome[1]])[0]!r}: key ({outcome[0]}, "
      f"{words([outcome[1]])[0]!r}) is {'IN' if outcome in r['keys'] else 'NOT in'} the cache.")

times = r["times"]
t0 = min(span[0] for span in times.values() if span)
t1 = max(span[1] for span in times.values() if span)
width = 60


def bar(spans):
    """One text line over [t0, t1]: each (span, letter) paints its share of the line."""
    line = ["."] * width
    for span, letter in spans:
        if span:
            a, b = (int((s - t0) / (t1 - t0) * width) for s in span)
            line[a:max(b, a + 1)] = letter * (max(b, a + 1) - a)
    return "".join(line)


print(f"\n   The round as it ran ({(t1 - t0) * 1e3:.1f} ms; drafter and target each on its own thread):")
print(f"     drafter |{bar([(times['jit'], 'j'), (times['ahead'], 'a')])}|  j = drafting just in time, "
      "a = running ahead")
print(f"     target  |{bar([(times['verify'], 'v')])}|  v = verifying")
print(f"   The run-ahead made {r['ahead_forwards']} draft forwards (1 to catch up, then one per draft position,")
print(f"   all {len(r['keys'])} branches as rows of one batch). Where 'a' outlasts 'v' the target waits: on this")
print("   CPU a batch of rows costs about as much as the rows one by one (the 50,258-wide head), on a GPU")
print("   it costs about one forward, and the run-ahead hides inside the verification.")
nxt = rounds[shown]
if nxt["cached"]:
    print(f"   HIT: the next round's drafts {words(nxt['drafts'])} were ready, with no drafting at all.")
miss_rounds, miss_fan_out = rounds, 3
if miss is None:  # every verdict was cached: a smaller fan-out misses more often
    miss_rounds, miss_fan_out = [], 1
    ssd_generate(target, draft, prompt, new, K, 1, temperature=0, stop_token=None, on_round=miss_rounds.append)
    miss = next((i for i in range(1, len(miss_rounds)) if miss_rounds[i]["cached"] is False), None)
if miss is not None:
    m = miss_rounds[miss - 1]
    print(f"   A MISS (round {miss}, fan-out {miss_fan_out}): the verdict ({m['accepted']}, "
          f"{words(m['tokens'][-1:])[0]!r}) was not among the keys")
    print(f"   {[(k, words([b])[0]) for k, b in m['keys']]};")
    print(f"   round {miss + 1} was drafted just in time, as in lesson 07.")
ar_out, _ = ar_generate(target, prompt, new, temperature=0, stop_token=None)
print(f"   Over the whole run: hit rate {stats.hit_rate:.2f}, hits/lookups per k {stats.hits} / "
      f"{stats.lookups}; output == greedy target decoding: {out == ar_out}.\n")

print("2. Fan-out against hit rate, time and the modelled speedup (draft on its own device; a batched")
print(f"   forward priced as one). {new} tokens, k = {K}, temperature 0.")
spec_out, spec = speculative_generate(target, draft, prompt, new, K, temperature=0, stop_token=None)
print(f"   spec-k{K}: {spec.tokens_per_s:.0f} tokens/s, tau {spec.tau:.2f}, alpha {spec.alpha:.2f}")
print("   method   hit rate  draft fwd (ahead+jit)  tok/s threaded  tok/s sequential  modelled vs SD")
uniform = {}
for fan_out in ((1, 3) if args.quick else (1, 3, 8)):
    fan_rounds = []
    runs = {threaded: ssd_generate(target, draft, prompt, new, K, fan_out, temperature=0, stop_token=None,
                                   threaded=threaded, on_round=fan_rounds.append if threaded else None)[1]
            for threaded in (True, False)}
    st = uniform[fan_out] = runs[True]
    print(f"   ssd-f{fan_out:<3} {st.hit_rate:8.2f}  {st.ahead_forwards:>6} + {st.jit_forwards:<14}"
          f"{st.tokens_per_s:14.0f}  {runs[False].tokens_per_s:16.0f}  "
          f"{modelled_speedup(st, fan_rounds, *costs):13.2f}x")
print("   The modelled column prices every forward with the costs measured above: SD pays k draft forwards")
print("   and a verification per round, SSD a verification (or the run-ahead, if longer) plus drafting")
print("   only after a miss. The measured columns are this CPU, both threads sharing its memory bandwidth.\n")

alpha = spec.alpha
budget = K + 1
fan = geometric_fan_out(budget, K, alpha)
print(f"3. Where to spend the branches. With alpha = {alpha:.2f}, 'k accepted' has probability "
      f"alpha^k (1 - alpha) for k < {K},")
print(f"   alpha^{K} for k = {K}. The paper's capped geometric allocation of {budget} branches "
      "(geometric_fan_out):")
print(f"   {fan} instead of fan-out 1's {[1] * (K + 1)}.")
st = ssd_generate(target, draft, prompt, new, K, fan, temperature=0, stop_token=None)[1]
print(f"   Hit rate {st.hit_rate:.2f} (fan-out 1: {uniform[1].hit_rate:.2f}); lookups per k {st.lookups}.")
print("   The allocation assumes independent acceptances and a power law for the bonus's rank in q;")
print("   acceptances come in streaks, so check it against the lookups per k you measure.")
one = geometric_fan_out(1, K, 0.9)
st = ssd_generate(target, draft, prompt, new, K, one, temperature=0, stop_token=None, threaded=True)[1]
print("   On a CPU every branch is work the second core must finish within one verification, so the")
print(f"   cheapest bet can win: one branch, {one} (all {K} drafts pass, then the draft's favourite):")
print(f"   hit rate {st.hit_rate:.2f}, {st.tokens_per_s:.0f} tokens/s threaded against spec-k{K}'s "
      f"{spec.tokens_per_s:.0f} (bench row ssd-g1).\n")

generator = torch.Generator().manual_seed(args.seed)
st = ssd_generate(target, draft, prompt, new, K, 3, temperature=1.0, generator=generator, stop_token=None)[1]
print(f"4. At temperature 1 (fan-out 3): hit rate {st.hit_rate:.2f}, hits/lookups per k {st.hits} / "
      f"{st.lookups}.")
print("   After a rejection the target's token comes from the residual max(0, p - q): tokens the draft")
print("   under-rates, so the draft's own favourites are poor bets there (the paper's Saguaro sampling")
print("   reshapes q to fix that). The output still has exactly the target's distribution: verification")
print("   never changed, and tests/test_ssd.py checks it with a chi-square test on a tiny vocabulary.")
