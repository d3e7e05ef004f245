"""Spec: FP4 weights (tinydiff/fp4.py), FP4 experts (tinydiff/fp4.py) and
`python -m tinydiff.tools.quantize`. MXFP4 is checked three ways: exhaustively where the space is small
(every E2M1 value at every normal scale, every byte, every E8M0 code), against a brute-force
oracle of OCP's rule (the scale by search over powers of two, each element by distance to all 16
grid values) on adversarial blocks, and against torchao, the library implementation people use,
bit for bit. The kernel that reads the packed weights: tests/test_kernels_fp4.py."""
import importlib.util
import json
import math
import random

import pytest
import torch
from entry_points import last_line, run_in_process

from tinydiff import fp4
from tinydiff.bench.moe_stats import moe_stats, reset_stats
from tinydiff.checks import UserError
from tinydiff.dmoe import MoEConfig, MoETransformer, moe_layers, set_routing
from tinydiff.fp4 import QuantizedMoEFeedForward, dequantized_copy, quantize_experts
from tinydiff.io.checkpoint import load_checkpoint, load_model, save_checkpoint
from tinydiff.model import ModelConfig, Transformer
from tinydiff.tools import quantize

GRID = fp4.E2M1 + tuple(-v for v in fp4.E2M1)  # the value of each code 0..15


# --- the format ---------------------------------------------------------------------------------

def test_every_e2m1_value_times_every_normal_scale_round_trips_exactly():
    exps = torch.arange(-126, 128)  # every power of two in float32's normal range
    codes = torch.arange(16).repeat(2)  # (32,) each code twice: one block holds all of them
    values = torch.tensor(GRID, dtype=torch.float64)[codes][None, :] * torch.exp2(exps.double())[:, None]  # (254, 32)
    finite = values.abs() <= torch.finfo(torch.float32).max  # 6 x 2^126 is past float32's largest
    w = torch.where(finite, values, 0.0).float()
    assert torch.equal(w.double(), torch.where(finite, values, 0.0))  # every product is a float32 exactly
    p = fp4.quantize(w)
    assert torch.equal(p.dequantize(), w)
    full = finite.all(1)  # the rows that hold 6 x 2^X: their scale is 2^X itself
    assert torch.equal(p.scales[full, 0].long() - 127, exps[full]) and int(full.sum()) == 252
    assert torch.equal(fp4.unpack(p.codes)[full], codes.expand(int(full.sum()), 32).to(torch.uint8))


def test_pack_and_unpack_are_inverse_bijections_over_all_256_bytes():
    every = torch.arange(256, dtype=torch.uint8)
    codes = fp4.unpack(every)  # (512,): (low, high) of each byte
    pairs = {(int(lo), int(hi)) for lo, hi in codes.view(256, 2)}
    assert len(pairs) == 256 and all(0 <= lo < 16 and 0 <= hi < 16 for lo, hi in pairs)
    assert torch.equal(fp4.pack(codes), every)
    assert codes.view(256, 2)[0x21].tolist() == [1, 2]  # element 2i in the low nibble (torch's float4_e2m1fn_x2)


def test_e8m0_codes_are_exact_powers_of_two_and_decoding_is_exact():
    s = torch.arange(255, dtype=torch.uint8)
    assert fp4.e8m0_value(s).double().tolist() == [2.0 ** (i - 127) for i in range(255)]  # 2^-127: subnormal
    assert fp4.e2m1_decode(torch.arange(16, dtype=torch.uint8)).tolist() == list(GRID)


def random_blocks(n, size, seed):
    """n adversarial blocks of `size` float32 values: a random common exponent (subnormal to huge),
    values on the grid, on the midpoints between grid values, a ulp beside either, above 6 (to
    saturate), random, zero and -0; some blocks all zero, some in the subnormal range."""
    rng = random.Random(seed)
    specials = list(fp4.E2M1) + list(fp4.MIDPOINTS) + [6.5, 7.0, 7.999, 4.0001]
    blocks = []
    for _ in range(n):
        k = rng.choice([rng.randint(-149, 124), rng.randint(-160, -120), rng.randint(-4, 4)])
        block = []
        for _ in range(size):
            kind = rng.random()
            m = rng.choice(specials) if kind < 0.6 else rng.uniform(0, 8) if kind < 0.9 else 0.0
            v = math.ldexp(m, k) * rng.choice([1, -1])
            if rng.random() < 0.2:  # a float32 ulp beside it
                v = float(torch.nextafter(torch.tensor(v, dtype=torch.float32),
                                          torch.tensor(rng.choice([-1e39, 1e39]), dtype=torch.float32)))
            block.append(v)
        blocks.append([0.0] * size if rng.random() < 0.03 else block)
    w = torch.tensor(blocks, dtype=torch.float32)
    return torch.where(w.isfinite(), w, 0.0)


def oracle(block):
    """OCP MX's conversion of one block by brute force: the scale by search over the powers of two,
    each element the nearest of the grid values of its sign, a tie to the even code."""
    amax = max(abs(v) for v in block)
    x = -127
    if amax > 0:
        k = 127
        while 2.0 ** k > amax:  # the largest power of two <= amax (down into float32's subnormals)
            k -= 1
        x = max(k - 2, -127)
    codes = []
    for v in block:
        y = v / 2.0 ** x  # exact in float64
        sign = 8 if math.copysign(1, v) < 0 else 0
        codes.append(min(range(sign, sign + 8), key=lambda c: (abs(GRID[c] - y), c % 2)))
    return x + 127, codes


@pytest.mark.parametrize("size", [2, 4, 32])
def test_quantize_is_the_ocp_rule_by_brute_force(size):
    w = random_blocks(1200 if size < 32 else 150, size, seed=size)
    p = fp4.quantize(w, block_size=size)
    got_codes = fp4.unpack(p.codes)
    for i, block in enumerate(w.tolist()):
        scale, codes = oracle(block)
        assert (int(p.scales[i, 0]), got_codes[i].tolist()) == (scale, codes), block
    assert (p.scales == 0).any() and (p.scales > 200).any()  # the subnormal and huge ranges were reached
    dq = p.dequantize()
    assert torch.equal(dq, fp4.fake_quantize(w, "mxfp4", size))
    assert bool((dq.abs() <= 6 * fp4.e8m0_value(p.scales)).all())


def test_nvfp4_blocks_are_the_rounded_e4m3_scale_and_the_nearest_grid_values():
    w = torch.randn(3, 8, 64) * torch.exp(torch.randn(3, 1, 1) * 3)  # three matrices, three tensor scales
    w[1, 2, :16] = 0  # a zero block
    p = fp4.quantize(w, "nvfp4")
    s = w.abs().amax(dim=(1, 2)) / (448 * 6)
    assert torch.equal(p.tensor_scale, s) and p.block_size == 16 and p.scales.shape == (3, 8, 4)
    b = (fp4.per_block(w, 16).abs().amax(-1) / 6 / s[:, None, None]).clamp(2 ** -6, 448).to(torch.float8_e4m3fn)
    assert torch.equal(p.scales, b.view(torch.uint8))
    scaled = fp4.per_block(w, 16) * ((1 / s[:, None, None]) / b.float())[..., None]
    nearest = torch.tensor(GRID)[(scaled[..., None] - torch.tensor(GRID)).abs().argmin(-1)]  # ties aside
    got = fp4.e2m1_decode(fp4.unpack(p.codes)).view_as(scaled)
    untied = ((scaled.abs()[..., None] - torch.tensor(fp4.MIDPOINTS)).abs() > 1e-6).all(-1)
    assert torch.equal(got[untied].abs(), nearest[untied].abs())
    # the error: at most half the widest grid step (4 -> 6: 2 x the block's scale), or what saturation clips
    # when b was rounded down (amax / (b s) <= 6 x (1 + 1/16)): under one block scale, block by block
    assert bool(((fp4.per_block(p.dequantize() - w, 16)).abs() <= p.block_scales()[..., None]).all())
    with pytest.raises(UserError, match="2 or more dimensions"):
        fp4.quantize(torch.ones(16), "nvfp4")


@pytest.mark.parametrize("fmt, block, message", [
    ("int4", 32, "unknown FP4 format 'int4'"), ("mxfp4", 3, "even number"), ("mxfp4", 64, "does not divide"),
])
def test_bad_formats_and_block_sizes_fail_with_a_message(fmt, block, message):
    with pytest.raises(UserError, match=message):
        fp4.quantize(torch.ones(4, 96), fmt, block)


def test_nan_and_inf_cannot_be_quantized():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(UserError, match="NaN or inf"):
            fp4.quantize(torch.tensor([[1.0, bad] * 16]))


# --- torchao, bit for bit -----------------------------------------------------------------------

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is optional: pip install -r requirements-fp4.txt (CI installs it)")


def torchao_mx(w):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    scales, codes = to_mx(w, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR)  # FLOOR: OCP's rule
    return scales.view(torch.uint8), codes.view(torch.uint8)


@needs_torchao
@pytest.mark.parametrize("case", ["random", "bfloat16", "adversarial"])
def test_mxfp4_equals_torchaos_mx_quantization_bit_for_bit(case):
    g = torch.Generator().manual_seed(0)
    if case == "adversarial":
        w = random_blocks(512, 32, seed=7).view(64, 256)
    else:
        w = torch.randn(64, 256, generator=g) * torch.exp(4 * torch.randn(64, 1, generator=g))
        w = w.bfloat16() if case == "bfloat16" else w
    ours = fp4.quantize(w)
    scales, codes = torchao_mx(w)
    assert torch.equal(ours.scales, scales)
    # One difference, by design on torchao's side: for a block whose scale is 2^-127 (E8M0 code 0,
    # amax < 2^-125) it divides by 2^-126, float32's smallest normal ("it would be more correct to
    # set the minimum to 2**-127", its source says). Elsewhere the bytes agree exactly.
    tiny = (scales == 0).repeat_interleave(16, -1)  # (64, 128): the bytes of such blocks
    assert torch.equal(ours.codes[~tiny], codes[~tiny])
    theirs = fp4.pack(fp4.e2m1_encode(fp4.per_block(w.float(), 32) / 2.0 ** -126).flatten(-2))
    assert torch.equal(theirs[tiny], codes[tiny])
    assert bool(tiny.any()) == (case == "adversarial")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    if case != "adversarial":  # torchao's dequantized values are ours too
        back = MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)
        assert torch.equal(back, ours.dequantize())


@needs_torchao
def test_nvfp4_equals_torchaos_nvfp4_quantization_bit_for_bit():
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    g = torch.Generator().manual_seed(1)
    for w in (torch.randn(64, 256, generator=g) * torch.exp(3 * torch.randn(64, 1, generator=g)),
              random_blocks(512, 32, seed=8).view(64, 256).clamp(-1e30, 1e30)):
        ours = fp4.quantize(w, "nvfp4")
        scales, codes = nvfp4_quantize(w, 16, per_tensor_amax_to_scale(w.abs().amax()))
        assert torch.equal(ours.scales, scales.view(torch.uint8)) and torch.equal(ours.codes, codes.view(torch.uint8))


# --- FP4 experts --------------------------------------------------------------------------------

def tiny_moe(seed=0, **overrides):
    torch.manual_seed(seed)
    config = MoEConfig(**{"context": 32, "n_layer": 2, "n_head": 2, "d_model": 64, "d_ff": 128, "causal": False,
                          "n_experts": 4, "moe_top_k": 2, "expert_d_ff": 64, "route_block": 8, "route_guard": 2,
                          **overrides})
    return MoETransformer(config).eval()


@pytest.mark.parametrize("fmt", fp4.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantized_experts_give_exactly_the_dequantized_float_models_outputs(fmt, dtype):
    model = tiny_moe().to(dtype)
    set_routing(model, "block", threshold=0.6, guard=2)
    q = quantize_experts(model, fmt)
    plain = dequantized_copy(q)
    for f, layer in zip(moe_layers(plain), moe_layers(model)):  # what the copy holds: each weight fake-quantized
        for e, expert in enumerate(layer.experts):
            assert torch.equal(f.experts[e].down.weight, fp4.fake_quantize(expert.down.weight, fmt))
    ids = torch.randint(0, 50257, (3, 29), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, want, before = q(ids), plain(ids), model(ids)
    assert out.dtype == dtype and torch.equal(out, want)  # the same calls on the same weights: bit for bit
    assert not torch.equal(out, before) and (out - before).abs().max() < 0.05 * before.abs().max()
    assert q.config.routing == "block" and moe_layers(q)[0].routing == "block"


def test_only_the_experts_change_and_the_bytes_are_4_25_bits_a_weight():
    model = tiny_moe()
    q = quantize_experts(model)
    kept = {k: v for k, v in model.state_dict().items() if ".experts." not in k and ".shared." not in k}
    assert all(torch.equal(q.state_dict()[k], v) for k, v in kept.items())  # attention, router, norms, embedding
    assert not any(p.dtype == torch.uint8 for p in q.parameters())  # packed weights are buffers
    layer = moe_layers(q)[0]
    assert isinstance(layer, QuantizedMoEFeedForward) and layer.expert_bytes() == 3 * 64 * 64 * 4.25 / 8
    reset_stats(q)
    with torch.no_grad():
        q(torch.zeros(1, 8, dtype=torch.long))
    assert moe_stats(q)["expert_bytes_all"] == 2 * 5 * layer.expert_bytes()  # 2 layers x (4 experts + shared)


def test_bad_models_are_refused_before_any_work():
    with pytest.raises(UserError, match="no mixture-of-experts layers"):
        quantize_experts(Transformer(ModelConfig(context=8, n_layer=1, n_head=2, d_model=32, d_ff=64)))
    with pytest.raises(UserError, match="does not divide the input width expert_d_ff = 48"):
        quantize_experts(tiny_moe(expert_d_ff=48))
    with pytest.raises(UserError, match="already mxfp4"):
        quantize_experts(quantize_experts(tiny_moe()))
    model = tiny_moe()
    with torch.no_grad():
        model.blocks[1].ffn.experts[2].up.weight[0, 0] = float("nan")
    with pytest.raises(UserError, match="MoE layer 1: experts.2.up.weight holds NaN or inf"):
        quantize_experts(model)


# --- python -m tinydiff.tools.quantize, and loading what it writes -------------------------------------

def run(*args):
    res = run_in_process(quantize.main, *args)
    return res.returncode, res.stdout, last_line(res.stderr)


@pytest.fixture
def moe_ckpt(tmp_path):
    model = tiny_moe()
    save_checkpoint(tmp_path / "moe.pt", kind="mdlm-moe", config=model.config, model=model, step=7)
    return tmp_path / "moe.pt"


def test_the_cli_writes_a_checkpoint_that_loads_as_a_quantized_model(moe_ckpt, tmp_path):
    code, out, _ = run("--ckpt", moe_ckpt, "--out", tmp_path / "fp4.pt")
    assert code == 0 and "mxfp4, block 32" in out and "7.53x fewer" in out
    ckpt = load_checkpoint(tmp_path / "fp4.pt")
    assert ckpt["kind"] == "mdlm-moe" and ckpt["config"]["expert_format"] == "mxfp4" and ckpt["step"] == 7
    model, _ = load_model(tmp_path / "fp4.pt", kinds=("mdlm-moe",))
    assert isinstance(model.blocks[0].ffn, QuantizedMoEFeedForward)
    want = quantize_experts(load_model(moe_ckpt)[0]).eval()
    ids = torch.randint(0, 50257, (2, 32))
    with torch.no_grad():
        assert torch.equal(model(ids), want(ids))
    saved = 2 * 5 * 3 * 64 * 64 * (4 - 4.25 / 8)  # expert bytes: 2 layers x 5 experts, float32 -> 4.25 bits
    assert moe_ckpt.stat().st_size - (tmp_path / "fp4.pt").stat().st_size > 0.95 * saved
    code, _, _ = run("--ckpt", moe_ckpt, "--out", tmp_path / "nv.pt", "--format", "nvfp4")
    assert code == 0 and load_model(tmp_path / "nv.pt")[0].config.expert_format == "nvfp4"


def test_generate_and_eval_take_an_fp4_checkpoint(tmp_path, story_file):
    import generate
    from tinydiff.tools import eval as pinned
    block = tiny_moe(routing="block")  # saved block-routed: generate.py decodes with the checkpoint's routing
    save_checkpoint(tmp_path / "block.pt", kind="mdlm-moe", config=block.config, model=block)
    assert run("--ckpt", tmp_path / "block.pt", "--out", tmp_path / "fp4.pt")[0] == 0
    res = run_in_process(generate.main, "--ckpt", tmp_path / "fp4.pt", "--prompt", "Once", "--max-new-tokens", 8,
                         "--steps", 4, "--block-length", 8, "--json")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)["stats"]
    assert stats["routing"] == "block" and stats["expert_bytes_all"] == 2 * 5 * 3 * 64 * 64 * 4.25 / 8
    res = run_in_process(pinned.main, "--ckpt", tmp_path / "fp4.pt", "--data", story_file, "--mc", 2)
    assert res.returncode == 0 and "ELBO bound" in res.stdout, res.stderr


def test_cli_bad_input_is_one_line_with_nothing_written(moe_ckpt, tmp_path):
    mdlm = Transformer(ModelConfig(context=32, n_layer=1, n_head=2, d_model=32, d_ff=64, causal=False))
    save_checkpoint(tmp_path / "mdlm.pt", kind="mdlm", config=mdlm.config, model=mdlm)
    odd = tiny_moe(expert_d_ff=48)
    save_checkpoint(tmp_path / "odd.pt", kind="mdlm-moe", config=odd.config, model=odd)
    broken = tiny_moe()
    with torch.no_grad():
        broken.blocks[0].ffn.experts[1].gate.weight[3, 3] = float("inf")
    save_checkpoint(tmp_path / "inf.pt", kind="mdlm-moe", config=broken.config, model=broken)
    assert run("--ckpt", moe_ckpt, "--out", tmp_path / "done.pt")[0] == 0
    (tmp_path / "folder").mkdir()
    out = tmp_path / "new.pt"
    cases = [
        (["--ckpt", tmp_path / "mdlm.pt", "--out", out], 1, "holds a mdlm model, which has no experts to quantize"),
        (["--ckpt", moe_ckpt, "--out", out, "--format", "int4"], 2, "invalid choice: 'int4'"),
        (["--ckpt", moe_ckpt, "--out", out, "--block-size", 48], 1, "block size 48 does not divide the input "
                                                                    "width d_model = 64"),
        (["--ckpt", tmp_path / "odd.pt", "--out", out], 1, "does not divide the input width expert_d_ff = 48"),
        (["--ckpt", tmp_path / "inf.pt", "--out", out], 1, "holds NaN or inf"),
        (["--ckpt", tmp_path / "done.pt", "--out", out], 1, "already mxfp4"),
        (["--ckpt", moe_ckpt, "--out", moe_ckpt], 1, "exists (it is --ckpt); pass a new path"),
        (["--ckpt", moe_ckpt, "--out", tmp_path / "done.pt"], 1, "exists; pass a new path (nothing is overwritten)"),
        (["--ckpt", moe_ckpt, "--out", tmp_path / "folder"], 1, "is a folder"),
        (["--ckpt", moe_ckpt, "--out", tmp_path / "missing" / "x.pt"], 1, "does not exist"),
    ]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for args, status, message in cases:
        code, stdout, err = run(*args)
        assert (code, stdout) == (status, "") and message in err and err.startswith("error: "), (args, err)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, not even a temp file


def test_a_tampered_fp4_checkpoint_is_refused_on_load(moe_ckpt, tmp_path):
    assert run("--ckpt", moe_ckpt, "--out", tmp_path / "fp4.pt")[0] == 0
    ckpt = torch.load(tmp_path / "fp4.pt", weights_only=True)
    for key, value, message in (("blocks.0.ffn.experts.up.codes", lambda t: t.float(), "is torch.float32, packed"),
                                ("blocks.1.ffn.shared.down.scales", lambda t: t.fill_(255), r"E8M0 code 255 \(NaN\)")):
        bad = {**ckpt, "model": {**ckpt["model"], key: value(ckpt["model"][key].clone())}}
        torch.save(bad, tmp_path / "bad.pt")
        with pytest.raises(UserError, match=message):
            load_model(tmp_path / "bad.pt")
