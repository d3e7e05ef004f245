"""The diffusion sampler's step: per position the Gumbel-max candidate and its softmax probability.

For logits (N, V) computes, per row, the candidate argmax(logits / T - log(-log u)) (T = 0: the
plain argmax of the logits) and its confidence softmax(logits)[candidate], with the MASK logit
excluded when V > MASK (SUBS: the model never predicts MASK). Replaces the math of
`tinydiff.sampler.propose` with remasking="low_confidence": `sampler_step_reference` is that math
with the uniforms u passed in, so kernel and reference see the same noise. Drawing u as propose
does (`torch.rand(logits.shape, generator=g, dtype=torch.float64)`) gives propose's exact tokens.

PyTorch's path writes several (N, V) float64 tensors (the logits upcast, the noise, the perturbed
scores, the probabilities) and reads each back. The kernel reads the logits (and u) once. Program
(row, part) walks one slice of the row's vocabulary in chunks of BLOCK_V, and every lane of the
chunk keeps a running max and a running sum of exp(logit - max) (the online softmax: when the max
grows, the sum so far is rescaled by exp(old max - new max)), plus the best perturbed score it has
seen, that score's vocabulary id and raw logit. At the end of the slice the lanes are combined:
the max M, the sum S = sum_lanes s * exp(m - M), the best score with the smallest id among equals
(torch.argmax's first-occurrence rule) and that id's logit. A second small kernel combines the
slices of each row by the same rules and stores the candidate and exp(logit - M) / S. Slicing
keeps a whole GPU busy when a step has few positions (a 32-token block is 32 rows). The
probabilities are never stored. Arithmetic is float64, as in propose (float32 Gumbel noise has
visible ties).

Leaves out: drawing the noise inside the kernel (tl.rand's Philox stream differs from
torch.Generator's, which would change the sampled tokens; it would also save reading u),
random remasking (its confidence is a uniform draw, no vocabulary pass), top-k / top-p warping,
one launch instead of two (the last program of a row could combine, behind an atomic counter).
"""
import functools

import torch

from tinydiff.kernels import check_device, use_triton
from tinydiff.tokenizer import MASK

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: the reference below still works, the kernel never runs
    from tinydiff.kernels import no_triton as tl
    from tinydiff.kernels import no_triton as triton


def check_inputs(logits, temperature, uniforms):
    if logits.dim() != 2 or logits.shape[1] < 1:
        raise ValueError(f"logits must be (N, V), got {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = argmax), got {temperature}")
    if temperature > 0 and (uniforms is None or uniforms.shape != logits.shape):
        raise ValueError(f"temperature > 0 needs uniforms of the logits' shape {tuple(logits.shape)}, got "
                         f"{None if uniforms is None else tuple(uniforms.shape)}")


def sampler_step_reference(logits, temperature: float, uniforms=None):
    """sampler.propose's low_confidence math with the noise given: (candidates (N,), confidence (N,) f64)."""
    check_inputs(logits, temperature, uniforms)
    logits = logits.double()  # (N, V); MASK is never a candidate (diffusion.subs_logits)
    if logits.shape[-1] > MASK:
        logits = logits.index_fill(-1, torch.tensor([MASK], device=logits.device), float("-inf"))
    if temperature > 0:
        candidates = (logits / temperature - torch.log(-torch.log(uniforms.double()))).argmax(-1)
    else:
        candidates = logits.argmax(-1)  # (N,)
    confidence = torch.softmax(logits, -1).gather(-1, candidates[:, None]).squeeze(-1)
    return candidates, confidence


@triton.jit
def _sampler_step_kernel(logits_ptr, u_ptr, temperature_ptr, stats_ptr, ids_ptr, V, per, exclude,
                         s_logits, s_u, BLOCK_V: tl.constexpr, NOISE: tl.constexpr):
    row, part = tl.program_id(0), tl.program_id(1)  # position, and which slice of the vocabulary
    lo = part * per
    hi = tl.minimum(lo + per, V)
    lane = tl.arange(0, BLOCK_V)
    m = tl.full((BLOCK_V,), float("-inf"), tl.float64)  # per lane: running max of the logits
    s = tl.zeros((BLOCK_V,), tl.float64)  # per lane: running sum of exp(logit - m)
    best = tl.full((BLOCK_V,), float("-inf"), tl.float64)  # per lane: best perturbed score so far
    best_id = tl.zeros((BLOCK_V,), tl.int64)  # ... its vocabulary id
    best_logit = tl.full((BLOCK_V,), float("-inf"), tl.float64)  # ... and its raw logit
    for start in range(lo, hi, BLOCK_V):
        ids = start + lane
        ok = (ids < hi) & (ids != exclude)  # past the slice, or MASK: logit -inf
        logit = tl.load(logits_ptr + row * s_logits + ids, mask=ok, other=float("-inf")).to(tl.float64)
        if NOISE:  # Gumbel-max: argmax(logit / T + g), g = -log(-log u)
            u = tl.load(u_ptr + row * s_u + ids, mask=ok, other=0.5).to(tl.float64)
            score = logit / tl.load(temperature_ptr) - tl.log(-tl.log(u))
        else:
            score = logit
        better = score > best  # strictly: a lane keeps its first (smallest) id among equal scores
        best = tl.where(better, score, best)
        best_id = tl.where(better, ids.to(tl.int64), best_id)
        best_logit = tl.where(better, logit, best_logit)
        m_new = tl.maximum(m, logit)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with nothing yet: no NaN
        s = s * tl.exp(m - shift) + tl.exp(logit - shift)
        m = m_new
    # Combine the lanes: the max, the sum of exponentials relative to it, the best score and the
    # smallest id holding it (with its logit). Five numbers for this slice of the vocabulary.
    M = tl.max(m, 0)
    S = tl.sum(s * tl.exp(m - tl.where(M == float("-inf"), 0.0, M)), 0)
    top = tl.max(best, 0)
    winner = tl.min(tl.where(best == top, best_id, V), 0)
    logit_c = tl.max(tl.where(best_id == winner, best_logit, float("-inf")), 0)
    out = stats_ptr + (row * tl.num_programs(1) + part) * 4
    tl.store(out, M)
    tl.store(out + 1, S)
    tl.store(out + 2, top)
    tl.store(out + 3, logit_c)
    tl.store(ids_ptr + row * tl.num_programs(1) + part, winner)


@triton.jit
def _combine_kernel(stats_ptr, ids_ptr, cand_ptr, conf_ptr, V, SPLIT, BLOCK: tl.constexpr):
    """The slices of one row are combined exactly as the lanes were."""
    row = tl.program_id(0)
    part = tl.arange(0, BLOCK)
    ok = part < SPLIT
    base = stats_ptr + (row * SPLIT + part) * 4
    m = tl.load(base, mask=ok, other=float("-inf"))
    s = tl.load(base + 1, mask=ok, other=0.0)
    best = tl.load(base + 2, mask=ok, other=float("-inf"))
    best_logit = tl.load(base + 3, mask=ok, other=float("-inf"))
    best_id = tl.load(ids_ptr + row * SPLIT + part, mask=ok, other=V)
    M = tl.max(m, 0)
    S = tl.sum(tl.where(ok, s * tl.exp(m - M), 0.0), 0)
    top = tl.max(best, 0)
    winner = tl.min(tl.where(best == top, best_id, V), 0)  # slices hold increasing ids: the first wins
    logit_c = tl.max(tl.where(best_id == winner, best_logit, float("-inf")), 0)
    tl.store(cand_ptr + row, winner)
    tl.store(conf_ptr + row, tl.exp(logit_c - M) / S)


@functools.lru_cache(maxsize=8)
def multiprocessors(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=16)
def temperature_tensor(temperature: float, device) -> torch.Tensor:
    """T as a float64 tensor on the device: a Python float argument would reach the kernel rounded to
    float32. Kept per (T, device), so a step copies nothing to the GPU (and a CUDA graph can hold it)."""
    return torch.tensor([temperature], dtype=torch.float64, device=device)


def sampler_step_triton(logits, temperature: float, uniforms=None, block_v: int = 2048, split: int | None = None):
    """The kernel; same arguments and result as `sampler_step_reference`.

    block_v: vocabulary ids per chunk (a power of 2). split: programs per row, each walking one
    slice of the vocabulary (default: as many as give every multiprocessor of a GPU at most one
    program, 1 on CPU); a second, tiny kernel combines the slices. Each program ends in reductions
    over its lanes, so fewer, longer programs win (timed on an H200: dev/LOG.md).
    """
    check_inputs(logits, temperature, uniforms)
    check_device(_sampler_step_kernel, logits)
    N, V = logits.shape
    if N == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device), torch.empty(0, dtype=torch.float64,
                                                                                    device=logits.device)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    noise = temperature > 0
    u = (uniforms if uniforms.stride(-1) == 1 else uniforms.contiguous()) if noise else logits  # unread at T = 0
    block_v = min(block_v, triton.next_power_of_2(V))
    if split is None:
        programs = multiprocessors(logits.device) if logits.is_cuda else 1
        split = max(1, min(programs // N, triton.cdiv(V, block_v)))
    per = triton.cdiv(triton.cdiv(V, split), block_v) * block_v  # ids per slice, whole chunks
    split = triton.cdiv(V, per)  # no empty slice
    stats = torch.empty(N, split, 4, dtype=torch.float64, device=logits.device)  # max, sum, best score, its logit
    ids = torch.empty(N, split, dtype=torch.int64, device=logits.device)  # the best score's id
    t = temperature_tensor(float(temperature), logits.device)
    _sampler_step_kernel[(N, split)](logits, u, t, stats, ids, V, per, MASK if V > MASK else -1,
                                     logits.stride(0), u.stride(0), BLOCK_V=block_v, NOISE=noise, num_warps=8)
    candidates = torch.empty(N, dtype=torch.int64, device=logits.device)
    confidence = torch.empty(N, dtype=torch.float64, device=logits.device)
    _combine_kernel[(N,)](stats, ids, candidates, confidence, V, split, BLOCK=triton.next_power_of_2(split))
    return candidates, confidence


def sampler_step(logits, temperature: float, uniforms=None):
    """Dispatch: the kernel where `use_triton(logits)`, else the reference. Same arguments and result."""
    if use_triton(logits):
        return sampler_step_triton(logits, temperature, uniforms)
    return sampler_step_reference(logits, temperature, uniforms)


def fused_propose(logits, temperature: float, remasking: str, generator=None):
    """sampler.propose for low_confidence remasking (what sampler.pick_proposer gives the samplers): it draws
    propose's uniforms (same generator, shape and dtype), so the same tokens, and never writes the (N, V)
    float64 logits, scores and probabilities."""
    u = None
    if temperature > 0:
        u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
    return sampler_step(logits, temperature, u)
