"""Spec: an AR draft started from its target's first layers (train.py --model ar --target CKPT
--target-layers N; LayerSkip's early exit). Before training it is the target read out after N blocks
through the target's own final norm and head; it trains and loads as any AR draft; the flag
is checked where it enters, before any folder is made."""
import pytest
import torch

import train
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_checkpoint, load_model, save_checkpoint
from tinydiff.model import ModelConfig, Transformer
from tinydiff.train.run_config import RunConfig
from tinydiff.train.run_model import early_exit_draft


@pytest.fixture
def target_path(tmp_path):
    torch.manual_seed(0)
    config = ModelConfig(context=32, n_layer=3, n_head=2, d_model=32, d_ff=64)
    model = Transformer(config).eval()
    path = tmp_path / "target.pt"
    save_checkpoint(path, kind="ar", config=config, model=model)
    return path


@pytest.mark.parametrize("n", [1, 2])
def test_the_new_draft_is_the_targets_early_exit(target_path, n):
    target, _ = load_model(target_path)
    draft = early_exit_draft({"target": str(target_path), "target_layers": n}, "cpu").eval()
    assert (draft.config.n_layer, draft.config.d_model, draft.config.context) == (n, 32, 32)
    target, draft = target.double(), draft.double()
    idx = torch.randint(0, target.config.vocab_size, (2, 20))
    with torch.no_grad():
        _, (hidden,) = target(idx, hidden_layers=[n])  # (2, 20, D): the residual stream after n blocks
        exit_logits = target.logits(hidden)  # (2, 20, V): the target's own norm and head
        assert (draft(idx) - exit_logits).abs().max() < 1e-12
        assert (target(idx) - exit_logits).abs().max() > 1e-3  # the later layers do change the prediction


def test_a_draft_from_the_targets_layers_trains_and_loads_as_an_ar_draft(story_file, tmp_path, target_path):
    out = tmp_path / "exit"
    flags = ["--model", "ar", "--target", str(target_path), "--target-layers", "2", "--draft-temperature", "1",
             "--data", str(story_file), "--batch-size", "2", "--warmup", "1", "--eval-every", "1",
             "--eval-batches", "1", "--device", "cpu", "--out", str(out)]
    train.main([*flags, "--max-steps", "1"])
    assert load_checkpoint(out / "ckpt.pt")["args"]["target_layers"] == 2
    trained, _ = load_model(out / "ckpt.pt", kinds=("ar",))  # an AR draft like any other
    start = early_exit_draft({"target": str(target_path), "target_layers": 2}, "cpu")
    assert trained.config == start.config
    assert not torch.equal(trained.blocks[1].ffn.down.weight, start.blocks[1].ffn.down.weight)  # it trained


def test_target_layers_is_checked_where_it_enters(story_file, tmp_path, target_path, capsys):
    base = ["--data", str(story_file), "--device", "cpu", "--out", str(tmp_path / "bad")]
    target = ["--model", "ar", "--target", str(target_path)]
    refusals = {"has 3 layers; a draft of its first 1 to 2": [*target, "--target-layers", "3"],
                "takes the draft's shape from --target: drop --preset": [*target, "--target-layers", "1",
                                                                        "--preset", "draft"],
                "drop --init and --distill": [*target, "--target-layers", "1", "--init", str(target_path)],
                "use --model ar with --target CKPT": ["--model", "ar", "--target-layers", "1"]}
    for message, flags in refusals.items():
        with pytest.raises(UserError, match=message):
            train.main([*flags, *base])
    with pytest.raises(UserError, match="use --model ar with --target CKPT"):
        RunConfig(model="mdlm", target=str(target_path), target_layers=1)
    with pytest.raises(SystemExit):
        train.main([*target, "--target-layers", "0", *base])
    assert "--target-layers: must be" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
