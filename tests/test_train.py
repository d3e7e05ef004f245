"""Spec: train.py. An interrupted-then-resumed run ends with the same weights as an uninterrupted
one (Ctrl-C and a hard kill alike); flags that would silently change a resumed run are errors."""
import hashlib
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_checkpoint
from tinydiff.io.tokens import prepare_tokens
from tinydiff.tokenizer import EOT

ROOT = Path(__file__).resolve().parents[1]


def argv(data, out, *extra, kind="mdlm"):
    shape = [] if "--init" in extra else ["--preset", "draft", "--context", "16"]  # --init keeps its model's
    return ["--model", kind, "--data", str(data), "--out", str(out), *shape, "--batch-size", "2", "--max-steps", "6",
            "--warmup", "2", "--eval-every", "3", "--eval-batches", "1", "--ckpt-every", "2", "--seed", "3", "--device", "cpu", *extra]


def final_weights(out):
    return load_checkpoint(Path(out) / "ckpt.pt")["model"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(params=["mdlm", "ar"])
def kind(request):
    return request.param


@pytest.fixture
def uninterrupted(story_file, tmp_path, kind):
    train.main(argv(story_file, tmp_path / "full", kind=kind))
    return final_weights(tmp_path / "full")


def interrupt_at(monkeypatch, kind: str, call: int, action):
    """Run `action` inside the `call`-th training loss evaluation (1-based) of `kind`."""
    loss_fn, extra = train.training_loss(kind)
    calls = {"n": 0}

    def wrapped(model, windows, generator):
        if model.training:
            calls["n"] += 1
            if calls["n"] == call:
                action()
        return loss_fn(model, windows, generator)
    real = train.training_loss
    monkeypatch.setattr(train, "training_loss", lambda k: (wrapped, extra) if k == kind else real(k))


def test_ctrl_c_then_resume_equals_uninterrupted(story_file, tmp_path, monkeypatch, capsys, kind, uninterrupted):
    out = tmp_path / "run"
    interrupt_at(monkeypatch, kind, 4, lambda: os.kill(os.getpid(), signal.SIGINT))  # a real signal
    train.main(argv(story_file, out, kind=kind))
    assert load_checkpoint(out / "ckpt.pt")["step"] == 4  # finished the step it was in, then saved
    assert "--resume" in capsys.readouterr().out
    monkeypatch.undo()
    train.main(["--out", str(out), "--resume"])
    assert_same_weights(final_weights(out), uninterrupted)
    done = capsys.readouterr().out.strip().splitlines()[-1]  # the last line says the peak memory so far
    peak = float(re.fullmatch(r"done: .* \| peak resident memory ([\d.]+) GB", done).group(1)) * 1e9
    now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    assert 0 < peak <= now + 0.05e9


def test_kill_then_resume_equals_uninterrupted(story_file, tmp_path, monkeypatch, kind, uninterrupted):
    out = tmp_path / "run"

    def kill():  # dies mid-step 5 with no chance to save: the step-4 checkpoint is what is left
        raise SystemExit("killed")
    interrupt_at(monkeypatch, kind, 5, kill)
    with pytest.raises(SystemExit):
        train.main(argv(story_file, out, kind=kind))
    assert load_checkpoint(out / "ckpt.pt")["step"] == 4
    monkeypatch.undo()
    train.main(["--out", str(out), "--resume"])
    assert_same_weights(final_weights(out), uninterrupted)


OLDER_THAN = ("noise_block", "openings", "route_mask_vote", "drafter_layers", "feature_layers", "distill",
              "distill_stories", "certainty_weight", "distill_loss", "teacher_temperature", "teacher_order",
              "anchor_weight")


@pytest.mark.parametrize("kind", ["mdlm"])
def test_a_checkpoint_from_before_the_newer_settings_resumes_to_the_same_weights(story_file, tmp_path, monkeypatch,
                                                                                 kind, uninterrupted):
    """The migration (run_config.migrate) gives the settings a checkpoint lacks what those runs did."""
    out = tmp_path / "run"
    interrupt_at(monkeypatch, "mdlm", 5, lambda: (_ for _ in ()).throw(SystemExit("killed")))
    with pytest.raises(SystemExit):
        train.main(argv(story_file, out))
    monkeypatch.undo()
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    old = {**ckpt, "args": {k: v for k, v in ckpt["args"].items() if k not in OLDER_THAN}}
    torch.save(old, out / "ckpt.pt")
    train.main(["--out", str(out), "--resume"])
    assert_same_weights(final_weights(out), uninterrupted)
    torch.save({**old, "args": {**old["args"], "dropout": 0.1}}, out / "ckpt.pt")
    with pytest.raises(UserError, match=r"run settings this code does not know \(dropout\)"):
        train.main(["--out", str(out), "--resume"])


def test_checkpoint_holds_the_whole_training_state(story_file, tmp_path, kind):
    train.main(argv(story_file, tmp_path / "r", kind=kind))
    ckpt = load_checkpoint(tmp_path / "r" / "ckpt.pt")
    assert ckpt["config"]["causal"] == (kind == "ar")
    tokens = hashlib.sha256(b"".join(Path(p).read_bytes() for p in prepare_tokens(str(story_file)))).hexdigest()
    assert ckpt["kind"] == kind and ckpt["step"] == 6 and ckpt["data"] == {"seed": 3, "index": 6, "tokens": tokens}
    assert {"optimizer", "rng", "args", "config"} <= ckpt.keys()
    assert ckpt["config"]["context"] == 16 and ckpt["args"]["preset"] == "draft"


def test_existing_run_is_never_overwritten(story_file, tmp_path):
    train.main(argv(story_file, tmp_path / "r"))
    with pytest.raises(UserError, match="--resume"):
        train.main(argv(story_file, tmp_path / "r"))
    with pytest.raises(UserError, match="--lr .* differs"):
        train.main(["--out", str(tmp_path / "r"), "--resume", "--lr", "0.5"])


def test_resume_without_a_checkpoint(tmp_path):
    with pytest.raises(UserError, match="not found"):
        train.main(["--out", str(tmp_path / "none"), "--resume"])
    with pytest.raises(UserError, match="needs --out"):
        train.main(["--resume"])


def test_learning_rate_schedule():
    run = {"lr": 1.0, "min_lr": 0.1, "warmup": 10, "max_steps": 110}
    assert train.lr_at(0, run) == pytest.approx(0.1) and train.lr_at(9, run) == pytest.approx(1.0)
    assert train.lr_at(60, run) == pytest.approx(0.55) and train.lr_at(110, run) == pytest.approx(0.1)


def test_user_errors_are_one_line_without_traceback(tmp_path):
    cmd = [sys.executable, "train.py", "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: data file")


def test_moe_token_training_then_block_fine_tune(story_file, tmp_path):
    train.main(argv(story_file, tmp_path / "token", kind="mdlm-moe"))
    token = load_checkpoint(tmp_path / "token" / "ckpt.pt")
    assert token["kind"] == "mdlm-moe" and token["config"]["routing"] == "token"
    train.main(["--model", "mdlm-moe", "--init", str(tmp_path / "token" / "ckpt.pt"), "--routing", "block",
                "--route-guard", "3", "--route-mask-vote", "4", "--data", str(story_file),
                "--out", str(tmp_path / "block"),
                "--batch-size", "2", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--device", "cpu"])
    block = load_checkpoint(tmp_path / "block" / "ckpt.pt")
    assert block["config"]["routing"] == "block" and block["config"]["route_guard"] == 3 and block["step"] == 2
    assert block["config"]["route_mask_vote"] == 4
    assert block["config"]["context"] == token["config"]["context"]  # the architecture came from --init
    moved = [k for k in token["model"] if not torch.equal(token["model"][k], block["model"][k])]
    assert moved  # it trained from the token-routed weights
    with pytest.raises(UserError, match="holds a mdlm-moe model"):
        train.main(["--model", "mdlm", "--init", str(tmp_path / "token" / "ckpt.pt"), "--data", str(story_file),
                    "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match="--routing applies to --model mdlm-moe only"):
        train.main(argv(story_file, tmp_path / "y", "--routing", "block"))


def test_moe_expert_count_and_top_k_are_flags(story_file, tmp_path):
    train.main(argv(story_file, tmp_path / "fine", "--experts", "8", "--top-k", "2", kind="mdlm-moe"))
    ckpt = load_checkpoint(tmp_path / "fine" / "ckpt.pt")
    assert ckpt["config"]["n_experts"] == 8 and ckpt["config"]["moe_top_k"] == 2
    assert ckpt["model"]["blocks.0.ffn.router.weight"].shape[0] == 8
    init = ["--model", "mdlm-moe", "--init", str(tmp_path / "fine" / "ckpt.pt"), "--data", str(story_file),
            "--max-steps", "1", "--device", "cpu"]
    with pytest.raises(UserError, match="has n_experts 8, this run asks for 16; pass --experts"):
        train.main([*init, "--out", str(tmp_path / "a"), "--experts", "16"])
    with pytest.raises(UserError, match="--experts and --top-k apply to --model mdlm-moe and ar-moe only"):
        train.main(argv(story_file, tmp_path / "b", "--top-k", "2"))
    with pytest.raises(UserError, match="need 1 <= top_k <= n_experts"):
        train.main(argv(story_file, tmp_path / "c", "--experts", "2", "--top-k", "3", kind="mdlm-moe"))


def test_a_step_that_does_not_fit_is_one_line_that_names_the_batch_that_would(story_file, tmp_path, monkeypatch):
    """torch's OutOfMemoryError (a GPU's; a CPU's where the allocator refuses) in a step: the flag that fits,
    and where the last checkpoint is; the checkpoint kept as it was."""
    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.07 GiB")
    interrupt_at(monkeypatch, "mdlm", 1, oom)
    with pytest.raises(UserError, match=r"^out of memory on cpu at --batch-size 2: pass --batch-size 1 "
                                        r"\(nothing was written\)$"):
        train.main(argv(story_file, tmp_path / "first"))
    assert not (tmp_path / "first" / "ckpt.pt").exists()
    monkeypatch.undo()
    interrupt_at(monkeypatch, "mdlm", 4, oom)  # after the checkpoint of step 2 (--ckpt-every 2)
    with pytest.raises(UserError, match=r"at --batch-size 1: one window does not fit: pass a smaller --preset or "
                                        r"--context \(.*ckpt.pt holds step 2\)$"):
        train.main([*argv(story_file, tmp_path / "later"), "--batch-size", "1"])
    assert load_checkpoint(tmp_path / "later" / "ckpt.pt")["step"] == 2


def test_a_batch_that_cannot_fit_is_refused_before_any_work_naming_one_that_could(story_file, tmp_path, monkeypatch):
    """io/cli.check_fits against a device of `total` bytes (this machine's RAM monkeypatched): refused
    before the data is read and before the folder is claimed; the --batch-size it names is the largest whose
    step floor x 3 fits."""
    from tinydiff.io import cli
    from tinydiff.model import Transformer, preset
    model = Transformer(preset("draft", context=16))  # what argv builds
    weights, per_window = cli.step_floor(model, "fp32", 0)[0], cli.step_floor(model, "fp32", 1)[1]
    for total, batch in ((3 * (weights + 4 * per_window), 2 * weights // per_window + 20), (weights // 2, 2)):
        monkeypatch.setattr(cli, "device_memory", lambda device: total)
        with pytest.raises(UserError, match=rf"^--batch-size {batch} cannot fit: a step holds at least .* GB, and "
                                            r"this machine has .* GB; pass ") as refusal:
            train.main([*argv(story_file, tmp_path / "run"), "--batch-size", str(batch)])
        assert not (tmp_path / "run").exists() and not list(tmp_path.glob("*.bin"))  # nothing read, nothing written
        named = re.search(r"--batch-size (\d+) or less$", str(refusal.value))
        if total < weights:
            assert named is None and str(refusal.value).endswith("a smaller --preset or --context")
        else:  # the largest batch whose floor x 3 fits
            floor = [cli.step_floor(model, "fp32", n)[0] for n in (int(named.group(1)), int(named.group(1)) + 1)]
            assert 3 * floor[0] <= total < 3 * floor[1]


def test_noise_block_trains_block_diffusion_and_init_keeps_it(story_file, tmp_path, monkeypatch):
    from tinydiff.train import fused_loss
    calls, block, mdlm = [], fused_loss.block_diffusion_loss, fused_loss.mdlm_loss  # record the block used, 0: MDLM
    monkeypatch.setattr(fused_loss, "block_diffusion_loss", lambda m, x, b, *a: calls.append(b) or block(m, x, b, *a))
    monkeypatch.setattr(fused_loss, "mdlm_loss", lambda m, *a: calls.append(0) or mdlm(m, *a))
    train.main(argv(story_file, tmp_path / "bd", "--noise-block", "8", "--max-steps", "2", kind="mdlm-moe"))
    assert load_checkpoint(tmp_path / "bd" / "ckpt.pt")["config"]["noise_block"] == 8 and set(calls) == {8}
    init = ["--init", str(tmp_path / "bd" / "ckpt.pt"), "--max-steps", "1"]
    train.main(argv(story_file, tmp_path / "kept", *init, kind="mdlm-moe"))
    assert load_checkpoint(tmp_path / "kept" / "ckpt.pt")["config"]["noise_block"] == 8  # from --init
    train.main(argv(story_file, tmp_path / "mdlm", *init, "--noise-block", "0", kind="mdlm-moe"))
    assert load_checkpoint(tmp_path / "mdlm" / "ckpt.pt")["config"]["noise_block"] == 0 and calls[-1] == 0
    with pytest.raises(UserError, match="--noise-block takes 0 .* a block that divides the context of 16; got 5"):
        train.main(argv(story_file, tmp_path / "x", "--noise-block", "5"))
    with pytest.raises(UserError, match="--noise-block applies to --model mdlm and mdlm-moe only"):
        train.main(argv(story_file, tmp_path / "y", "--noise-block", "8", kind="ar"))


def test_an_ar_checkpoint_starts_a_shifted_diffusion_run(story_file, tmp_path):
    train.main(argv(story_file, tmp_path / "ar", "--max-steps", "2", kind="ar"))
    ar = load_checkpoint(tmp_path / "ar" / "ckpt.pt")
    train.main(argv(story_file, tmp_path / "mdlm", "--init", str(tmp_path / "ar" / "ckpt.pt"), "--max-steps", "2"))
    mdlm = load_checkpoint(tmp_path / "mdlm" / "ckpt.pt")
    assert mdlm["kind"] == "mdlm" and mdlm["step"] == 2 and mdlm["args"]["preset"] is None  # the shape is --init's
    assert mdlm["config"] == {**ar["config"], "causal": False, "shift": True}  # Dream's adaptation
    assert all(not torch.equal(ar["model"][k], mdlm["model"][k]) for k in ar["model"] if "norm" not in k)
    with pytest.raises(UserError, match="holds a mdlm model, not ar"):
        train.main(argv(story_file, tmp_path / "x", "--init", str(tmp_path / "mdlm" / "ckpt.pt"), kind="ar"))


def test_dflash_drafter_trains_against_a_frozen_target_and_resumes(story_file, tmp_path, tiny_model, tiny_config,
                                                                    monkeypatch):
    from tinydiff.io.checkpoint import save_checkpoint
    save_checkpoint(tmp_path / "target.pt", kind="ar", config=tiny_config, model=tiny_model)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    common = ["--model", "dflash", "--target", str(tmp_path / "target.pt"), "--block-size", "4", "--regenerate", "3",
              "--data", str(story_file), "--batch-size", "2", "--max-steps", "4", "--warmup", "1",
              "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2", "--device", "cpu"]
    train.main([*common, "--feature-layers", "0,1", "--out", str(tmp_path / "full")])
    ckpt = load_checkpoint(tmp_path / "full" / "ckpt.pt")
    assert ckpt["kind"] == "dflash" and ckpt["config"]["block_size"] == 4 and ckpt["config"]["feature_layers"] == [0, 1]
    assert not any(k.startswith(("embed", "blocks")) and k in before for k in ckpt["model"])  # drafter weights only
    target_after = load_checkpoint(tmp_path / "target.pt")["model"]
    assert all(torch.equal(before[k], target_after[k]) for k in before)  # the target stayed frozen
    assert (tmp_path / "full" / "regenerated.u16").stat().st_size > 0
    # validated on the target's text as well, written from the validation split's openings
    val_text = (tmp_path / "full" / "regenerated-val.u16").read_bytes()
    assert val_text and val_text != (tmp_path / "full" / "regenerated.u16").read_bytes()
    assert np.frombuffer(val_text, np.uint16).tolist().count(EOT) == 3 + 1  # 3 stories as asked, not 16 (+ the end)

    interrupt_at(monkeypatch, "dflash", 3, lambda: os.kill(os.getpid(), signal.SIGINT))
    train.main([*common, "--feature-layers", "0,1", "--out", str(tmp_path / "cut")])
    monkeypatch.undo()
    cut = torch.load(tmp_path / "cut" / "ckpt.pt", weights_only=True)
    for key in ("feature_layers", "drafter_layers", "openings"):  # as a checkpoint written before these flags
        del cut["args"][key]
    torch.save(cut, tmp_path / "cut" / "ckpt.pt")
    train.main(["--out", str(tmp_path / "cut"), "--resume"])
    assert_same_weights(final_weights(tmp_path / "cut"), ckpt["model"])
    with pytest.raises(UserError, match="needs --target"):
        train.main(["--model", "dflash", "--data", str(story_file), "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match=r"feature layer id must be an integer >= 0 and <= 1, got 9"):
        train.main([*common, "--feature-layers", "1,9", "--out", str(tmp_path / "x")])
    train.main([*common, "--drafter-layers", "2", "--max-steps", "1", "--out", str(tmp_path / "two")])
    assert load_checkpoint(tmp_path / "two" / "ckpt.pt")["config"]["n_layer"] == 2
    train.main([*common, "--openings", "target", "--max-steps", "1", "--out", str(tmp_path / "sampled")])
    sampled, full = tmp_path / "sampled", tmp_path / "full"
    assert (sampled / "regenerated.u16").read_bytes() != (full / "regenerated.u16").read_bytes()
    # ... while validation keeps the corpus's openings, which is what a drafter is judged on
    assert (sampled / "regenerated-val.u16").read_bytes() == (full / "regenerated-val.u16").read_bytes()
    with pytest.raises(UserError, match="--openings picks where --regenerate's stories start"):
        train.main(argv(story_file, tmp_path / "w", "--openings", "target"))
    # --init: a new run (fresh optimizer and schedule) that starts from a trained drafter's weights
    continued = [*common, "--feature-layers", "0,1", "--init", str(full / "ckpt.pt"), "--max-steps", "1"]
    train.main([*continued, "--lr", "1e-12", "--min-lr", "1e-12", "--out", str(tmp_path / "more")])
    more = load_checkpoint(tmp_path / "more" / "ckpt.pt")
    assert more["step"] == 1 and more["config"] == ckpt["config"]
    for key, value in ckpt["model"].items():  # one step at lr 1e-12 leaves the weights it started from
        torch.testing.assert_close(more["model"][key], value, rtol=0, atol=1e-8)
    with pytest.raises(UserError, match="has block_size 4, this run asks for 8; pass --block-size"):
        train.main([*continued, "--block-size", "8", "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match="holds a ar model, not dflash"):
        train.main([*common, "--init", str(tmp_path / "target.pt"), "--out", str(tmp_path / "x")])
    eagle = ["--model", "eagle3", "--target", str(tmp_path / "target.pt"), "--steps-ahead", "2", *common[6:]]
    train.main([*eagle, "--out", str(tmp_path / "eagle")])
    head = load_checkpoint(tmp_path / "eagle" / "ckpt.pt")
    assert head["kind"] == "eagle3" and head["config"]["steps_ahead"] == 2 and head["step"] == 4
    assert not any(k.startswith(("embed.", "blocks.")) for k in head["model"])  # the head's own weights only
    with pytest.raises(UserError, match="--feature-layers, --drafter-layers and --markov-rank apply to --model dflash only"):
        train.main([*eagle, "--feature-layers", "1", "--out", str(tmp_path / "x")])
    for flags, message in ((["--experts", "4"], "--experts and --top-k apply"),  # a drafter once ignored these
                           (["--routing", "block"], "--routing applies"), (["--noise-block", "8"], "--noise-block")):
        with pytest.raises(UserError, match=message):
            train.main([*eagle, *flags, "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match="--regenerate trains a draft"):
        train.main(argv(story_file, tmp_path / "y", "--regenerate", "2"))
    with pytest.raises(UserError, match="needs --target"):
        train.main(argv(story_file, tmp_path / "z", "--regenerate", "2", kind="ar"))
    train.main(argv(story_file, tmp_path / "ar-draft", "--regenerate", "2", "--target", str(tmp_path / "target.pt"), kind="ar"))
    assert (tmp_path / "ar-draft" / "regenerated.u16").stat().st_size > 0


def test_distillation_trains_a_student_on_its_teachers_stories_and_resumes(story_file, tmp_path, monkeypatch):
    common = ["--data", str(story_file), "--batch-size", "2", "--warmup", "1", "--eval-every", "2",
              "--eval-batches", "1", "--ckpt-every", "2", "--seed", "3", "--device", "cpu"]
    teacher = tmp_path / "teacher" / "ckpt.pt"  # context 48: one 32-token block after a prompt of up to 9
    train.main(["--model", "mdlm", "--preset", "draft", "--context", "48", "--out", str(teacher.parent),
                "--max-steps", "2", *common])
    student = ["--model", "mdlm", "--distill", str(teacher), "--distill-stories", "4", "--teacher-temperature", "0",
               "--anchor-weight", "0.5", "--max-steps", "4", *common, "--eval-batches", "4"]  # the anchor's windows
    # replay on resume too; 4 x 2 validation rows asked, but never more stories than the 4 it trains on
    train.main([*student, "--out", str(tmp_path / "full")])
    ckpt, parent = load_checkpoint(tmp_path / "full" / "ckpt.pt"), load_checkpoint(teacher)
    assert ckpt["kind"] == "mdlm" and ckpt["config"] == parent["config"] and ckpt["step"] == 4
    assert ckpt["args"]["distill"] == str(teacher) and ckpt["args"]["distill_stories"] == 4
    assert not torch.equal(ckpt["model"]["blocks.0.attn.wq.weight"], parent["model"]["blocks.0.attn.wq.weight"])
    import numpy as np
    stories = np.load(tmp_path / "full" / "trajectories.npy")
    assert stories.shape == (4, 2, 1 + 8 + 32) and np.load(tmp_path / "full" / "trajectories-val.npy").shape[0] == 4
    from tinydiff.io.checkpoint import load_model
    from tinydiff.sampler import generate_cached
    tokens, steps = stories[0][:, stories[0][1] != -2]  # the teacher wrote greedily, as asked
    prompt = tokens[steps == -1].tolist()
    assert generate_cached(load_model(teacher)[0], prompt, 32, 32, 32)[0] == tokens[len(prompt):].tolist()
    assert all(torch.isfinite(w).all() for w in ckpt["model"].values())

    from tinydiff.extras import distill
    real = distill.distill_run

    def dies_in_step_3(*args):  # no chance to save: the step-2 checkpoint is what is left
        loss_fn, draw, val = real(*args)
        calls = {"n": 0}

        def wrapped(model, batch, generator):
            calls["n"] += model.training
            if calls["n"] == 3:
                raise SystemExit("killed")
            return loss_fn(model, batch, generator)
        return wrapped, draw, val
    monkeypatch.setattr(distill, "distill_run", dies_in_step_3)  # train.py calls distill.distill_run
    with pytest.raises(SystemExit):
        train.main([*student, "--out", str(tmp_path / "run")])
    assert load_checkpoint(tmp_path / "run" / "ckpt.pt")["step"] == 2
    monkeypatch.undo()
    train.main(["--out", str(tmp_path / "run"), "--resume"])
    assert_same_weights(final_weights(tmp_path / "run"), final_weights(tmp_path / "full"))

    ar = tmp_path / "ar" / "ckpt.pt"
    train.main(argv(story_file, ar.parent, "--max-steps", "1", kind="ar"))
    for flags, message in (
            (["--distill", str(ar)], "the teacher must be a diffusion LM"),
            (["--model", "ar", "--distill", str(teacher)], "--model ar is not one"),
            (["--model", "mdlm-moe", "--distill", str(teacher)], "pass --model mdlm to distil it"),
            (["--distill", str(teacher), "--preset", "tiny"], "a student has its teacher's shape .* drop --preset"),
            (["--distill", str(teacher), "--init", str(ar)], "does not fit the teacher"),
            (["--certainty-weight", "1"], "tune --distill TEACHER_CKPT"),
            (["--anchor-weight", "1"], "tune --distill TEACHER_CKPT")):
        with pytest.raises(UserError, match=message):
            train.main(["--model", "mdlm", *common, "--max-steps", "1", "--out", str(tmp_path / "bad"), *flags])
