"""Lesson 15: decoding without launch overhead. Fixed shapes, one compiled graph a step, then several steps a graph.

Run: python lessons/15_compiled_decoding.py [--quick] [--ckpt out/ar-tiny/ckpt.pt]
Read next: docs/USAGE.md (`--compile`); for this lesson's code tinydiff/model.py (KVCache, Transformer.step),
tinydiff/fast/compiled.py (`compiled`), tinydiff/fast/fused_steps.py (several steps as one graph),
tinydiff/fast/fused_round.py (a speculative round as one graph); tests/fast/test_compiled.py and
tests/fast/test_fused_steps.py (the proof that the tokens do not change). This is the last lesson:
`python -m tinydiff.bench --report docs` measures every method on models it trains itself.

A decoding step of a small model is a few hundred small operations. On a GPU each one is a kernel
launched from Python, and the launches, not the arithmetic, take the time: eager `tiny` decoding ran
2.4-2.6 ms a step on an H200 (dev/LOG.md). gpt-fast's remedy has three moves: shapes that never
change (a KV cache of fixed size, a mask for the rows not yet written), `torch.compile` of the step
(inductor fuses the operations into a few kernels), and on a GPU CUDA graphs (the whole step replayed
by one launch). Then the loop around the step shrinks too: the sampling goes into the graph, and
several steps can share one graph call. This lesson does each move on a CPU, where compiling helps
less (the arithmetic of the 50,258-row head is a real cost here), and checks that no token changes.
"""
from collections import Counter

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tinydiff.ar import ar_generate
from tinydiff.fast.compiled import compiled
from tinydiff.fast.fused_steps import FusedSteps, multi_step_generate
from tinydiff.model import ModelConfig, Transformer

args = common.setup(__doc__, "fewer tokens", ckpt=(["out/ar-tiny/ckpt.pt", "out/tour-ar/ckpt.pt"], "an AR checkpoint"))
if args.ckpt:
    model = common.load(args.ckpt, ("ar",))
else:
    model = Transformer(ModelConfig(context=128, n_layer=2, n_head=2, d_model=64, d_ff=192)).eval()
    print("model: an untrained 2-layer model (pass --ckpt for a trained one; the costs are the same)")
prompt, new = [50256, 464, 1110, 373, 257, 1263, 286, 13], 16 if args.quick else 48


class CountOps(TorchDispatchMode):
    """Counts the operations a piece of PyTorch code dispatches that compute a tensor: on a GPU each is
    (about) one kernel launch. Views (a reshape, a transpose) and dtype queries launch nothing."""

    def __init__(self):
        super().__init__()
        self.ops, self.other = Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name == "_unsafe_view" or not isinstance(out, torch.Tensor):
            self.other += 1
        else:
            self.ops[name] += 1
        return out


with torch.no_grad():
    print("\n1. One eager decoding step, operation by operation.")
    cache = model.new_cache(1)
    model(torch.tensor([prompt[:-1]]), cache=cache, causal=True)
    with CountOps() as counter:
        model(torch.tensor([prompt[-1:]]), cache=cache, causal=True)
    n_ops = sum(counter.ops.values())
    top = ", ".join(f"{name} {n}" for name, n in counter.ops.most_common(5))
    print(f"   {n_ops} operations compute a tensor for one token (most common: {top}),")
    flops = 2 * sum(p.numel() for p in model.parameters())  # a multiply-add per weight (the tied head included)
    print(f"   beside {counter.other} views and queries that launch nothing; {flops / 1e6:.0f} MFLOP of arithmetic.")
    print(f"   A GPU does that arithmetic in microseconds; launching {n_ops} kernels from Python, one by one,")
    print("   costs it milliseconds. The step is launch-bound.\n")

    print("2. Fixed shapes. model.py's KVCache is static from the start (gpt-fast's): its buffers hold the")
    print("   whole context, a step writes its rows in place at row indices held in a tensor, and attention")
    print("   reads every row behind a mask that hides the ones not written yet:")
    model.double()  # float64: the two paths below agree to rounding
    for t in (2, 6):
        cache = model.new_cache(1)
        model(torch.tensor([prompt[:t]]), cache=cache, causal=True)
        step = model(torch.tensor([prompt[t:t + 1]]), cache=cache, causal=True)[0, -1]  # all rows, masked
        whole = model(torch.tensor([prompt[:t + 1]]), causal=True)[0, -1]  # no cache: the sequence read again
        print(f"   position {t}: a step reads all {cache.k[0].shape[2]} rows of its cache ({t} valid); "
              f"logits differ by {(step - whole).abs().max().item():.1e} from reading the sequence again")
    model.float()
    print("   So a step's shapes depend only on how many tokens it reads: it compiles once for every position.\n")

    print("3. One compiled graph a step: compiled(model, hot=(1,)) is the same model whose `step` is")
    print("   torch.compile'd for one-token calls, and the loop the lessons teach (ar_generate) runs on it.")
    one = compiled(model, (1,))
    ar_generate(one, prompt, 4, 0.0, stop_token=None)  # the first call of each shape compiles it
    print(f"   compiling: {one.compiled_step.compile_seconds:.1f} s (once per shape; on a GPU also recorded as a "
          "CUDA graph)")
    eager_ids, eager = ar_generate(model, prompt, new, 0.0, stop_token=None)
    ids, steps = ar_generate(one, prompt, new, 0.0, stop_token=None)
    print(f"   eager {new / eager.seconds:6.1f} tokens/s, compiled {new / steps.seconds:6.1f} tokens/s; "
          f"same tokens as eager (greedy): {ids == eager_ids}\n")

    print("4. Several steps a graph call (multi-step decoding). Each call still costs the host its guards")
    print("   and the wait for the read-back, and the warp and draw run eagerly between calls. Four steps")
    print("   with their draws unrolled in one graph, each token fed to the next on the device, pay that once")
    print("   for four tokens (fused_steps.py; the bench's ar-steps8 and ar-steps16 rows put more in a graph,")
    print("   which takes longer to compile):")
    four = FusedSteps(model, 4)
    multi_step_generate(four, prompt, 4, 0.0, stop_token=None)
    print(f"   compiling: {four.compile_seconds:.1f} s (the prompt's chunk and a bigger graph: longer from a cold "
          "compile cache)")
    ids4, result4 = multi_step_generate(four, prompt, new, 0.0, stop_token=None)
    print(f"   one token a call {new / steps.seconds:6.1f} tokens/s, four a call {new / result4.seconds:6.1f} "
          f"tokens/s; same tokens as eager (greedy): {ids4 == eager_ids}")
    print("   At T > 0 the graph samples too: the uniforms are drawn before it runs, in the eager loop's order,")
    print("   so a seed gives the eager loop's tokens (a second graph to compile; tests/fast/test_fused_steps.py")
    print("   checks the samples in float64, where no draw falls within rounding of a boundary).\n")

print("5. On a GPU, `--compile` also captures each graph as a CUDA graph: one launch replays every kernel")
print("   at the addresses it recorded. So a compiled model keeps one set of cache buffers for every story")
print("   (new buffers would make inductor record every graph again). A whole speculative round can be one")
print("   graph too (fused_round.py, fused_dflash.py). Compare them with")
print("   python -m tinydiff.bench --compile \\")
print("       --methods ar,ar-steps4,ar-steps8,spec-k4,spec-k4-fused,dflash-b16,dflash-b16-fused")
