"""Spec: quantization-aware training of the MoE experts (tinydiff/qat.py). The straight-through
estimator's forward is the fake-quantized weight and its gradient the identity; a fake-quantized
model computes exactly what its packed FP4 form computes; train.py --qat fine-tunes a mdlm-moe
checkpoint, records the format, fake-quantizes again on resume, and refuses what it cannot do."""
import pytest
import torch
from test_train import argv

import train
from tinydiff import fp4
from tinydiff.checkpoint import load_checkpoint
from tinydiff.dmoe import MoEConfig, MoETransformer, moe_layers
from tinydiff.errors import UserError
from tinydiff.fp4_experts import quantize_experts
from tinydiff.qat import fake_quantize_experts, straight_through
from tinydiff.run_config import migrate
from tinydiff.run_model import build_model


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
    assert all(layer.weight_view is not None for layer in moe_layers(resumed))
    # 32-value blocks do not divide 48; a dense model has no experts
    for extra, message in ((["--qat", "mxfp4"], "does not divide the input width expert_d_ff = 48"),
                           (["--qat", "nvfp4", "--model", "mdlm"], "--qat fake-quantizes the experts")):
        with pytest.raises(UserError, match=message):
            train.main([*argv(story_file, tmp_path / "bad", "--init", str(tmp_path / "full" / "ckpt.pt"),
                              kind="mdlm-moe"), *extra])
    assert not (tmp_path / "bad").exists()
