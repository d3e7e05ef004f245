"""Spec: checkpoints round-trip, are written atomically, and every bad file is a clear error."""
import pickle
from types import SimpleNamespace

import pytest
import torch

from tinydiff.checks import UserError
from tinydiff.io import checkpoint
from tinydiff.io.checkpoint import load_checkpoint, load_model, save_checkpoint
from tinydiff.model import ModelConfig, Transformer


def test_round_trip(tmp_path, tiny_model, tiny_config):
    opt = torch.optim.AdamW(tiny_model.parameters())
    tiny_model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "c.pt", kind="ar", config=tiny_config, model=tiny_model,
                    optimizer=opt.state_dict(), step=7, rng={"cpu": torch.get_rng_state()}, args={"lr": 1e-3})
    model, ckpt = load_model(tmp_path / "c.pt", kinds=("ar",))
    assert model.config == tiny_config and ckpt["step"] == 7 and ckpt["args"] == {"lr": 1e-3}
    for (n, a), (_, b) in zip(tiny_model.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), n
    opt2 = torch.optim.AdamW(model.parameters())
    opt2.load_state_dict(ckpt["optimizer"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert not model.training
    assert list(tmp_path.iterdir()) == [tmp_path / "c.pt"]  # no temp files left


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, tiny_model, tiny_config, monkeypatch):
    path = tmp_path / "c.pt"
    save_checkpoint(path, kind="ar", config=tiny_config, model=tiny_model, step=1)
    before = path.read_bytes()

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, kind="ar", config=tiny_config, model=tiny_model, step=2)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_checkpoint(tmp_path / "nope.pt")


def test_truncated_file(tmp_path, tiny_model, tiny_config):
    path = tmp_path / "c.pt"
    save_checkpoint(path, kind="ar", config=tiny_config, model=tiny_model)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_checkpoint(path)


def test_text_file(tmp_path):
    (tmp_path / "notes.pt").write_text("hello")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_checkpoint(tmp_path / "notes.pt")


class Payload:
    def __reduce__(self):
        return (print, ("unpickled code ran",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_pickled_code_is_refused(tmp_path, capsys):
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"format": "tinydiff-checkpoint", "x": Payload()}, f)
    with pytest.raises(UserError):
        load_checkpoint(tmp_path / "evil.pt")
    assert "unpickled code ran" not in capsys.readouterr().out


def test_foreign_torch_file(tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "other.pt")
    with pytest.raises(UserError, match="not a tinydiff checkpoint"):
        load_checkpoint(tmp_path / "other.pt")


def test_weights_that_do_not_fit_the_config(tmp_path, tiny_model, tiny_config):
    wrong = Transformer(type(tiny_config)(**{**tiny_config.__dict__, "d_ff": 96}))
    save_checkpoint(tmp_path / "c.pt", kind="ar", config=tiny_config, model=wrong)
    with pytest.raises(UserError, match="do not fit its config"):
        load_model(tmp_path / "c.pt")


def test_unknown_config_field_and_wrong_kind(tmp_path, tiny_model, tiny_config):
    save_checkpoint(tmp_path / "c.pt", kind="mdlm", config=tiny_config, model=tiny_model)
    with pytest.raises(UserError, match="holds a mdlm model; this needs ar"):
        load_model(tmp_path / "c.pt", kinds=("ar",))
    ckpt = load_checkpoint(tmp_path / "c.pt")
    ckpt["config"]["n_experts"] = 8
    torch.save(ckpt, tmp_path / "d.pt")
    with pytest.raises(UserError, match="n_experts"):
        load_model(tmp_path / "d.pt")


def test_a_moe_checkpoint_with_the_retired_router_score_loads(tmp_path):
    """MoEConfig.score ("softmax" in every run; "sigmoid" was removed) is dropped on load; another value
    is a field this code does not know."""
    from tinydiff.dmoe import MoEConfig, MoETransformer
    config = MoEConfig(context=16, n_layer=1, n_head=2, d_model=16, d_ff=32, n_experts=4, moe_top_k=2, causal=False)
    model = MoETransformer(config)
    save_checkpoint(tmp_path / "m.pt", kind="mdlm-moe", config=config, model=model)
    ckpt = load_checkpoint(tmp_path / "m.pt")
    for score, loads in (("softmax", True), ("sigmoid", False)):
        ckpt["config"]["score"] = score
        torch.save(ckpt, tmp_path / "old.pt")
        if loads:
            loaded, _ = load_model(tmp_path / "old.pt")
            x = torch.tensor([[5, 6, 7]])
            assert loaded.config == config and torch.equal(loaded(x), model.eval()(x))
        else:
            with pytest.raises(UserError, match="score"):
                load_model(tmp_path / "old.pt")


def test_a_checkpoint_from_before_the_padding_loads_as_the_same_model_and_optimizer(tmp_path):
    """An embedding of the true vocabulary's rows (a checkpoint written before the head was padded, or an
    export) gets zero padding rows on load, and so do AdamW's moments of it: what an up-to-date run of the
    same steps holds, so the model decodes the same and a resumed run goes on exactly."""
    torch.manual_seed(0)
    config = ModelConfig(context=16, n_layer=1, n_head=2, d_model=16, d_ff=32)
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    model(torch.tensor([[1, 2, 3]])).logsumexp(-1).sum().backward()
    optimizer.step()
    V, state = config.vocab_size, optimizer.state_dict()
    old_state = {**state, "state": {i: {k: t[:V] if t.dim() == 2 and t.shape[0] > V else t for k, t in s.items()}
                                    for i, s in state["state"].items()}}
    old_model = SimpleNamespace(state_dict=lambda: {k: t[:V] if k == "embed.weight" else t
                                                    for k, t in model.state_dict().items()})
    save_checkpoint(tmp_path / "old.pt", kind="ar", config=config, model=old_model, optimizer=old_state)
    assert torch.load(tmp_path / "old.pt", weights_only=True)["model"]["embed.weight"].shape == (V, 16)
    ckpt = load_checkpoint(tmp_path / "old.pt")
    assert ckpt["model"].keys() == model.state_dict().keys()
    assert all(torch.equal(ckpt["model"][k], t) for k, t in model.state_dict().items())  # the padding: zeros
    for i, moments in state["state"].items():
        assert all(torch.equal(ckpt["optimizer"]["state"][i][k], t) for k, t in moments.items())
    loaded, _ = load_model(tmp_path / "old.pt")
    x = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded(x), model(x))
