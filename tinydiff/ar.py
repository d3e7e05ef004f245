"""The autoregressive language model's two halves: next-token loss and KV-cached decoding.

Decoding follows gpt-fast's generate.py: one prefill forward over the prompt, then one forward
per new token that reads the KV cache. The MASK id belongs to the diffusion models' vocabulary
and is never sampled here. Every decoder in tinydiff returns (new ids, result): `Decoded` is what
all of them count (tokens, forwards of the model sampled, seconds); speculative.py's `Speculated`
adds what a draft -> verify loop counts. `row()` is a result as one flat dict (JSON, the stats line).
The loss and the loop come first; the result, the clock and the prompt check they use, after.
Leaves out: batched prompts of different lengths, beam search.
"""
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tinydiff.checks import UserError
from tinydiff.model import wide
from tinydiff.sampling import check_warp_args, next_token_probs, sample
from tinydiff.tokenizer import EOT


def ar_loss(model, windows, generator=None):
    """Mean next-token cross-entropy on windows (B, T+1); returns (loss, stats).

    `generator` is unused (the AR loss draws no noise); it keeps one signature for all losses.
    """
    x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
    logits = model(x, causal=True)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1).to(wide(logits.dtype)), y.flatten())
    return loss, {"ce": loss.detach()}


@torch.no_grad()
def ar_generate(model, prompt, max_new_tokens=None, temperature=1.0, top_k=None, top_p=None,
                generator=None, stop_token=EOT):
    """Decode after `prompt` (list of ids).

    Stops after `max_new_tokens` (default: until the context is full) or after emitting
    `stop_token` (None: never). Returns (new ids, Decoded).
    """
    check_warp_args(temperature, top_k, top_p)
    n_new = check_prompt(prompt, model.config.context, max_new_tokens)
    device = model.embed.weight.device
    cache = model.new_cache(1)
    start = time.perf_counter()
    x = torch.tensor([prompt], device=device)  # (1, T) prefill, then (1, 1) per step
    out, forwards = [], 0
    while len(out) < n_new:
        logits = model(x, cache=cache, causal=True)[:, -1]  # (1, V)
        forwards += 1
        token = sample(next_token_probs(logits, temperature, top_k, top_p), generator)  # (1,)
        out.append(int(token))
        if out[-1] == stop_token:
            break
        x = token.view(1, 1)
    return out, Decoded(new_tokens=len(out), forwards=forwards, seconds=elapsed(start, device))


@dataclass(frozen=True, kw_only=True)
class Decoded:
    new_tokens: int
    forwards: int  # forwards of the model whose distribution is sampled (a speculative loop's target)
    seconds: float  # wall time, after waiting for the GPU
    DERIVED = ("tokens_per_s", "tokens_per_forward")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def tokens_per_forward(self) -> float:
        return self.new_tokens / self.forwards

    def row(self) -> dict:
        return {**{name: getattr(self, name) for name in self.DERIVED}, **asdict(self)}  # the headline first


def split_time(device) -> float:
    """time.perf_counter() after waiting for the GPU, so the work queued before is billed before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def elapsed(start: float, device) -> float:
    """Seconds since `start`, after waiting for the GPU, so they are the wall time of real work."""
    return split_time(device) - start


def check_prompt(prompt, context: int, max_new_tokens: int | None) -> int:
    """Validate a prompt; return how many tokens to generate."""
    if len(prompt) == 0:
        raise UserError("the prompt is empty; pass some text, e.g. --prompt 'Once upon a time'")
    room = context - len(prompt)
    if room <= 0:
        raise UserError(f"the prompt has {len(prompt)} tokens but the model's context is {context}; shorten it")
    if max_new_tokens is None:
        return room
    if not 1 <= max_new_tokens <= room:
        raise UserError(f"max new tokens must lie in [1, {room}] for this {len(prompt)}-token prompt "
                        f"and a {context}-token context, got {max_new_tokens}")
    return max_new_tokens
