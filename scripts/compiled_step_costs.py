"""Where one compiled AR decoding step's time goes: the captured graph, the wrapper, the sampling.

    python scripts/compiled_step_costs.py [--ckpt CKPT | --preset tiny] [--calls 200] [--device cuda]

Times, per token, each layer of what `python -m tinydiff.bench --compile` runs for `ar`, each
averaged over --calls back-to-back calls at a fixed cache length (the cache is cropped back after
each call, so every call has the same shape):
  replay   the compiled Transformer.step alone (on CUDA: the CUDA-graph replay), host wall time;
  gpu      the same calls measured by CUDA events: the device's own time (CUDA only);
  call     the compiled model's forward around it (the checks, rows, mask, copies out of the graph's pool);
  token    call + next_token_probs + sample + int(): one step of ar_generate's loop;
  fused    fused_steps.py's one-token call (forward, warp and draw one graph) + tolist(): a `--compile`
           ar token;
  steps8   its call of 8 steps + tolist(), per token: an ar-steps8 token;
  eager    the same token with the plain model (the readable reference the compiled step replaces).
The differences say what to cut next: token - call is the sampling, call - replay the wrapper,
fused - steps8 what a graph call costs beyond its kernels, over 7/8.
An untrained model of the preset has the same costs as a trained one.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tinydiff.bench.measure import device_us, per_call_us
from tinydiff.fast.compiled import compiled
from tinydiff.fast.fused_steps import FusedSteps
from tinydiff.io.checkpoint import load_model
from tinydiff.kernels import kernels_enabled
from tinydiff.model import Transformer, preset
from tinydiff.sampling import next_token_probs, sample


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="an ar checkpoint (default: an untrained model of --preset)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=16, help="cache length every timed call sees")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    if args.ckpt:
        model = load_model(args.ckpt, device, kinds=("ar",))[0]
    else:
        torch.manual_seed(0)
        model = Transformer(preset(args.preset)).to(device)
    model.eval()
    static = compiled(model, hot=(1,))
    prompt = torch.arange(args.prompt_tokens, device=device)[None]  # (1, P)
    x = prompt[0, -1:].clone().view(1, 1)  # (1, 1): the token each call reads
    rows = torch.arange(args.prompt_tokens - 1, args.prompt_tokens, device=device)

    with torch.no_grad():
        cache = static.new_cache(1)
        static(prompt[:, :-1], cache=cache, causal=True)  # the prefill, eager (not a hot shape)
        length = cache.length

        def replay():  # what the compiled step runs inside, kernels off as there: the graph call() compiled
            torch.compiler.cudagraph_mark_step_begin()
            with kernels_enabled(False):
                return static.compiled_step.compiled(x.clone(), None, None, cache, rows.clone(), False, None, 0, None)

        def call():
            out = static(x, cache=cache, causal=True)
            cache.crop(length)
            return out

        def token(model_, cache_):
            logits = model_(x, cache=cache_, causal=True)[:, -1]  # (1, V)
            cache_.crop(length)
            return int(sample(next_token_probs(logits, 0.0, None, None)))

        greedy, u = (0.0, None, None), torch.zeros(8, 1, 1, dtype=torch.float64, device=device)
        fused, steps = FusedSteps(model, 1), FusedSteps(model, 8)

        def fused_token():  # as multi_step_generate's loop: a new (1, 1) token and row tensor a call
            with kernels_enabled(False):
                return fused.call(1, greedy, cache, x.clone(), rows.clone(), u[:1], greedy).tolist()

        def steps_call():  # as multi_step_generate's loop; the 8 rows it writes lie past the kept length
            with kernels_enabled(False):
                return steps.call(8, greedy, cache, x.clone(), rows.clone(), u, greedy).tolist()

        eager_cache = model.new_cache(1)
        model(prompt[:, :-1], cache=eager_cache, causal=True)
        call()  # compiles the hot shapes once, outside the timing
        fused_token()
        steps_call()
        rows_out = {"replay": per_call_us(replay, args.calls, device)}
        if device.type == "cuda":
            rows_out["gpu"] = device_us(replay, args.calls)
        rows_out["call"] = per_call_us(call, args.calls, device)
        rows_out["token"] = per_call_us(lambda: token(static, cache), args.calls, device)
        rows_out["fused"] = per_call_us(fused_token, args.calls, device)
        rows_out["steps8"] = per_call_us(steps_call, args.calls, device) / 8
        rows_out["eager"] = per_call_us(lambda: token(model, eager_cache), args.calls, device)
    name = args.ckpt or f"untrained {args.preset}"
    print(f"{name} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{args.calls} calls at cache length {length}")
    for key, us in rows_out.items():
        print(f"{key:<8}{us:9.1f} us  ({1e6 / us:8.0f} per second)")
    from torch._dynamo.utils import counters
    # call's 1-token forward, fused's step and steps8's 8 steps; one more means a row timed another graph
    print(f"graphs compiled: {counters['stats']['unique_graphs']} (3 expected)")
    if device.type == "cuda":  # a graph inductor left uncaptured runs its kernels one launch at a time
        print(f"graphs that skipped CUDA graphs: {counters['inductor']['cudagraph_skips']} (TORCH_LOGS=cudagraphs: why)")


if __name__ == "__main__":
    main()
