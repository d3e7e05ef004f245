"""Lesson 13: FP4 experts. Four bits a weight, one shared scale per 32, and the bytes a token reads.

Run: python lessons/13_fp4_experts.py [--quick] [--ckpt CKPT]
Read next: tinydiff/fp4.py (this lesson's code: the formats, then a MoE layer with packed experts),
tinydiff/kernels/moe_ffn.py (moe_ffn_fp4, a kernel that reads them packed), tests/test_fp4.py; then
`python -m tinydiff.tools.quantize` on a trained mdlm-moe checkpoint (docs/USAGE.md, "FP4 experts");
then lessons/14_triton.py.

Decoding is memory-bound: every forward reads the weights it uses, and in a mixture-of-experts
model the experts are most of the weights. Xiaomi's MiMo-V2.5-Pro stores its experts, and only
them, in MXFP4 (OCP Microscaling v1.0): each weight is a 4-bit float, E2M1, and every 32
consecutive weights along an input row share one power-of-two scale, an 8-bit E8M0 exponent. That
is 4.25 bits a weight instead of 16 (bf16) or 32. Attention, router and embedding stay as they were.
"""
import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch
import torch.nn.functional as F

from tinydiff import fp4
from tinydiff.dmoe import MoETransformer, moe_config, moe_layers, set_routing, unique_experts
from tinydiff.fp4 import quantize_experts
from tinydiff.tokenizer import EOT, MASK, Tokenizer

args = common.setup(__doc__, "a shorter block in part 4",
                    ckpt=(["out/mdlm-moe-tiny/ckpt.pt", "out/report-tiny/moe/ckpt.pt"],
                          "a full-precision mdlm-moe checkpoint"))

print("1. The E2M1 grid: 1 sign bit, 2 exponent bits, 1 mantissa bit. Sixteen codes, fifteen values:")
print("   code  bits   value     code  bits   value")
for c in range(8):
    row = [f"{code:>6}  {code >> 3}{(code >> 1) & 3:02b}{code & 1}  {fp4.E2M1[code & 7] * (-1 if code & 8 else 1):>5}"
           for code in (c, c + 8)]
    print("   " + "   ".join(row))
print("   The steps double with the exponent: 0.5 apart up to 2, then 1, then 2. Code 8 is -0 (a negative")
print("   number too small for the grid keeps its sign). Rounding is to the nearest value, a tie to the")
print("   even code (mantissa bit 0), and anything past 6 saturates to 6:")
demo = torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 5.1, 7.9, 100.0])
print("   " + "  ".join(f"{v:g} -> {fp4.E2M1[int(c) & 7]:g}" for v, c in zip(demo.tolist(), fp4.e2m1_encode(demo))))

print()
if args.ckpt:
    model = common.load(args.ckpt, ("mdlm-moe",))
else:
    model = MoETransformer(moe_config("tiny")).eval()
    print("model: an untrained moe_config('tiny') (pass --ckpt, or train one: docs/USAGE.md; its weights are "
          "N(0, 0.02), a trained model's are less tidy)")
config = model.config
layer = moe_layers(model)[0]
w = layer.experts[0].gate.weight.detach()  # (F, D): expert 0's gate, nn.Linear's (out, in) layout

print(f"\n2. One block: the first 32 weights of row 0 of layer 0, expert 0's gate ({tuple(w.shape)}, blocks along "
      f"its {w.shape[1]} inputs).")
block = w[0, :32]
amax = float(block.abs().max())
x = int(fp4.mx_exponent(torch.tensor(amax)))
print(f"   amax = {amax:.5f}, log2(amax) = {torch.log2(torch.tensor(amax)):.3f}, so X = floor(log2 amax) - 2 = {x}: "
      f"the scale is 2^{x} = {2.0 ** x:.3g},\n   stored as the E8M0 byte {x + 127} (X + 127). The 2 is E2M1's "
      "largest exponent: amax / 2^X lands in [4, 8), the top of the grid.")
p = fp4.quantize(block[None])
codes, back = fp4.unpack(p.codes)[0], p.dequantize()[0]
order = block.abs().argsort(descending=True)
print("   weight       / 2^X   -> code  value x 2^X   error")
for i in order[:6].tolist() + order[-3:].tolist():
    v = float(block[i])
    print(f"   {v:+.5f}  {v / 2.0 ** x:+7.3f}  -> {int(codes[i]):>4}  {float(back[i]):+.5f}  {float(back[i]) - v:+.5f}")
print(f"   (the 6 largest and 3 smallest of 32.) Stored: 16 bytes of codes + 1 byte of scale = 17 bytes "
      f"for 32 weights,\n   4.25 bits each; relative error of this block "
      f"{float((back - block).norm() / block.norm()):.1%}.")

print("\n3. One quantized expert. Relative error of each weight matrix, and of the expert's output on the")
tok = Tokenizer()
ids = torch.tensor([[EOT] + tok.encode("Once upon a time, there was a little girl named Lily. She loved to play "
                                       "in the park with her red ball. One day she saw a big dog.")])
masked = ids.clone()
hide = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0)) < 0.5
hide[:, 0] = False
masked[hide] = MASK
seen = {}
hook = layer.register_forward_pre_hook(lambda module, inputs: seen.setdefault("x", inputs[0].detach()))
with torch.no_grad():
    logits = model(masked)
hook.remove()
h = seen["x"][0]  # (T, D): what layer 0's experts really receive on this story, half of it MASK
print(f"   {h.shape[0]} hidden states layer 0's feed-forward receives on a half-masked story:")
expert = layer.experts[0]
with torch.no_grad():
    y = expert(h)
    print("   format  bits/weight | gate     up       down    | expert output")
    for fmt in ("bf16", "mxfp4", "nvfp4"):
        cast = (lambda t: t.bfloat16().float()) if fmt == "bf16" else (lambda t, f=fmt: fp4.fake_quantize(t, f))
        gate, up, down = (cast(getattr(expert, n).weight) for n in ("gate", "up", "down"))
        yq = F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)
        errs = [float((q - getattr(expert, n).weight).norm() / getattr(expert, n).weight.norm())
                for q, n in ((gate, "gate"), (up, "up"), (down, "down"))]
        bits = 16 if fmt == "bf16" else fp4.bits_per_weight(fmt)
        print(f"   {fmt:<6} {bits:>6.2f}      | " + "  ".join(f"{e:6.2%}" for e in errs) +
              f" | {float((yq - y).norm() / y.norm()):6.2%}")
print("   Fifteen values per block leave each weight far less exact than bf16 does; how the errors of gate,")
print("   up and down add up in the output depends on the weights and the inputs (they partly cancel in a")
print("   trained expert). NVFP4's finer scales (16 values, E4M3) buy some of it back.")
print("   What matters is the model's loss: the masked-token cross-entropy on this story,")
quantized = quantize_experts(model).eval()
with torch.no_grad():
    for name, m in (("full precision", model), ("MXFP4 experts ", quantized)):
        out = logits if m is model else m(masked)
        ce = F.cross_entropy(out[hide].float(), ids[hide])
        print(f"   {name}: {float(ce):.4f} nats over {int(hide.sum())} masked tokens")
print("   (a trained model's number is the one to read; `python -m tinydiff.tools.eval` measures the held-out bound.)")

print(f"\n4. The bytes a token reads. moe_config: {config.n_layer} layers x {config.n_experts} experts "
      f"(3 x {config.d_model} x {config.expert_d_ff} weights each), top-{config.moe_top_k} + shared.")
per_expert = 3 * config.d_model * config.expert_d_ff
active = config.n_layer * (config.moe_top_k + config.shared_expert)  # experts one token passes through
rest = (config.n_layer * (4 * config.d_model ** 2 + config.d_model * config.n_experts)  # attention, router
        + config.vocab_size * config.d_model)  # the tied head: every forward reads all of it
print("   format  bytes/expert | one token's experts | all experts | with attention, router and tied head")
for fmt, bits in (("fp32", 32), ("bf16", 16), ("mxfp4", 4.25), ("nvfp4", 4.5)):
    one, rest_bytes = per_expert * bits / 8, 4 if fmt == "fp32" else 2  # FP4 experts: the rest at bf16, as MiMo
    print(f"   {fmt:<6} {one / 1e3:9.1f} kB | {active * one / 1e6:14.2f} MB | "
          f"{config.n_layer * (config.n_experts + config.shared_expert) * one / 1e6:8.2f} MB | "
          f"{(active * one + rest_bytes * rest) / 1e6:8.2f} MB per one-token forward")
print(f"   MXFP4 reads {32 / 4.25:.2f}x fewer expert bytes than fp32, {16 / 4.25:.2f}x fewer than bf16. Here the tied "
      f"head\n   ({config.vocab_size:,} x {config.d_model}) is read in full every forward and outweighs the experts; "
      "in MiMo's\n   trillion-parameter MoE the experts are nearly everything, which is why they are what "
      "goes to 4 bits.")
T = 64 if args.quick else config.route_block * 4
block_ids = torch.randint(0, 50257, (1, T), generator=torch.Generator().manual_seed(1))
print(f"   A diffusion LM reads a block of {config.route_block} tokens per forward ({T} positions here, random ids):")
with torch.no_grad():
    for routing, m, label in (("token", model, "fp32 "), ("block", quantized, "MXFP4")):
        set_routing(m, routing, threshold=0.6, guard=config.moe_top_k + 1)
        m(block_ids)
        layers = moe_layers(m)
        unique = sum(float(unique_experts(x.last["experts"], x.n_experts, x.block_size).float().mean()) for x in layers)
        read = sum(len(x.last["experts"].unique()) + 1 for x in layers) * layers[0].expert_bytes()  # + the shared
        print(f"   {routing:>5} routing, {label} experts: {unique / len(layers):5.1f} experts per block, "
              f"{read / 1e6:6.2f} MB of expert weights per forward")
print("   Block routing (lesson 12) cuts the experts a block reads (most where the router spreads a block\n"
      "   over many experts, as an untrained one does); FP4 cuts the bytes of each, whatever the routing.")
