"""Lesson 02: one Transformer, three kinds of attention, and the KV cache.

Run: python lessons/02_transformer.py [--quick]
Read next: lessons/03_masking.py; for this lesson's code tinydiff/model.py (every step below).

The same weights serve as an autoregressive model (causal attention: position i sees 0..i) and
as a masked-diffusion model (bidirectional: every position sees every position). An explicit
boolean mask covers everything in between, such as the block-causal masks of semi-autoregressive
diffusion and the tree masks of DDTree. The KV cache makes causal decoding cost one position
per new token instead of the whole sequence.
"""
import time

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.model import ModelConfig, Transformer

args = common.setup(__doc__, "time the KV cache over fewer tokens")
model = Transformer(ModelConfig(context=256, n_layer=4, n_head=4, d_model=128, d_ff=384)).eval()
print(f"1. A tiny model: {model.num_params():,} parameters, {model.num_params(embedding=False):,} "
      "outside the 50,258-row embedding.\n   At this scale the vocabulary is most of the model.\n")

x = torch.randint(0, 50257, (1, 12))
y = x.clone()
y[0, 6] += 1  # change the token at position 6
with torch.no_grad():
    print("2. Change the token at position 6 and see which positions' logits move.")
    for causal in (True, False):
        diff = (model(x, causal=causal) - model(y, causal=causal)).abs().amax(-1)[0]
        marks = "".join("x" if d > 1e-6 else "." for d in diff)
        print(f"   {'causal       ' if causal else 'bidirectional'}  positions 0..11: {marks}")
    print("   Causal: only 6 and after (the AR model must not see the future).")
    print("   Bidirectional: all of them (the diffusion model reads the whole canvas).\n")

    print("3. Any pattern is a boolean mask (True = may attend). Block-causal, blocks of 4:")
    block = torch.arange(12) // 4
    mask = block[:, None] >= block[None, :]  # (T, T): see your own block and earlier blocks
    for row in mask.tolist():
        print("   " + "".join("#" if m else "." for m in row))
    logits = model(x, mask=mask)
    print(f"   The first block's logits equal a bidirectional pass over it alone: "
          f"{torch.allclose(logits[:, :4], model(x[:, :4], causal=False), atol=1e-5)}\n")

    n = 32 if args.quick else 200
    print(f"4. The KV cache: decode {n} positions one at a time, keeping keys and values.")
    seq = torch.randint(0, 50257, (1, n))
    start = time.perf_counter()
    for t in range(1, n + 1):
        model(seq[:, :t], causal=True, head_from=t - 1)  # no cache: every position again (logits of the last)
    slow = time.perf_counter() - start
    cache = model.new_cache()
    start = time.perf_counter()
    steps = [model(seq[:, t:t + 1], cache=cache, causal=True) for t in range(n)]
    fast = time.perf_counter() - start
    err = (torch.cat(steps, 1) - model(seq, causal=True)).abs().max().item()
    print(f"   without cache {slow:.2f}s, with cache {fast:.2f}s; largest logit difference {err:.1e}")
    print(f"   Same logits, up to float rounding. The blocks read {n * (n + 1) // 2:,} positions without the cache,")
    print(f"   {n} with it; both paths run the 50,258-row head once a token, and at this size the head is most")
    print("   of a step's time (step 1), so the clock shows less than the count. Speculative decoding also")
    print("   needs to *undo* tokens:")
    cache.crop(n - 5)
    print(f"   cache.crop({n - 5}) forgets the last 5 rows (now {cache.length}); "
          "cache.keep(rows) keeps any chosen rows, the accepted path of a draft tree.")
