"""Spec: AR loss and KV-cached decoding. Greedy decoding equals argmax over full recomputation;
MASK is never sampled; stops and seeds behave; bad prompts are clear errors."""
import pytest
import torch
import torch.nn.functional as F

from tinydiff.ar import ar_generate, ar_loss
from tinydiff.checks import UserError
from tinydiff.tokenizer import EOT, MASK


@torch.no_grad()
def test_greedy_equals_argmax_of_full_recomputation(tiny_model):
    for seed in range(3):
        prompt = torch.randint(0, 50257, (5 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        out, stats = ar_generate(tiny_model, prompt, 12, temperature=0, stop_token=None)
        seq = list(prompt)
        for _ in range(12):
            logits = tiny_model(torch.tensor([seq]), causal=True)[0, -1]
            logits[MASK] = float("-inf")
            seq.append(int(logits.argmax()))
        assert out == seq[len(prompt):]
        assert stats.forwards == stats.new_tokens == 12


@torch.no_grad()
def test_mask_is_never_sampled(tiny_model):
    def favour_mask(module, inputs, logits):  # MASK now dominates every logit the model returns
        logits[..., MASK] += 100.0
    tiny_model.register_forward_hook(favour_mask)
    assert tiny_model(torch.tensor([[1, 2]]))[0, -1].argmax() == MASK
    out, _ = ar_generate(tiny_model, [1, 2], 10, temperature=0, stop_token=None)
    assert MASK not in out
    out, _ = ar_generate(tiny_model, [1, 2], 10, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert MASK not in out


@torch.no_grad()
def test_stops_at_the_stop_token_and_fills_the_context_by_default(tiny_model):
    out, _ = ar_generate(tiny_model, [1, 2, 3], None, temperature=0, stop_token=None)
    assert len(out) == tiny_model.config.context - 3
    stop = out[4]
    cut, stats = ar_generate(tiny_model, [1, 2, 3], None, temperature=0, stop_token=stop)
    assert cut == out[:out.index(stop) + 1] and stats.new_tokens == len(cut)


@torch.no_grad()
def test_same_seed_same_tokens(tiny_model):
    runs = [ar_generate(tiny_model, [EOT, 7], 15, temperature=1.0, top_k=20,
                        generator=torch.Generator().manual_seed(s), stop_token=None)[0] for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def test_bad_prompts(tiny_model):
    with pytest.raises(UserError, match="empty"):
        ar_generate(tiny_model, [], 5)
    with pytest.raises(UserError, match="context is 32"):
        ar_generate(tiny_model, list(range(32)), 5)
    with pytest.raises(UserError, match=r"\[1, 22\]"):
        ar_generate(tiny_model, list(range(10)), 23)


def test_loss_is_next_token_cross_entropy(tiny_model):
    windows = torch.randint(0, 50257, (2, 9))
    loss, stats = ar_loss(tiny_model, windows)
    logits = tiny_model(windows[:, :-1])
    manual = -F.log_softmax(logits, -1).gather(-1, windows[:, 1:, None]).mean()
    torch.testing.assert_close(loss, manual)
    assert stats["ce"] == loss.detach()
