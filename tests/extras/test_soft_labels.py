"""Spec: drafts trained for sampling (train.py --draft-temperature T). The soft-label loss is the plain
cross-entropy for one-hot labels and is smallest at the target's own distribution; the stories
regenerated at T follow the target's distribution at T; the AR draft's, DFlash's and EAGLE-3's
losses take their labels from the target read at T; the flag is checked where it enters."""
import pytest
import torch
import torch.nn.functional as F
from stats_helpers import (
    DIST_CONFIG,
    NEW,
    PROMPT,
    V,
    assert_follows_the_joint,
    assert_same,
    exact_joint,
    float64,
    random_model,
)

import train
from tinydiff.checks import UserError
from tinydiff.dflash import DFlashConfig, DFlashDrafter, dflash_loss, packed_logits, sample_anchors
from tinydiff.eagle3 import EagleConfig, EagleHead, eagle_loss, unrolled_logits
from tinydiff.extras.regenerate import continue_batch
from tinydiff.extras.soft_labels import soft_ar_loss
from tinydiff.io.checkpoint import load_checkpoint, save_checkpoint
from tinydiff.sampling import next_token_probs, soft_ce, tempered_ce


def test_soft_ce_with_one_hot_labels_is_the_cross_entropy():
    logits = torch.randn(5, 7, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (5, 7), generator=torch.Generator().manual_seed(1))
    hard = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(5, 7)
    torch.testing.assert_close(soft_ce(logits, F.one_hot(labels, 11).double()), hard, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_tempered_ce_is_smallest_at_the_targets_own_distribution(temperature):
    g = torch.Generator().manual_seed(2)
    target = 3 * torch.randn(4, 9, dtype=torch.float64, generator=g)
    own = tempered_ce(target, target, temperature)  # q_T = p_T: H(p_T), the minimum (Gibbs' inequality)
    for _ in range(50):
        other = target + torch.randn(4, 9, dtype=torch.float64, generator=g)
        assert (tempered_ce(other, target, temperature) > own).all()
    z = target.clone().requires_grad_(True)  # the gradient (q_T - p_T) / T vanishes there exactly
    tempered_ce(z, target, temperature).sum().backward()
    assert z.grad.abs().max() < 1e-12
    z = torch.zeros(4, 9, dtype=torch.float64, requires_grad=True)  # and descent finds it from anywhere
    opt = torch.optim.LBFGS([z], max_iter=200, tolerance_grad=1e-14, tolerance_change=0, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = tempered_ce(z, target, temperature).sum()
        loss.backward()
        return loss

    opt.step(closure)
    torch.testing.assert_close(torch.softmax(z / temperature, -1), next_token_probs(target, temperature),
                               rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_stories_regenerated_at_a_temperature_follow_the_targets_distribution_there(temperature):
    """N batched continuations of PROMPT: their first NEW tokens against the exact joint at T (power
    stated and asserted by assert_follows_the_joint)."""
    target, n = random_model(DIST_CONFIG, seed=0), 12000
    rows = continue_batch(target, [PROMPT] * n, temperature, torch.Generator().manual_seed(4))
    counts = torch.zeros(V ** NEW, dtype=torch.long)
    for row in rows:
        counts[sum(t * V ** (NEW - 1 - i) for i, t in enumerate(row[:NEW]))] += 1
    assert_follows_the_joint(exact_joint(target, temperature, None, None), counts, n)


def test_each_draft_loss_reads_the_target_at_the_temperature(tiny_model):
    """The AR draft's loss is H(p_T, q_T) against the target's logits over the same tokens; DFlash's
    slot k, at temperature T, is H(p_T, q_T) against the target's prediction for that position;
    EAGLE-3's default (T = 1) is unchanged by passing T = 1."""
    torch.manual_seed(0)
    windows = torch.randint(0, 500, (2, 33))
    drafter = DFlashDrafter(DFlashConfig.for_target(tiny_model.config, block_size=4), tiny_model)
    head = EagleHead(EagleConfig.for_target(tiny_model.config), tiny_model)
    # float64: each loss and its recomputation differ only in summation order
    tiny_model, draft, drafter, head = float64(tiny_model, random_model(tiny_model.config, seed=5), drafter, head)
    loss, stats = soft_ar_loss(draft, windows, target=tiny_model, temperature=0.8)
    with torch.no_grad():
        want = tempered_ce(draft(windows[:, :-1], causal=True), tiny_model(windows[:, :-1], causal=True), 0.8)
    assert_same(loss, want.mean())
    assert 0 <= float(stats["acc"]) <= 1

    x = windows[:, :32]
    anchors = sample_anchors(2, 32, 4, drafter.config.anchors, torch.Generator().manual_seed(6))
    logits, target_logits = packed_logits(drafter, x, anchors)  # (2, A, 3, V), (2, 32, V)
    got, _ = dflash_loss(drafter, x, torch.Generator().manual_seed(6), temperature=0.8)  # the same anchors
    w = torch.exp(-torch.arange(3, dtype=torch.float64) / drafter.config.loss_decay)
    per_slot = torch.stack([tempered_ce(logits[:, :, k], target_logits.gather(
        1, (anchors + k)[..., None].expand(-1, -1, target_logits.shape[-1])), 0.8) for k in range(3)], -1)
    assert_same(got, (per_slot * w).sum(-1).mean() / w.sum())

    assert torch.equal(eagle_loss(head, x, steps=2)[0], eagle_loss(head, x, steps=2, temperature=1.0)[0])
    head_logits, head_target = unrolled_logits(head, x, 1)
    hot = eagle_loss(head, x, steps=1, temperature=0.5)[0]
    assert_same(hot, tempered_ce(head_logits[0], head_target[:, 1:], 0.5).mean())


def test_train_draft_temperature_trains_drafts_for_sampling_and_is_checked(story_file, tmp_path, tiny_model,
                                                                            tiny_config, capsys):
    save_checkpoint(tmp_path / "target.pt", kind="ar", config=tiny_config, model=tiny_model)
    common = ["--data", str(story_file), "--batch-size", "2", "--max-steps", "1", "--warmup", "1", "--eval-every",
              "1", "--eval-batches", "1", "--device", "cpu", "--target", str(tmp_path / "target.pt"),
              "--draft-temperature", "0.9"]
    runs = {"ar": ["--preset", "draft", "--context", "16"],  # soft labels on corpus windows
            "dflash": ["--block-size", "4", "--regenerate", "2"]}  # on stories sampled at 0.9
    for model, extra in runs.items():
        train.main(["--model", model, *extra, *common, "--out", str(tmp_path / model)])
        assert load_checkpoint(tmp_path / model / "ckpt.pt")["args"]["draft_temperature"] == 0.9
    for flags in (["--model", "ar"], ["--model", "mdlm", "--target", "t.pt"]):
        with pytest.raises(UserError, match="--draft-temperature trains a draft or drafter for sampling"):
            train.main([*flags, "--draft-temperature", "1", "--data", str(story_file), "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit):
        train.main(["--model", "ar", "--target", "t.pt", "--draft-temperature", "0", "--out", str(tmp_path / "bad")])
    assert "--draft-temperature: must be a finite number >= 0.01" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
