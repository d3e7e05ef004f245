"""Lesson 10: DDTree. Verify a whole tree of drafts, picked from one DFlash pass, in one target forward.

Run: python lessons/10_ddtree.py [--quick] [--target CKPT --drafter CKPT]
Read next: tinydiff/ddtree.py (this lesson's code: build, compile, follow, compact, the loop),
tests/test_ddtree.py (the proof that the heap picks the best prefixes, the mask is right and the
output is the target's); for trees that sample (T > 0), tinydiff/extras/ddtree_sampled.py and
tests/extras/test_ddtree_sampled.py; then lessons/11_eagle3.py.

Lesson 09's drafter fills a block in one forward and the target checks ONE path: the drafter's
favourite token at every depth. But that forward gave a whole distribution per depth. DDTree
("Accelerating Speculative Decoding with Block Diffusion Draft Trees", 2026) spends a budget of N
nodes on the likeliest continuations under those distributions, lays them out as a tree and checks
them all in one target forward, with a mask that lets each node see only its own ancestors. When the
drafter's favourite is wrong but its second guess is right, the tree still gets there.
"""
import math
import os
import tempfile

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.ar import ar_generate
from tinydiff.ddtree import build_tree, compact_cache, compile_tree, ddtree_generate, follow_tree
from tinydiff.dflash import DFlashConfig, DFlashDrafter, dflash_generate, draft_block
from tinydiff.extras.ddtree_sampled import build_sampled_tree, follow_sampled_tree
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import EOT, Tokenizer
from tinydiff.tools.replay import Recorder

args = common.setup(__doc__, "a tiny random target, fewer tokens", needs={"drafter": "target"},
                    target=(["out/ar-tiny/ckpt.pt", "out/tour-ar/ckpt.pt"], "an AR target"),
                    drafter=(["out/dflash-tiny/ckpt.pt", "out/tour-dflash/ckpt.pt"], "a trained DFlash drafter for it"))
tok = Tokenizer()
show = lambda t: repr(tok.decode([int(t)]))  # noqa: E731

if args.target:
    target = common.load(args.target, ("ar",), "target")
else:  # lesson 09's tiny random target, whose blocks matter
    target = common.random_target()
    print("target: a tiny random Transformer (train out/ar-tiny for real stories)")
trained = bool(args.target and args.drafter)
if trained:
    drafter = common.load_drafter(args.drafter, target)
else:
    drafter = DFlashDrafter(DFlashConfig.for_target(target.config, n_layer=1, block_size=8), target).eval()
    print("drafter: untrained (train one with lesson 09's command to see real trees)")
B, D, BUDGET = drafter.config.block_size, 4, 8  # the lesson's tree: depths 1..4, 8 nodes

prompt = [EOT] + tok.encode("Once upon a time, there was a")
seq = prompt
with torch.no_grad():
    greedy = ar_generate(target, seq, D + 1, temperature=0, stop_token=None)[0]  # what the target will say
    print(f"\n1. The drafter's one forward after {tok.decode(seq[1:])!r} gives a distribution per depth.")
    if trained:
        cache = drafter.new_cache()
        _, hidden = target(torch.tensor([seq[:-1]]), hidden_layers=drafter.config.taps)
        draft_logits = draft_block(drafter, cache, seq[-1], hidden)[:D]  # (D, V)
        print("   Here: the trained drafter's logits for depths 1..4.")
    else:  # an untrained drafter's guesses are flat; stand in for a good one that is wrong once
        rows, s = [], list(seq)
        for t in greedy[:D]:
            rows.append(target(torch.tensor([s]))[0, -1])  # the target's own logits along its greedy path
            s.append(t)
        draft_logits = torch.stack(rows)  # (D, V)
        draft_logits[torch.arange(D), greedy[:D]] += 5.0  # confident: most of its mass on the target's pick
        second = int(draft_logits[1].topk(2).indices[1])
        draft_logits[1, second] = draft_logits[1].max() + 0.5  # depth 2: its second guess is its favourite
        print("   Untrained drafters are flat, so here a stand-in for a good one: the target's own distributions")
        print("   along its greedy path, made confident (+5 on the target's pick), except that at depth 2 the")
        print(f"   drafter prefers {show(second)} to the target's {show(greedy[1])}.")
    favourites = next_token_probs(draft_logits, 0, None, None).argmax(-1).tolist()
    print(f"   DFlash would verify its favourites only: {[tok.decode([t]) for t in favourites]}")

    tree = build_tree(draft_logits, BUDGET)
    print(f"\n2. The best-first heap (budget {BUDGET}): a prefix scores the sum of its per-depth log-probs. Start from")
    print("   (root, depth 1, rank 0); each pop adds a node and pushes its next sibling (rank + 1) and its first")
    print("   child (depth + 1, rank 0), both scoring no more than it: nodes pop best first.")
    print("   pop  depth  parent  token          score")
    for i in range(1, tree.size + 1):
        print(f"   {i:>3}  {int(tree.depths[i]):>5}  {int(tree.parents[i]):>6}  {show(tree.tokens[i]):<12} "
              f"{float(tree.scores[i]):7.2f}")
    print("   As a tree (node number, token; root = the newest committed token):")
    print(f"   0 {show(seq[-1])}")

    def draw(node, indent):
        for c in [i for i in range(1, tree.size + 1) if int(tree.parents[i]) == node]:
            print(f"   {'   ' * indent}└ {c} {show(tree.tokens[c])}")
            draw(c, indent + 1)
    draw(0, 1)

    start = len(seq) - 1  # the target's cache holds seq[:-1]; the root sits at position start
    ids, pos, mask = compile_tree(tree, start, seq[-1])
    print(f"\n3. One target forward reads [root, {tree.size} nodes] at position ids start + depth: {pos.tolist()}.")
    print(f"   Its mask (# = may attend): {start} cached prefix columns, then the tree. Row i = row parent(i) + i:")
    print("   a node sees the prefix, its ancestors and itself, never a sibling or a cousin.")
    for i, row in enumerate(mask.tolist()):
        marks = "".join("#" if m else "." for m in row)
        print(f"   node {i:>2}  {marks[:start]} | {marks[start:]}")

    cache = target.new_cache()
    target(torch.tensor([seq[:-1]]), cache=cache)
    logits = target(ids, pos=pos, mask=mask, cache=cache)[0]  # (N+1, V): the target at every node at once
    picks = next_token_probs(logits, 0, None, None).argmax(-1)  # greedy: the target's pick at each node
    path, bonus = follow_tree(tree, picks)
    print("\n4. Verify: walk from the root while a child carries the target's own pick at the current node.")
    node = 0
    for child in path + [None]:
        where = "root" if node == 0 else f"node {node}"
        step = f"child {child} has it: step in" if child else "no child has it: the bonus"
        print(f"   at {where:<7} the target picks {show(picks[node]):<12} {step}")
        node = child
    tokens = tree.tokens[path].tolist() + [bonus]
    print(f"   {len(path)} accepted + the bonus = {len(tokens)} tokens {[tok.decode([t]) for t in tokens]} "
          f"from one target forward")
    n_chain = next((k for k in range(D) if favourites[k] != greedy[k]), D)  # DFlash: accept while draft == pick
    print(f"   DFlash's single path would have committed {n_chain + 1} (its favourites until the first miss, + bonus).")
    print(f"   Same tokens as the target's greedy decoding: {tokens == greedy[:len(tokens)]}.")
    before = cache.length
    compact_cache(cache, start, path)
    print(f"   Compaction: the cache held {before} rows (prefix + root + {tree.size} nodes); KVCache.keep moves the")
    print(f"   root's and the path's rows into place: {cache.length} rows = the committed tokens but the bonus.")
    print("   The drafter's context grows by the features of the same rows (the verify forward's hidden states).\n")

    n_new = 48 if args.quick else min(120, target.config.context - len(prompt))  # what the context holds
    ar_out, ar_stats = ar_generate(target, prompt, n_new, temperature=0, stop_token=None)
    print(f"5. The loop, greedy, {n_new} tokens after {tok.decode(prompt[1:])!r}:")
    print(f"   ar          : {ar_stats.tokens_per_s:6.0f} tokens/s")
    out, st = dflash_generate(target, drafter, prompt, n_new, temperature=0, stop_token=None)
    print(f"   dflash B={B:<3}: {st.tokens_per_s:6.0f} tokens/s, tau {st.tau:.2f}, same as ar: {out == ar_out}")
    for budget in (4, 16, 64):
        out, st = ddtree_generate(target, drafter, prompt, n_new, budget=budget, temperature=0, stop_token=None)
        print(f"   ddtree N={budget:<3}: {st.tokens_per_s:6.0f} tokens/s, tau {st.tau:.2f}, "
              f"{st.nodes_per_round:5.1f} nodes verified per round, same as ar: {out == ar_out}")
    print("   Same tokens as greedy ar, always (at T > 0 the target's own distribution: it samples at each node")
    print("   itself and the tree only decides how far it gets). With a trained drafter tau rises with the budget,")
    print("   but every node is one more row in the verify forward: a GPU decoding one sequence has room to spare")
    print("   for a few dozen rows, this CPU has little, so the budget that maximises tokens/s sits lower here.")
    print("   Untrained, the drafter is pure overhead: tau ~ 1 and the tree's rows cost time for nothing.")

    print("\n6. Users sample (T = 1), and there following the target's samples keeps little: a child survives")
    print("   only if the target happens to sample its token. ddtree_sampled.py draws the children from the drafter")
    print("   instead (without replacement) and judges them in order with speculation's rule: accept x with")
    print("   probability min(1, R(x)/Q(x)), else move R to the residual and take x out of Q. At the root of step 4,")
    print("   with the target's own T = 1 distribution p and a drafter q near it (p's log-probs plus noise):")
    p = next_token_probs(logits[0], 1.0)  # (V,): the target at the root
    q = torch.softmax(p.log() + torch.randn(p.shape, generator=torch.Generator().manual_seed(1)), -1)
    g, walks = torch.Generator().manual_seed(2), 1000 if args.quick else 2000
    for k in (1, 3):
        kept = sum(bool(follow_sampled_tree(build_sampled_tree(lambda depth, token: q, [-math.log(2)] * k, 1, k, g),
                                            lambda node: p, lambda depth, token: q, g)[0]) for _ in range(walks))
        print(f"   {k} child{'ren' if k > 1 else '   '}: the top {k} of q, kept if p's sample is one: "
              f"{float(p[q.topk(k).indices].sum()):.2f} | {k} draw{'s' if k > 1 else ' '} of q judged by rejection: "
              f"{kept / walks:.2f}")
    print("   Either way the committed token is a sample of p (tests/extras/test_ddtree_sampled.py proves it). On the")
    print("   T = 1 drafter of dev/LOG.md, 32-node trees go from tau 2.13 to 3.69 (`python -m")
    print("   tinydiff.extras.ddtree_sampled`; the bench's ddtree-n32-reject row).")

print("\n7. See it: a greedy DDTree run, every round's tree and the path the target followed, recorded by the")
print("   loop's on_round and written as one page that replays it (tinydiff/tools/replay.py; generate.py --html):")
recorder = Recorder("ddtree", tok, prompt, tok.decode(prompt[1:]))
ddtree_generate(target, drafter, prompt, 32, budget=16, temperature=0, stop_token=None, on_round=recorder)
page = os.path.abspath(recorder.write(os.path.join(tempfile.gettempdir(), "tinydiff-lesson10.html"), overwrite=True))
print(f"   open {page} in any browser: {len(recorder.steps)} rounds, each tree drawn with its path")
