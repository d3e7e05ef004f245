"""Lesson 14: a Triton kernel read line by line next to the PyTorch it replaces, run on a CPU.

Run: python lessons/14_triton.py [--quick]
Read next: tinydiff/kernels/sampler_step.py (this kernel), then masked_attention.py and moe_ffn.py
(the same ideas with matrix tiles), tests/test_kernels.py, and `python -m tinydiff.bench.kernels`
on a GPU; then lessons/15_compiled_decoding.py.

Every diffusion sampler step turns the logits of each position (N, V = 50,258) into a candidate
token and a confidence. PyTorch does it in a few clear lines (sampler.propose), but each line is
a pass over (N, V) float64 tensors written to memory and read back. A Triton kernel is a Python
function compiled for the GPU in which one *program* handles one position: it walks the
vocabulary a chunk at a time and keeps only a few running numbers per lane. Nothing of size V
is ever written. On a machine without a GPU, Triton's interpreter (TRITON_INTERPRET=1) runs the
very same kernel with NumPy: slow, but exact, so we can check it against PyTorch here.
"""
import inspect
import os
import time

import torch

# @triton.jit chooses between GPU code and the interpreter when the kernel module is imported,
# so the choice must be in the environment before that import.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
import common  # noqa: E402  (lessons/common.py: the repository on sys.path, the flags, one thread, the seed)

from tinydiff import kernels  # noqa: E402
from tinydiff.kernels import sampler_step as step  # noqa: E402
from tinydiff.sampler import propose  # noqa: E402
from tinydiff.tokenizer import MASK, VOCAB_SIZE  # noqa: E402

args = common.setup(__doc__, "fewer positions in the full-vocabulary run")
device = "cpu" if kernels.interpreting() else "cuda"

print("1. The reference: sampler.propose's math, with the uniforms u passed in (sampler_step_reference):\n")
for line in inspect.getsource(step.sampler_step_reference).splitlines()[2:]:
    print("   |" + line)
print("""
   Three passes over (N, V), each materialised in float64: the upcast logits, the perturbed scores
   for the argmax, and the softmax probabilities, of which one number per row is kept.

2. The idea that removes them: a softmax needs only the max m and the sum of exp(x - m), and both
   can be built chunk by chunk. When a new chunk raises the max from m to m', the sum so far is
   worth sum * exp(m - m') in the new units. Check it by hand on 10 numbers in chunks of 4:""")
x = torch.randn(10, dtype=torch.float64) * 3
m, s = float("-inf"), 0.0
for chunk in x.split(4):
    m_new = max(m, float(chunk.max()))
    s = s * torch.exp(torch.tensor(m - m_new)) + torch.exp(chunk - m_new).sum()
    m = m_new
    print(f"   chunk {[round(v, 2) for v in chunk.tolist()]}: running max {m:6.3f}, running sum {float(s):.4f}")
print(f"   softmax(x).max() = {float(x.softmax(0).max()):.6f};  exp(max - m) / sum = "
      f"{float(torch.exp(x.max() - m) / s):.6f}: the same, without the vector of probabilities.\n")

print("3. The kernel, a piece at a time (the source as it is in tinydiff/kernels/sampler_step.py):")


def source_of(kernel):
    return inspect.getsource(kernel.fn if hasattr(kernel, "fn") else kernel).splitlines()


def walk(source, notes):
    """Print the source in pieces, each starting at a line that begins with a note's key."""
    starts = [next(i for i, line in enumerate(source) if line.strip().startswith(key)) for key, _ in notes]
    for (key, note), lo, hi in zip(notes, starts, starts[1:] + [len(source)]):
        print()
        for line in source[lo:hi]:
            print("   |" + line)
        print("   -> " + note.replace("\n", "\n      "))


walk(source_of(step._sampler_step_kernel), [  # (the first line of a piece, what it does)
    ("@triton.jit", "The signature: pointers to the inputs and outputs, sizes, strides; BLOCK_V and NOISE\n"
     "are compile-time constants (tl.constexpr), so each value gets its own compiled kernel."),
    ("row, part = tl.program_id(0)", "The launch grid is (N, split): program (row, part) handles one\n"
     "position and one slice [lo, hi) of its vocabulary. `lane` is a vector 0..BLOCK_V-1: every\n"
     "operation below works on BLOCK_V numbers at once. Each lane keeps its own running max m and\n"
     "sum s, its best score so far, that score's id and its raw logit."),
    ("for start in range(lo, hi, BLOCK_V):", "The walk over the slice. `ok` masks the ids past the\n"
     "slice (the last chunk is partial) and MASK (SUBS: never predicted); masked loads give -inf,\n"
     "which loses every comparison and adds exp(-inf) = 0 to the sum. Upcast to float64, as propose."),
    ("if NOISE:", "Gumbel-max, exactly propose's expression. NOISE is a constexpr, so at temperature 0\n"
     "this branch (and the read of u) is compiled out."),
    ("better = score > best", "The argmax, lane by lane. Strictly greater: a lane sees its ids in\n"
     "increasing order, so on a tie it keeps the smaller id, like torch.argmax."),
    ("m_new = tl.maximum(m, logit)", "The online softmax of step 2, per lane. A lane that has seen\n"
     "only -inf so far would compute exp(-inf - (-inf)) = NaN; measuring from 0 instead gives 0."),
    ("# Combine the lanes", "After the loop the lanes are combined: the max M, the sum rescaled to\n"
     "it, the best score and the smallest id holding it. Five numbers per (row, slice) are stored."),
])
print("""
   Why slices? One program per row would leave most of a GPU idle: a 32-token block is 32
   programs, and a GPU has around a hundred multiprocessors. Splitting each row over several
   programs keeps them all streaming. A second, tiny kernel combines a row's slices with the
   same rules the lanes used (slices hold increasing ids, so the smallest id still wins ties):""")
walk(source_of(step._combine_kernel), [
    ("@triton.jit", "One program per row loads its slices' five numbers as lanes; then M, S, the\n"
     "winner and its probability exp(logit - M) / S. The probabilities never existed in memory."),
])

print(f"\n4. Run it ({'on the GPU' if device == 'cuda' else 'under the interpreter, on the CPU'}) "
      "and compare with sampler.propose itself.")
g = torch.Generator().manual_seed(0)
logits = torch.randn(4, 1000, generator=g).to(device)
for temperature in (0.0, 0.8):
    want_c, want_p = propose(logits, temperature, "low_confidence", torch.Generator(device).manual_seed(7))
    u = torch.rand(logits.shape, generator=torch.Generator(device).manual_seed(7), device=device,
                   dtype=torch.float64) if temperature > 0 else None  # propose's own draw
    c, p = step.sampler_step_triton(logits, temperature, u, block_v=128, split=3)  # 3 slices of 3, 3, 2 chunks
    print(f"   T={temperature}: kernel {c.tolist()} conf {[round(v, 4) for v in p.tolist()]}")
    print(f"          propose {want_c.tolist()} conf {[round(v, 4) for v in want_p.tolist()]}  "
          f"same tokens: {torch.equal(c, want_c)}, max |conf diff| {float((p - want_p).abs().max()):.1e}")

N = 4 if args.quick else 32
logits = (3 * torch.randn(N, VOCAB_SIZE, generator=g)).to(device)
logits[0, MASK] = 100.0  # the largest logit of row 0 is MASK's: the kernel must skip it
start = time.perf_counter()
c, p = step.sampler_step_triton(logits, 0.0, block_v=8192)
seconds = time.perf_counter() - start
want_c, want_p = propose(logits, 0.0, "low_confidence")
print(f"\n   The full vocabulary, {N} positions x {VOCAB_SIZE} ids ({-(-VOCAB_SIZE // 8192)} chunks of 8192): "
      f"same tokens as propose: {torch.equal(c, want_c)};\n   row 0 skipped MASK despite its logit 100: "
      f"{int(c[0]) != MASK}. {seconds * 1000:.0f} ms here.")

# Bytes per logit at temperature 0: subs_logits' clone (read 4, write 4), the upcast (read 4,
# write 8), argmax (read 8), softmax (read 8, write 8): 44, against the kernel's one read of 4.
pytorch_bytes, kernel_bytes = N * VOCAB_SIZE * 44, N * VOCAB_SIZE * 4 + N * 16
print(f"""
5. What it buys on a GPU. At temperature 0 the PyTorch path copies the logits (to mask MASK), upcasts
   them to float64, takes the argmax, and writes and reads the probabilities: about 44 bytes of
   memory traffic per logit, {pytorch_bytes / 2**20:.1f} MiB for these {N} rows, in five or more launches.
   The kernel reads each logit once ({kernel_bytes / 2**20:.1f} MiB) in one launch. The
   interpreter's {seconds * 1000:.0f} ms says nothing about that: it runs NumPy per program. On a GPU,
   `python -m tinydiff.bench.kernels` times both and compares them with the floor bytes / bandwidth.
   The same two ideas, tiles walked by a program and running statistics instead of stored
   intermediates, make the other kernels: flash attention with a tree mask (masked_attention.py)
   and the grouped expert feed-forward (moe_ffn.py).""")
