"""Spec: block diffusion's loss and bound (tinydiff/diffusion.py).

The one-forward form over [clean; noisy] must give, position for position, what the sampler's
block-causal forwards give (a clean prefix, then the noisy block); with one block it is MDLM's loss
draw for draw; and for a denoiser that knows the data's conditionals its mean is the exact NLL.
"""
import itertools
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from stats_helpers import assert_same

from tinydiff.checks import UserError
from tinydiff.diffusion import (
    EPS,
    block_diffusion_elbo,
    block_diffusion_loss,
    block_masked_ce,
    block_noise,
    clean_and_noisy_mask,
    diffusion_elbo,
    diffusion_loss,
    elbo,
    mdlm_loss,
)
from tinydiff.dmoe import MoETransformer, moe_config, set_routing
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampler import block_causal_mask
from tinydiff.tokenizer import MASK

Z = 4.0  # z-score for "within Monte-Carlo error": a false failure has probability ~6e-5


@pytest.fixture
def dense():
    torch.manual_seed(0)
    return Transformer(ModelConfig(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False)).eval()


@pytest.fixture
def moe():
    torch.manual_seed(0)
    model = MoETransformer(moe_config("draft", context=32, n_experts=8, moe_top_k=2, route_block=8)).eval()
    set_routing(model, "block", threshold=0.5, guard=2)
    return model


@pytest.fixture
def moe_voting(moe):
    set_routing(moe, "block", mask_vote=4.0)  # the noisy half's MASKs weigh more in its coresets
    return moe


def test_mask_lets_clean_blocks_see_back_and_noisy_blocks_see_clean_prefix_and_themselves():
    c, n = "clean", "noisy"
    rows = [(c, 0), (c, 1), (n, 0), (n, 1)]  # T = 4, block 2: positions 0,1 in block 0, 2,3 in block 1

    def sees(q, k):
        (qh, qb), (kh, kb) = q, k
        if qh == c:
            return kh == c and kb <= qb
        return (kh == c and kb < qb) or (kh == n and kb == qb)
    want = torch.tensor([[sees(rows[i // 2], rows[j // 2]) for j in range(8)] for i in range(8)])
    assert torch.equal(clean_and_noisy_mask(4, 2), want)


@pytest.mark.parametrize("which", ["dense", "moe", "moe_voting"])
def test_one_forward_equals_the_samplers_block_causal_forwards(which, request):
    """For every block: the model run on [clean blocks before, noisy block] with the block-causal
    mask the samplers use (the routing blocks line up too) scores the block the same."""
    model = request.getfixturevalue(which).double()  # float64: the two paths differ only in summation order
    x = torch.randint(0, 50257, (3, 32), generator=torch.Generator().manual_seed(1))
    noisy, masked, _ = block_noise(x, 8, torch.Generator().manual_seed(2))
    ce = block_masked_ce(model, x, noisy, masked, 8)  # (3, 32)
    for lo in range(0, 32, 8):
        seq = torch.cat([x[:, :lo], noisy[:, lo:lo + 8]], 1)
        logits = model(seq, mask=block_causal_mask(torch.arange(lo + 8) // 8))[:, lo:]
        logits[..., MASK] = float("-inf")
        want = F.cross_entropy(logits.flatten(0, 1), x[:, lo:lo + 8].flatten(), reduction="none").view(3, 8)
        assert_same(ce[:, lo:lo + 8], want * masked[:, lo:lo + 8])
    assert masked.any() and (~masked).any()


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_one_block_is_mdlm_draw_for_draw(which, request):
    model = request.getfixturevalue(which)
    x = torch.randint(0, 50257, (4, 32), generator=torch.Generator().manual_seed(3))
    ours, _ = block_diffusion_loss(model, x, 32, torch.Generator().manual_seed(4))
    mdlm, _ = mdlm_loss(model, x, torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours, mdlm)


def test_every_block_gets_its_own_stratified_noise_level():
    x = torch.zeros(4, 64, dtype=torch.long)
    _, masked, t = block_noise(x, 8, torch.Generator().manual_seed(5))
    per_block = t.view(4, 8, 8)
    assert torch.equal(per_block, per_block[..., :1].expand(-1, -1, 8))  # constant inside a block
    strata = ((per_block[..., 0].flatten() - EPS) / (1 - EPS) * 32).floor().sort().values
    assert torch.equal(strata, torch.arange(32.0))  # one draw in each of the 32 strata


def test_the_model_config_picks_the_loss_and_the_bound(dense):
    x = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(6))
    g = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    torch.testing.assert_close(diffusion_loss(dense, x, g())[0], mdlm_loss(dense, x, g())[0])
    assert diffusion_elbo(dense, x, 2, g()) == elbo(dense, x, 2, g())
    dense.config = replace(dense.config, noise_block=8)
    torch.testing.assert_close(diffusion_loss(dense, x, g())[0], block_diffusion_loss(dense, x, 8, g())[0])
    assert diffusion_elbo(dense, x, 2, g()) == block_diffusion_elbo(dense, x, 8, 2, g())


class ExactBlockDenoiser(nn.Module):
    """log p(x_i | the clean blocks before i's, the unmasked positions of i's block) under a known
    joint over {0,1,2}^4, read from the [clean; noisy] input (the attention mask is ignored: this
    model's information is fixed by construction)."""

    def __init__(self, joint, block):
        super().__init__()
        self.config = ModelConfig(causal=False, context=4)
        self.seqs = torch.tensor(list(itertools.product(range(3), repeat=4)))  # (81, 4)
        self.joint, self.block = joint, block

    def forward(self, idx, pos=None, mask=None, head_from=0):
        B, T = idx.shape[0], idx.shape[1] // 2
        clean, noisy = idx[:, :T], idx[:, T:]
        logits = torch.zeros(B, 2 * T, 3, dtype=torch.float64)
        for i in range(T):
            lo = i // self.block * self.block
            seen = torch.full_like(noisy, MASK)
            seen[:, :lo] = clean[:, :lo]
            seen[:, lo:lo + self.block] = noisy[:, lo:lo + self.block]
            fits = ((self.seqs[None] == seen[:, None]) | (seen[:, None] == MASK)).all(-1)  # (B, 81)
            marginal = (fits * self.joint) @ F.one_hot(self.seqs[:, i], 3).double()  # (B, 3)
            logits[:, T + i] = (marginal / marginal.sum(-1, keepdim=True)).log()
        return logits[:, head_from:]


def test_bound_is_the_exact_nll_for_the_true_conditionals():
    joint = -torch.rand(81, generator=torch.Generator().manual_seed(8), dtype=torch.float64).log()
    joint /= joint.sum()
    model = ExactBlockDenoiser(joint, block=2)
    est = block_diffusion_elbo(model, model.seqs, 2, mc=300, generator=torch.Generator().manual_seed(9))
    exact = -joint.log().mean().item() / 4  # nats per token, averaged over the 81 sequences
    # the (EPS, 1) truncation of t moves the mean by about EPS * CE: far below Z * stderr
    assert abs(est["bound"] - exact) < Z * est["stderr"]
    assert est["stderr"] > 0


def test_bad_input_is_a_user_error(dense):
    x = torch.randint(0, 50257, (2, 32))
    with pytest.raises(UserError, match="must split into whole noise blocks of 12"):
        block_diffusion_loss(dense, x, 12)
    with pytest.raises(UserError, match="mc must be >= 2"):
        block_diffusion_elbo(dense, x, 8, mc=1)
    with pytest.raises(UserError, match="holds MASK tokens"):
        block_diffusion_elbo(dense, torch.full((1, 32), MASK), 8)
    dense.config = replace(dense.config, shift=True)
    with pytest.raises(UserError, match="needs an unshifted diffusion LM"):
        block_diffusion_loss(dense, x, 8)
