"""AR decoding as compiled graphs of S tokens: one token a call (`ar` with --compile), or several.

An AR step with its draw is one graph, `sampled_step`: the forward of the newest token, the warp, the
draw (its uniform drawn before the graph runs, from the loop's generator in ar_generate's order).
With one token a call, the loop reads each token back before the next call, and what a call costs
the host (the compiled function's guards, the wrapper, on CUDA the graph replay's bookkeeping, the
wait for the read-back) is paid once per token: on the H200 a compiled `tiny` step took 480 us,
several times what its kernels need (dev/LOG.md). vLLM's multi-step scheduling
(`--num-scheduler-steps`) runs several decoding steps before it goes back to the host; so does
`decode_steps` here: S steps unrolled in one graph, each step's token the next step's input on the
device, the S tokens read back once.

The host cannot stop a graph halfway. A story that ends inside a call (at its stop token, or at
max_new_tokens) keeps its tokens up to there, and the call's later steps are wasted work: `forwards`
counts the forwards run, not the tokens kept. Random numbers: a call draws one per step whose token
it may keep; after a stop token the generator is rewound to spend one per token kept, as
ar_generate spends them (fused_round.RewindableDraws). Tokens whose rows a call would write past the
cache are decoded one at a time by sampled_step, eagerly.
(As in fused_round.py, `sampling.sample` spends no number on an exactly one-hot row at T > 0, the
graph does; both are exact draws.)

Leaves out: several speculative rounds per graph (each round's positions would follow the last
round's accepted count on the device), and batches.
"""
import time

import torch

from tinydiff.ar import Decoded, check_prompt, elapsed
from tinydiff.checks import UserError
from tinydiff.fast.compiled import Compiled, compiled, forward_at
from tinydiff.fast.fused_round import PREFILL_CHUNK, RewindableDraws, padded, prefill
from tinydiff.kernels import kernels_enabled
from tinydiff.sampling import check_warp_args, inverse_cdf, next_token_probs
from tinydiff.tokenizer import EOT


def sampled_step(model, cache, idx, rows, u, warp_args):
    """An ar_generate step: idx (1, 1) the newest token at rows (1,); u (1, 1) float64
    (unread when greedy). Returns the next token (1,)."""
    logits, _ = forward_at(model, cache, idx, rows, rows)  # (1, 1, V)
    p = next_token_probs(logits[0], *warp_args)  # (1, V)
    return p.argmax(-1) if warp_args[0] == 0 else inverse_cdf(p, u)


def decode_steps(model, cache, idx, rows, u, warp_args, steps: int):
    """`steps` ar_generate steps: idx (1, 1) the newest token, at rows (1,); u (steps, 1, 1) float64, one
    step's uniform each (unread when greedy). Each step writes its token's keys and values at the next
    row and feeds its draw to the next. Returns the tokens drawn (steps,)."""
    tokens = []
    for i in range(steps):
        token = sampled_step(model, cache, idx, rows, u[i], warp_args)  # (1,)
        tokens.append(token)
        idx, rows = token.view(1, 1), rows + 1
    return torch.cat(tokens)


class FusedSteps:
    """A model for multi_step_generate: `model` (compiled.compiled for the prefill's chunk) reads the prompt,
    and `call` is decode_steps of `steps` tokens compiled (with `compile`: True, a COMPILE_MODES name, or
    False) on `module`, the model itself."""

    def __init__(self, module, steps: int, compile=True):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise UserError(f"steps per graph must be an integer >= 1, got {steps!r}")
        self.model, self.module, self.steps = compiled(module, (PREFILL_CHUNK,), compile), module, steps
        self.call = Compiled(lambda *a: decode_steps(module, *a, steps), module.embed.weight.device, (steps,), compile)

    @property
    def compile_seconds(self) -> float:
        return self.model.compiled_step.compile_seconds + self.call.compile_seconds


@torch.no_grad()
def multi_step_generate(fused: FusedSteps, prompt, max_new_tokens=None, temperature=1.0, top_k=None, top_p=None,
                        generator=None, stop_token=EOT):
    """ar.ar_generate with fused.steps tokens per compiled graph: the same arguments and tokens. The prompt
    but its newest token is read first (`prefill`, counted in `forwards`); every token then comes from a
    call's steps, the first included."""
    check_warp_args(temperature, top_k, top_p)
    model, steps, warp_args = fused.model, fused.steps, (temperature, top_k, top_p)
    n_new = check_prompt(prompt, model.config.context, max_new_tokens)
    device = model.embed.weight.device
    cache = model.new_cache(1)
    start = time.perf_counter()
    forwards = prefill(model, cache, prompt[:-1])[1] if len(prompt) > 1 else 0
    out = []
    while len(out) < n_new:
        idx = torch.tensor([[out[-1] if out else prompt[-1]]], device=device)  # (1, 1): the newest token
        rows = torch.tensor([cache.length], device=device)  # (1,)
        draws = RewindableDraws(generator, device, temperature == 0)
        with kernels_enabled(False):
            if cache.length + steps <= cache.capacity:
                wanted = min(steps, n_new - len(out))  # the tokens this call may keep: one number each
                u = padded(draws.draw((wanted, 1, 1)), steps)  # (steps, 1, 1)
                tokens = fused.call(steps, warp_args, cache, idx, rows, u, warp_args).tolist()[:wanted]
                forwards += steps
            else:  # at the context's end: one token at a time
                tokens = sampled_step(fused.module, cache, idx, rows, draws.draw((1, 1)), warp_args).tolist()
                forwards += 1
        if stop_token in tokens:  # the story ends inside the call: keep its tokens up to the stop
            tokens = tokens[:tokens.index(stop_token) + 1]
            draws.spend(len(tokens))
        cache.advance(len(tokens))
        out += tokens
        if out[-1] == stop_token:
            break
    return out, Decoded(new_tokens=len(out), forwards=forwards, seconds=elapsed(start, device))
