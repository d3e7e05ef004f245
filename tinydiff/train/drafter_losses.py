"""The drafters' training losses: DFlash's packed block loss and EAGLE-3's training-time test.

Both drafters (tinydiff/dflash.py, tinydiff/eagle3.py) read a frozen target, whose one forward per batch
gives their features and their soft labels (EAGLE-3's always, DFlash's with a `temperature`); train.py
minimises these through batches.OBJECTIVES.
  DFlash   ("DFlash: Block Diffusion for Flash Speculative Decoding", 2026; z-lab/dflash): up to
           `anchors` random anchors per window (`sample_anchors`), every block [token at the anchor,
           MASK x (B-1)] packed into ONE drafter forward under `training_mask` (a block sees the context
           strictly before its anchor and itself bidirectionally, nothing else); slot k's label is the
           token at anchor + k (slot 0 unsupervised), its CE weighted exp(-(k-1)/g) (`block_loss`).
  EAGLE-3  (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
           Training-Time Test"; SafeAILab/EAGLE): the "training-time test", the head unrolled K steps on
           its own hidden states, each step's rows attending to exactly the keys the matching draft step
           sees at inference (`unroll_mask`), step i's soft CE against the target's next-token
           distribution weighted step_decay^i (`eagle_loss`).
Memory: a drafted slot reads a row of 50,258 logits, so both read them a chunk at a time and again in the
backward (`checkpointed_chunks`), never the batch's at once.
Leaves out: the papers' scale (DFlash: a few hundred anchors per sequence), EAGLE-3's reduced draft
vocabulary, a head fused into the cross-entropy (train/fused_loss.py serves the AR and MDLM losses).
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tinydiff.checks import UserError
from tinydiff.dflash import DFlashDrafter
from tinydiff.eagle3 import EagleHead
from tinydiff.model import wide
from tinydiff.sampling import draftable, next_token_probs, soft_ce, tempered_ce
from tinydiff.tokenizer import MASK

# ---- DFlash: every block of a window in one drafter forward

def training_mask(anchors, block_size: int, T: int):
    """(Bw, A*B, T + A*B) bool for anchors (Bw, A): columns are the T context positions, then A blocks of B
    slots; a block's rows see the context strictly before its anchor and their own block, nothing else."""
    A = anchors.shape[1]
    row_anchor = anchors.repeat_interleave(block_size, 1)  # (Bw, A*B)
    sees_context = torch.arange(T, device=anchors.device) < row_anchor[..., None]  # (Bw, A*B, T)
    blocks = torch.arange(A * block_size, device=anchors.device) // block_size
    sees_block = (blocks[:, None] == blocks[None, :]).expand(len(anchors), -1, -1)  # (Bw, A*B, A*B)
    return torch.cat([sees_context, sees_block], -1)


LOSS_ROWS = 512  # rows a loss reads at once: each holds a few vectors of 50,258 floats (~0.2 MB each in float32)


def checkpointed_chunks(fn, rows_each: int, *tensors) -> list:
    """[fn(*chunk) for chunks of tensors along dim 0], a chunk about LOSS_ROWS rows of rows_each each, its graph
    run again in the backward (activation checkpointing): a loss over 50,258-wide logits holds one chunk's
    logits at a time, not the batch's."""
    n = max(1, LOSS_ROWS // rows_each)
    return [checkpoint(fn, *(t[i:i + n] for t in tensors), use_reentrant=False) for i in range(0, len(tensors[0]), n)]


def packed_hidden(drafter: DFlashDrafter, windows, anchors):
    """The drafter's hidden states (Bw, A, B-1, D) for the blocks at anchors (Bw, A) of windows (Bw, T), and the
    target's last residual stream (Bw, T, D): one frozen target forward for the features, ONE drafter forward
    for all blocks. No logits: at 50,258 a row, dflash_loss reads them a chunk of windows at a time."""
    (Bw, T), A, B = windows.shape, anchors.shape[1], drafter.config.block_size
    with torch.no_grad():  # head_from=T: the target's head is left for the loss to run on `last`
        _, hidden = drafter.target(windows, causal=True, head_from=T,
                                   hidden_layers=[*drafter.config.taps, drafter.config.target_layers])
    last = hidden.pop()
    kv = drafter.context_kv(drafter.features(hidden), torch.arange(T, device=windows.device))
    pos = (anchors[..., None] + torch.arange(B, device=windows.device)).flatten(1)  # (Bw, A*B)
    block = windows.gather(1, pos).view(Bw, A, B)
    block[:, :, 1:] = MASK  # [token at anchor, MASK x (B-1)] per block
    mask = training_mask(anchors, B, T)[:, None]  # (Bw, 1, A*B, T + A*B): shared by heads
    h = drafter.hidden(block.flatten(1), pos, [k for k, _ in kv], [v for _, v in kv], mask)  # (Bw, A*B, D)
    return h.view(Bw, A, B, -1)[:, :, 1:], last  # slot 0 holds the anchor's token: no prediction


def packed_logits(drafter: DFlashDrafter, windows, anchors):
    """packed_hidden's logits: the drafter's (Bw, A, B-1, V) and the target's (Bw, T, V)."""
    h, last = packed_hidden(drafter, windows, anchors)
    with torch.no_grad():
        target_logits = drafter.target.logits(last)
    return drafter.logits(h), target_logits


def sample_anchors(batch: int, T: int, block_size: int, anchors: int, generator=None, device=None):
    """min(anchors, T - B) distinct random anchors per window in [1, T - B], (batch, A): from 1, every block
    has context; up to T - B, its last slot's label is still in the window."""
    A = min(anchors, T - block_size)
    return torch.rand(batch, T - block_size, generator=generator, device=device).argsort(-1)[:, :A] + 1


def block_loss(drafter: DFlashDrafter, windows, anchors, logits, target_logits, temperature: float | None = None):
    """The weighted block CE of logits (Bw, A, B-1, V) at anchors (Bw, A) of windows (Bw, T), and its stats."""
    (Bw, A), B = anchors.shape, drafter.config.block_size
    positions = (anchors[..., None] + torch.arange(1, B, device=windows.device)).flatten(1)  # (Bw, A*(B-1))
    labels = windows.gather(1, positions).view(Bw, A, B - 1)
    if logits.shape[-1] > MASK:  # never a label, never drafted: keep no mass on it
        logits[..., MASK] = float("-inf")
    if temperature is None:
        ce = F.cross_entropy(logits.flatten(0, 2).to(wide(logits.dtype)), labels.flatten(), reduction="none")
    else:  # the target's distribution for slot k's position, predicted from the position before it
        V = target_logits.shape[-1]
        predicted = target_logits.gather(1, (positions - 1)[..., None].expand(-1, -1, V))  # (Bw, A*(B-1), V)
        ce = tempered_ce(logits, predicted.view(Bw, A, B - 1, V), temperature)
    ce = ce.view(Bw, A, B - 1)
    w = torch.exp(-torch.arange(B - 1, device=windows.device, dtype=ce.dtype) / drafter.config.loss_decay)
    loss = (ce * w).sum(-1).mean() / w.sum()  # slot k weighted exp(-(k-1)/g): nats per token whatever B is
    correct = (logits.argmax(-1) == labels).long()  # (Bw, A, B-1)
    return loss, {"ce": loss.detach(), "acc": correct[..., 0].float().mean(),
                  "tau_proxy": 1 + correct.cumprod(-1).sum(-1).float().mean()}


def dflash_loss(drafter: DFlashDrafter, windows, generator=None, temperature: float | None = None):
    """Weighted block CE on windows (Bw, T) of clean text: (loss, stats). Labels: the text's tokens, or with
    a `temperature` the target's distribution (sampling.tempered_ce). stats: ce, acc (slot 1's argmax right),
    tau_proxy (1 + the mean run of leading correct slots: greedy tau if the target's picks were the text).
    Memory: the logits of a few windows at a time (checkpointed_chunks), made again in the backward:
    a window of 256 tokens reads 32 blocks x 15 slots of 50,258 logits, 97 MB in float32."""
    B = drafter.config.block_size
    if windows.shape[1] < B + 1:
        raise UserError(f"windows of {windows.shape[1]} tokens are too short for blocks of {B}; use >= {B + 1}")
    Bw = len(windows)
    anchors = sample_anchors(Bw, windows.shape[1], B, drafter.config.anchors, generator, windows.device)
    hidden, last = packed_hidden(drafter, windows, anchors)  # (Bw, A, B-1, D), (Bw, T, D)

    def chunk_loss(h, last, windows, anchors):  # summed over a chunk's windows (checkpointed_chunks)
        with torch.no_grad():
            target_logits = None if temperature is None else drafter.target.logits(last)  # (b, T, V)
        loss, stats = block_loss(drafter, windows, anchors, drafter.logits(h), target_logits, temperature)
        return loss * len(windows), {k: v * len(windows) for k, v in stats.items()}

    parts = checkpointed_chunks(chunk_loss, anchors.shape[1] * (B - 1), hidden, last, windows, anchors)
    loss = sum(part for part, _ in parts) / Bw
    return loss, {"ce": loss.detach(), **{k: sum(stats[k] for _, stats in parts) / Bw for k in ("acc", "tau_proxy")}}


def markov_loss(drafter: DFlashDrafter, windows, generator=None, temperature: float | None = None):
    """dflash_loss for DSpark's Markov head (extras/markov_head.py's MarkovDrafter, its head at `drafter.markov`):
    slot k's logits biased by the text's token at k - 1 (teacher forcing). Not chunked: its runs are small."""
    B = drafter.config.block_size
    if windows.shape[1] < B + 1:
        raise UserError(f"windows of {windows.shape[1]} tokens are too short for blocks of {B}; use >= {B + 1}")
    Bw, T = windows.shape
    anchors = sample_anchors(Bw, T, B, drafter.config.anchors, generator, windows.device)  # (Bw, A)
    logits, target_logits = packed_logits(drafter, windows, anchors)  # (Bw, A, B-1, V)
    if getattr(drafter, "markov", None) is not None:
        previous = (anchors[..., None] + torch.arange(B - 1, device=windows.device)).flatten(1)  # (Bw, A*(B-1))
        logits = logits + drafter.markov(windows.gather(1, previous).view(logits.shape[:-1])).to(logits.dtype)
    return block_loss(drafter, windows, anchors, logits, target_logits, temperature)


# ---- EAGLE-3: the training-time test, the head unrolled on its own features

def unroll_mask(T: int, step: int, device=None):
    """Who row r of unroll step i may attend to: (T, (i+1)T) bool over [step 0 | step 1 | ... | step i].

    Row r at step i is draft step i+1 after the committed row c = r - i: as at inference it sees
    step 0's rows 0..c (the committed rows, read with target features) and from each step m = 1..i
    the single row c + m (the m-th draft row of its own chain; m = i is the row itself). Rows r < i
    have no committed row; they see only themselves and feed no loss.
    """
    r, c = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None]
    anchored = r >= step
    return torch.cat([c <= r - step] + [(c == r - step + m) & (anchored | (m == step)) for m in range(1, step + 1)], 1)


def unrolled_hidden(head: EagleHead, windows, steps: int):
    """The head unrolled `steps` steps on windows (Bw, T): its hidden states, (Bw, steps, T-1, D) (row r's
    logits predict token r+2), and the target's last residual stream (Bw, T, D), one frozen target forward.
    No logits: at 50,258 a row, eagle_loss reads them a chunk of rows at a time."""
    Bw, T = windows.shape
    with torch.no_grad():  # head_from=T: the target's head is left for the loss to run on `last`
        _, hidden = head.target(windows, causal=True, head_from=T,
                                hidden_layers=[*head.config.feature_layers, head.config.target_layers])
    tokens, pos, last = windows[:, 1:], torch.arange(1, T, device=windows.device), hidden.pop()  # row r reads token r+1
    features = head.fused([h[:, :-1] for h in hidden])  # (Bw, T-1, D): row r's is position r's
    D, H = head.config.d_model, head.config.n_head
    past_k = past_v = features.new_zeros(Bw, H, 0, D // H)
    out = []
    for i in range(steps):
        h, k, v = head.hidden(tokens, features, pos, past_k, past_v, unroll_mask(T - 1, i, windows.device))
        past_k, past_v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)  # (Bw, H, (i+1)(T-1), D/H)
        out.append(h)
        features = F.pad(h[:, :-1], (0, 0, 1, 0))  # row r's next feature: row r-1's hidden (row 0: none)
    return torch.stack(out, 1), last  # (Bw, steps, T-1, D)


def unrolled_logits(head: EagleHead, windows, steps: int):
    """unrolled_hidden's logits: the head's per step, steps x (Bw, T-1, V), and the target's (Bw, T, V)."""
    hidden, last = unrolled_hidden(head, windows, steps)
    with torch.no_grad():
        target_logits = head.target.logits(last)
    return list(head.logits(hidden).unbind(1)), target_logits


def eagle_loss(head: EagleHead, windows, generator=None, steps=None, temperature: float = 1.0):
    """Training-time-test distillation loss on windows (Bw, T); returns (loss, stats).

    loss = sum_i w_i CE_i / sum_i w_i, w_i = step_decay^i over steps i = 0..K-1 (K = steps, default
    config.steps_ahead), CE_i the mean over rows r >= i of the cross-entropy of step i's row r
    against the target's distribution for token r+2, both read at `temperature` (1 by default,
    --draft-temperature's for a head trained for sampling there). `generator` is unused (kept for train.py's
    one loss signature). stats: ce (the loss), acc (step 0's argmax == the target's), acc_last
    (the same at step K-1), tau_proxy (1 + the mean run of leading correct steps per committed
    row: the greedy tau at k = K if the target's picks were the data).
    Memory: the logits of a few windows at a time (checkpointed_chunks), made again in the
    backward, so the batch's (Bw, K, T-1, V) logits never exist at once.
    """
    K = head.config.steps_ahead if steps is None else steps
    if not isinstance(K, int) or K < 1:
        raise UserError(f"steps (unrolled draft steps) must be an integer >= 1, got {K!r}")
    Bw, T = windows.shape
    if T < K + 1:
        raise UserError(f"windows of {T} tokens are too short to unroll {K} steps; use windows of >= {K + 1}")
    hidden, last = unrolled_hidden(head, windows, K)  # (Bw, K, T-1, D), (Bw, T, D)
    w = torch.tensor([head.config.step_decay ** i for i in range(K)], dtype=torch.float64)
    rows = torch.arange(T - 1)
    weight = torch.stack([(rows >= i) * wi / (w.sum() * Bw * (T - 1 - i)) for i, wi in enumerate(w)])  # (K, T-1)
    weight = weight.to(windows.device, wide(hidden.dtype))  # row r >= i's share of step i's mean

    def chunk_loss(hidden, last):  # a few windows' share of the loss (checkpointed_chunks)
        with torch.no_grad():
            p = next_token_probs(head.target.logits(last[:, 1:]), temperature)  # (b, T-1, V): for token r+2
        logits = head.logits(hidden)  # (b, K, T-1, V)
        loss = (soft_ce(logits / temperature, p[:, None]) * weight).sum()
        return loss, draftable(logits.detach()).argmax(-1) == p[:, None].argmax(-1)  # (b, K, T-1)

    parts = checkpointed_chunks(chunk_loss, K * (T - 1), hidden, last)
    loss = sum(part for part, _ in parts)
    correct = torch.cat([right for _, right in parts]).transpose(0, 1)  # (K, Bw, T-1)
    runs = torch.stack([correct[i, :, i:T - K + i] for i in range(K)]).long()  # (K, Bw, T-K): row c's chain
    acc_last = correct[-1, :, K - 1:].float().mean()  # step K-1's rows that have a committed row
    return loss, {"ce": loss.detach(), "acc": correct[0].float().mean(), "acc_last": acc_last,
                  "tau_proxy": 1 + runs.cumprod(0).sum(0).float().mean()}
