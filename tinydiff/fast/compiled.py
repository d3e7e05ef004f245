"""Decoding without launch overhead: the library's own loops, their model steps compiled (gpt-fast's recipe).

A decode step of a 13M model is a few hundred tiny kernels; on a GPU its time is Python and launches,
not arithmetic. model.py's KVCache is static (buffers of the whole context, written at row tensors, read
behind a mask), so a step's shapes depend only on how many tokens it reads. So compiling is this:

    target = compiled(target, hot=(k + 1,))        # the verify's k + 1 tokens
    draft = compiled(draft, hot=(1, 2))            # one token, or two after a full acceptance
    speculative_generate(target, draft, ...)       # the loop the lessons teach, unchanged

`compiled` returns a shallow copy of the model (the same weights) whose `step` (Transformer.step, or a
DFlash drafter's forward) is compiled once per token count in `hot` with torch.compile(fullgraph=True,
dynamic=False), CUDA graphs on CUDA (mode="reduce-overhead"). Any other count (a prefill, a story's last
short verify) runs the same step eagerly, so the tokens never depend on which ran. On CUDA a graph
replays fixed addresses: its outputs are cloned (the next replay overwrites them) and every cache the
copy makes is one set of buffers, marked static and emptied for each story, so a graph is recorded once.
`--compile max-autotune` also times each matrix product as the BLAS call and as inductor's own kernel
and keeps the faster (`inductor_settings`): it pays on a CPU whose BLAS is slow at a few rows.
Where a whole round as one graph measures faster than its compiled steps, fused_round.py, fused_steps.py
and fused_dflash.py hold that round (dev/LOG.md says which and by how much).
Leaves out: batches, the Triton kernels inside compiled steps, SSD's threaded run-ahead.
"""
import copy
import time
import types

import torch
import torch.nn.functional as F

from tinydiff.checks import UserError
from tinydiff.dflash import DFlashDrafter
from tinydiff.io.cli import COMPILE_MODES
from tinydiff.kernels import kernels_enabled


def own_frame(fn):
    """fn behind a function whose code object is this call's alone. Dynamo keeps its graphs (and their
    guards) per code object; every model's `step` is one method, so without this all compiled models would
    share one cache and each call would test every other model's guards."""
    def step(*args, **kwargs):
        return fn(*args, **kwargs)
    return types.FunctionType(step.__code__.replace(), step.__globals__, "step", None, step.__closure__)


def inductor_settings(mode: str, device) -> tuple[dict, dict]:
    """torch.compile's options for a step compiled in `mode` on `device`, and the inductor config in force
    while a shape compiles. default: inductor's code, matrix products by the BLAS; CUDA graphs on CUDA.
    max-autotune: each matrix product timed as the BLAS call and as inductor's own kernel, the faster kept;
    on a CPU inductor writes its own only for weights it may treat as constants, hence `freezing` (the
    step keeps the weights it saw: decoding, never training)."""
    if mode not in COMPILE_MODES:
        raise UserError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    cuda = torch.device(device).type == "cuda"
    if mode == "default":
        return ({"mode": "reduce-overhead"} if cuda else {}), {}
    if cuda:
        return {"mode": "max-autotune"}, {}  # CUDA graphs included
    return {}, {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def compile_step(fn, device, mode="default"):
    """torch.compile for a decode step: the whole graph or an error; CUDA graphs on CUDA."""
    # Past the recompile limit (8 graphs per code object) dynamo would run the rest eagerly, without a word.
    # Its config exists once torch._dynamo is imported (not at `import torch`): so here, not at the top.
    import torch._dynamo
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(own_frame(fn), fullgraph=True, dynamic=False, **inductor_settings(mode, device)[0])


def detach_outputs(out, device):
    """A CUDA graph's outputs live in its memory pool and are overwritten by the next replay: clone them."""
    if device.type != "cuda":
        return out
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(detach_outputs(o, device) if isinstance(o, (torch.Tensor, list, tuple)) else o for o in out)


class Compiled:
    """A step function, compiled per shape for the token counts in `hot`, eager for the rest.

    compile: True (the default mode) or a COMPILE_MODES name; False or None runs every shape eagerly.
    `compile_seconds` sums the first call of each compiled shape (tracing, code generation and that call's
    run), which a benchmark reports apart from decoding; `read_seconds` the calls made through `read_back`.
    """

    def __init__(self, fn, device, hot, compile=True):
        self.fn, self.device, self.hot = fn, torch.device(device), set(hot)
        mode = "default" if compile is True else compile
        self.compiled = compile_step(fn, device, mode) if mode else None
        self.settings = inductor_settings(mode, device)[1] if mode else {}
        self.seen, self.compile_seconds, self.read_seconds = set(), 0.0, 0.0

    def __call__(self, tokens: int, key, *args, **kwargs):
        if self.compiled is None or tokens not in self.hot:
            return self.fn(*args, **kwargs)
        torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are consumed
        with kernels_enabled(False):  # inductor writes the attention itself
            if key in self.seen:
                return detach_outputs(self.compiled(*args, **kwargs), self.device)
            from torch._inductor import config as inductor_config  # imported when a step first compiles
            start = time.perf_counter()
            with inductor_config.patch(self.settings):
                out = detach_outputs(self.compiled(*args, **kwargs), self.device)
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


def replays_cuda_graphs(step: Compiled, weight) -> bool:
    """Whether a compiled step replays CUDA graphs: compiled, on a CUDA device."""
    return step.compiled is not None and weight.is_cuda


def compiled(model, hot, compile=True):
    """A shallow copy of `model` (a Transformer or a DFlash drafter: the same weights) whose step is compiled
    for the token counts in `hot` (see the module docstring); compile=False: the copy, nothing compiled."""
    drafter = isinstance(model, DFlashDrafter)
    weight = model.fc.weight if drafter else model.embed.weight
    clone = copy.copy(model)  # its own __dict__: a `step` and caches of its own, the modules shared
    step = Compiled(model.forward if drafter else model.step, weight.device, hot, compile)
    clone.compiled_step, clone.cache_buffers, newest = step, None, [None]
    if replays_cuda_graphs(step, weight):  # CUDA graphs: every cache the same buffers, at fixed addresses
        import torch._dynamo
        clone.cache_buffers = buffers = model.new_cache(1)
        for t in buffers.k + buffers.v:
            torch._dynamo.mark_static_address(t)

        def new_cache(batch_size: int = 1):
            if batch_size != 1:
                raise UserError("a model compiled for CUDA graphs decodes one sequence; pass batch_size 1")
            newest[0] = copy.copy(buffers)  # a cache of its own on the same tensors, empty: junk past 0 is hidden
            newest[0].length = 0
            return newest[0]
        clone.new_cache = new_cache
    if drafter:  # forward(block (1, B), pos, ctx_k, ctx_v, mask)
        clone.forward = lambda block, *args: step(block.shape[1], block.shape[1], block, *args)
        return clone

    def compiled_step(idx, pos, mask, cache, rows, is_causal, hidden_layers=None, head_from=0):
        if cache is not None and cache.k is getattr(clone.cache_buffers, "k", None) and cache is not newest[0]:
            raise UserError("this cache's buffers now hold a newer story: a model compiled for CUDA graphs decodes "
                            "one story at a time with one cache; compile the model once per role (target, draft)")
        key = (tuple(idx.shape), pos is None, mask is None, tuple(hidden_layers or ()), head_from)
        idx = idx.flatten().clone().view(idx.shape)  # a slice of a longer canvas has its strides: a new graph
        return step(idx.shape[1], key, idx, pos, mask, cache, rows, is_causal, hidden_layers, head_from)
    clone.step = compiled_step
    return clone


def hot_steps(method: str, *, k: int = 4, block_size: int = 16, budget: int | None = None, block_length: int = 32,
              shift: int = 0) -> dict:
    """What each model of a method's loop reads again and again, by role: the token counts to compile.

    spec: the target verifies k + 1 tokens, the draft reads 1 (2 after a full acceptance); dflash: a block
    of block_size both ways; ddtree: the root and `budget` nodes; eagle3: the chain's k + 1 or the tree's
    budget + 1 (the head stays eager); diffusion-cached: one block (with the finished token before it for a
    shifted model), and the first step of a block, which reads the one before.
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


def compile_all(models: dict, hot: dict, compile=True) -> dict:
    """models (role -> model) with each role in hot compiled (`compiled`); the other roles as they are."""
    return {role: compiled(model, hot[role], compile) if role in hot else model for role, model in models.items()}


def compile_seconds(models) -> float:
    """Seconds the compiled models among `models` (and the fused rounds) spent compiling (tracing, code
    generation, first run); a plain model (or None) spent none."""
    return sum(getattr(getattr(m, "compiled_step", m), "compile_seconds", 0.0) for m in models)


def forward_at(model, cache, idx, pos, rows, mask=None, head=None):
    """A Transformer's step at explicit positions pos (T,) and cache rows (T,), reading nothing back: logits
    (1, T, V) and the residual stream before the first block and after each (L + 1 x (1, T, D)), as the
    one-graph rounds read them. mask: (T, C) over the cache's rows, None: causal. head: rows (N, D) scored
    instead of the tied embedding (FR-Spec's pruned draft): logits (1, T, N)."""
    layers = list(range(model.config.n_layer + 1))
    if head is None:
        return model.step(idx, pos, mask, cache, rows, False, layers)
    _, hidden = model.step(idx, pos, mask, cache, rows, False, layers, idx.shape[1])
    return F.linear(model.norm(hidden[-1]), head), hidden
