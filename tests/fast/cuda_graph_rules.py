"""Why inductor would not capture a compiled step as a CUDA graph, found on a CPU (no GPU needed).

On CUDA, torch.compile(mode="reduce-overhead") records each graph once and then replays it, unless
inductor finds a reason not to; then the step's kernels launch one by one, as slow as without the
graph, and only a log line says so (torch 2.13: _inductor/output_code.py, compile_fx.py,
cudagraph_utils.py). The reasons that lie in our code rather than in the GPU, and how each is found:
  - the graph writes an input that has no static address (a parameter, a buffer, or a tensor marked
    with torch._dynamo.mark_static_address): "mutated inputs";
  - an input that is not a tensor: "non-Tensor inputs";
  - an op inductor will not capture (an output shape that depends on data, a boolean-mask
    index_put): "incompatible op";
  - a tensor made on the CPU inside the graph: "cpu device".
The first three are read from the graph inductor would receive: `Recorder` is a torch.compile backend
that runs dynamo and AOTAutograd (the functionalised forward, with its input-mutation and
static-input metadata) and records the facts instead of compiling; the graph then runs as traced.
The last needs a second device: `off_device_ops` runs a step with every weight, buffer and input on
the meta device and lists the ops that touch a tensor anywhere else (a tensor made without
`device=` lands on the CPU).
A replay also copies each input that is not static into the graph's own memory (`copied_bytes`): a
weight or a cache passed that way would be copied at every step. And a static input found at another
address makes the graph tree record the graph again (keeping the old recording), so `calls` holds the
static inputs' addresses at every call. Not a test file.
"""
import contextlib
import copy
import dataclasses

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from tinydiff.fast.compiled import own_frame
from tinydiff.model import KVCache


@dataclasses.dataclass
class GraphFacts:
    """What inductor would check in one compiled graph before capturing it."""
    mutated_not_static: list  # input positions the graph writes that have no static address
    non_tensor_inputs: list  # input positions that hold no tensor
    incompatible: str | None  # the first op CUDA graphs refuse, or None
    copied_bytes: list  # bytes of each input a replay copies in (the non-static ones)
    calls: list = dataclasses.field(default_factory=list)  # per call: (Recorder.story, its static inputs' addresses)

    def refusals(self) -> list:
        """inductor's reasons to run this graph without capturing it (none: it is captured)."""
        return ([f"mutated inputs {self.mutated_not_static}"] if self.mutated_not_static else []) + \
            ([f"non-Tensor inputs {self.non_tensor_inputs}"] if self.non_tensor_inputs else []) + \
            ([f"incompatible op {self.incompatible}"] if self.incompatible else [])


class Recorder:
    """A torch.compile backend (`backend`) that appends each graph's GraphFacts to `graphs`; each call of
    the graph then adds the addresses of its static inputs, labelled with `story` (the caller's to set)."""

    def __init__(self):
        # imported here, not at collection: they import Triton, which tests/kernel_mode.py must import first
        from torch._dynamo.backends.common import aot_autograd
        self.graphs, self.story = [], None
        self.backend = aot_autograd(fw_compiler=self.record)

    def record(self, gm, example_inputs):
        from torch._inductor.utils import _fx_node_is_input_dependent_cudagraph_unsafe as unsafe_with_its_inputs
        from torch._inductor.utils import get_first_incompatible_cudagraph_node
        meta = torch._guards.TracingContext.try_get().fw_metadata  # AOTAutograd's view of the inputs
        static = set(meta.static_input_indices)
        mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata]
        incompatible = get_first_incompatible_cudagraph_node(gm) or next(
            (n for n in gm.graph.nodes if unsafe_with_its_inputs(n)), None)
        facts = GraphFacts(
            mutated_not_static=[i for i in mutated if i not in static],
            non_tensor_inputs=[i for i, x in enumerate(example_inputs) if not isinstance(x, torch.Tensor)],
            incompatible=None if incompatible is None else str(incompatible.target),
            copied_bytes=[x.numel() * x.element_size() for i, x in enumerate(example_inputs)
                          if i not in static and isinstance(x, torch.Tensor)])
        self.graphs.append(facts)
        static_order = sorted(static)

        def run(*args):
            facts.calls.append((self.story, tuple(args[i].data_ptr() for i in static_order)))
            return gm(*args)
        return run

    def compile(self, fn):
        """fn compiled as compiled.compile_step compiles a step (its own frame, the whole graph, fixed
        shapes), but traced by this backend instead of inductor."""
        return torch.compile(own_frame(fn), fullgraph=True, dynamic=False, backend=self.backend)


def reachable_modules(fn) -> list:
    """Every module a step function reaches: through its closure, its bound self and the modules a module
    keeps unregistered (a DFlash drafter's borrowed target)."""
    seen, todo = [], [fn]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.nn.Module):
            if not any(x is m for m in seen):
                seen.append(x)
                todo += list(x.children()) + [v for v in vars(x).values() if isinstance(v, torch.nn.Module)]
        elif callable(x):
            todo += [cell.cell_contents for cell in getattr(x, "__closure__", None) or ()]
            todo.append(getattr(x, "__self__", None))
    return seen


def on_meta(x):
    """x (a tensor, a KVCache, or a list or tuple of them) on the meta device: shapes, no data."""
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, KVCache):
        cache = copy.copy(x)
        cache.k, cache.v = on_meta(x.k), on_meta(x.v)
        return cache
    if isinstance(x, (list, tuple)):
        return type(x)(on_meta(y) for y in x)
    return x


class OffDevice(TorchDispatchMode):
    """Records each op that reads or makes a tensor off the meta device."""

    def __init__(self):
        super().__init__()
        self.ops, self.off = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        off = lambda t: isinstance(t, torch.Tensor) and t.device.type != "meta"  # noqa: E731
        if any(off(t) for t in tree_leaves((args, kwargs))):  # recorded, then moved so that the op runs
            self.off.append(str(func))
            args, kwargs = tree_map(lambda t: t.to("meta") if off(t) else t, (args, kwargs or {}))
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if any(off(t) for t in tree_leaves(out)):
            self.off.append(str(func))
        return out


def off_device_ops(fn, args) -> tuple[list, int]:
    """The ops of fn(*args) that touch a tensor off the device of its inputs and weights (all moved to
    meta for the call), and how many ops ran."""
    with contextlib.ExitStack() as stack:
        for module in reachable_modules(fn):
            own = list(module.named_parameters(recurse=False, remove_duplicate=False)) + \
                list(module.named_buffers(recurse=False, remove_duplicate=False))
            stack.enter_context(_reparametrize_module(module, {name: on_meta(t) for name, t in own}))
        meta_args = on_meta(args)
        with OffDevice() as mode:
            fn(*meta_args)
    return mode.off, mode.ops
