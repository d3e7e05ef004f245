"""The model paths give the same results with the Triton kernels as without (tinydiff/kernels/).

model.Attention with an explicit mask (kernels.attention), dmoe.MoEFeedForward and the diffusion
samplers' proposal (sampler.pick_proposer picks sampler_step.fused_propose for propose) call a kernel
where kernels.for_inference() says so: with Triton, no gradients, and a CUDA tensor or, as here on
CPU, the interpreter (tests/kernel_mode.py sets it up; scripts/gpu_check.sh runs this file on a GPU).
Each test runs a path with the kernels and again inside kernels_enabled(False), and counts the
kernel launches, so a test cannot pass by never reaching a kernel. Float32 throughout; the
differences left are float32 rounding (another summation order), so outputs agree to 1e-5 of
their scale and greedy or seeded tokens are identical.
"""
import pytest
import torch
from kernel_mode import DEVICE, triton_mode  # noqa: F401 (first: sets TRITON_INTERPRET; autouse fixture)
from stats_helpers import random_drafter, random_model

from tinydiff import kernels
from tinydiff.ddtree import build_tree, compile_tree, ddtree_generate
from tinydiff.dmoe import MoEConfig, MoEFeedForward, MoETransformer
from tinydiff.kernels import masked_attention as attn
from tinydiff.kernels import moe_ffn as moe
from tinydiff.kernels import sampler_step as step
from tinydiff.model import ModelConfig
from tinydiff.sampler import block_causal_mask, generate, generate_cached, pick_proposer, propose


@pytest.fixture
def launches(monkeypatch):
    """Counts the calls of each kernel ({"attention": n, "moe": n, "sampler": n}) during a test."""
    counts = {}
    for key, module, name in (("attention", attn, "masked_attention_triton"), ("moe", moe, "moe_ffn_triton"),
                              ("sampler", step, "sampler_step_triton")):
        def counted(*args, _kernel=getattr(module, name), _key=key, **kw):
            counts[_key] = counts.get(_key, 0) + 1
            return _kernel(*args, **kw)
        monkeypatch.setattr(module, name, counted)  # the dispatchers look the name up at each call
    return counts


def both_ways(run):
    """run() with the kernels, then with the PyTorch paths."""
    with kernels.kernels_enabled(True):
        on = run()
    with kernels.kernels_enabled(False):
        return on, run()


def assert_near(ours, ref):
    """Equal up to float32 rounding: within 1e-5 of the reference's largest magnitude."""
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()


@torch.no_grad()
def test_transformer_with_tree_and_block_causal_masks_over_a_kv_prefix(launches):
    """DDTree verification (a (T, S) tree ancestor mask) and generate_cached's first step of a block
    (a (B, T, S) block-causal mask per row) over a cached prefix: logits and hidden states as with SDPA."""
    model = random_model(ModelConfig(vocab_size=64, context=48, n_layer=2, n_head=2, d_model=32, d_ff=64),
                         seed=0).to(DEVICE)
    g = torch.Generator().manual_seed(1)
    past = 13
    tree = build_tree(torch.randn(5, 64, generator=g), budget=20)
    ids, pos, tree_mask = compile_tree(tree, past, root_token=5, device=DEVICE)  # (1, 21), (21,), (21, 34)
    # Row 0: a finished block of 4 and a new block of 12; row 1: 7 and 9. Both see the whole prefix.
    block_masks = torch.stack([torch.cat([torch.ones(16, past, dtype=torch.bool),
                                          block_causal_mask((torch.arange(16) >= n).long())], 1) for n in (4, 7)])
    cases = [(torch.randint(0, 64, (1, past), generator=g), ids, pos, tree_mask),
             (torch.randint(0, 64, (2, past), generator=g), torch.randint(0, 64, (2, 16), generator=g), None,
              block_masks)]
    for prefix, new, pos, mask in cases:
        def forward():
            cache = model.new_cache(len(prefix))
            model(prefix.to(DEVICE), cache=cache)  # causal prefill: a mask over the static cache's rows too
            return model(new.to(DEVICE), pos=pos, mask=mask.to(DEVICE), cache=cache, hidden_layers=[1, 2])
        (logits, hidden), (ref_logits, ref_hidden) = both_ways(forward)
        assert_near(logits, ref_logits)
        for h, ref in zip(hidden, ref_hidden):
            assert_near(h, ref)
    assert launches == {"attention": 2 * 2 * 2}  # two cases of two forwards over the cache, two layers each


@pytest.mark.parametrize("routing", ["token", "block"])
@torch.no_grad()
def test_moe_layer_equals_the_dispatch_loop(routing, launches):
    torch.manual_seed(2)
    layer = MoEFeedForward(MoEConfig(d_model=24, d_ff=60, n_experts=8, moe_top_k=2, routing=routing,
                                     route_block=8, route_guard=3)).to(DEVICE).eval()
    torch.nn.init.normal_(layer.router.weight, std=0.5)  # routing that differs from token to token
    x = torch.randn(2, 13, 24, device=DEVICE)
    y, ref = both_ways(lambda: layer(x))
    assert_near(y, ref)
    assert launches == {"moe": 1}  # one launch for the whole layer


def test_moe_layer_restacks_its_experts_after_training_and_loading(launches):
    """The kernel reads the experts' weights stacked once and cached on the layer; it must see every
    change: a fused AdamW step (which bumps no version counter) and load_state_dict (which does)."""
    torch.manual_seed(3)
    layer = MoEFeedForward(MoEConfig(d_model=24, d_ff=60, n_experts=8, moe_top_k=2, shared_expert=False)).to(DEVICE)
    x = torch.randn(2, 13, 24, device=DEVICE)

    @torch.no_grad()
    def inference():  # the kernel, against the loop on the routing it used (the layer is not rerun)
        y = layer(x)
        last = layer.last
        ref = moe.moe_ffn_reference(x.view(26, 24), last["weights"].view(26, 2), last["experts"].view(26, 2),
                                    *moe.stack_experts(layer)).view_as(x)
        assert_near(y, ref)
        return y

    before = inference()
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.05, fused=True)
    layer(x).square().mean().backward()  # gradients wanted: the loop (the kernel has no backward)
    optimizer.step()
    trained = inference()
    assert not torch.allclose(before, trained, atol=1e-3)  # the step changed the output
    with torch.no_grad():
        layer.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in layer.state_dict().items()})
    loaded = inference()
    assert not torch.allclose(trained, loaded, atol=1e-3)
    assert launches == {"moe": 3}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampler_gives_the_same_tokens_with_the_kernels(temperature, launches):
    """generate (block-causal mask over the whole canvas) and generate_cached (block-causal mask over
    the cached prefix, every step) on a block-routed dMoE: the same tokens, greedy and, at temperature > 0,
    for the same seed (the kernel takes propose's uniforms)."""
    torch.manual_seed(4)
    model = MoETransformer(MoEConfig(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False,
                                     n_experts=8, moe_top_k=2, routing="block", route_block=4,
                                     route_guard=2)).to(DEVICE).eval()
    prompt = [464, 3290, 373, 257, 1310]
    for sample, kwargs in ((generate, {"block_causal": True}), (generate_cached, {})):
        def run():
            generator = torch.Generator(DEVICE).manual_seed(5)
            return sample(model, prompt, gen_length=8, steps=8, block_length=4, temperature=temperature,
                          generator=generator, **kwargs)[0]
        ids, ref = both_ways(run)
        assert ids == ref, sample.__name__
    assert launches["sampler"] == 8 + 8  # one per step, 8 steps per run
    assert launches["attention"] == 2 * (8 + 8)  # 2 layers x every step of both (each masks its prefix explicitly)
    assert launches["moe"] == 2 * (8 + 8)  # 2 layers x every forward


def test_the_samplers_take_the_fused_proposal_only_where_it_runs_and_it_draws_proposes_tokens(launches):
    x = torch.zeros(1, device=DEVICE)
    with torch.no_grad():
        assert pick_proposer("low_confidence", x) is step.fused_propose
        assert pick_proposer("low_entropy", x) is propose  # no kernel for another ranking
        with kernels.kernels_enabled(False):
            assert pick_proposer("low_confidence", x) is propose
    assert pick_proposer("low_confidence", x) is propose  # gradients on: the PyTorch path
    logits = 4 * torch.randn(6, 300, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    for temperature in (0.0, 0.8):
        with torch.no_grad():
            fused = step.fused_propose(logits, temperature, "low_confidence", torch.Generator(DEVICE).manual_seed(9))
        plain = propose(logits, temperature, "low_confidence", torch.Generator(DEVICE).manual_seed(9))
        assert torch.equal(fused[0], plain[0])
        assert_near(fused[1], plain[1])
    assert launches == {"sampler": 2}


@torch.no_grad()
def test_ddtree_verification_gives_the_same_tokens_with_the_kernels(launches):
    """ddtree_generate, greedy: every round verifies a tree of ~15 nodes over the cached prefix."""
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=2, n_head=2, d_model=32, d_ff=64),
                          seed=6).to(DEVICE)
    drafter = random_drafter(target, seed=7, block_size=8, n_features=1, std=0.3).to(DEVICE)
    out, ref = both_ways(lambda: ddtree_generate(target, drafter, [1, 2, 3], 20, budget=16, stop_token=None))
    assert out[0] == ref[0]
    assert launches["attention"] == 2 * (out[1].rounds + 1)  # the prefill and every verify forward, both layers
