"""Spec: self-distillation for parallel decoding (tinydiff/extras/distill.py).

The teacher's trajectories are its own cached one-token-per-step decoding (same seed, same tokens;
each recorded state is the canvas the sampler had); a state keeps earlier blocks, masks later ones
and reveals a prefix of the teacher's order; the one-forward form gives every block's state the
very logits the cached sampler computes (float64, shifted models included); the certainty term,
the plain-CE limit and TAD's KL; bad input is a one-line error.
"""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from stats_helpers import random_model

from tinydiff.checks import UserError
from tinydiff.diffusion import mdlm_loss
from tinydiff.extras.distill import (
    PAD,
    PROMPT,
    DistillConfig,
    block_states,
    certainty,
    corpus_anchor,
    distill_terms,
    load_or_write,
    make_loss,
    sample_rows,
    state,
    state_logits,
    write_trajectories,
)
from tinydiff.model import ModelConfig
from tinydiff.sampler import generate_cached
from tinydiff.tokenizer import EOT, MASK

N, OPENING, CONTEXT = 8, 3, 40
G = (CONTEXT - 1 - OPENING) // N  # 4 blocks a story


def corpus():
    """Token ids with an EOT every 7: story openings to start from."""
    tokens = np.arange(200) % 50 + 100
    tokens[::7] = EOT
    return tokens


def teacher(shift):
    return random_model(ModelConfig(context=CONTEXT, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False,
                                    shift=shift), seed=0).double()


def config(**overrides):
    return DistillConfig(**{"stories": 3, "block_length": N, "max_opening": OPENING, **overrides})


class BlockLogits:
    """Records the logits the cached sampler reads for its block at every forward."""

    def __init__(self, model):
        self.seen, shift = [], int(model.config.shift)
        model.register_forward_hook(lambda m, a, out: self.seen.append(out[0, out.shape[1] - N - shift:
                                                                           out.shape[1] - shift].clone()))


@pytest.mark.parametrize("temperature, order", [(0.0, "low_confidence"), (1.0, "low_confidence"), (1.0, "random")])
def test_trajectories_are_the_cached_samplers_own_steps(temperature, order):
    """Story 0 replayed through generate_cached with the same seed and order: the same tokens, and
    after step r of block b the sampler's canvas is state(story, b, r + 1): earlier blocks final,
    later all MASK, the revealed set the first r + 1 of the recorded order."""
    model = teacher(False)
    stories = write_trajectories(model, corpus(), config(temperature=temperature, order=order), seed=5)
    assert stories.shape == (3, 2, 1 + OPENING + G * N)
    story = torch.from_numpy(stories[0]).long()
    tokens, steps = story[:, story[1] != PAD]
    prompt = tokens[steps == PROMPT].tolist()
    assert prompt[0] == EOT and (steps[len(prompt):] >= 0).all()
    for b in range(G):  # one token per step: each block's steps are a permutation of 0..N-1
        lo = len(prompt) + b * N
        assert sorted(steps[lo:lo + N].tolist()) == list(range(N))
    events = []
    ids, _ = generate_cached(model, prompt, G * N, G * N, N, temperature, order,
                             generator=torch.Generator().manual_seed(5), callback=events.append)
    assert ids == tokens[len(prompt):].tolist()
    for i, event in enumerate(events):
        b, r = divmod(i, N)
        assert torch.equal(event["canvas"], state(story, b, r + 1, N))
    for b in range(G):  # before the block's first step: nothing of it revealed, everything after it MASK
        canvas = state(story, b, 0, N)
        lo = len(prompt) + b * N
        assert torch.equal(canvas[:lo], tokens[:lo]) and (canvas[lo:] == MASK).all()


@pytest.mark.parametrize("shift", [False, True])
@torch.no_grad()
def test_one_forward_gives_each_block_state_the_cached_samplers_logits(shift):
    """For every story, block b and step r, the one-forward form's logits at block b, with every other
    block at some other step, equal (float64, to 1e-12) what generate_cached computed at that step."""
    model = teacher(shift)
    seen = BlockLogits(model)
    stories = torch.from_numpy(write_trajectories(model, corpus(), config(temperature=1.0), seed=2)).long()
    S = stories.shape[-1]
    for r in range(N):
        revealed = ((r + 3 * torch.arange(G)) % N).expand(len(stories), G)  # block b at step r + 3b
        idx, pos, mask, targets, masked, ahead = block_states(stories, revealed, N, int(shift))
        logits = state_logits(model, idx, pos, mask, S, G, N)  # (3, G, N, V)
        for i in range(len(stories)):
            for b in range(G):
                want = seen.seen[i * G * N + b * N + int(revealed[i, b])].clone()
                want[:, MASK] = float("-inf")
                finite = torch.isfinite(want)
                assert torch.equal(finite, torch.isfinite(logits[i, b]))
                assert (logits[i, b][finite] - want[finite]).abs().max() <= 1e-12 * want[finite].abs().max()
                story = stories[i]
                canvas = state(story, b, int(revealed[i, b]), N)
                lo = len(canvas) - (G - b) * N
                assert torch.equal(masked[i, b], canvas[lo:lo + N] == MASK)
                assert torch.equal(targets[i, b], story[0, story[1] != PAD][lo:lo + N])
                assert torch.equal(ahead[i, b], story[1, story[1] != PAD][lo:lo + N] - revealed[i, b])


def test_rows_come_from_seed_and_index_alone():
    stories = np.arange(5 * 2 * 4).reshape(5, 2, 4)
    a, b = sample_rows(stories, 3, 1, 7), sample_rows(stories, 3, 1, 7)
    assert torch.equal(a, b) and a.shape == (3, 2, 4)
    assert not all(torch.equal(sample_rows(stories, 3, 1, i), a) for i in range(8, 12))


def test_certainty_is_zero_where_wrong_and_for_one_hot_and_the_entropy_elsewhere():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 11, generator=g, dtype=torch.float64)
    logits[..., 10] = float("-inf")  # SUBS: one id is never predicted
    targets = torch.randint(0, 10, (2, 3, 4), generator=g)
    masked = torch.rand(2, 3, 4, generator=g) < 0.7
    wrong = (logits.argmax(-1) + 1) % 10
    assert certainty(logits, wrong, masked) == 0
    one_hot = torch.full_like(logits, -1e4).scatter(-1, targets[..., None], 1e4)
    assert certainty(one_hot, targets, masked) == 0
    right = logits.argmax(-1)
    picked = masked & (torch.rand(2, 3, 4, generator=g) < 0.5)
    targets = torch.where(picked, right, wrong)  # right exactly where picked
    p = torch.softmax(logits[..., :10] / 0.5, -1)
    want = -(p * p.log()).sum(-1)[picked & masked].mean()
    assert torch.allclose(certainty(logits, targets, masked), want, rtol=1e-12, atol=0)


def test_the_loss_is_masked_ce_plus_beta_certainty_and_plain_ce_at_beta_zero():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 3, 4), generator=g)
    targets[0, 0] = logits[0, 0].argmax(-1)  # some positions already right
    masked = torch.rand(2, 3, 4, generator=g) < 0.7
    ahead = torch.zeros_like(targets)
    ce = -torch.log_softmax(logits[masked], -1).gather(-1, targets[masked][:, None])  # (n, 1)
    plain, stats = distill_terms(logits, targets, masked, ahead, config(certainty_weight=0.0))
    assert torch.allclose(plain, ce.mean(), rtol=1e-12, atol=0) and torch.allclose(stats["masked_ce"], ce.mean())
    forced, stats = distill_terms(logits, targets, masked, ahead, config())
    assert stats["certainty"] > 0
    assert torch.allclose(forced, ce.mean() + 2.0 * certainty(logits, targets, masked), rtol=1e-12, atol=0)


def test_tad_takes_hard_ce_near_and_kl_to_the_teacher_far():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 2, 4, 7, generator=g, dtype=torch.float64)
    teacher_logits = torch.randn(1, 2, 4, 7, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 7, (1, 2, 4), generator=g)
    masked = torch.ones(1, 2, 4, dtype=torch.bool)
    ahead = torch.tensor([[[0, 1, 2, 9], [8, 3, 11, 7]]])  # horizon 8: far at 9, 8, 11
    tad = config(loss="tad", certainty_weight=0.0)
    loss, _ = distill_terms(logits, targets, masked, ahead, tad, teacher_logits)
    p, q = torch.softmax(teacher_logits, -1), torch.log_softmax(logits, -1)
    kl = (p * (p.log() - q)).sum(-1)
    ce = -q.gather(-1, targets[..., None])[..., 0]
    assert torch.allclose(loss, torch.where(ahead >= 8, kl, ce).mean(), rtol=1e-12, atol=0)
    same, _ = distill_terms(logits, targets, masked, torch.full_like(ahead, 9), tad, logits.clone())
    assert same.abs() < 1e-12  # the student is its teacher: nothing left to learn far away


def test_the_training_loss_runs_on_stories_and_reaches_every_weight():
    model = teacher(True).float()
    stories = torch.from_numpy(write_trajectories(model, corpus(), config(), seed=1)).long()
    loss, stats = make_loss(config())(model, stories, torch.Generator().manual_seed(0))
    loss.backward()
    assert set(stats) == {"distill", "masked_ce", "certainty", "acc"} and torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()
    tad, _ = make_loss(config(loss="tad"), teacher=model)(model, stories, torch.Generator().manual_seed(0))
    tad.backward()
    assert torch.isfinite(tad) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_the_anchor_adds_its_weight_times_the_corpus_loss_in_training_only():
    model = teacher(True)
    stories = torch.from_numpy(write_trajectories(model, corpus(), config(stories=2), seed=1)).long()
    model.train()
    anchor = corpus_anchor(mdlm_loss, torch.from_numpy(corpus()), 3, CONTEXT, seed=5)

    def loss_at(weight, seed=0):
        return make_loss(config(anchor_weight=weight), anchor=anchor)(model, stories,
                                                                      torch.Generator().manual_seed(seed))[0]
    plain = loss_at(0.0)
    # the anchor's batch and noise come from the step's generator: the same seed draws the same loss
    assert loss_at(0.5) == loss_at(0.5) and loss_at(0.5, seed=1) != loss_at(0.5)
    g = torch.Generator().manual_seed(0)
    make_loss(config())(model, stories, g)  # the distillation terms draw first from the generator
    anchored, _ = anchor(model, g, "cpu")
    assert torch.allclose(loss_at(0.5), plain + 0.5 * anchored, rtol=1e-12, atol=0) and anchored > 0
    model.eval()  # validation: the distillation terms alone
    assert loss_at(0.5) == plain
    with pytest.raises(UserError, match="needs corpus windows"):
        make_loss(config(anchor_weight=1.0))


@pytest.mark.parametrize("overrides, message", [
    ({"loss": "kl"}, "distill-loss"), ({"certainty_weight": -1.0}, "certainty-weight"),
    ({"certainty_weight": float("nan")}, "certainty-weight"), ({"stories": 0}, "stories"),
    ({"certainty_temperature": 0.0}, "certainty-temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"anchor_weight": -0.5}, "anchor-weight"), ({"anchor_weight": float("nan")}, "anchor-weight"),
    ({"order": "confidence"}, "teacher-order"),
])
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(UserError, match=message):
        config(**overrides)
    with pytest.raises(UserError, match="needs the teacher"):
        make_loss(replace(config(), loss="tad"))


def test_a_student_fits_a_teacher_saved_before_the_newer_config_fields(tmp_path):
    """A config field the teacher's file predates (here the MoE's expert_format and expert_block) counts as
    its default: a student saved since, with the field written out, still has the teacher's shape."""
    from tinydiff.dmoe import MoETransformer, moe_config
    from tinydiff.extras.distill import student_from
    from tinydiff.io.checkpoint import save_checkpoint
    model = MoETransformer(moe_config("draft", context=32, n_experts=4, moe_top_k=2, route_guard=2))
    save_checkpoint(tmp_path / "student.pt", kind="mdlm-moe", config=model.config, model=model)
    old = torch.load(tmp_path / "student.pt", weights_only=True)
    old["config"] = {k: v for k, v in old["config"].items() if k not in ("expert_format", "expert_block")}
    torch.save(old, tmp_path / "teacher.pt")
    assert student_from(tmp_path / "teacher.pt", "mdlm-moe", tmp_path / "student.pt").config == model.config
    wider = MoETransformer(moe_config("draft", context=32, n_experts=8, moe_top_k=2, route_guard=2))
    save_checkpoint(tmp_path / "wider.pt", kind="mdlm-moe", config=wider.config, model=wider)
    with pytest.raises(UserError, match="differs in n_experts"):
        student_from(tmp_path / "teacher.pt", "mdlm-moe", tmp_path / "wider.pt")


SOURCE = {"teacher": "teacher.pt", "data": "stories.txt"}


@pytest.mark.parametrize("damage", ["0xff", "other ids", "cut", "floats", "other seed", "no stamp"])
def test_trajectories_that_fail_their_stamp_are_written_again(tmp_path, capsys, damage):
    """A run's cached trajectories are read back only while their stamp holds: overwritten in place (ids past
    GPT-2's last, or in-range ids in another order: the sha256), cut short, another program's array, left by a
    run with another seed, or without a stamp, the teacher writes them again, with one notice naming the file."""
    path = tmp_path / "trajectories.npy"
    model = teacher(False)
    good = load_or_write(path, SOURCE, model, corpus(), config(), seed=1)
    assert (load_or_write(path, SOURCE, model, corpus(), config(), seed=1) == good).all()  # read back as written
    assert "notice" not in capsys.readouterr().err
    data = path.read_bytes()
    header = len(data) - good.nbytes
    seed = 2 if damage == "other seed" else 1
    if damage == "0xff":
        path.write_bytes(data[:header] + b"\xff" * good.nbytes)
    elif damage == "other ids":
        path.write_bytes(data[:header] + good[::-1].tobytes())
    elif damage == "cut":
        path.write_bytes(data[:-4])
    elif damage == "floats":
        np.save(path, good.astype(np.float32), allow_pickle=False)
    elif damage == "no stamp":
        Path(f"{path}.stamp.json").unlink()
    again = load_or_write(path, SOURCE, model, corpus(), config(), seed=seed)
    assert capsys.readouterr().err.count(f"notice: {path} ") == 1
    expected = load_or_write(tmp_path / "fresh.npy", SOURCE, model, corpus(), config(), seed=seed)
    assert (again == expected).all() and (np.load(path) == expected).all()
    assert (again == good).all() == (seed == 1)