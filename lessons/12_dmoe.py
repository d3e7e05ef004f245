"""Lesson 12: dMoE. Route one block of tokens two ways and count the experts it reads.

Run: python lessons/12_dmoe.py [--quick]
Read next: tinydiff/dmoe.py (this lesson's code: block_mass and block_routing are the paper's rule),
tests/test_dmoe.py; then lessons/13_fp4_experts.py.

A mixture-of-experts layer sends each token to its top-k experts. An autoregressive model reads
one token per forward, so k experts. A diffusion LM decodes a whole block per forward, and its
tokens' top-k sets together cover nearly every expert: the layer reads almost all expert weights
every step. dMoE (block-level routing) sums the block's routing into one distribution, keeps the
smallest set of top experts that holds most of the mass (the coreset), and lets every token
choose its top-k only inside it. Fewer experts per forward means fewer weight bytes to read.
"""
import time

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.dmoe import (
    MoEConfig,
    MoEFeedForward,
    MoETransformer,
    block_mass,
    block_routing,
    moe_config,
    moe_layers,
    set_routing,
    unique_experts,
)

args = common.setup(__doc__, "a shorter sequence for the whole-model part")

E, K, BLOCK, D = 16, 2, 32, 32
layer = MoEFeedForward(MoEConfig(d_model=D, d_ff=96, n_experts=E, moe_top_k=K, route_block=BLOCK,
                                 route_guard=K, shared_expert=False)).eval()
# A trained router is confident, and neighbouring tokens talk about the same things. Imitate both:
# a sharp router, and a block of 32 token states drawn around 3 "topics".
torch.nn.init.normal_(layer.router.weight, std=0.8)
topics = torch.randn(3, D)
x = (topics[torch.randint(0, 3, (BLOCK,))] + 0.7 * torch.randn(BLOCK, D))[None]  # (1, 32, D)
print(f"1. One MoE layer: {E} SwiGLU experts, each token routed to its top-{K}; one block of {BLOCK} tokens.\n")


def show_experts(title):
    experts = layer.last["experts"][0]  # (T, k)
    print(f"   {title}: each token's experts")
    for row in range(0, BLOCK, 8):
        print("   " + "  ".join(f"t{t:02d}:{','.join(f'{e:>2}' for e in sorted(experts[t].tolist()))}"
                               for t in range(row, row + 8)))
    used = sorted(set(experts.flatten().tolist()))
    print(f"   unique experts in the block: {len(used)} of {E}: {used}\n")
    return len(used)


with torch.no_grad():
    by_token = layer(x)
    n_token = show_experts("Token routing (each token its own top-2)")
    print("   One forward over the block reads the weights of every expert listed above.\n")

    scores = layer.last["scores"]  # (1, T, E) softmax probabilities
    mass = block_mass(scores, K, BLOCK)[0, 0]  # (E,)
    order = mass.argsort(descending=True).tolist()
    threshold = 0.6
    coreset = block_routing(scores, K, BLOCK, threshold, guard=K)[0, 0]
    print(f"2. The block's distribution: every token adds its own top-{K} scores, the sum is normalised.")
    print(f"   Experts by mass, with the running total; the coreset (#) stops once it reaches {threshold}:")
    running = 0.0
    for e in order:
        if mass[e] == 0:
            break
        running += float(mass[e])
        mark, bar = "#" if coreset[e] else " ", "=" * round(60 * float(mass[e]))
        print(f"   {mark} expert {e:>2}  {float(mass[e]):.3f}  {bar:<22} total {running:.3f}")
    unused = [e for e in range(E) if mass[e] == 0]
    print(f"   (no token picked experts {unused}: mass 0, never in a coreset)")
    print(f"   coreset: {sorted(coreset.nonzero().flatten().tolist())}: the first expert always, "
          "and the one that crosses the threshold.\n")

    layer.routing, layer.threshold, layer.guard = "block", threshold, K
    by_block = layer(x)
    print("3. Block routing: the same tokens choose their top-2 only inside the coreset.")
    n_block = show_experts("Block routing")
    rel = float((by_block - by_token).norm() / by_token.norm())
    print(f"   {n_token} -> {n_block} experts for this block ({n_token / n_block:.1f}x fewer weights read); "
          f"the layer's output moved by {rel:.1%} (relative norm).\n   Fine-tuning with block routing on "
          "teaches the model to live with that (the paper keeps 99.1% of quality).\n")

    print("4. The knobs. threshold: mass the coreset must hold; guard: its smallest size.")
    print("   threshold guard | coreset | unique experts | output change")
    for thr, guard in [(0.2, K), (0.2, 4), (0.4, K), (0.6, K), (0.8, K), (1.0, K), (1.0, E)]:
        layer.threshold, layer.guard = thr, guard
        out = layer(x)
        size = int(layer.last["coreset"].sum())
        unique = int(unique_experts(layer.last["experts"], E, BLOCK).max())
        print(f"   {thr:>9} {guard:>5} | {size:>7} | {unique:>14} | "
              f"{float((out - by_token).norm() / by_token.norm()):>12.1%}")
    print(f"   Threshold 1.0 keeps every expert some token wanted; with guard {E} the coreset is all "
          "experts:\n   either way each token gets its own top-2 back, which is token routing "
          "(tests/test_dmoe.py proves the guard case).\n")

    print("5. Whose votes count. Late in a block most tokens are committed and vote alike, but the sampler")
    print("   reads only the MASK positions' outputs. Say the last 6 tokens are still MASK (one shared state):")
    x[0, -6:] = 1.5 * torch.randn(D)  # MASKs share an embedding, so they route alike
    layer.threshold, layer.guard = threshold, K
    mask_top = set(layer.router(x[0, -1]).topk(K).indices.tolist())  # what the MASK tokens want
    for vote in (1.0, 8.0):
        layer.votes = torch.where(torch.arange(BLOCK) >= BLOCK - 6, vote, 1.0)[None]  # (1, T)
        layer(x)
        kept = set(layer.last["coreset"][0, 0].nonzero().flatten().tolist())
        print(f"   MASK vote {vote:g}: coreset {sorted(kept)}; the MASK tokens' own top-{K} {sorted(mask_top)} "
              f"{'inside' if mask_top <= kept else 'not all inside'}")
    layer.votes = None
    print("   (--route-mask-vote W; ours, not the paper's. MoETransformer sets the votes from the token ids.)\n")

    config = moe_config("tiny", context=64 if args.quick else 256)
    model = MoETransformer(config).eval()
    idle = sum((layer.n_experts - layer.top_k) * sum(p.numel() for p in layer.experts[0].parameters())
               for layer in moe_layers(model))  # the routed experts a token does not use
    counts = {"total": model.num_params(), "active": model.num_params() - idle}
    print(f"6. The whole diffusion LM: moe_config('tiny') = {config.n_layer} layers x {config.n_experts} "
          f"experts of width {config.expert_d_ff}, top-{config.moe_top_k} + 1 shared\n   "
          f"({config.moe_top_k + 1} x {config.expert_d_ff} = the dense d_ff {config.d_ff}): "
          f"{counts['total']:,} parameters, {counts['active']:,} active per token.")
    ids = torch.randint(0, 50257, (1, config.context))
    for routing in ("token", "block"):
        set_routing(model, routing, threshold=0.6, guard=4)
        start = time.perf_counter()
        model(ids, causal=False)
        seconds, layers = time.perf_counter() - start, moe_layers(model)
        unique = sum(float(unique_experts(m.last["experts"], m.n_experts, m.block_size).float().mean()) for m in layers)
        read = sum(len(m.last["experts"].unique()) + 1 for m in layers) * layers[0].expert_bytes()  # + the shared
        every = len(layers) * (config.n_experts + 1) * layers[0].expert_bytes()
        print(f"   {routing:>5} routing: {unique / len(layers):5.1f} unique experts per block of {config.route_block}, "
              f"{read / 2**20:5.1f} MiB of expert weights read of {every / 2**20:.1f}, {1000 * seconds:.0f} ms a forward")
    print("   Untrained, the router is nearly uniform, so the block's mass is spread thin and the coreset\n"
          "   is large. Training with token routing, then fine-tuning with block routing, concentrates it:\n"
          "   python train.py --model mdlm-moe, then --routing block --route-threshold 0.6 --route-guard 4.")
