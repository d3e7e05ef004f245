"""Lesson 03: the forward process of masked diffusion, and why the loss weighs each token by 1/t.

Run: python lessons/03_masking.py [--quick]
Read next: tinydiff/diffusion.py (add_noise, sample_t, mdlm_loss, elbo: this lesson's code), then
lessons/04_train_mdlm.py.

A masked-diffusion LM learns to undo one corruption: each token is replaced by MASK with
probability t, for t anywhere in (0, 1). At t near 0 the model fills one hole in a whole story;
at t near 1 it writes from almost nothing. Sampling runs the process backwards.
"""
import math

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.diffusion import add_noise, elbo, sample_t
from tinydiff.model import ModelConfig, Transformer
from tinydiff.tokenizer import Tokenizer

args = common.setup(__doc__, "fewer Monte-Carlo draws")
tok = Tokenizer()
story = "Lily had a red ball. She threw it to her dog, and the dog ran to get it."
x = torch.tensor([tok.encode(story)])  # (1, T)

print("1. Mask each token with probability t, using one uniform number per position.")
u = torch.rand(x.shape, generator=torch.Generator().manual_seed(0))
for t in (0.1, 0.5, 0.9):
    noisy, masked = add_noise(x, torch.tensor([t]), uniforms=u)
    print(f"   t={t}: {tok.decode(noisy[0].tolist())}")
print("   With the same uniforms, a larger t masks a superset: MASK is absorbing, nothing comes back.\n")

print("2. Training draws t per sequence, stratified: one draw in each of B equal slices of (0, 1).")
print("   ", [round(v, 3) for v in sample_t(8, torch.Generator().manual_seed(1)).tolist()])
print("   Fewer batches with all-small or all-large t, so a steadier loss.\n")

print("3. The loss: cross-entropy on the masked tokens, each weighted 1/t, over all B*T tokens.")
print("   At small t few tokens are masked, but each is easy; 1/t makes every t count the same in")
print("   expectation, and turns the sum into an upper bound on the NLL (the ELBO): for a sequence")
print("   of T tokens, integrating Binomial(l; T, t) / t over t gives exactly 1/l. So the bound is")
print("   the average over l = 1..T of (1/l) x (CE of l random masked tokens): any-order autoregression.")
T = 6
grid = torch.linspace(1e-6, 1, 200001, dtype=torch.float64)
for l in (1, 2, 3):
    binom = torch.tensor(float(torch.special.gammaln(torch.tensor(T + 1.0)) - torch.special.gammaln(torch.tensor(l + 1.0))
                               - torch.special.gammaln(torch.tensor(T - l + 1.0)))).exp()
    integral = torch.trapezoid(binom * grid ** l * (1 - grid) ** (T - l) / grid, grid).item()
    print(f"   T={T}, l={l}: integral of Binom(l; T, t) / t dt = {integral:.4f}   (1/l = {1 / l:.4f})")

print("\n4. The bound on an untrained model. A uniform guess over the 50,257 text ids scores exactly")
print("   log(50,257) = 10.82 nats/token, and random logits of variance s^2 add about s^2 / 2 to that.")
print("   The bound is an estimate over noise draws (t, then which tokens are masked), and the 1/t weight")
print("   makes a draw at small t count for a lot: read it with its standard error.")
torch.manual_seed(args.seed)
model = Transformer(ModelConfig(context=64, n_layer=2, n_head=2, d_model=64, d_ff=128, causal=False)).eval()
result = elbo(model, x, mc=4 if args.quick else 32, generator=torch.Generator().manual_seed(0),
              n_bytes=len(story.encode()))
with torch.no_grad():
    spread = model(x)[..., :-1].var(-1).mean().item()  # the logits' variance over the text ids
print(f"   bound {result['bound']:.2f} +- {result['stderr']:.2f} nats/token, ppl <= {result['ppl_bound']:,.0f}, "
      f"{result['bits_per_byte']:.2f} bits/byte")
guess = math.log(50257) + spread / 2
print(f"   log(50,257) + s^2 / 2 = {guess:.2f}, {abs(result['bound'] - guess) / result['stderr']:.1f} standard errors "
      "from the estimate (more draws narrow the error)")
print("   Report it as 'ppl <=': it is a bound. The unweighted masked CE is not a likelihood at all.")
