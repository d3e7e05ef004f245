"""Spec: quantization-aware training of the MoE experts (tinydiff/extras/qat.py). The straight-through
estimator's forward is the fake-quantized weight and its gradient the identity; a fake-quantized
model computes exactly what its packed FP4 form computes; train.py --qat fine-tunes a mdlm-moe
checkpoint, records the format, fake-quantizes again on resume, and refuses what it cannot do.
QAT against the full-precision model (ar-moe, --target): the loss is the cross-entropy to that
model's distribution, so it is exactly its entropy where the two models agree and more where FP4
moves them apart; train.py trains with it, and a killed run resumes to the same weights."""
import copy

import pytest
import torch
from stats_helpers import assert_same, random_model
from test_train import argv, assert_same_weights, final_weights

import train
from tinydiff import fp4
from tinydiff.checks import UserError
from tinydiff.dmoe import MoEConfig, MoETransformer, balance_loss, moe_layers
from tinydiff.extras import qat
from tinydiff.extras.ar_moe import ar_moe_config
from tinydiff.extras.qat import FakeQuantizedMoEFeedForward, fake_quantize_experts, matching_loss, straight_through
from tinydiff.fp4 import quantize_experts
from tinydiff.io.checkpoint import load_checkpoint, save_checkpoint
from tinydiff.train.run_config import migrate
from tinydiff.train.run_model import build_model


@pytest.mark.parametrize("fmt", fp4.FORMATS)
def test_straight_through_is_the_quantized_weight_forward_and_the_identity_backward(fmt):
    w = torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    y = straight_through(w, fmt)
    assert torch.equal(y.detach(), fp4.fake_quantize(w.detach(), fmt)) and not torch.equal(y.detach(), w.detach())
    g = torch.randn(8, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y.backward(g)
    assert torch.equal(w.grad, g)


@pytest.mark.parametrize("fmt", fp4.FORMATS)
def test_a_fake_quantized_model_computes_what_its_packed_form_computes(fmt):
    torch.manual_seed(2)
    config = MoEConfig(context=16, n_layer=2, n_head=2, d_model=64, d_ff=128, expert_d_ff=64, causal=False,
                       n_experts=4, moe_top_k=2, shared_expert=True)
    model = MoETransformer(config).double().eval()
    with torch.no_grad():
        for layer in moe_layers(model):
            for p in layer.parameters():
                p.normal_(0, 0.3)  # weights far from the grid's zero, so rounding matters
    x = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(3))
    packed = quantize_experts(model, fmt)(x)
    plain = model(x)
    fake = fake_quantize_experts(model, fmt)(x)
    assert (fake - plain).abs().max() > 1e-3  # the rounding shows
    torch.testing.assert_close(fake, packed, rtol=0, atol=1e-10)  # float64: only the summation order differs


def test_train_qat_fine_tunes_records_resumes_and_refuses(story_file, tmp_path):
    short = ["--max-steps", "3", "--eval-every", "3", "--warmup", "1"]
    train.main(argv(story_file, tmp_path / "full", *short, kind="mdlm-moe"))
    qat = argv(story_file, tmp_path / "qat", "--init", str(tmp_path / "full" / "ckpt.pt"), "--qat", "nvfp4", *short,
               kind="mdlm-moe")  # the draft preset's expert width, 48, takes NVFP4's 16-value blocks
    train.main(qat)
    ckpt = load_checkpoint(tmp_path / "qat" / "ckpt.pt")
    assert ckpt["args"]["qat"] == "nvfp4" and ckpt["config"]["expert_format"] == "float"  # float w underneath
    before = load_checkpoint(tmp_path / "full" / "ckpt.pt")["model"]
    assert any(not torch.equal(w, before[k]) for k, w in ckpt["model"].items() if ".ffn.experts." in k)  # trained
    resumed = build_model(migrate(ckpt["args"], "ckpt"), "cpu", ckpt, "ckpt")  # as train.py --resume builds it
    assert all(isinstance(layer, FakeQuantizedMoEFeedForward) for layer in moe_layers(resumed))
    # 32-value blocks do not divide 48; a dense model has no experts
    for extra, message in ((["--qat", "mxfp4"], "does not divide the input width expert_d_ff = 48"),
                           (["--qat", "nvfp4", "--model", "mdlm"], "--qat fake-quantizes the experts")):
        with pytest.raises(UserError, match=message):
            train.main([*argv(story_file, tmp_path / "bad", "--init", str(tmp_path / "full" / "ckpt.pt"),
                              kind="mdlm-moe"), *extra])
    assert not (tmp_path / "bad").exists()


def test_matching_the_full_precision_model_costs_its_entropy_where_the_two_agree_and_more_where_fp4_moves():
    target = random_model(MoEConfig(context=16, n_layer=2, n_head=2, d_model=64, d_ff=128, expert_d_ff=64,
                                    causal=True, n_experts=4, moe_top_k=2), seed=4, build=MoETransformer).double()
    target.requires_grad_(False)
    windows = torch.randint(0, 50257, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = target(windows[:, :-1], causal=True)
    logits[..., 50257] = float("-inf")  # MASK: never a label, never drafted
    p = logits.softmax(-1)
    entropy = -(p * logits.log_softmax(-1)).nan_to_num().sum(-1).mean()  # 0 * log 0 = 0 at MASK
    loss_fn = matching_loss(target)
    same = copy.deepcopy(target).requires_grad_(True)
    loss, stats = loss_fn(same, windows)  # q = p: the cross-entropy is p's entropy, KL 0
    assert_same(loss - same.config.balance_coef * balance_loss(same), entropy)
    assert stats["acc"] == 1
    quantized = fake_quantize_experts(copy.deepcopy(target).requires_grad_(True), "mxfp4")
    loss, stats = loss_fn(quantized, windows)
    assert loss - quantized.config.balance_coef * balance_loss(quantized) > entropy + 1e-3  # FP4 moved q off p
    loss.backward()
    assert all(layer.shared.up.weight.grad.abs().sum() > 0 for layer in moe_layers(quantized))  # through the STE
    assert all(p.grad is None for p in target.parameters())  # the full-precision model stays as it was


def test_train_qat_matches_its_target_resumes_and_refuses_what_does_not_use_a_target(story_file, tmp_path,
                                                                                     monkeypatch):
    model = random_model(ar_moe_config("draft", context=16, n_experts=4, moe_top_k=2), seed=6, build=MoETransformer)
    save_checkpoint(tmp_path / "float.pt", kind="ar-moe", config=model.config, model=model)
    flags = ["--init", str(tmp_path / "float.pt"), "--qat", "mxfp4", "--max-steps", "4", "--lr", "3e-4"]
    matched = [*flags, "--target", str(tmp_path / "float.pt")]
    train.main(argv(story_file, tmp_path / "matched", *matched, kind="ar-moe"))
    train.main(argv(story_file, tmp_path / "corpus", *flags, kind="ar-moe"))
    ckpt = load_checkpoint(tmp_path / "matched" / "ckpt.pt")
    assert ckpt["args"]["target"] == str(tmp_path / "float.pt") and ckpt["args"]["qat"] == "mxfp4"
    assert any(not torch.equal(w, final_weights(tmp_path / "corpus")[k]) for k, w in ckpt["model"].items())

    calls = {"n": 0}

    def killed_at_step_3(target):  # dies mid-step 3 with no chance to save: the step-2 checkpoint is left
        loss_fn = matching_loss(target)

        def wrapped(model, windows, generator=None):
            calls["n"] += model.training
            if calls["n"] == 3 and model.training:
                raise SystemExit("killed")
            return loss_fn(model, windows, generator)
        return wrapped
    monkeypatch.setattr(qat, "matching_loss", killed_at_step_3)  # its train_hook calls qat.matching_loss
    with pytest.raises(SystemExit):
        train.main(argv(story_file, tmp_path / "cut", *matched, kind="ar-moe"))
    monkeypatch.undo()
    assert load_checkpoint(tmp_path / "cut" / "ckpt.pt")["step"] == 2
    train.main(["--out", str(tmp_path / "cut"), "--resume"])
    assert_same_weights(final_weights(tmp_path / "cut"), ckpt["model"])  # the resumed run matches the target too

    short = model.config.context // 2
    small = random_model(ar_moe_config("draft", context=short, n_experts=4, moe_top_k=2), seed=6, build=MoETransformer)
    save_checkpoint(tmp_path / "short.pt", kind="ar-moe", config=small.config, model=small)
    for extra, kind, message in (
            (["--target", str(tmp_path / "float.pt")], "mdlm", "--model mdlm does not use --target"),
            (["--init", str(tmp_path / "float.pt"), "--target", str(tmp_path / "float.pt")], "ar-moe",
             "--model ar-moe does not use --target"),
            ([*flags, "--target", str(tmp_path / "short.pt")], "ar-moe", f"reads {short} tokens, this run's windows 16")):
        with pytest.raises(UserError, match=message):
            train.main(argv(story_file, tmp_path / "bad", *extra, kind=kind))
    assert not (tmp_path / "bad" / "ckpt.pt").exists()
