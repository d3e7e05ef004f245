"""Samplers for the masked-diffusion LM: the canvas starts all-MASK after the prompt and fills in.

`generate` follows LLaDA's reference sampler (Nie et al. 2025, `generate.py`):
  - the answer is split into blocks of `block_length`, filled left to right (semi-autoregressive);
  - `steps` is shared equally among the blocks; inside a block, step i commits
    masks // steps tokens, plus one for each of the first (masks % steps) steps;
  - each step is one forward pass; candidates are the argmax of Gumbel-perturbed logits
    (float64 noise; temperature 0 = plain argmax); confidence is the softmax probability of the
    candidate (`low_confidence`) or a uniform draw (`random`); the most confident masked positions
    of the current block are committed. Prompt and committed tokens never change.
Variants, each off by default:
  - `threshold` (Fast-dLLM parallel decoding): commit every masked position of the block whose
    confidence >= threshold, and always at least the most confident one;
  - `entropy_bound` (EB-Sampler, Ben-Hamu et al. 2025; DiffusionGemma's `EntropyBoundSampler`):
    rank the block's masked positions as the remasking rule does, then commit the longest prefix U
    of that ranking with sum(H_U) - max(H_U) <= bound, H in nats (always at least one). The most
    uncertain token of U is free: KL(joint || product of marginals) <= sum(H) - max(H). Bound 0 is
    one token per step. `remasking="low_entropy"` ranks by entropy, DiffusionGemma's order;
    the default ranks by confidence, so that bound 0 is exactly LLaDA's one-token-per-step sampler;
    `remasking="left_to_right"` ranks by position, so a step commits the run of positions right
    after the committed text that fits under the bound (bound 0: AR order inside the block).
    `remasking="top_margin"` (Kim et al. 2025, "Train for the Worst, Plan for the Best") ranks by the gap
    between a position's two likeliest tokens: a position torn between two answers waits, however likely
    each is (on Sudoku: lessons/16_sudoku.py, tinydiff/extras/sudoku.py).
    At T > 0 the rankings differ in kind: entropy, margin and position are chosen before the draw, so each
    committed token is a fair sample of its position (one token per step: ancestral sampling in
    that order); confidence ranks the draws themselves and commits whichever position drew a
    likely token, a mode. For a model sure of many positions that collapses diversity;
  - `block_causal`: attention across blocks is causal (a block sees the prompt, earlier blocks and
    itself), inside a block bidirectional: the attention `generate_cached` needs.
`generate_cached` is the block-causal sampler with a KV cache of the finished prefix (BD3-LM,
Fast-dLLM): each step runs the current block only. Same tokens as `generate(block_causal=True)`.
A shifted model (diffusion.py: adapted from an AR checkpoint) predicts position i at output i-1,
so the block's logits are read one position earlier; the prompt is never empty, so that exists.
Variants in tinydiff/extras/: self-correction (self_correction.py), lossless self-speculation
(self_speculative.py), an AR draft for the diffusion LM (drafted_diffusion.py).
Leaves out: classifier-free guidance, batched prompts, approximate (stale) prefix caching.
"""
import time

import torch

from tinydiff import kernels
from tinydiff.ar import Decoded, check_prompt, elapsed
from tinydiff.checks import UserError
from tinydiff.diffusion import subs_logits
from tinydiff.sampling import check_warp_args
from tinydiff.tokenizer import MASK

REMASKING = ("low_confidence", "random", "low_entropy", "left_to_right", "top_margin")


def commit_schedule(masks: int, steps: int) -> list[int]:
    """Tokens to commit at each of `steps` steps for `masks` masked positions (LLaDA)."""
    base, extra = divmod(masks, steps)
    return [base + (i < extra) for i in range(steps)]


def propose(logits, temperature: float, remasking: str, generator=None):
    """Candidates and confidences for logits (N, V): one Gumbel-max draw per position.

    argmax(logits/T + Gumbel) is argmax(exp(logits) / (-log u)^T), LLaDA's form, computed as
    argmax(softmax(logits / T) / -log u): one logarithm per id instead of two, and at T = 1 the
    softmax is the confidence's too. Noise and probabilities in float64: float32 Gumbel noise has
    visible ties. (Where Triton runs, the samplers take sampler_step.fused_propose for low_confidence:
    one pass over the vocabulary on the same uniforms, so the same tokens; see pick_proposer.)
    """
    logits = subs_logits(logits).double()  # (N, V)
    probs = None
    if temperature > 0:
        u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
        tempered = torch.softmax(logits / temperature, -1)  # exp(logits / T - max) / sum: no overflow
        candidates = (tempered / -torch.log(u)).argmax(-1)
        probs = tempered if temperature == 1 else None
    else:
        candidates = logits.argmax(-1)  # (N,)
    if remasking == "low_confidence":
        probs = torch.softmax(logits, -1) if probs is None else probs
        confidence = probs.gather(-1, candidates[:, None]).squeeze(-1)
    elif remasking == "low_entropy":
        confidence = -position_entropy(logits, temperature)
    elif remasking == "top_margin":  # Kim et al. 2025: the gap between the two likeliest tokens
        top2 = torch.softmax(logits, -1).topk(2, -1).values  # (N, 2)
        confidence = top2[:, 0] - top2[:, 1]
    elif remasking == "left_to_right":  # the leftmost masked position first: the rows come in position order
        confidence = -torch.arange(len(logits), device=logits.device, dtype=torch.float64)
    else:
        confidence = torch.rand(candidates.shape, generator=generator, device=logits.device, dtype=torch.float64)
    return candidates, confidence


def position_entropy(logits, temperature: float):
    """Entropy in nats (N,) of each position's sampling distribution softmax(logits / T), float64;
    at T = 0 (argmax, a point mass) of the model's own softmax(logits)."""
    probs = torch.softmax(subs_logits(logits).double() / (temperature or 1.0), -1)  # (N, V)
    return torch.special.entr(probs).sum(-1)  # entr(0) = 0: the MASK column adds nothing


def entropy_bound_count(entropy, bound: float) -> int:
    """Length of the longest prefix U of `entropy` (N,), in commit order, with sum(H_U) - max(H_U)
    <= bound; at least 1. sum - max never falls as U grows, so the prefix is a count."""
    excess = entropy.cumsum(0) - entropy.cummax(0).values  # (N,)
    return max(1, int((excess <= bound).sum()))


def commit(canvas, lo: int, logits, count: int | None, threshold: float | None, temperature: float,
           remasking: str, generator, confidences, entropy_bound: float | None = None, proposer=propose):
    """One step on the block canvas[lo:lo+N] given its logits (N, V): commit tokens in place.

    Commits the `count` most confident masked positions; with a threshold, all masked positions at
    or above it (at least one); with an entropy bound, the longest most-confident run whose
    entropies fit under it (at least one). Records each committed position's confidence; returns
    the committed positions (absolute indices). proposer: propose, or its fused kernel (pick_proposer).
    """
    masked = (canvas[lo:lo + len(logits)] == MASK).nonzero()[:, 0]  # (n,): committed tokens never move
    candidates, confidence = proposer(logits[masked], temperature, remasking, generator)  # (n,) each
    ranked = torch.argsort(confidence, descending=True, stable=True)  # most confident first
    if threshold is not None:
        count = max(1, int((confidence >= threshold).sum()))
    elif entropy_bound is not None:
        count = entropy_bound_count(position_entropy(logits[masked[ranked]], temperature), entropy_bound)
    chosen = ranked[:count]
    canvas[lo + masked[chosen]] = candidates[chosen]
    confidences[lo + masked[chosen]] = confidence[chosen]
    return (lo + masked[chosen]).tolist()


def block_causal_mask(block_ids):
    """(T, T) bool: position i sees j when j's block is not after i's."""
    return block_ids[None, :] <= block_ids[:, None]


class Trace:
    """Counts forwards and reports every step to an optional callback(event dict; confidences: read it at once)."""

    def __init__(self, callback):
        self.callback = callback
        self.forwards = 0
        self.start = time.perf_counter()

    def step(self, canvas, block, committed, **more):
        if self.callback is not None:
            self.callback({"forward": self.forwards, "block": block, "canvas": canvas.clone(), "committed": committed,
                           **more})

    def result(self, new_tokens: int, device) -> Decoded:
        return Decoded(new_tokens=new_tokens, forwards=self.forwards, seconds=elapsed(self.start, device))


def fill_block(canvas, b: int, lo: int, block_length: int, block_logits, block_steps: int, trace, temperature,
               remasking, threshold, entropy_bound, generator, confidences, proposer=propose):
    """Block b (canvas[lo:lo+block_length]) filled, one forward a step (block_logits(lo) -> (N, V)): LLaDA's
    schedule, or with a threshold or entropy bound as many a step as pass it, until no MASK is left."""
    schedule = commit_schedule(block_length, block_steps)
    step = 0
    while (canvas[lo:lo + block_length] == MASK).any():
        count = schedule[step] if step < block_steps else None  # None only with a threshold or bound
        committed = commit(canvas, lo, block_logits(lo), count, threshold, temperature, remasking, generator,
                           confidences, entropy_bound, proposer)
        trace.step(canvas, b, committed, confidences=confidences)
        step += 1


def start_canvas(model, prompt, gen_length):
    """The canvas (L,): the prompt then gen_length MASKs; each position's commit confidence (inf: the prompt)."""
    canvas = torch.tensor(prompt + [MASK] * gen_length, device=model.embed.weight.device)  # (L,)
    return canvas, torch.full(canvas.shape, float("inf"), dtype=torch.float64, device=canvas.device)


def diffusion_lengths(model, prompt: list[int], max_new_tokens, block_length) -> tuple[int, int]:
    """A diffusion LM's canvas after the prompt, and its block: --max-new-tokens (default as many whole
    blocks of 32 as fit, at most 128) and --block-length (default 32, or the largest size under it that
    divides the canvas; the whole canvas where none of 8..32 does: a default never refuses a length given)."""
    room = model.config.context - len(prompt)
    new = max_new_tokens or min(128, room - room % 32) or room
    return new, block_length or next((b for b in range(min(32, new), 7, -1) if new % b == 0), new)


@torch.no_grad()
def generate(model, prompt, gen_length=64, steps=64, block_length=32, temperature=0.0,
             remasking="low_confidence", threshold=None, block_causal=False, generator=None, callback=None,
             entropy_bound=None):
    """Fill `gen_length` MASKs after `prompt` (list of ids); returns (new ids, ar.Decoded).
    block_causal: a block sees the prompt, earlier blocks and itself (generate_cached's attention)."""
    blocks, block_steps = check_args(model, prompt, gen_length, steps, block_length, temperature,
                                     remasking, threshold, entropy_bound)
    P = len(prompt)
    canvas, confidences = start_canvas(model, prompt, gen_length)
    mask = None
    if block_causal:  # the prompt is block 0, answer block b is block b + 1
        block_ids = torch.cat([torch.zeros(P, dtype=torch.long), 1 + torch.arange(gen_length) // block_length])
        mask = block_causal_mask(block_ids.to(canvas.device))
    trace = Trace(callback)

    def block_logits(lo):
        trace.forwards += 1
        logits = model(canvas[None], causal=False, mask=mask)[0]  # (L, V)
        first = lo - model.config.shift  # the output that predicts position lo
        return logits[first:first + block_length]  # positions after the block are never committed

    proposer = pick_proposer(remasking, canvas)  # propose, or its fused kernel where Triton runs
    for b in range(blocks):
        fill_block(canvas, b, P + b * block_length, block_length, block_logits, block_steps, trace, temperature,
                   remasking, threshold, entropy_bound, generator, confidences, proposer)
    return canvas[P:].tolist(), trace.result(gen_length, canvas.device)


def prefix_block_mask(start: int, lo: int, prompt_length: int, block_length: int, device=None):
    """(n, start + n) bool for the positions start..lo+block_length over a cache of `start` rows: every
    cached row, then block-causal among the n new ones (the prompt is one block)."""
    position = torch.arange(start, lo + block_length, device=device)
    block_ids = (position - prompt_length).div(block_length, rounding_mode="floor").clamp(min=-1)  # the prompt: -1
    cached = torch.ones(len(block_ids), start, dtype=torch.bool, device=device)
    return torch.cat([cached, block_causal_mask(block_ids)], 1)


def prefix_cached_logits(model, canvases, cache, lo: int, prompt_length: int, block_length: int):
    """Logits (S, N, V) that predict the block canvases[:, lo:lo+N] (S canvases (S, L) that agree
    before lo; `cache` holds S rows): one forward of the finished positions the cache lacks, then
    the block, block-causal against the cached prefix. The cache then keeps the rows of the finished
    positions, up to lo - shift (generate_cached's forward; self_speculative.py's batched one)."""
    shift = int(model.config.shift)
    start = cache.length  # finished positions not yet cached, then the block
    mask = prefix_block_mask(start, lo, prompt_length, block_length, canvases.device)  # (n, start + n)
    first = lo - shift - start  # the output that predicts position lo
    logits = model(canvases[:, start:lo + block_length], mask=mask, cache=cache)  # (S, n, V)
    cache.crop(lo - shift)  # keep the finished positions' rows, drop the block's
    return logits[:, first:first + block_length]


@torch.no_grad()
def generate_cached(model, prompt, gen_length=64, steps=64, block_length=32, temperature=0.0,
                    remasking="low_confidence", threshold=None, generator=None, callback=None,
                    entropy_bound=None):
    """Block-causal semi-AR sampling with a KV cache of the finished prefix; (new ids, tally.Decoded).

    The cache holds the prompt and the finished blocks. A block's keys/values are computed once,
    from its final tokens: they ride along with the first step of the next block (one forward
    over [finished block, next block], block-causal), after which the cache keeps the finished
    block's rows and drops the rest. Every other step runs the current block alone, or for a
    shifted model the block and the finished token before it, whose output predicts the block's
    first position (that one token stays out of the cache and is recomputed each step). Each row
    sees the blocks up to its own (the prompt is one block), as in generate(block_causal=True):
    that finished token sees the prefix only, never the block it predicts the start of.
    """
    blocks, block_steps = check_args(model, prompt, gen_length, steps, block_length, temperature,
                                     remasking, threshold, entropy_bound)
    P = len(prompt)
    canvas, confidences = start_canvas(model, prompt, gen_length)
    cache = model.new_cache(1)
    trace = Trace(callback)

    def block_logits(lo):
        trace.forwards += 1
        return prefix_cached_logits(model, canvas[None], cache, lo, P, block_length)[0]

    proposer = pick_proposer(remasking, canvas)  # propose, or its fused kernel where Triton runs
    for b in range(blocks):
        fill_block(canvas, b, P + b * block_length, block_length, block_logits, block_steps, trace, temperature,
                   remasking, threshold, entropy_bound, generator, confidences, proposer)
    return canvas[P:].tolist(), trace.result(gen_length, canvas.device)


def pick_proposer(remasking: str, x):
    """The samplers' proposal on x's device: propose, or for low_confidence where kernels.for_inference(x),
    kernels/sampler_step.py's fused_propose (propose's tokens, in one pass over the vocabulary)."""
    if remasking != "low_confidence" or not kernels.for_inference(x):
        return propose
    from tinydiff.kernels.sampler_step import fused_propose  # lazily: see kernels/__init__.py
    return fused_propose


def check_args(model, prompt, gen_length, steps, block_length, temperature, remasking, threshold,
               entropy_bound=None):
    """Validate sampler arguments; return (number of blocks, steps per block)."""
    check_prompt(prompt, model.config.context, gen_length)
    if block_length < 1 or gen_length % block_length:
        raise UserError(f"gen length {gen_length} must be a multiple of the block length {block_length}")
    blocks = gen_length // block_length
    if steps < blocks or steps % blocks or steps > gen_length:
        raise UserError(f"steps {steps} must be a multiple of the number of blocks ({blocks}) and at most the "
                        f"gen length {gen_length} (one token per step)")
    check_warp_args(temperature, None, None)
    check_rule(remasking, threshold, entropy_bound)
    return blocks, steps // blocks


def check_rule(remasking, threshold, entropy_bound):
    """The order a step ranks positions in, and what decides how many it commits: what `commit` reads."""
    if remasking not in REMASKING:
        raise UserError(f"remasking must be one of {', '.join(REMASKING)}, got {remasking!r}")
    if threshold is not None and not 0 < threshold <= 1:
        raise UserError(f"threshold must lie in (0, 1], got {threshold}")
    if entropy_bound is not None and not 0 <= entropy_bound < float("inf"):
        raise UserError(f"entropy bound must be a finite number of nats >= 0 (0 = one token per step), "
                        f"got {entropy_bound}")
    if threshold is not None and remasking == "left_to_right":
        raise UserError("a threshold compares confidences, and left_to_right ranks by position: use an entropy bound")
    if threshold is not None and entropy_bound is not None:
        raise UserError("pass a threshold or an entropy bound, not both: each decides how many tokens a step commits")
