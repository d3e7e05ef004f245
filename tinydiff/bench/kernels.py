"""`python -m tinydiff.bench.kernels`: each kernel against its reference and the best stock path.

    python -m tinydiff.bench.kernels [--kernels attention,moe,moe-fp4,sampler] [--dtypes float32,bfloat16] [--json PATH]

Sizes are the project's: the 13m preset's attention (6 heads of 32) verifying DDTree trees of
64, 128 and 256 nodes over a 256-token prefix, and the block-causal masks of the diffusion
sampler; the mdlm-moe feed-forward of the tiny and 13m presets (32 experts, top-3) on one
32-token block (dMoE block routing: a 6-expert coreset; token routing: any expert) and on a
256-token canvas; the sampler step over the 50,258-token vocabulary for a 32-token block.
Paths per kernel:
  attention  reference = SDPA with the dense boolean mask (model.py's call), flex = FlexAttention
             (torch.compile'd; the block mask is built inside the timed call, since a tree's mask
             changes every round), triton (float32: exact "ieee" products, and "tf32")
  moe        reference = MoEFeedForward's loop over experts, bmm = gather the used experts' weights
             and run padded batched matmuls (the best few-launch stock path), triton
  moe-fp4    the same problems with MXFP4 experts: reference = dequantize, then the loop; grouped =
             moe's triton kernel on the weights kept dequantized (in the row's dtype); dequant+grouped
             = dequantize on every call, then that kernel; triton-fp4 = the kernel that reads the
             packed nibbles and scales (GB/s counts 4.25 bits per weight for every path); on a GPU
             also experts of 1024 x 2048, where the bytes read, not the launches, take the time
  sampler    reference = sampler.propose's float64 math, lse = argmax + logsumexp (no probability
             tensor; float32 at T = 0), triton
Columns: ms (median time per call; on a GPU triton.testing.do_bench, L2 flushed between runs: at
these sizes mostly the host's work of launching), gpu_ms (on a GPU: the same call captured in a
CUDA graph and replayed, so the device's time alone; '-' for paths that read a result back to the
host, which a graph cannot hold), GB/s (the bytes a perfect kernel must move / time) and TFLOP/s
(the useful FLOPs / time), both over gpu_ms where there is one, floor_ms = max(bytes / measured
copy bandwidth, FLOPs / measured matmul rate) and of_floor = floor_ms / that time (1.0 would be the
physical limit), ok = the output agrees with the reference (TF32 rows to TF32's accuracy).
--sweep adds rows for other tile sizes of the Triton kernels (defaults in their launchers; pick
new ones from these rows). At these sizes every path is far from its floor: a launch costs a few
microseconds, which is what fusing into one launch buys.
On a machine without CUDA the Triton timings need a GPU: only the references are timed.
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tinydiff.checks import SEED, Rule
from tinydiff.ddtree import build_tree, compile_tree
from tinydiff.fp4 import bits_per_weight, quantize
from tinydiff.io.cli import add_device, check_device, make_parser, run_main
from tinydiff.io.files import check_output, write_atomic
from tinydiff.kernels import HAVE_TRITON
from tinydiff.kernels.masked_attention import masked_attention_reference, masked_attention_triton
from tinydiff.kernels.moe_ffn import moe_ffn_fp4_reference, moe_ffn_fp4_triton, moe_ffn_reference, moe_ffn_triton
from tinydiff.kernels.sampler_step import sampler_step_reference, sampler_step_triton
from tinydiff.sampler import block_causal_mask
from tinydiff.tokenizer import VOCAB_SIZE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISIONS = {True: ("ieee", "tf32"), False: ("ieee",)}  # float32 products: exact or TF32; 16-bit: one kind
# A median of more calls says nothing new, and a CPU call of a reference takes milliseconds: 10^6 reps was hours.
REPS = Rule(integer=True, lo=1, hi=10_000)


def time_ms(fn, device: str, reps: int) -> float:
    if device.startswith("cuda"):
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=max(20, reps), return_mode="median")
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def graph_ms(fn) -> float:
    """fn's device time alone: calls captured in a CUDA graph (about 20 ms of them), replayed 10 times."""
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def measured_peaks(device: str, dtype) -> dict:
    """Copy bandwidth (bytes/s) and matmul rate (FLOP/s, float32: exact, tf32 and 16-bit), measured here."""
    cuda = device.startswith("cuda")
    n = (256 if cuda else 32) * 2**20 // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    bandwidth = 2 * 4 * n / (time_ms(lambda: dst.copy_(src), device, 10) / 1000)
    size = 4096 if cuda else 512
    rates = {}
    for name, dt, tf32 in (("ieee", torch.float32, False), ("tf32", torch.float32, True), ("16bit", dtype, False)):
        if name == "16bit" and dtype == torch.float32 or name == "tf32" and not cuda:
            continue
        a, b = torch.randn(size, size, device=device, dtype=dt), torch.randn(size, size, device=device, dtype=dt)
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        rates[name] = 2 * size**3 / (time_ms(lambda: a @ b, device, 5) / 1000)
        torch.backends.cuda.matmul.allow_tf32 = before
    return {"bandwidth": bandwidth, **rates}


_flex = None


def flex_path(q, k, v, mask):
    """FlexAttention over the dense mask: the block mask is rebuilt each call (the tree changes)."""
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    if _flex is None:
        import torch._dynamo
        for limit in ("recompile_limit", "cache_size_limit"):  # one compile per shape and dtype: allow them
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, 64)
        _flex = torch.compile(flex_attention, dynamic=False)
    compiled = _flex
    T, S = mask.shape

    def run():
        block_mask = create_block_mask(lambda b, h, i, j: mask[i, j], None, None, T, S, device=q.device)
        return compiled(q, k, v, block_mask=block_mask)
    return run


def attention_cases(device, dtype, gpu, sweep=False):
    """(case, {path: fn}, bytes, FLOPs) for tree verification and block-causal steps."""
    H, d, g = 6, 32, torch.Generator().manual_seed(0)
    masks = {}
    for budget in (64, 128, 256):
        tree = build_tree(torch.randn(15, 2000, generator=g), budget)  # a DFlash block of 16: 15 depths
        masks[f"tree-b{budget}"] = compile_tree(tree, 256, 0, device)[2]  # (budget+1, 256 + budget+1)
    ids = torch.cat([torch.zeros(64), 1 + torch.arange(192) // 32])  # 64-token prompt, 6 blocks of 32
    masks["block-causal-256"] = block_causal_mask(ids).to(device)  # generate(block_causal=True)
    ids = torch.cat([torch.zeros(32), torch.ones(32)])  # generate_cached: finished block + new block
    masks["cached-step-64"] = torch.cat([torch.ones(64, 160, dtype=torch.bool), block_causal_mask(ids)], 1).to(device)
    for name, mask in masks.items():
        T, S = mask.shape
        q = torch.randn(1, H, T, d, device=device, dtype=dtype)
        k, v = (torch.randn(1, H, S, d, device=device, dtype=dtype) for _ in range(2))
        size = q.element_size()
        moved = size * H * d * (2 * T + 2 * S) + mask.numel()  # q, out, k, v once; the mask once
        flops = 4 * d * H * int(mask.sum())  # q.k and p.v for the allowed pairs only
        paths = {"reference": lambda q=q, k=k, v=v, m=mask: masked_attention_reference(q, k, v, m)}
        if gpu:
            paths["flex"] = flex_path(q, k, v, mask)
            for precision in PRECISIONS[dtype == torch.float32]:
                path = f"triton-{precision}" if dtype == torch.float32 else "triton"
                paths[path] = lambda q=q, k=k, v=v, m=mask, p=precision: masked_attention_triton(q, k, v, m, precision=p)
            for bt, bs in ((bt, bs) for bt in (16, 32, 64) for bs in (32, 64, 128)) if sweep else ():
                paths[f"tiles {bt}x{bs}"] = (lambda q=q, k=k, v=v, m=mask, bt=bt, bs=bs:
                                             masked_attention_triton(q, k, v, m, block_t=bt, block_s=bs))
        yield f"{name} T={T} S={S}", paths, moved, flops


def moe_bmm(x, weights, experts, gate_w, up_w, down_w):
    """Stock PyTorch in a few launches: tokens padded per used expert, the used experts' weights
    gathered, three batched matmuls, then a scatter-add back (one host sync for the padding size)."""
    N, k = experts.shape
    flat = experts.flatten()
    used, slot_of = torch.unique(flat, return_inverse=True)  # (U,) experts read, each pair's index in used
    counts = torch.bincount(slot_of, minlength=len(used))
    order = torch.argsort(slot_of, stable=True)
    rank = torch.arange(len(flat), device=x.device) - (torch.cumsum(counts, 0) - counts)[slot_of[order]]
    rows = torch.zeros(len(used), int(counts.max()), dtype=torch.long, device=x.device)
    live = torch.zeros_like(rows, dtype=torch.bool)
    rows[slot_of[order], rank], live[slot_of[order], rank] = order, True
    h = x[rows // k]  # (U, C, D), padding rows read token 0 and are dropped below
    y = torch.bmm(F.silu(torch.bmm(h, gate_w[used].transpose(1, 2))) * torch.bmm(h, up_w[used].transpose(1, 2)),
                  down_w[used].transpose(1, 2))  # (U, C, D)
    y = y * weights.flatten()[rows].unsqueeze(-1).to(y.dtype) * live.unsqueeze(-1)
    return torch.zeros_like(x).index_add_(0, (rows // k).flatten(), y.flatten(0, 1))


def moe_problems(device, dtype, large=False):
    """The MoE cases both MoE kernels are timed on: the tiny and 13m presets' experts (32, top-3)
    under block routing (one 32-token block, a 6-expert coreset) and token routing (32 and 256 tokens);
    large: also experts of 1024 x 2048, where reading the weights, not launching, takes the time."""
    g = torch.Generator().manual_seed(1)
    for preset, D, Fd in (("tiny", 128, 96), ("13m", 192, 128)) + ((("1024x2048", 1024, 2048),) if large else ()):
        E, k = 32, 3
        gate_w, up_w = (torch.randn(E, Fd, D, generator=g).mul(D ** -0.5).to(device, dtype) for _ in range(2))
        down_w = torch.randn(E, D, Fd, generator=g).mul(Fd ** -0.5).to(device, dtype)
        for routing, N, pool in (("block", 32, 6), ("token", 32, E), ("token", 256, E)):
            choice = torch.randperm(E, generator=g)[:pool]
            experts = torch.stack([choice[torch.randperm(pool, generator=g)[:k]] for _ in range(N)]).to(device)
            weights = torch.rand(N, k, generator=g).softmax(-1).to(device)
            x = torch.randn(N, D, generator=g).to(device, dtype)
            used = int(experts.unique().numel())
            case = f"{preset} {routing} N={N} experts={used}"
            yield case, (x, weights, experts, gate_w, up_w, down_w), used * Fd * D


def moe_traffic(args, used_weights: int, weight_bytes: float) -> tuple[int, int]:
    """(bytes a perfect kernel moves, useful FLOPs) of one MoE problem: the used experts' weights at
    weight_bytes each, x and out, the routing; gate, up and down, 2 FLOPs per weight per (token, slot)."""
    x, experts, gate_w = args[0], args[2], args[3]
    (N, D), k, size = x.shape, experts.shape[1], x.element_size()
    return int(3 * used_weights * weight_bytes + 2 * N * D * size + N * k * 12), 6 * N * k * D * gate_w.shape[1]


def moe_cases(device, dtype, gpu, sweep=False):
    for case, args, used_weights in moe_problems(device, dtype):
        moved, flops = moe_traffic(args, used_weights, args[0].element_size())
        paths = {"reference": lambda a=args: moe_ffn_reference(*a)}
        if gpu:
            paths["bmm"] = lambda a=args: moe_bmm(*a)
            for precision in PRECISIONS[dtype == torch.float32]:
                path = f"triton-{precision}" if dtype == torch.float32 else "triton"
                paths[path] = lambda a=args, p=precision: moe_ffn_triton(*a, precision=p)
            for bm, bf, bk in ((16, 16, 32), (16, 32, 64), (32, 32, 32)) if sweep else ():
                paths[f"tiles {bm}/{bf}/{bk}"] = (lambda a=args, bm=bm, bf=bf, bk=bk:
                                                  moe_ffn_triton(*a, block_m=bm, block_f=bf, block_k=bk))
        yield case, paths, moved, flops


def moe_fp4_cases(device, dtype, gpu, sweep=False):
    """The same problems with MXFP4 experts: the packed kernel against the grouped kernel of moe_cases
    reading the same weights dequantized into dtype (what a model without FP4 keeps), and against
    dequantizing on every call first. bytes count the packed weights (4.25 bits each)."""
    for case, args, used_weights in moe_problems(device, dtype, large=gpu):
        x, weights, experts = args[:3]
        packed = [quantize(w.float()) for w in args[3:]]
        dense = tuple(p.dequantize(dtype) for p in packed)
        moved, flops = moe_traffic(args, used_weights, bits_per_weight("mxfp4") / 8)
        fp4_args = (x, weights, experts, *packed)
        paths = {"reference": lambda a=fp4_args: moe_ffn_fp4_reference(*a)}
        if gpu:
            paths["grouped"] = lambda a=(x, weights, experts, *dense): moe_ffn_triton(*a)
            paths["dequant+grouped"] = lambda a=(x, weights, experts), p=packed: moe_ffn_triton(
                *a, *(w.dequantize(dtype) for w in p))
            paths["triton-fp4"] = lambda a=fp4_args: moe_ffn_fp4_triton(*a)
            for bm, bn, bf, bk in ((16, 64, 16, 16), (16, 128, 32, 32), (16, 64, 64, 64)) if sweep else ():
                paths[f"tiles {bm}/{bn}/{bf}/{bk}"] = (lambda a=fp4_args, bm=bm, bn=bn, bf=bf, bk=bk:
                                                       moe_ffn_fp4_triton(*a, block_m=bm, block_n=bn,
                                                                          block_fh=bf, block_kh=bk))
        yield case, paths, moved, flops


def sampler_lse(logits, temperature, uniforms=None):
    """Stock PyTorch without a probability tensor: argmax, then exp(logit - logsumexp)."""
    logits = logits.clone()
    logits[:, -1] = float("-inf")  # MASK is the last id of the 50,258
    if temperature > 0:
        candidates = (logits.double() / temperature - torch.log(-torch.log(uniforms))).argmax(-1)
    else:
        candidates = logits.argmax(-1)
    lse = torch.logsumexp(logits.float(), -1)
    return candidates, torch.exp(logits.gather(-1, candidates[:, None]).squeeze(-1).float() - lse)


def sampler_cases(device, dtype, gpu, sweep=False):
    g = torch.Generator().manual_seed(2)
    N, V = 32, VOCAB_SIZE
    logits = (3 * torch.randn(N, V, generator=g)).to(device, dtype)
    u = torch.rand(N, V, generator=g, dtype=torch.float64).to(device)
    for temperature in (0.0, 1.0):
        uniforms = u if temperature > 0 else None
        moved = N * V * logits.element_size() + (N * V * 8 if temperature > 0 else 0) + N * 16
        args = (logits, temperature, uniforms)
        paths = {"reference": lambda a=args: sampler_step_reference(*a)}
        if gpu:
            paths["lse"] = lambda a=args: sampler_lse(*a)
            paths["triton"] = lambda a=args: sampler_step_triton(*a)
            for block_v, split in ((1024, None), (4096, None), (2048, 1), (2048, 2), (2048, 4), (2048, 8),
                                   (1024, 4), (4096, 4)) if sweep else ():
                paths[f"tiles {block_v}/{split or 'auto'}"] = (lambda a=args, bv=block_v, sp=split:
                                                               sampler_step_triton(*a, block_v=bv, split=sp))
        yield f"N={N} V={V} T={temperature:g}", paths, moved, 0


KERNELS = {"attention": attention_cases, "moe": moe_cases, "moe-fp4": moe_fp4_cases, "sampler": sampler_cases}


def agrees(out, want, tf32: bool) -> bool:
    if isinstance(out, tuple):  # the sampler: the same candidates, close confidences
        return torch.equal(out[0], want[0]) and torch.allclose(out[1].double(), want[1].double(), atol=1e-4)
    scale = 3e-2 if out.dtype != torch.float32 else 3e-3 if tf32 else 1e-4  # TF32 keeps 10 mantissa bits
    return torch.allclose(out.float(), want.float(), atol=scale, rtol=scale)


HEADER = (f"{'dtype':<8} {'kernel':<9} {'case':<34} {'path':<16} {'ms':>8} {'gpu_ms':>8} {'GB/s':>7} "
          f"{'TFLOP/s':>8} {'floor_ms':>9} {'of_floor':>8}  ok")
# Paths that read a result back to the host (to size a tensor, or to loop over the experts present)
# cannot be captured in a CUDA graph; FlexAttention's block mask is built by compiled code outside one.
# Dequantizing copies E2M1's value table to the GPU, which a capture forbids.
NOT_CAPTURABLE = {("moe", "reference"), ("moe", "bmm"), ("moe-fp4", "reference"), ("moe-fp4", "dequant+grouped"),
                  ("attention", "flex")}


def measure(row, fn, want, moved, flops, peaks, args, rows) -> None:
    """Check fn against the reference output, time it, print and record (and save) one row."""
    label = f"{row['dtype']:<8} {row['kernel']:<9} {row['case']:<34} {row['path']:<16}"
    try:
        ok = agrees(fn(), want, "tf32" in row["path"])
        ms = time_ms(fn, args.device, args.reps)
    except Exception as e:  # FlexAttention where it does not compile, for one
        print(f"{label} n/a: {type(e).__name__}: {str(e)[:80]}", flush=True)
        return
    gpu_ms = None
    if args.device.startswith("cuda") and (row["kernel"], row["path"]) not in NOT_CAPTURABLE:
        try:
            gpu_ms = graph_ms(fn)
        except Exception as e:  # keep the per-call row
            print(f"{label} (no CUDA graph: {type(e).__name__}: {str(e)[:60]})", flush=True)
    dtype = DTYPES[row["dtype"]]
    rate = peaks.get(row["path"].split("-")[-1], peaks.get("ieee" if dtype == torch.float32 else "16bit"))
    floor = 1000 * max(moved / peaks["bandwidth"], flops / rate)
    t = gpu_ms or ms
    row.update({"ms": ms, "gpu_ms": gpu_ms, "gb_s": moved / t / 1e6, "tflop_s": flops / t / 1e9,
                "floor_ms": floor, "of_floor": floor / t, "ok": ok})
    rows.append(row)
    gpu = f"{gpu_ms:8.4f}" if gpu_ms else f"{'-':>8}"
    print(f"{label} {ms:8.4f} {gpu} {row['gb_s']:7.1f} {row['tflop_s']:8.3f} {floor:9.5f} {row['of_floor']:8.3f}  "
          f"{'ok' if ok else 'MISMATCH'}", flush=True)
    if args.json:  # rewritten after every row (atomically): a run cut short still leaves its rows
        text = json.dumps({"device": args.device_name, "torch": torch.__version__, "rows": rows}, indent=1)
        write_atomic(args.json, lambda f: f.write(text.encode("utf-8")))


def run(args) -> list[dict]:
    gpu = args.device.startswith("cuda") and HAVE_TRITON
    rows, later = [], []  # FlexAttention compiles for minutes: its rows come last
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        peaks = measured_peaks(args.device, dtype)
        print(f"\n{dtype_name}: measured copy bandwidth {peaks['bandwidth'] / 1e9:.0f} GB/s, matmul "
              + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in peaks.items() if k != "bandwidth"))
        print(HEADER, flush=True)
        for kernel in args.kernels.split(","):
            for case, paths, moved, flops in KERNELS[kernel](args.device, dtype, gpu, args.sweep):
                want = paths["reference"]()
                for path, fn in paths.items():
                    row = {"dtype": dtype_name, "kernel": kernel, "case": case, "path": path}
                    job = (row, fn, want, moved, flops, peaks, args, rows)
                    if path == "flex" and args.flex:
                        later.append(job)
                    elif path != "flex":
                        measure(*job)
    if later:
        print("\nFlexAttention (torch.compile'd):\n" + HEADER, flush=True)
        for job in later:
            measure(*job)
    return rows


def main(argv=None):
    p = make_parser("python -m tinydiff.bench.kernels", __doc__.split("\n")[0])
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"comma list from: {', '.join(KERNELS)}")
    p.add_argument("--dtypes", default=None, help="comma list from float32, bfloat16, float16 "
                   "(default: float32,bfloat16 on a GPU, float32 on CPU)")
    add_device(p)
    p.add_argument("--reps", type=REPS, default=None, help="timed repetitions (default: 100 on a GPU, 3 on CPU)")
    p.add_argument("--seed", type=SEED, default=1337, help="seeds every random choice: same seed, same output")
    p.add_argument("--sweep", action="store_true", help="also time the Triton kernels at other tile sizes "
                   "(attention: block_t x block_s; moe: block_m/block_f/block_k; moe-fp4: "
                   "block_m/block_n/block_fh/block_kh; sampler: block_v/split)")
    p.add_argument("--no-flex", dest="flex", action="store_false", help="skip FlexAttention (it compiles for minutes)")
    p.add_argument("--json", help="also write the rows as JSON to this path")
    args = p.parse_args(argv)
    check_device(args.device)
    check_output(args.json, "--json")
    cuda = args.device.startswith("cuda")
    args.dtypes = args.dtypes or ("float32,bfloat16" if cuda else "float32")
    args.reps = args.reps or (100 if cuda else 3)
    torch.manual_seed(args.seed)
    name = torch.cuda.get_device_name(args.device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    args.device_name = name
    print(f"kernel benchmark on {name}, torch {torch.__version__}")
    if not cuda:
        print("No CUDA device: the Triton timings need a GPU (under TRITON_INTERPRET the kernels run in NumPy, "
              "which says nothing about speed). Timing only the PyTorch references.")
    elif not HAVE_TRITON:
        print("Triton is not installed: timing only the PyTorch references.")
    for bad in set(args.kernels.split(",")) - set(KERNELS) | set(args.dtypes.split(",")) - set(DTYPES):
        p.error(f"unknown kernel or dtype {bad!r}")
    with torch.no_grad():
        run(args)
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(run_main(main))
