"""Decoding without launch overhead: static-shape forwards, compiled once per shape.

gpt-fast's recipe (generate.py), kept apart from the eager code it speeds up. A decode step of a
13M model is a few hundred tiny kernels; on a GPU its time is Python and launches, not arithmetic.
Three things remove them:
  1. a static KV cache (`StaticCache`): attention always reads all `capacity` rows, and a mask
     built from the position ids (device tensors) hides the rows not yet valid. New keys/values are
     written with `index_copy_` at rows held in a device tensor, so a step's shapes depend only on
     how many tokens it reads, never on how long the sequence is;
  2. `torch.compile(fullgraph=True, dynamic=False)` of that step, once per shape: a graph break is
     an error, not a slow path;
  3. on CUDA, `mode="reduce-overhead"`: the compiled step is captured as a CUDA graph and replayed.
`--compile max-autotune` also times each matrix product as the BLAS call and as inductor's own
kernel and keeps the faster (`inductor_settings`): it matters on a CPU whose BLAS is slow at a few
rows by a wide head (the project's AMD EPYC machines: docs/LOG.md).
`StaticModel` and `StaticDrafter` wrap a model so that every decoding loop of the library runs
unchanged on top of them (the loop, its sampling and its random numbers stay the eager ones):
`speculative_generate(StaticModel(target), StaticModel(draft), ...)`. A loop reads back only what
it already reads (accepted counts and committed tokens); the forwards themselves never wait for
the host. Each wrapper compiles the token counts in `hot` (the steps a method repeats: 1 for AR
decoding, k + 1 for a verify, the block or tree budget); any other count (the prefill, the last
round's shorter verify) runs the same static function eagerly, so the tokens never depend on it.

fused_steps.py goes one step further for `ar` (the step with its draw, or several steps, one graph
call), fused_round.py for speculative rounds, fused_dflash.py and fused_ddtree.py for DFlash's and
DDTree's: the warp, the draws, the acceptance rule (and the tree) inside the graph, one graph call a
round.

Leaves out: batches, the Triton kernels inside compiled steps (inductor fuses the masked
attention itself; `kernels_enabled(False)` while a step runs), and SSD's threaded run-ahead.
"""
import copy
import time
import types

import torch
import torch.nn.functional as F

from tinydiff.checks import UserError
from tinydiff.fast.frequent_vocab import FrequentVocabDraft
from tinydiff.io.cli import COMPILE_MODES
from tinydiff.kernels import kernels_enabled
from tinydiff.model import KVCache


class StaticCache(KVCache):
    """A KVCache whose readers see every row, behind a mask (`past`): its shapes never change.

    `length` (a host int) is the loop's bookkeeping, as in KVCache; crop() and keep() are KVCache's.
    """

    def __init__(self, config, batch_size, device, dtype, static_address=False):
        super().__init__(config, batch_size, device, dtype)
        if static_address:  # CUDA graphs replay fixed addresses: the buffers must never move
            for t in self.k + self.v:
                torch._dynamo.mark_static_address(t)

    def emptied(self) -> "StaticCache":
        """A new cache on these buffers with no valid row (what they hold is hidden, as past any length)."""
        cache = copy.copy(self)  # the same k and v lists, so the same tensors
        cache.length = 0
        return cache

    def write(self, layer: int, rows, k, v):
        """k, v (B, H, T, D) into rows (T,) (a device tensor); returns the whole buffers (B, H, C, D)."""
        self.k[layer].index_copy_(2, rows, k)
        self.v[layer].index_copy_(2, rows, v)
        return self.k[layer], self.v[layer]

    def append(self, layer: int, k, v):
        """KVCache.append at the rows after the valid ones; the whole buffers are returned."""
        rows = torch.arange(self.length, self.length + k.shape[2], device=k.device)
        return self.write(layer, rows, k, v)

    def past(self, new_rows: int):
        """All rows, and the mask (1, 1, 1, C + new_rows) that shows the valid ones and the new rows."""
        C, device = self.capacity, self.k[0].device
        mask = torch.arange(C + new_rows, device=device)
        return self.k, self.v, ((mask < self.length) | (mask >= C)).view(1, 1, 1, -1)


class RowWriter:
    """What model.Attention calls `cache`: its append() writes at fixed rows of a StaticCache."""

    def __init__(self, cache: StaticCache, rows):
        self.cache, self.rows = cache, rows

    def append(self, layer, k, v):
        return self.cache.write(layer, self.rows, k, v)


def static_forward(model, cache: StaticCache, idx, pos, rows, mask, head=None):
    """model's forward for idx (1, T) at position ids pos (T,), its keys/values written into rows (T,).

    mask: bool (T, C) over the cache's rows, or None for causal reading (row j visible to the token
    at position p when j <= p: the rows of a chain are its positions). Returns logits (1, T, V) and
    the residual stream before the first block and after each (L + 1 x (1, T, D)): one graph serves
    every reader of hidden states (DFlash, EAGLE-3 and plain decoding). No host synchronisation.
    head: the rows (N, D) the head scores instead of the tied embedding (FR-Spec's pruned draft):
    logits (1, T, N).
    """
    T = idx.shape[1]
    if mask is None:
        mask = torch.arange(cache.capacity, device=idx.device)[None] <= pos[:, None]  # (T, C)
    cos, sin = (c[pos].view(1, 1, T, -1) for c in (model.rope_cos, model.rope_sin))  # (1, 1, T, D/2)
    x = model.embed(idx)  # (1, T, D)
    hidden = [x]
    writer = RowWriter(cache, rows)
    for i, block in enumerate(model.blocks):
        x = block(x, cos, sin, mask, False, writer, i)
        hidden.append(x)
    logits = F.linear(model.norm(x), model.embed.weight if head is None else head)  # (1, T, V or N)
    return logits, hidden


def own_frame(fn):
    """fn behind a function whose code object is this call's alone.

    Dynamo keeps its compiled graphs (and their guards) per code object. Every StaticModel's step
    is the same lambda, so without this all wrapped models would share one cache: each call would
    test the guards of every other model's graphs, and a recompile would evaluate them against a
    model with another layer count (torch 2.13 then fails with an IndexError in its
    recompile-reason report)."""
    def step(*args):
        return fn(*args)
    return types.FunctionType(step.__code__.replace(), step.__globals__, "step", None, step.__closure__)


def inductor_settings(mode: str, device) -> tuple[dict, dict]:
    """For a decode step compiled in `mode` on `device`: torch.compile's mode, and the inductor config
    in force while a shape compiles (tinydiff.fast.compiled.Compiled patches it around the first call).

    default: inductor's code, matrix products by the BLAS; CUDA graphs on CUDA. max-autotune: each
    matrix product timed once as the BLAS call and as inductor's own kernel, the faster kept. On a
    CPU inductor writes its own (a C++ template) only for weights it may treat as constants, hence
    `freezing` (read when the graph compiles, so a config patch, not torch.compile's options): the
    compiled step keeps the weights it saw, so it serves decoding, never training.
    """
    if mode not in COMPILE_MODES:
        raise UserError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    cuda = torch.device(device).type == "cuda"
    if mode == "default":
        return ({"mode": "reduce-overhead"} if cuda else {}), {}
    if cuda:
        return {"mode": "max-autotune"}, {}  # CUDA graphs included
    return {}, {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def compile_step(fn, device, mode="default"):
    """torch.compile for a decode step: whole graph or an error; CUDA graphs on CUDA."""
    # Past the recompile limit (8 graphs per code object) dynamo would run the rest eagerly, without
    # a word; a step compiles one graph per hot shape, so this only guards a longer `hot`. The config
    # exists once torch._dynamo itself is imported (not at `import torch`): import it here, not at the top.
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(own_frame(fn), fullgraph=True, dynamic=False, **inductor_settings(mode, device)[0])


class Compiled:
    """One step function, compiled per shape for the token counts in `hot`, eager for the rest.

    compile: True (the default mode) or a COMPILE_MODES name; False or None runs every shape eagerly.

    `compile_seconds` sums the first call of each compiled shape (tracing, code generation and
    that call's run), which a benchmark reports apart from decoding. `read_seconds` sums the calls made
    through `read_back`, compiling left out.
    """

    def __init__(self, fn, device, hot, compile=True):
        self.fn, self.device, self.hot = fn, torch.device(device), set(hot)
        mode = "default" if compile is True else compile  # True: the default mode; False or None: eager
        self.compiled = compile_step(fn, device, mode) if mode else None
        self.settings = inductor_settings(mode, device)[1] if mode else {}
        self.seen, self.compile_seconds, self.read_seconds = set(), 0.0, 0.0

    def __call__(self, tokens: int, key, *args):
        if self.compiled is None or tokens not in self.hot:
            return self.fn(*args)
        torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are consumed
        if key in self.seen:
            return self.compiled(*args)
        from torch._inductor import config as inductor_config  # imported when a step first compiles
        start = time.perf_counter()
        with inductor_config.patch(self.settings):
            out = self.compiled(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.seen.add(key)
        self.compile_seconds += time.perf_counter() - start
        return out

    def read_back(self, tokens: int, key, *args) -> list:
        """The call's one tensor as host values, timed from the call to the copy back (on CUDA: the launch or
        replay and the device's work the copy waits for). What a round spends outside it is the host's."""
        start, compiling = time.perf_counter(), self.compile_seconds
        values = self(tokens, key, *args).tolist()
        self.read_seconds += time.perf_counter() - start - (self.compile_seconds - compiling)
        return values


def detach_outputs(out, device):
    """A CUDA graph's outputs live in its memory pool and are overwritten by the next replay."""
    if device.type != "cuda":
        return out
    return tuple(o.clone() if isinstance(o, torch.Tensor) else [h.clone() for h in o] for o in out)


class Wrapped:
    """What StaticModel and StaticDrafter share: everything but the forward and the caches is the
    wrapped module's. `__class__` answers as the module's class, so the loops' checks (isinstance)
    see the model they expect."""

    def __init__(self, module, forward, device, hot, compile):
        self.module = module
        self.step = Compiled(forward, device, hot, compile)
        self.cache_buffers = self.newest_cache = None  # with CUDA graphs: the one set of buffers, the newest cache

    @property
    def __class__(self):
        return type(self.module)

    def __getattr__(self, name):  # only called for what the wrapper lacks
        return getattr(self.module, name)

    @property
    def compile_seconds(self) -> float:
        return self.step.compile_seconds

    def replays_cuda_graphs(self, weight) -> bool:
        return self.step.compiled is not None and weight.is_cuda

    def static_cache(self, config, weight) -> StaticCache:
        """A cache for one story. Where the steps replay CUDA graphs, every story's cache is the same buffers,
        emptied: a graph replays fixed addresses, and inductor's CUDA-graph trees record a graph again (and
        keep the old recording) whenever a static input moves, so new buffers for each story would record
        every graph once a story. One story at a time per wrapper, then: `check_current` refuses a cache
        whose buffers the wrapper has since given to a newer one."""
        if not self.replays_cuda_graphs(weight):
            return StaticCache(config, 1, weight.device, weight.dtype)
        if self.cache_buffers is None:
            self.cache_buffers = StaticCache(config, 1, weight.device, weight.dtype, static_address=True)
        self.newest_cache = self.cache_buffers.emptied()
        return self.newest_cache

    def check_current(self, cache: StaticCache):
        if self.newest_cache is not None and cache is not self.newest_cache and cache.k is self.newest_cache.k:
            raise UserError("this cache's buffers now hold a newer story: a model compiled for CUDA graphs decodes "
                            "one story at a time with one cache; wrap the model once per role (target, draft)")


class StaticModel(Wrapped):
    """A Transformer whose caches are StaticCaches and whose forward is static_forward, compiled
    for the token counts in `hot`. A FrequentVocabDraft keeps its subset head: logits (1, T, N)."""

    def __init__(self, model, hot=(1,), compile=True):
        # A pruned draft's head rows are read from the module at each call: a buffer, so a static input of
        # a CUDA graph (a tensor held in the closure would be an ordinary input, copied in at every replay).
        if isinstance(model, FrequentVocabDraft):
            forward = lambda *a: static_forward(model.draft, *a, head=model.rows)  # noqa: E731
        else:
            forward = lambda *a: static_forward(model, *a)  # noqa: E731
        super().__init__(model, forward, model.embed.weight.device, hot, compile)

    def new_cache(self, batch_size: int = 1) -> StaticCache:
        if batch_size != 1:
            raise UserError("static decoding runs one sequence; pass batch_size 1")
        return self.static_cache(self.module.config, self.module.embed.weight)

    def __call__(self, idx, *, pos=None, mask=None, causal=None, cache=None, hidden_layers=None, head_from=0):
        """Transformer.forward's arguments, for the calls decoding makes: a StaticCache is required."""
        if not isinstance(cache, StaticCache):
            raise UserError("a StaticModel decodes with its own caches: pass cache=model.new_cache(1)")
        self.check_current(cache)
        if mask is None and causal is False:
            raise UserError("a StaticModel reads causally or with an explicit mask")
        T, past, device = idx.shape[1], cache.length, idx.device
        if past + T > cache.capacity:
            raise UserError(f"sequence of {past + T} tokens exceeds the model's context of {cache.capacity}")
        rows = torch.arange(past, past + T, device=device)
        # Fresh tensors: a slice of a longer canvas has its strides, and a new stride is a new graph.
        idx = idx.flatten().clone().view(1, T)  # (1, T), strides (T, 1)
        pos = rows if pos is None else pos.flatten().clone()  # (T,)
        if mask is not None:  # (T, past + T) -> (T, C): rows past the sequence stay hidden
            full = torch.zeros(T, cache.capacity, dtype=torch.bool, device=device)
            full[:, :past + T] = mask
            mask = full
        with kernels_enabled(False):
            out = self.step(T, (T, mask is None), cache, idx, pos, rows, mask)
        logits, hidden = out
        wanted = [] if hidden_layers is None else [hidden[i] for i in hidden_layers]
        logits, wanted = detach_outputs((logits, wanted), device)  # copies only what the caller reads
        cache.advance(T)
        logits = logits[:, head_from:]
        return logits if hidden_layers is None else (logits, wanted)


class StaticDrafter(Wrapped):
    """A DFlash drafter (tinydiff/dflash.py) whose context cache is a StaticCache: draft_block reads
    all its rows behind a mask (StaticCache.past), so the drafting forward has one shape per block
    size, compiled for the sizes in `hot`. extend() stays the drafter's own (eager)."""

    def __init__(self, drafter, hot=None, compile=True):
        hot = (drafter.config.block_size,) if hot is None else hot
        super().__init__(drafter, drafter.forward, drafter.fc.weight.device, hot, compile)

    def new_cache(self, batch_size: int = 1) -> StaticCache:
        if batch_size != 1:
            raise UserError("static decoding runs one sequence; pass batch_size 1")
        return self.static_cache(self.module.layer_config, self.module.fc.weight)

    def __call__(self, block, pos, ctx_k, ctx_v, mask=None):
        T = block.shape[1]
        with kernels_enabled(False):
            out = self.step(T, T, block, pos, ctx_k, ctx_v, mask)
        return detach_outputs((out,), block.device)[0]


def hot_steps(method: str, *, k: int = 4, block_size: int = 16, budget: int | None = None,
              block_length: int = 32, shift: int = 0) -> dict:
    """What each model of a method's loop reads again and again, by role: the token counts to compile.

    spec: the target verifies k + 1 tokens, the draft reads 1 (2 after a full acceptance); dflash:
    a block of block_size both ways; ddtree: the root and `budget` nodes; eagle3: the chain's k + 1
    or the tree's budget + 1 (its head stays eager); diffusion-cached: one block (with the finished
    token before it for a shifted model), and the first step of a block, which reads the one before.
    """
    hot = {"ar": lambda: {"target": (1,)},
           "spec": lambda: {"target": (k + 1,), "draft": (1, 2)},
           "dflash": lambda: {"target": (block_size,), "drafter": (block_size,)},
           "ddtree": lambda: {"target": (budget + 1,), "drafter": (block_size,)},
           "eagle3": lambda: {"target": (k + 1 if budget is None else budget + 1,)},
           "diffusion-cached": lambda: {"target": (block_length + shift, 2 * block_length + shift)}}
    if method not in hot:
        raise UserError(f"compiled decoding covers {', '.join(hot)}, not {method}")
    return hot[method]()


def wrap(models: dict, hot: dict, compile: bool | str = True) -> dict:
    """models (role -> model) with each role in hot wrapped for static decoding (a DFlash drafter
    as StaticDrafter, any Transformer as StaticModel); the other roles as they are."""
    def static(role, model):
        return (StaticDrafter if role == "drafter" else StaticModel)(model, hot[role], compile)
    return {role: static(role, model) if role in hot else model for role, model in models.items()}


def compile_seconds(models) -> float:
    """Seconds the compiled wrappers among `models` (Wrapped, the fused rounds) spent compiling (tracing, code
    generation, first run); a plain model (or None) spent none."""
    return sum(getattr(m, "compile_seconds", 0.0) for m in models)
