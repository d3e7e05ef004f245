"""Spec: the masked-diffusion forward process, the ELBO loss and the likelihood bound.

The bound is checked against a toy "model" that knows its data distribution exactly: a joint
over 3 tokens x 3 positions, whose denoiser returns the true conditionals p(x_i | unmasked);
shifted (output i scores position i+1, the alignment a model adapted from an AR one keeps), it
bounds the NLL of positions 1..T-1 given position 0.
"""
import itertools
import math

import pytest
import torch
import torch.nn as nn

from tinydiff.checks import UserError
from tinydiff.diffusion import EPS, add_noise, elbo, masked_token_ce, mdlm_loss, noise, sample_t
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import MASK, VOCAB_SIZE

Z = 4.0  # z-score for "within Monte-Carlo error": a false failure has probability ~6e-5


def test_stratified_t_has_one_draw_per_stratum():
    t = sample_t(16, torch.Generator().manual_seed(0))
    strata = ((t - EPS) / (1 - EPS) * 16).floor().sort().values
    assert torch.equal(strata, torch.arange(16.0)) and t.min() > EPS and t.max() < 1


@pytest.mark.parametrize("t", [0.05, 0.3, 0.5, 0.9])
def test_mask_rate_matches_t_within_binomial_error(t):
    x = torch.zeros(64, 512, dtype=torch.long)
    noisy, masked = add_noise(x, torch.full((64,), t), generator=torch.Generator().manual_seed(1))
    n = x.numel()
    assert torch.equal(noisy == MASK, masked)
    assert abs(masked.float().mean().item() - t) < Z * math.sqrt(t * (1 - t) / n)


def test_masking_is_monotone_in_t_with_shared_uniforms():
    x = torch.randint(0, 100, (1, 200)).expand(5, 200)
    u = torch.rand(1, 200).expand(5, 200)
    _, masked = add_noise(x, torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9]), uniforms=u)
    for lower, higher in zip(masked, masked[1:]):
        assert (higher | ~lower).all()  # every position masked at the lower t is masked at the higher


class ExactDenoiser(nn.Module):
    """Returns log p(x_i = v | the unmasked positions) under a known joint over {0,1,2}^3."""

    def __init__(self, joint, shift=False):
        super().__init__()
        self.config = ModelConfig(causal=False, shift=shift)
        self.seqs = torch.tensor(list(itertools.product(range(3), repeat=3)))  # (27, 3)
        self.joint = joint  # (27,)

    def forward(self, noisy, causal=False):
        fits = ((self.seqs[None] == noisy[:, None]) | (noisy[:, None] == MASK)).all(-1)  # (B, 27)
        w = fits * self.joint  # (B, 27)
        onehot = nn.functional.one_hot(self.seqs, 3).double()  # (27, 3, 3)
        marginal = torch.einsum("bs,siv->biv", w, onehot)  # (B, 3, 3)
        logits = torch.full((*noisy.shape, VOCAB_SIZE), float("-inf"), dtype=torch.float64)
        logits[..., :3] = (marginal / marginal.sum(-1, keepdim=True)).log()
        return logits.roll(-1, 1) if self.config.shift else logits  # shifted: output i holds position i+1


def exact_count_bound(model, x):
    """LLaDA's exact-count form, enumerated: sum over l of (1/l) * E_{|M|=l}[sum over M of CE] / T.
    Equal in expectation to the 1/t-weighted estimator (the integral of Binom(l; T, t)/t is 1/l)."""
    positions = range(int(model.config.shift), x.shape[1])  # a shifted model never masks position 0
    total = torch.zeros(x.shape[0], dtype=torch.float64)
    for l in range(1, len(positions) + 1):
        subsets = list(itertools.combinations(positions, l))
        for subset in subsets:
            masked = torch.zeros_like(x, dtype=torch.bool)
            masked[:, list(subset)] = True
            noisy = torch.where(masked, torch.full_like(x, MASK), x)
            total += masked_token_ce(model, x, noisy, masked).sum(1) / (l * len(subsets))
    return total / len(positions)  # (B,) nats per scored token


@pytest.fixture
def joint():
    """A random distribution over the 27 sequences: Dirichlet(1), as normalised exponentials."""
    p = -torch.rand(27, generator=torch.Generator().manual_seed(3), dtype=torch.float64).log()
    return p / p.sum()


def test_bound_is_exact_for_the_true_denoiser(joint):
    model = ExactDenoiser(joint)
    x = model.seqs  # all 27 sequences
    torch.testing.assert_close(exact_count_bound(model, x) * 3, -joint.log())
    first = joint.view(3, 9).sum(1).repeat_interleave(9)  # p(x_0) of each sequence
    shifted = ExactDenoiser(joint, shift=True)
    torch.testing.assert_close(exact_count_bound(shifted, x) * 2, -(joint / first).log())  # -log p(x_1, x_2 | x_0)


@pytest.mark.parametrize("shift", [False, True])
def test_estimator_mean_matches_the_exact_count_estimator(joint, shift):
    wrong = ExactDenoiser(joint.flip(0), shift)  # a denoiser for a different distribution
    x = wrong.seqs
    exact = exact_count_bound(wrong, x).mean().item()
    est = elbo(wrong, x, mc=400, generator=torch.Generator().manual_seed(0))
    # the (EPS, 1) truncation of t moves the mean by about T * EPS * CE: far below Z * stderr
    assert abs(est["bound"] - exact) < Z * est["stderr"]
    assert est["ppl_bound"] == pytest.approx(math.exp(est["bound"]))


def test_bound_is_at_least_the_true_nll(joint):
    """Data from `joint`; denoisers that are wrong by different amounts. The bound averaged over
    the data is a cross-entropy of some distribution, so it is >= the data's entropy (the true
    NLL per token), with equality for the true denoiser."""
    entropy = -(joint * joint.log()).sum().item() / 3  # nats per token
    for other in (joint.flip(0), torch.full((27,), 1 / 27, dtype=torch.float64), joint ** 2 / (joint ** 2).sum()):
        model = ExactDenoiser(other)
        assert (joint * exact_count_bound(model, model.seqs)).sum().item() > entropy
    model = ExactDenoiser(joint)
    assert (joint * exact_count_bound(model, model.seqs)).sum().item() == pytest.approx(entropy)


class JunkAtUnmasked(nn.Module):
    """Wraps a model; overwrites its logits at unmasked positions with noise."""

    def __init__(self, base):
        super().__init__()
        self.base, self.config = base, base.config

    def forward(self, noisy, causal=False):
        logits = self.base(noisy, causal=causal)
        junk = torch.randn(logits.shape) * 100
        return torch.where((noisy != MASK)[..., None], junk, logits)


def test_loss_ignores_unmasked_logits_and_is_zero_without_masks(tiny_model):
    x = torch.randint(0, 50257, (4, 16))
    a = mdlm_loss(tiny_model, x, torch.Generator().manual_seed(5))
    b = mdlm_loss(JunkAtUnmasked(tiny_model), x, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1]["masked_ce"], b[1]["masked_ce"])
    no_masks = torch.zeros_like(x, dtype=torch.bool)
    assert masked_token_ce(tiny_model, x, x, no_masks).abs().sum() == 0


def test_loss_is_the_weighted_masked_ce(tiny_model):
    x = torch.randint(0, 50257, (4, 16))
    loss, stats = mdlm_loss(tiny_model, x, torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(7)
    t = sample_t(4, g)
    noisy, masked = add_noise(x, t, generator=g)
    ce = masked_token_ce(tiny_model, x, noisy, masked)
    torch.testing.assert_close(loss, (ce / t[:, None]).sum() / x.numel())
    torch.testing.assert_close(stats["masked_ce"], ce.sum() / masked.sum())
    assert loss >= stats["masked_ce"] * masked.float().mean()  # 1/t >= 1 on every term


def test_elbo_input_checks(tiny_model):
    with pytest.raises(UserError, match="mc must be"):
        elbo(tiny_model, torch.zeros(1, 4, dtype=torch.long), mc=1)
    with pytest.raises(UserError, match="MASK"):
        elbo(tiny_model, torch.full((1, 4), MASK))
    bpb = elbo(tiny_model, torch.zeros(2, 4, dtype=torch.long), mc=2, n_bytes=10)
    assert bpb["bits_per_byte"] == pytest.approx(bpb["bound"] * 8 / (10 * math.log(2)))


def test_a_shifted_model_never_masks_position_0_and_scores_from_the_output_before():
    model = ExactDenoiser(torch.full((27,), 1 / 27, dtype=torch.float64), shift=True)
    x = torch.randint(0, 3, (256, 3), generator=torch.Generator().manual_seed(0))
    noisy, masked = noise(model, x, torch.full((256,), 0.99), torch.Generator().manual_seed(1))
    assert not masked[:, 0].any() and torch.equal(noisy[:, 0], x[:, 0]) and masked[:, 1:].float().mean() > 0.95
    logits = torch.randn(1, 3, VOCAB_SIZE)
    logits[..., MASK] = float("-inf")  # what SUBS does anyway
    model.forward = lambda noisy, causal=False: logits  # output 0 scores position 1, output 1 position 2
    ce = masked_token_ce(model, x[:1], noisy[:1], torch.tensor([[False, True, True]]))
    expected = -logits[0, :2].log_softmax(-1)[[0, 1], x[0, 1:]]
    torch.testing.assert_close(ce[0], torch.cat([torch.zeros(1), expected]))
