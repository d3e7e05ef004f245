"""The EAGLE-3 tests' models: a random head whose weights matter, the memoising and oracle heads the
decoding tests use, and the module-scoped target + head fixtures (GPT-2's vocabulary, float64, and a
16-id vocabulary). Not a test file: test_eagle.py and test_eagle_decode.py import from it.
"""
import pytest
import torch
from stats_helpers import float64, random_model

from tinydiff.eagle3 import EagleConfig, EagleHead
from tinydiff.model import ModelConfig
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import MASK


def random_head(target, seed, std=0.5, kind=None, **overrides):
    """An untrained head (EagleHead or `kind`) whose weights matter (the default init barely does), in
    the target's dtype (a float64 target's head holds the float32 one's weights, widened)."""
    torch.manual_seed(seed)
    head = (kind or EagleHead)(EagleConfig.for_target(target.config, **overrides), target).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return head.to(target.embed.weight.dtype)



class MemoHead(EagleHead):
    """An EagleHead that returns stored outputs for inputs it has seen: no answer changes (the head is
    deterministic), but a chi-square test's thousands of generations skip recomputing rows."""

    def forward(self, *args):
        key = tuple(a if a is None else (a.shape, a.numpy().tobytes()) for a in args)
        if key not in self.__dict__.setdefault("memo", {}):
            self.memo[key] = super().forward(*args)
        return self.memo[key]


class HeadOracle:
    """Makes a head draft from the target: each row's logits become the target's after the tokens the row
    stands for (those of the latest earlier row its mask shows: previous row, draft or tree parent, plus
    its own), plus SHARP on the target's pick. Where wrong(position predicted), a decoy gets the pick's
    logit + 1: a chain drafts it, a tree of branch >= 2 still holds the pick. reset(prompt) before a run."""
    SHARP = 20.0

    def __init__(self, head, target, wrong=lambda position: False):
        self.head, self.target, self.wrong, self.memo = head, target, wrong, {}
        head.register_forward_hook(self.hook)

    def reset(self, prompt):
        self.first, self.rows = list(prompt[:1]), []

    def hook(self, module, args, output):
        tokens, past, mask = args[0], args[3].shape[2], args[5] if len(args) > 5 else None  # as eagle passes them
        del self.rows[past:]  # draft rows of earlier forwards this round that this one does not read
        logits = output[0].clone()
        for i, token in enumerate(tokens[0].tolist()):
            visible = torch.arange(past + i) if mask is None else mask[i, :past + i].nonzero()
            seen = int(visible.max()) if len(visible) else -1
            self.rows.append((self.first if seen < 0 else self.rows[seen]) + [token])
            key = tuple(self.rows[-1])
            if key not in self.memo:
                self.memo[key] = self.target(torch.tensor([key]), causal=True, head_from=len(key) - 1)[0, -1]
            row = self.memo[key].clone()
            pick = int(next_token_probs(row, 0).argmax())
            row[pick] += self.SHARP
            if self.wrong(len(key)):
                row[(pick + 1) % min(len(row), MASK)] = row[pick] + 1
            logits[0, i] = row
        return (logits, *output[1:])


@pytest.fixture(scope="module")
def models():  # GPT-2's full vocabulary (and MASK); five target layers: features after blocks [1, 3, 5]
    target = random_model(ModelConfig(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    return target, random_head(target, seed=1)


@pytest.fixture(scope="module")
def models64(models):  # the same in float64: tests that compare two code paths hold them to float64 rounding
    return float64(*models)


@pytest.fixture(scope="module")
def small_vocab():  # 16 ids: a random head's drafts and trees hit the target's picks now and then; float64
    target = random_model(ModelConfig(vocab_size=16, context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=0)
    return float64(target, random_head(target, seed=1))
