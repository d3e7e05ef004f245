"""Spec: fused_steps.py's AR decoding, one step or several per graph, commits ar_generate's tokens.

Run here uncompiled (compile=False: the same functions, eagerly; tests/test_compiled.py runs them
compiled). From the same seed and at every warp, multi_step_generate gives ar_generate's tokens for
any number of steps per graph, a story's last call keeping fewer tokens than it decodes; it stops
where ar_generate stops and leaves the generator where ar_generate leaves it (the numbers a stopped
call drew but the eager loop never drew are given back); at the context's end it decodes one token
at a time; it counts the forwards it runs; it refuses what it must. The models are float64, so the
static cache's padded attention moves a logit by float64 rounding only, far below any sampling
boundary."""
import pytest
import torch
from stats_helpers import float64, one_thread, random_model  # noqa: F401 (one_thread: autouse)

from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.fast.compiled import compiled
from tinydiff.fast.fused_round import PREFILL_CHUNK
from tinydiff.fast.fused_steps import FusedSteps, decode_steps, multi_step_generate
from tinydiff.model import ModelConfig

PROMPT, NEW = [3, 1, 4, 1, 5], 24
WARPS = [(0.0, None, None), (1.0, None, None), (0.8, 5, None), (1.3, None, 0.9)]


@pytest.fixture(scope="module")
def target():
    model = random_model(ModelConfig(vocab_size=64, context=40, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    return float64(model)[0]


def seeded(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("warp", WARPS)
@pytest.mark.parametrize("steps", [1, 5, 7])  # 5 and 7 do not divide NEW: the last call keeps fewer
def test_multi_step_decoding_commits_ar_generates_tokens(target, warp, steps):
    fused = FusedSteps(target, steps, compile=False)
    for seed in range(3):
        g, h = seeded(seed), seeded(seed)
        ours, result = multi_step_generate(fused, PROMPT, NEW, *warp, generator=g, stop_token=None)
        theirs = ar_generate(target, PROMPT, NEW, *warp, generator=h, stop_token=None)[0]
        assert ours == theirs and len(ours) == NEW
        # every call runs all its steps; the prompt but its newest token is read in one chunk
        assert result.forwards == steps * -(-NEW // steps) + -(-(len(PROMPT) - 1) // PREFILL_CHUNK)
        assert torch.equal(g.get_state(), h.get_state())  # the same numbers spent


def test_decode_steps_is_that_many_steps_each_fed_the_last_draw(target):
    static = compiled(target, (), compile=False)
    greedy = (0.0, None, None)
    cache = static.new_cache(1)
    static(torch.tensor([PROMPT[:-1]]), cache=cache, causal=True)
    tokens = decode_steps(target, cache, torch.tensor([[PROMPT[-1]]]), torch.tensor([cache.length]),
                          torch.zeros(6, 1, 1, dtype=torch.float64), greedy, 6)
    assert tokens.shape == (6,)
    assert tokens.tolist() == ar_generate(target, PROMPT, 6, 0.0)[0]


@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_story_stops_where_ar_generate_stops_and_spends_its_numbers(target, temperature, steps):
    fused = FusedSteps(target, steps, compile=False)
    stopped = 0
    for seed in range(6):
        story = ar_generate(target, PROMPT, NEW, temperature, generator=seeded(seed), stop_token=None)[0]
        stop = story[NEW // 2 - seed]  # a token the story holds, at several places inside a call
        g, h = seeded(seed), seeded(seed)
        ours = multi_step_generate(fused, PROMPT, NEW, temperature, generator=g, stop_token=stop)[0]
        theirs = ar_generate(target, PROMPT, NEW, temperature, generator=h, stop_token=stop)[0]
        assert ours == theirs == story[:story.index(stop) + 1]
        stopped += (len(ours) % steps) != 0  # the stop fell inside a call, not at its end
        assert torch.equal(g.get_state(), h.get_state())  # the numbers past the stop given back
    assert stopped > 0 or steps == 1


def test_the_context_end_is_decoded_one_token_at_a_time(target, monkeypatch):
    fused = FusedSteps(target, 8, compile=False)
    calls = []
    call = fused.call
    monkeypatch.setattr(fused, "call", lambda *a: calls.append(1) or call(*a))
    new = target.config.context - len(PROMPT)  # 35 tokens: 4 calls of 8, then 3 tokens one at a time
    for prompt, n in ((PROMPT, new), ([7], 20)):
        calls.clear()
        ours, result = multi_step_generate(fused, prompt, n, 1.0, generator=seeded(0), stop_token=None)
        assert ours == ar_generate(target, prompt, n, 1.0, generator=seeded(0), stop_token=None)[0]
        assert len(ours) == n
    assert result.forwards == 8 * 3  # a 1-token prompt: no prefill; 20 tokens in 3 calls
    calls.clear()
    result = multi_step_generate(fused, PROMPT, new, 1.0, generator=seeded(0), stop_token=None)[1]
    assert len(calls) == 4 and result.forwards == 1 + 4 * 8 + 3


def test_bad_input_is_a_one_line_error(target):
    for steps in (0, -2, 2.5, True, "4"):
        with pytest.raises(UserError, match="steps per graph must be an integer >= 1"):
            FusedSteps(target, steps, compile=False)
    fused = FusedSteps(target, 4, compile=False)
    with pytest.raises(UserError, match="prompt is empty"):
        multi_step_generate(fused, [], 4)
    with pytest.raises(UserError, match="temperature"):
        multi_step_generate(fused, PROMPT, 4, temperature=-1.0)
    with pytest.raises(UserError, match="max new tokens"):
        multi_step_generate(fused, PROMPT, 1000)
