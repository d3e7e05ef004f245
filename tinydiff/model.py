"""One Transformer for every model in tinydiff: AR target and draft, diffusion LM, drafters.

A decoder stack in the llama style: RMSNorm before each sublayer, rotary position embeddings
(RoPE), SwiGLU feed-forward, no biases, the LM head tied to the token embedding, whose rows are padded
to a multiple of 64 (nanoGPT's 50,304) with zero rows whose logits are cut (`tied_head`).
Attention is one of three kinds, chosen per call:
  - causal (the AR models),
  - bidirectional (the masked-diffusion LM: every position sees every position),
  - an explicit boolean mask with explicit position ids, for block-causal and tree attention
    (without gradients, where Triton runs: the flash kernel of tinydiff/kernels/masked_attention.py).
A `KVCache` holds past keys/values for incremental decoding in buffers of the whole context (gpt-fast's static cache,
so a compiled step keeps its shapes), with `crop(n)` and `keep(rows)` to roll back or compact after speculative
verification. `forward` does the host's part (checks, the rows a call writes, the cache's length) around `step`, the
arithmetic. `hidden_layers=` returns the residual stream after chosen blocks (0 = the embeddings, i = after block i),
which DFlash and EAGLE read.
Leaves out: dropout (small models on small data, short runs), GQA, sliding windows.
Follows nanoGPT's model.py and llama2.c's model.py in structure.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff import kernels
from tinydiff.checks import SIZE, Rule, UserError, check_fields
from tinydiff.tokenizer import VOCAB_SIZE


@dataclass
class ModelConfig:
    vocab_size: int = VOCAB_SIZE  # GPT-2's 50,257 ids + MASK
    context: int = 256            # longest sequence (RoPE table and KV cache size)
    n_layer: int = 8              # Transformer blocks
    n_head: int = 6               # attention heads; d_model must divide by it
    d_model: int = 192            # residual stream width
    d_ff: int = 512               # SwiGLU hidden width
    causal: bool = True           # default attention when no mask is given
    shift: bool = False           # diffusion only: output i predicts token i+1 (Dream's shift, kept from an AR start)
    noise_block: int = 0          # diffusion only: trained with a noise level per N-token block (diffusion.py)
    rope_base: float = 10000.0    # RoPE frequency base
    norm_eps: float = 1e-5        # RMSNorm epsilon

    def __post_init__(self):  # a config from a checkpoint is checked before any weight is allocated
        check_fields(self, RULES, "model config")


RULES = {"vocab_size": SIZE, "context": SIZE, "n_layer": Rule(integer=True, lo=1, hi=1024),
         "n_head": Rule(integer=True, lo=1, hi=1024), "d_model": SIZE, "d_ff": SIZE, "causal": bool, "shift": bool,
         "noise_block": Rule(integer=True, lo=0, hi=2**20), "rope_base": Rule(above=0, hi=1e12),
         "norm_eps": Rule(above=0, hi=1)}


PRESETS = {
    # ~13.2M parameters, 9.65M of them the tied 50,258-row embedding.
    "13m": ModelConfig(n_layer=8, n_head=6, d_model=192, d_ff=512),
    # Small enough to train to readable stories on 2 CPU cores in about ten minutes: the tied
    # 50,258 x d embedding/head dominates the cost, so width is the thing to keep small.
    "tiny": ModelConfig(n_layer=4, n_head=4, d_model=128, d_ff=384),
    # The speculative-decoding draft: same tokenizer and context, a fraction of the layers.
    "draft": ModelConfig(n_layer=2, n_head=2, d_model=64, d_ff=192),
}


def padded_vocab(vocab_size: int) -> int:
    """The embedding's rows: the vocabulary rounded up to a multiple of 64 (50,258 -> 50,304), tiled evenly."""
    return -(-vocab_size // 64) * 64


def tied_head(x, weight, vocab_size: int):
    """Logits (..., vocab_size) of x (..., D) on a tied embedding (padded_vocab rows, D): every model's logits are
    made here, the padding's columns cut, so no method samples, scores, counts or drafts them."""
    return F.linear(x, weight)[..., :vocab_size]


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name].__dict__, **overrides})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Normalise in float32 (or wider) so bf16 autocast does not lose the small mean square.
        x32 = x.to(wide(x.dtype))
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_table(context: int, head_dim: int, base: float, dtype=torch.float32):
    """cos, sin of shape (context, head_dim // 2) for rotating pairs (x[2i], x[2i+1]), computed in
    dtype (float64: the tests' exact paths, where float32's angles would be the largest rounding)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)
    angles = torch.outer(torch.arange(context, dtype=dtype), inv_freq)
    return angles.cos(), angles.sin()


def wide(dtype):
    """float32 for half precisions, else the dtype itself: float64 stays float64 (the tests' exact paths)."""
    return torch.promote_types(dtype, torch.float32)


def apply_rope(x, cos, sin):
    """x (B, H, T, D) rotated by per-position angles; cos/sin (B or 1, 1, T, D/2)."""
    x1, x2 = x.to(wide(x.dtype)).unflatten(-1, (-1, 2)).unbind(-1)  # (B, H, T, D/2) each
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def heads(y, n_head: int, cos=None, sin=None):
    """A projection y (B, T, D) as n_head heads (B, H, T, D/H), rotated by RoPE when given cos, sin."""
    B, T, _ = y.shape
    y = y.view(B, T, n_head, -1).transpose(1, 2)  # (B, H, T, D/H)
    return y if cos is None else apply_rope(y, cos, sin)


def gpt2_init_(module: nn.Module, n_layer: int):
    """GPT-2's init, in place: every Linear and Embedding weight N(0, 0.02), and the residual writes (attention's
    wo, the feed-forward's down) N(0, 0.02 / sqrt(2 * n_layer)), so the stream's variance holds over depth."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
    for name, p in module.named_parameters():
        if name.endswith(("wo.weight", "down.weight")):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))


class KVCache:
    """Keys and values of the positions seen so far, in buffers as long as the model's context.

    gpt-fast's static cache: a forward writes its T new rows in place, at row indices held in a tensor (`rows`), and
    attention reads every row behind a mask that shows the valid ones. So a step's shapes depend only on T, never
    on how long the sequence is, and compiling it takes a few lines (tinydiff/fast/compiled.py). `length` counts
    the valid rows; it is host bookkeeping, read only outside a step. Speculative decoding writes drafts and rolls
    back: `crop(n)` keeps the first n rows, `keep(rows)` moves the chosen rows (in order) to the front (DDTree
    keeps a tree's accepted path so). What lies past `length` is junk no mask shows; the next write replaces it.
    """

    def __init__(self, config: ModelConfig, batch_size: int, device, dtype=torch.float32):
        # dtype: the weights' (float32; float64 in the tests that compare two paths exactly)
        shape = (batch_size, config.n_head, config.context, config.d_model // config.n_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def rows(self, T: int):
        """The rows (T,) the next T tokens are written to: length, length + 1, ..."""
        return torch.arange(self.length, self.length + T, device=self.k[0].device)

    def write(self, layer: int, rows, k, v):
        """k, v (B, H, T, D) into rows (T,); returns the whole buffers (B, H, capacity, D)."""
        self.k[layer].index_copy_(2, rows, k)
        self.v[layer].index_copy_(2, rows, v)
        return self.k[layer], self.v[layer]

    def advance(self, n: int):
        self.length += n

    def past(self, new_rows: int):
        """What new_rows rows that are not written here (a drafter's block) read before their own keys: every
        row of every layer, and the mask (1, capacity + new_rows) that shows the valid rows and the new ones."""
        col = torch.arange(self.capacity + new_rows, device=self.k[0].device)
        return self.k, self.v, ((col < self.length) | (col >= self.capacity))[None]

    def crop(self, n: int):
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}) outside the cache's {self.length} valid rows")
        self.length = n

    def keep(self, rows):
        """Keep only `rows` (1-D indices into the valid rows, in the order given)."""
        rows = [int(r) for r in rows]  # checked on the host: a check of a device tensor waits for the device
        if rows and (min(rows) < 0 or max(rows) >= self.length):
            raise ValueError(f"keep(): row indices must lie in [0, {self.length})")
        n, rows = len(rows), torch.tensor(rows, device=self.k[0].device, dtype=torch.long)
        for cache in (self.k, self.v):
            for t in cache:
                t[:, :, :n] = t[:, :, rows].clone()  # clone: source and target rows overlap
        self.length = n


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_head = config.n_head
        self.wq = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wk = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wv = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=False)

    def project(self, x, cos, sin):
        """q, k, v (B, H, T, D/H) of x (B, T, D), RoPE applied to q and k."""
        q = heads(self.wq(x), self.n_head, cos, sin)
        k = heads(self.wk(x), self.n_head, cos, sin)
        return q, k, heads(self.wv(x), self.n_head)

    def forward(self, x, cos, sin, mask, is_causal, cache, rows, layer):
        B, T, D = x.shape
        q, k, v = self.project(x, cos, sin)  # (B, H, T, D/H)
        if cache is not None:
            k, v = cache.write(layer, rows, k, v)  # (B, H, C, D/H): every row; the mask shows the valid ones
        y = kernels.attention(q, k, v, mask, is_causal)  # (B, H, T, D/H): torch's, or the masked flash kernel
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.up = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, x, cos, sin, mask, is_causal, cache, rows, layer):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, is_causal, cache, rows, layer)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        check_heads(config.d_model, config.n_head)
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        cos, sin = rope_table(config.context, config.d_model // config.n_head, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        gpt2_init_(self, config.n_layer)
        with torch.no_grad():  # padded after the init, so the random draws are as without: zero rows, never read
            pad = padded_vocab(config.vocab_size) - config.vocab_size
            self.embed = nn.Embedding.from_pretrained(F.pad(self.embed.weight, (0, 0, 0, pad)), freeze=False)

    def num_params(self, embedding: bool = True) -> int:
        """Parameters, the embedding's padding rows (zeros, never read) left out."""
        V, D = self.config.vocab_size, self.config.d_model
        n = sum(p.numel() for p in self.parameters()) - (self.embed.weight.shape[0] - V) * D
        return n if embedding else n - V * D

    def new_cache(self, batch_size: int = 1, device=None, dtype=None) -> KVCache:
        weight = self.embed.weight
        return KVCache(self.config, batch_size, device or weight.device, dtype or weight.dtype)

    def forward(self, idx, *, pos=None, mask=None, causal=None, cache=None, hidden_layers=None, head_from=0):
        """Logits (B, T, V) for token ids idx (B, T).

        pos: position ids (T,) or (B, T); default the rows they are written to (cache.length + arange(T)), or
            arange(T). Given, without a cache, T may pass the context (block diffusion reads a window twice).
        mask: bool (T, S) or (B, T, S), True = may attend, S = cached rows + T. Overrides `causal`.
        causal: without a mask, causal (True) or bidirectional (False); default config.causal.
        cache: a KVCache; the new keys/values are written after its valid rows and its length advanced by T.
        hidden_layers: if given, also return [residual stream after block i for i in hidden_layers].
        head_from: logits for positions head_from.. only, (B, T - head_from, V): the head is most of a small
            model's cost (block diffusion scores the second half of what it reads; T: hidden states only).
        """
        T = idx.shape[1]
        past = cache.length if cache is not None else 0
        if (cache is not None or pos is None) and past + T > self.config.context:  # explicit pos: any length
            raise UserError(f"sequence of {past + T} tokens exceeds the model's context of {self.config.context}")
        if pos is not None and (pos.min() < 0 or pos.max() >= self.config.context):
            raise UserError(f"position ids must lie in [0, {self.config.context}), the model's context")
        causal = self.config.causal if causal is None else causal
        if mask is not None and mask.shape[-2:] != (T, past + T):
            raise ValueError(f"mask must end in shape ({T}, {past + T}), got {tuple(mask.shape)}")
        rows = None
        if cache is not None:
            rows = cache.rows(T)
            if mask is None and not causal:  # every valid row and every new one
                mask = torch.ones(T, past + T, dtype=torch.bool, device=idx.device)
            if mask is not None:  # over all the cache's rows: those past the new ones stay hidden
                mask = F.pad(mask, (0, cache.capacity - past - T), value=False)
        is_causal = causal and mask is None and cache is None
        out = self.step(idx, pos, mask, cache, rows, is_causal, hidden_layers, head_from)
        if cache is not None:
            cache.advance(T)
        return out

    def step(self, idx, pos, mask, cache, rows, is_causal, hidden_layers=None, head_from=0):
        """The forward's arithmetic, on tensors only, never the cache's host `length`: what fast/compiled.py
        compiles. With a cache and no mask it reads causally: the token written at row r sees rows 0..r (rows
        are positions in a chain). mask: (T, C) or (B, T, C) over the cache's rows (C = capacity), or (T, T)
        without a cache; is_causal: no mask, no cache, causal."""
        T = idx.shape[1]
        if pos is None:
            pos = rows if rows is not None else torch.arange(T, device=idx.device)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, D/2) or (B, T, D/2)
        cos, sin = (c.unsqueeze(-3) if c.dim() == 3 else c.view(1, 1, T, -1) for c in (cos, sin))
        if cache is not None and mask is None:
            mask = torch.arange(cache.capacity, device=idx.device) <= rows[:, None]  # (T, C)
        elif mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(-3)  # (B, 1, T, S): shared by heads
        x = self.embed(idx)  # (B, T, D)
        taps = set(hidden_layers or ())
        hidden = {0: x} if 0 in taps else {}
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask, is_causal, cache, rows, i)
            if i + 1 in taps:
                hidden[i + 1] = x
        logits = self.logits(x[:, head_from:])  # (B, T - head_from, V)
        return logits if hidden_layers is None else (logits, [hidden[i] for i in hidden_layers])

    def logits(self, x):
        """The tied head on residual streams x (..., D) after the last block: logits (..., V)."""
        return tied_head(self.norm(x), self.embed.weight, self.config.vocab_size)


def check_heads(d_model: int, n_head: int):  # RoPE rotates each head's dimensions in pairs
    if d_model % n_head or (d_model // n_head) % 2:
        raise UserError(f"d_model {d_model} must split into {n_head} heads of even size")
