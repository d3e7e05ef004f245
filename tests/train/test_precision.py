"""Spec: mixed precision (tinydiff/train/precision.py, train.backward_and_step). The dtype each device trains in; fp16's gradient
scaler skips a step whose gradients overflow, and counts it; an fp16 run resumed from its checkpoint
ends with the same weights and scaler state as one never interrupted."""
import pytest
import torch
from test_train import argv, assert_same_weights, interrupt_at

import train
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_checkpoint
from tinydiff.train.precision import MixedPrecision, choose_dtype


def test_each_device_gets_its_fastest_dtype_and_a_bf16_request_without_bf16_units_is_refused(monkeypatch):
    assert choose_dtype("auto", "cpu") == "fp32" and choose_dtype("fp16", "cpu") == "fp16"
    for units, want in ((True, "bf16"), (False, "fp16")):  # an A100-class GPU, then a T4
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, units=units: units)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
        assert choose_dtype("auto", "cuda") == want
    with pytest.raises(UserError, match="the Tesla T4 has no bf16 units.*--dtype fp16"):
        choose_dtype("bf16", "cuda")
    with pytest.raises(UserError, match="--dtype must be one of"):
        choose_dtype("fp8", "cpu")


def test_an_overflowing_step_is_skipped_and_counted():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    precision = MixedPrecision("fp16", "cpu")
    x = torch.randn(4, 8)
    history = []
    for factor in (1.0, 1.0, float("inf"), 1.0):
        before = [p.detach().clone() for p in model.parameters()]
        scale = precision.scaler.get_scale()
        with precision.autocast:
            loss = model(x).float().pow(2).mean() * factor
        optimizer.zero_grad()
        skipped = train.backward_and_step(loss, optimizer, list(model.parameters()), precision, 1.0)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        history.append((skipped, unchanged, precision.scaler.get_scale() / scale))
    assert history[2] == (True, True, 0.5)  # the inf step: no update, the scale halved
    assert [h[:2] for h in history if h[0]] == [(True, True)] * precision.skipped  # every skip counted, none moved
    assert history[3][:2] == (False, False) and precision.skipped == sum(h[0] for h in history)


def test_an_injected_inf_is_counted_and_an_fp16_run_resumes_exactly(story_file, tmp_path, monkeypatch, capsys):
    train.main(argv(story_file, tmp_path / "full", "--dtype", "fp16"))
    full = load_checkpoint(tmp_path / "full" / "ckpt.pt")
    assert full["precision"]["dtype"] == "fp16" and "fp16 autocast" in capsys.readouterr().out

    def kill():
        raise SystemExit("killed")
    interrupt_at(monkeypatch, "mdlm", 5, kill)  # dies in step 5: the step-4 checkpoint is what is left
    with pytest.raises(SystemExit):
        train.main(argv(story_file, tmp_path / "run", "--dtype", "fp16"))
    monkeypatch.undo()
    train.main(["--out", str(tmp_path / "run"), "--resume"])  # no --dtype: the run's own
    resumed = load_checkpoint(tmp_path / "run" / "ckpt.pt")
    assert_same_weights(resumed["model"], full["model"])
    assert resumed["precision"] == full["precision"]

    train.main(argv(story_file, tmp_path / "two", "--dtype", "fp16", "--max-steps", "2"))
    two = load_checkpoint(tmp_path / "two" / "ckpt.pt")  # steps 1-2 (warm-up: their lr ignores max_steps)
    real = train.training_loss
    loss_fn, extra = real("mdlm")
    steps = []

    def overflowing(model, windows, generator):  # an inf loss in every training step from step 3 on
        loss, stats = loss_fn(model, windows, generator)
        if model.training:
            steps.append(1)
        return (loss * float("inf") if model.training and len(steps) >= 3 else loss), stats
    monkeypatch.setattr(train, "training_loss", lambda kind: (overflowing, extra) if kind == "mdlm" else real(kind))
    train.main(argv(story_file, tmp_path / "inf", "--dtype", "fp16"))
    overflowed = load_checkpoint(tmp_path / "inf" / "ckpt.pt")
    assert overflowed["precision"]["skipped"] == two["precision"]["skipped"] + 4  # steps 3..6, each counted
    assert_same_weights(overflowed["model"], two["model"])  # and none of them moved a weight
    assert f"skipped {overflowed['precision']['skipped']}" in capsys.readouterr().err
