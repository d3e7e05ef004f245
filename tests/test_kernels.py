"""Each Triton kernel computes what the PyTorch function it replaces computes (tinydiff/kernels/).

On CPU the kernels run under Triton's interpreter: the same kernel source, executed with NumPy.
With a CUDA GPU (scripts/gpu_check.sh runs this file with TRITON_INTERPRET=0) they run compiled
(tests/kernel_mode.py sets this up). The model paths that call the kernels: test_kernel_paths.py.
Sizes are deliberately awkward (never a multiple of the tile) and tiles small, so every kernel
crosses partial tiles and several chunks; grids stay small because the interpreter spends
milliseconds per program instance. The references are evaluated in float64 on the same inputs,
so a kernel is held to its own dtype's accuracy, not to another float32 implementation's rounding.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_mode import DEVICE, INTERPRET, triton_mode  # noqa: F401 (first: sets TRITON_INTERPRET; autouse fixture)

from tinydiff import kernels
from tinydiff.ddtree import build_tree, compile_tree
from tinydiff.dmoe import MoEConfig, MoEFeedForward, block_routing
from tinydiff.kernels import masked_attention as attn
from tinydiff.kernels import moe_ffn as moe
from tinydiff.kernels import sampler_step as step
from tinydiff.sampler import block_causal_mask, propose
from tinydiff.tokenizer import MASK, VOCAB_SIZE

TOL = {torch.float32: 2e-5, torch.float16: 3e-3}  # absolute, on outputs of size ~1
DTYPES = [torch.float32, torch.float16]


def rand(*shape, dtype=torch.float32, scale=1.0, generator=None):
    return (scale * torch.randn(*shape, generator=generator)).to(DEVICE, dtype)


# --- masked attention -------------------------------------------------------------------------

def attention_inputs(B, H, T, S, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (rand(B, H, T, d, dtype=dtype, generator=g), rand(B, H, S, d, dtype=dtype, generator=g),
            rand(B, H, S, d, dtype=dtype, generator=g))


def diagonal(T, S):
    """(T, S) bool, True where query i meets its own key S - T + i: every row sees at least itself."""
    return torch.arange(S)[None, :] == torch.arange(S - T, S)[:, None]


def check_attention(q, k, v, mask, **tiles):
    out = attn.masked_attention_triton(q, k, v, mask, **tiles)
    want = attn.masked_attention_reference(q.double(), k.double(), v.double(), mask)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=TOL[q.dtype], rtol=TOL[q.dtype])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_random_mask_with_rows_whose_first_key_tiles_are_masked(dtype):
    B, H, T, P, d = 2, 2, 21, 16, 24  # S = 37 keys: two full tiles of 16 and a partial one; d padded to 32
    S = P + T
    q, k, v = attention_inputs(B, H, T, S, d, dtype, seed=0)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(B, T, S, generator=g) < 0.4
    mask[:, :, -1] = True  # every row sees at least one key
    mask[:, 0, :16] = False  # row 0: its whole first key tile is masked...
    mask[1, 5, :32] = False  # row 5 of batch 1: its first two tiles
    mask[0, 20, :] = False
    mask[0, 20, 36] = True  # row 20 of batch 0: only the very last key
    check_attention(q, k, v, mask.to(DEVICE), block_t=16, block_s=16)


def test_attention_shared_2d_mask_and_per_head_4d_mask():
    B, H, T, S, d = 1, 3, 19, 30, 16
    q, k, v = attention_inputs(B, H, T, S, d, torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    mask2 = (torch.rand(T, S, generator=g) < 0.5) | diagonal(T, S)
    check_attention(q, k, v, mask2.to(DEVICE), block_t=16, block_s=16)
    mask4 = (torch.rand(B, H, T, S, generator=g) < 0.5) | diagonal(T, S)
    check_attention(q, k, v, mask4.to(DEVICE), block_t=16, block_s=16)


@pytest.mark.parametrize("B,H,T,P,d,block_t,block_s", [(1, 1, 1, 40, 8, 16, 32), (3, 2, 33, 0, 20, 32, 16),
                                                       (1, 2, 50, 7, 64, 16, 64), (2, 1, 17, 70, 40, 32, 32)])
def test_attention_sweep_of_awkward_shapes(B, H, T, P, d, block_t, block_s):
    S = P + T
    q, k, v = attention_inputs(B, H, T, S, d, torch.float32, seed=T + P)
    g = torch.Generator().manual_seed(d)
    mask = (torch.rand(B, T, S, generator=g) < 0.3) | diagonal(T, S)
    check_attention(q, k, v, mask.to(DEVICE), block_t=block_t, block_s=block_s)


def test_attention_with_a_ddtree_ancestor_mask_over_a_prefix():
    torch.manual_seed(4)
    tree = build_tree(torch.randn(5, 50), budget=24)  # 5 depths, 24 nodes + the root
    start = 13
    _, _, mask = compile_tree(tree, start, root_token=0, device=DEVICE)  # (25, 13 + 25)
    T, S = mask.shape
    assert not mask.all(-1).any()  # a real tree: no node sees every position
    q, k, v = attention_inputs(1, 2, T, S, 16, torch.float32, seed=5)
    check_attention(q, k, v, mask, block_t=16, block_s=16)


def test_attention_with_a_block_causal_mask_over_a_kv_prefix():
    # generate_cached's first step of a block: the finished block and the new one over the cached prefix
    past, block = 11, 9
    block_ids = torch.cat([torch.zeros(block), torch.ones(block)])
    mask = torch.cat([torch.ones(2 * block, past, dtype=torch.bool), block_causal_mask(block_ids)], 1)
    T, S = mask.shape  # (18, 29)
    q, k, v = attention_inputs(2, 2, T, S, 16, torch.float16, seed=6)
    check_attention(q, k, v, mask.to(DEVICE), block_t=16, block_s=16)


def test_attention_skips_key_tiles_no_row_may_see():
    # Keys 16..31 are invisible to every query. If the kernel read them, NaN in K and V would leak
    # into the output (0 * NaN = NaN): a finite output proves those tiles were never loaded.
    B, H, T, S, d = 1, 2, 17, 40, 16
    q, k, v = attention_inputs(B, H, T, S, d, torch.float32, seed=7)
    g = torch.Generator().manual_seed(8)
    mask = torch.rand(T, S, generator=g) < 0.5
    mask[:, 16:32] = False
    mask[:, 0] = True
    want = attn.masked_attention_reference(q.double(), k.double(), v.double(), mask.to(DEVICE))
    k[:, :, 16:32], v[:, :, 16:32] = float("nan"), float("nan")
    out = attn.masked_attention_triton(q, k, v, mask.to(DEVICE), block_t=16, block_s=16)
    torch.testing.assert_close(out.double(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_attention_row_that_sees_nothing_is_zero_not_nan():
    q, k, v = attention_inputs(1, 1, 18, 20, 16, torch.float32, seed=9)
    mask = torch.ones(18, 20, dtype=torch.bool)
    mask[3] = False
    out = attn.masked_attention_triton(q, k, v, mask.to(DEVICE), block_t=16, block_s=16)
    assert torch.equal(out[0, 0, 3], torch.zeros_like(out[0, 0, 3]))
    keep = torch.arange(18) != 3
    want = attn.masked_attention_reference(q.double(), k.double(), v.double(), mask.to(DEVICE))
    torch.testing.assert_close(out[:, :, keep].double(), want[:, :, keep], atol=2e-5, rtol=2e-5)


def test_attention_rejects_a_mask_of_the_wrong_shape():
    q, k, v = attention_inputs(1, 1, 4, 6, 16, torch.float32, seed=10)
    with pytest.raises(ValueError, match="mask must be"):
        attn.masked_attention_triton(q, k, v, torch.ones(4, 5, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="boolean"):
        attn.masked_attention_triton(q, k, v, torch.ones(4, 6, device=DEVICE))


# --- dMoE expert feed-forward -----------------------------------------------------------------

def moe_inputs(N, D, Fd, E, k, used, dtype, seed):
    """Random tokens and experts; only the experts in `used` are ever routed to (the rest: empty)."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor(used)
    experts = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(N)])  # (N, k) distinct
    weights = torch.rand(N, k, generator=g)
    weights = weights / weights.sum(-1, keepdim=True)
    x = rand(N, D, dtype=dtype, generator=g)
    gate_w, up_w = (rand(E, Fd, D, dtype=dtype, scale=D ** -0.5, generator=g) for _ in range(2))
    down_w = rand(E, D, Fd, dtype=dtype, scale=Fd ** -0.5, generator=g)
    return x, weights.to(DEVICE), experts.to(DEVICE), gate_w, up_w, down_w


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_ffn_matches_the_dispatch_loop_with_empty_experts(dtype):
    # 13 tokens x 2 slots over experts {0, 2, 3, 5}: 1 and 4 are empty; D, F and the per-expert
    # counts are no multiples of the tiles (16): several row, column, hidden and model-width tiles.
    inputs = moe_inputs(N=13, D=40, Fd=24, E=6, k=2, used=[0, 2, 3, 5], dtype=dtype, seed=0)
    out = moe.moe_ffn_triton(*inputs, block_m=16, block_n=16, block_f=16, block_k=16)
    want = moe.moe_ffn_reference(*(t.double() if t.is_floating_point() else t for t in inputs))
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_moe_ffn_one_expert_gets_more_than_one_tile_and_no_tokens_gives_zeros():
    inputs = moe_inputs(N=37, D=16, Fd=16, E=3, k=1, used=[1], dtype=torch.float32, seed=1)  # 37 rows: 3 tiles
    out = moe.moe_ffn_triton(*inputs, block_m=16)
    want = moe.moe_ffn_reference(*(t.double() if t.is_floating_point() else t for t in inputs))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
    x, w, e, *weights = inputs
    empty = moe.moe_ffn_triton(x[:0], w[:0], e[:0], *weights)
    assert empty.shape == (0, 16)


def test_group_by_expert_sorts_pairs_into_padded_single_expert_tiles():
    g = torch.Generator().manual_seed(2)
    E, block_m = 7, 4
    experts = torch.randint(0, E, (23, 2), generator=g)
    experts[experts == 3] = 4  # expert 3 empty
    pairs, tile_expert = moe.group_by_expert(experts, E, block_m)
    real = pairs[pairs >= 0]
    assert sorted(real.tolist()) == list(range(experts.numel()))  # each (token, slot) pair exactly once
    flat = experts.flatten()
    counts = torch.bincount(flat, minlength=E)
    for t, e in enumerate(tile_expert.tolist()):
        tile = pairs[t * block_m:(t + 1) * block_m]
        if e < 0:
            assert (tile < 0).all()  # unused tiles past the end hold nothing
            continue
        assert (flat[tile[tile >= 0]] == e).all()  # a tile holds one expert's pairs only
        assert (tile >= 0).any()
    used_tiles = tile_expert[tile_expert >= 0]
    assert torch.equal(torch.bincount(used_tiles, minlength=E), (counts + block_m - 1) // block_m)
    assert 3 not in used_tiles.tolist()  # an empty expert has no tile: its weights are never read


def test_moe_reference_is_moe_feed_forward_with_block_routing():
    # The reference is the layer's own dispatch loop: identical output on the layer's routing.
    torch.manual_seed(3)
    layer = MoEFeedForward(MoEConfig(d_model=24, d_ff=60, n_experts=8, moe_top_k=2, shared_expert=False,
                                     routing="block", route_block=8, route_guard=2)).eval()
    torch.nn.init.normal_(layer.router.weight, std=0.5)
    x = torch.randn(2, 13, 24)
    with torch.no_grad(), kernels.kernels_enabled(False):  # the layer's own loop, not the kernel it calls now
        y = layer(x)
        weights, experts = layer.last["weights"].view(26, 2), layer.last["experts"].view(26, 2)
        stacked = moe.stack_experts(layer)
        assert torch.equal(moe.moe_ffn_reference(x.view(26, 24), weights, experts, *stacked), y.view(26, 24))
        out = moe.moe_ffn_triton(x.view(26, 24).to(DEVICE), weights.to(DEVICE), experts.to(DEVICE),
                                 *(w.to(DEVICE) for w in stacked))
    torch.testing.assert_close(out.cpu(), y.view(26, 24), atol=2e-5, rtol=2e-5)
    coreset = block_routing(layer.last["scores"], 2, 8, layer.threshold, layer.guard)  # (2, 2, 8)
    _, tile_expert = moe.group_by_expert(experts, 8, 16)
    assert set(tile_expert[tile_expert >= 0].tolist()) <= set(coreset.any(1).any(0).nonzero().flatten().tolist())


# --- sampler step -----------------------------------------------------------------------------

# 1000 ids in chunks of 128: 8 chunks, the last partial; split 3: slices of 384, 384 and 232 ids.
# The whole vocabulary (MASK excluded) in chunks of 4096: 13 chunks, over 1 or 4 programs per row.
@pytest.mark.parametrize("V,block_v,split", [(1000, 128, 1), (1000, 128, 3), (VOCAB_SIZE, 4096, 1),
                                             (VOCAB_SIZE, 4096, 4)])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_sampler_step_gives_propose_tokens_and_confidences(V, block_v, split, temperature):
    g = torch.Generator().manual_seed(int(10 * temperature) + V)
    logits = (3 * torch.randn(5, V, generator=g)).to(DEVICE)
    seed = 123
    with kernels.kernels_enabled(False):  # propose's own math
        want_c, want_p = propose(logits, temperature, "low_confidence", torch.Generator(DEVICE).manual_seed(seed))
    u = None  # propose's own draw: the same generator, seed and shape give the same uniforms
    if temperature > 0:
        u = torch.rand(logits.shape, generator=torch.Generator(DEVICE).manual_seed(seed),
                       device=DEVICE, dtype=torch.float64)
    c, p = step.sampler_step_triton(logits, temperature, u, block_v=block_v, split=split)
    assert torch.equal(c, want_c)
    torch.testing.assert_close(p, want_p, atol=1e-12, rtol=1e-10)
    if V > MASK:
        assert (c != MASK).all()


def test_sampler_step_never_picks_mask_even_when_its_logit_is_largest():
    logits = torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    logits[:, MASK] = 50.0
    c, p = step.sampler_step_triton(logits, 0.0, block_v=8192)
    without = logits.double().clone()
    without[:, MASK] = float("-inf")
    assert torch.equal(c, without.argmax(-1))
    torch.testing.assert_close(p, without.softmax(-1).max(-1).values, atol=1e-12, rtol=1e-10)


def test_sampler_step_ties_go_to_the_first_id_across_lanes_and_chunks():
    # float16 logits tie easily. Chunks of 128: the maximum appears at ids 7, 263 and 900 (row 0:
    # 7 and 263 share lane 7 in chunks 0 and 2), 300 and 301 (row 1, one chunk, neighbouring lanes)
    # and 650 and 140 (row 2: 650 sits in lane 10, 140 in lane 12, so choosing by lane would be wrong).
    V = 1000
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5)).clamp(-3, 3).half()
    for row, ids in enumerate([(7, 263, 900), (300, 301), (650, 140)]):
        logits[row, list(ids)] = 4.0
    want = logits.double().softmax(-1).max(-1).values
    for split in (1, 3):  # 3 slices of 384 ids: 7 | 263 | 900, 140 | 650 fall in different slices
        c, p = step.sampler_step_triton(logits.to(DEVICE), 0.0, block_v=128, split=split)
        assert c.tolist() == [7, 300, 140]
        torch.testing.assert_close(p.cpu(), want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sampler_step_float16_logits_match_the_reference(temperature):
    g = torch.Generator().manual_seed(6)
    logits = (2 * torch.randn(4, 777, generator=g)).half().to(DEVICE)
    u = torch.rand(4, 777, generator=g, dtype=torch.float64).to(DEVICE) if temperature else None
    c, p = step.sampler_step_triton(logits, temperature, u, block_v=256)
    want_c, want_p = step.sampler_step_reference(logits, temperature, u)
    assert torch.equal(c, want_c)
    torch.testing.assert_close(p, want_p, atol=1e-12, rtol=1e-10)
    assert ((p > 0) & (p <= 1)).all()


def test_dispatch_follows_use_triton_and_can_be_switched_off(monkeypatch):
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    assert kernels.use_triton(logits)
    assert not kernels.for_inference(logits)  # gradients on (training): the model paths keep PyTorch's
    with torch.no_grad():
        assert kernels.for_inference(logits)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernels.use_triton(logits) == logits.is_cuda  # CPU tensors: the interpreter only when asked
    monkeypatch.setenv("TRITON_INTERPRET", "1" if INTERPRET else "0")
    with kernels.kernels_enabled(False):
        assert not kernels.use_triton(logits)
        c0, p0 = step.sampler_step(logits, 0.0)
    c1, p1 = step.sampler_step(logits, 0.0)
    assert torch.equal(c0, c1)
    torch.testing.assert_close(p0, p1, atol=1e-12, rtol=1e-10)


def test_without_triton_the_kernel_files_import_and_dispatch_to_the_references():
    # A machine without Triton (macOS, Windows): `import triton` fails, the references still run.
    code = """
import sys, torch
sys.modules["triton"] = sys.modules["triton.language"] = None  # import triton -> ImportError
import tinydiff.kernels as K
K.HAVE_TRITON = False
from tinydiff.kernels import masked_attention, moe_ffn, sampler_step
q = torch.randn(1, 2, 3, 8)
mask = torch.ones(3, 3, dtype=torch.bool).tril()
out = masked_attention.masked_attention(q, q, q, mask)
assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), atol=1e-6)
x, experts = torch.randn(4, 8), torch.tensor([[0], [1], [1], [0]])
w = torch.randn(2, 6, 8)
assert moe_ffn.moe_ffn(x, torch.ones(4, 1), experts, w, w, w.transpose(1, 2)).shape == (4, 8)
logits = torch.randn(2, 10)
assert torch.equal(sampler_step.sampler_step(logits, 0.0)[0], logits.argmax(-1))
print("ok")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # even when asked: without Triton, the references
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_kernel_bench_checks_every_path_against_the_reference(tmp_path):
    # On CPU only the references are timed (Triton's timings need a GPU); on a GPU every path is, and
    # each must give the reference's answer: float32 to 1e-4, TF32 products to TF32's 10-bit accuracy.
    from tinydiff.bench import kernels as bench
    x = torch.randn(4, 8, dtype=torch.float32)
    assert bench.agrees(x + 1e-3, x, tf32=True) and not bench.agrees(x + 1e-3, x, tf32=False)
    rows_file = tmp_path / "rows.json"
    bench.main(["--kernels", "sampler,moe,moe-fp4", "--reps", "1", "--json", str(rows_file)])
    rows = json.loads(rows_file.read_text())["rows"]
    assert {(r["kernel"], r["path"]) for r in rows} >= {("sampler", "reference"), ("moe", "reference"),
                                                        ("moe-fp4", "reference")}
    assert all(r["ok"] and r["ms"] > 0 for r in rows)
    assert all((r["gpu_ms"] is None) == (not torch.cuda.is_available()
                                         or (r["kernel"], r["path"]) in bench.NOT_CAPTURABLE) for r in rows)
