"""Spec: warping. Temperature 0 is the argmax, top-k keeps k, top-p keeps the smallest set."""
import pytest
import torch

from tinydiff.checks import UserError
from tinydiff.sampling import sample, warp


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, 3.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert torch.equal(warp(logits, 0), torch.tensor([[0.0, 1, 0, 0], [1.0, 0, 0, 0]]))  # first on ties


def test_temperature_scales_logits():
    logits = torch.randn(3, 10)
    torch.testing.assert_close(warp(logits, 0.5), torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.0]])
    probs = warp(logits, 1.0, top_k=2)
    expected = torch.softmax(torch.tensor([4.0, 3.0]), 0)
    torch.testing.assert_close(probs, torch.tensor([[0, expected[0], 0, expected[1], 0]]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs_in.log()
    assert torch.equal(warp(logits, 1.0, top_p=0.5) > 0, torch.tensor([[True, False, False, False]]))
    assert torch.equal(warp(logits, 1.0, top_p=0.8) > 0, torch.tensor([[True, True, False, False]]))
    assert torch.equal(warp(logits, 1.0, top_p=0.81) > 0, torch.tensor([[True, True, True, False]]))
    torch.testing.assert_close(warp(logits, 1.0, top_p=0.8), torch.tensor([[0.625, 0.375, 0, 0]]))


def test_sample_is_seeded_and_respects_support():
    probs = warp(torch.randn(64, 50), 1.0, top_k=3)
    a = sample(probs, torch.Generator().manual_seed(1))
    assert torch.equal(a, sample(probs, torch.Generator().manual_seed(1)))
    assert probs.gather(-1, a[:, None]).min() > 0


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("inf")),
                                    dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan"))])
def test_bad_warp_arguments(kwargs):
    with pytest.raises(UserError):
        warp(torch.zeros(1, 4), **{"temperature": 1.0, **kwargs})


def test_one_hot_rows_sample_their_id_without_drawing():
    probs = warp(torch.randn(5, 50), 0)
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert torch.equal(sample(probs, g), probs.argmax(-1))
    assert torch.equal(g.get_state(), state)  # no random number was spent on a certain outcome
