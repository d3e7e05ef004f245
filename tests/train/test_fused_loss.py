"""Spec: train.py's AR and MDLM losses (tinydiff/train/fused_loss.py: the head fused with the cross-entropy, a
chunk of rows at a time, MDLM's head on its masked rows only) are the core's losses: the same loss, stats
and gradient of every parameter (none to the padding rows, whatever they hold), in float64 (float64
rounding only, stats_helpers.EXACT), for every kind train.py trains with them (train.training_loss), with chunks
that do not divide the rows; the same values without gradients (evaluation); and under bf16 autocast as
close to float32's as the core's. Their memory is test_memory.py's.
"""
import pytest
import torch
from stats_helpers import EXACT, assert_same, float64, random_model

import train
from tinydiff.ar import ar_loss
from tinydiff.diffusion import diffusion_loss
from tinydiff.dmoe import MoETransformer, mdlm_moe_loss, moe_config
from tinydiff.extras.ar_moe import ar_moe_config, ar_moe_loss
from tinydiff.model import ModelConfig
from tinydiff.train import fused_loss

SMALL = dict(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64)
MODELS = {  # kind -> (model, the core's loss)
    "ar": (lambda: random_model(ModelConfig(**SMALL), seed=0), ar_loss),
    "mdlm": (lambda: random_model(ModelConfig(**SMALL, causal=False), seed=0), diffusion_loss),
    "mdlm shifted": (lambda: random_model(ModelConfig(**SMALL, causal=False, shift=True), seed=0), diffusion_loss),
    "mdlm-moe": (lambda: random_model(moe_config("draft", context=32, n_experts=4, moe_top_k=2, route_guard=2),
                                      seed=0, build=MoETransformer), mdlm_moe_loss),
    "ar-moe": (lambda: random_model(ar_moe_config("draft", context=32, n_experts=4, moe_top_k=2), seed=0,
                                    build=MoETransformer), ar_moe_loss),
}


def run(loss_fn, model, windows, grad=True):
    """loss_fn's loss, stats and every parameter's gradient (None without grad) on windows, noise seeded."""
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        loss, stats = loss_fn(model, windows, torch.Generator().manual_seed(1))
    if grad:
        loss.backward()
    return loss.detach(), {k: v.detach() for k, v in stats.items()}, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("kind", MODELS)
def test_train_pys_loss_is_the_cores_in_loss_stats_and_every_gradient(kind, monkeypatch):
    (model,), reference = float64(MODELS[kind][0]()), MODELS[kind][1]
    with torch.no_grad():  # padding rows (model.padded_vocab) that would move the loss if it read them
        padding = model.embed.weight[model.config.vocab_size:]
        padding.copy_(100 * torch.randn(padding.shape, generator=torch.Generator().manual_seed(2)))
    monkeypatch.setattr(fused_loss, "ROWS", 7)  # several chunks, the last one short
    windows = torch.randint(0, 50257, (5, 32 + kind.startswith("ar")), generator=torch.Generator().manual_seed(0))
    theirs_loss, theirs_stats, theirs_grads = run(reference, model, windows)
    ours_loss, ours_stats, ours_grads = run(train.training_loss(kind.split()[0])[0], model, windows)
    assert_same(ours_loss, theirs_loss)
    assert ours_stats.keys() == theirs_stats.keys()
    for key in ours_stats:
        assert_same(ours_stats[key], theirs_stats[key])
    for ours, theirs in zip(ours_grads, theirs_grads, strict=True):
        assert_same(ours, theirs)
    # evaluation (no gradients) reads the same numbers and forms no gradient
    eval_loss, eval_stats, grads = run(train.training_loss(kind.split()[0])[0], model, windows, grad=False)
    assert_same(eval_loss, theirs_loss) and all(g is None for g in grads)
    assert all(abs(float(eval_stats[k] - theirs_stats[k])) <= EXACT * abs(float(theirs_stats[k])) for k in eval_stats)


@pytest.mark.parametrize("kind", ["ar", "mdlm"])
def test_under_bf16_autocast_it_is_as_close_to_float32_as_the_cores_loss(kind, monkeypatch):
    """The matmuls in bf16 as F.linear's under autocast, the softmax in float32. Against float32's gradients,
    bf16 moves these random models' by 15-37% of the largest (measured, both losses; bf16 keeps 8 bits and
    the random layers amplify it); ours must stay within 1.25x the core loss's error, its loss within 1e-5."""
    model, reference = MODELS[kind][0](), MODELS[kind][1]
    monkeypatch.setattr(fused_loss, "ROWS", 7)
    windows = torch.randint(0, 50257, (3, 32 + (kind == "ar")), generator=torch.Generator().manual_seed(0))
    _, _, exact = run(reference, model, windows)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        theirs_loss, _, theirs_grads = run(reference, model, windows)
        ours_loss, _, ours_grads = run(train.training_loss(kind)[0], model, windows)
    assert abs(float(ours_loss - theirs_loss)) <= 1e-5 * float(theirs_loss)

    def error(grads):
        return max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(grads, exact, strict=True))
    assert all(g.dtype == torch.float32 for g in ours_grads) and error(ours_grads) <= 1.25 * error(theirs_grads)


def test_no_rows_scored_is_a_zero_loss_with_zero_gradients():
    """An MDLM batch whose noise masked nothing scores no row: the loss is 0, not an error or a NaN."""
    h, head = torch.randn(0, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    loss, ce = fused_loss.LinearCrossEntropy.apply(h, head, torch.zeros(0, dtype=torch.long), torch.zeros(0),
                                                   len(head))
    loss.backward()
    assert float(loss.detach()) == 0 and ce.shape == (0,) and h.grad.shape == (0, 8) and not head.grad.any()
