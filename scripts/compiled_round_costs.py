"""Where one fused speculative round's time goes, against a compiled `ar` token.

    python scripts/compiled_round_costs.py [--ckpt CKPT | --preset tiny] [--drafter CKPT] [--calls 100] [--device cuda]

The bench's fused rows spec-k4-fused and dflash-b16-fused run each round as one compiled graph
(fused_round.py, fused_dflash.py; the plain `--compile` rows compile the eager loops' steps instead). For each, per round, averaged over --calls
back-to-back rounds after the same prompt (the caches cropped back after each, so every round has
the same shapes and rows):
  replay  the round's graph alone (on CUDA: the CUDA-graph replay), host wall time;
  gpu     the same calls measured by CUDA events: the device's own time (CUDA only);
  read    the call and its read-back: the bench's `graph` part of a round;
  round   run_round: the draws, the inputs, the read-back, the caches' lengths (the bench's round but
          the loop's commit and counting).
`ar` is one `--compile` ar token: what a story of multi_step_generate (fused_steps.py, one token a
graph) costs per token beyond a shorter story's, prompt and warm-up left out. "round / ar" is a round in
compiled ar tokens: a row that commits tau tokens a round runs at tau / that times compiled `ar` (the
issue's 3x at the drafters' tau of about 5-6 needs rounds of about 2 ar tokens at most). Untrained
models cost what trained ones do: a round's graph has fixed shapes, whatever it accepts.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tinydiff.bench.measure import device_us, per_call_us
from tinydiff.dflash import DFlashConfig, DFlashDrafter, start_decoding
from tinydiff.fast.fused_dflash import FusedDFlash
from tinydiff.fast.fused_round import fused_speculation, prefill
from tinydiff.fast.fused_steps import FusedSteps, multi_step_generate
from tinydiff.io.checkpoint import drafter_from, load_checkpoint, load_model
from tinydiff.kernels import kernels_enabled
from tinydiff.model import Transformer, preset

GREEDY = (0.0, None, None)  # the bench's --compile rows decode greedily (a round at T > 0 is another graph)


class Recorded:
    """A fused loop's compiled round that keeps the arguments of its last read_back, to replay them."""

    def __init__(self, step):
        self.step, self.args = step, None

    def read_back(self, *args):
        self.args = args
        return self.step.read_back(*args)

    def __getattr__(self, name):
        return getattr(self.step, name)


def rounds(target, draft, drafter, prompt: list) -> dict:
    """name -> (the fused loop, its caches after the prompt, run_round for them after the prompt)."""
    seq, found = list(prompt), {}
    spec = fused_speculation(target, draft, 4)
    caches = spec.target.new_cache(1), spec.draft.new_cache(1)
    for model, cache in zip((spec.target, spec.draft), caches):
        prefill(model, cache, prompt[:-1])
    found["spec-k4"] = spec, caches, lambda t, d: spec.run_round(t, d, seq, GREEDY, None, 4)
    dflash = FusedDFlash(target, drafter)
    caches = start_decoding(dflash.target, dflash.drafter, prompt, 64, dflash.block_size, GREEDY)[2:4]
    found[f"dflash-b{dflash.block_size}"] = (dflash, caches, lambda t, d: dflash.run_round(
        t, d, seq, "match", GREEDY, None, dflash.block_size - 1))
    return found


def round_costs(fused, caches, run_round, calls: int, device) -> dict:
    """replay, gpu, read and round microseconds for one fused loop (see the module docstring)."""
    lengths = [cache.length for cache in caches]
    fused.round = Recorded(fused.round)

    def crop():
        for cache, length in zip(caches, lengths):
            cache.crop(length)

    def whole_round():
        run_round(*caches)
        crop()

    whole_round()  # compiles the round's graph, outside the timing; records its arguments
    args = fused.round.args

    def replay():
        with kernels_enabled(False):
            return fused.round.step(*args)

    def read():
        with kernels_enabled(False):
            return fused.round.step.read_back(*args)

    costs = {"replay": per_call_us(replay, calls, device)}
    if device.type == "cuda":
        costs["gpu"] = device_us(replay, calls)
    costs["read"] = per_call_us(read, calls, device)
    costs["round"] = per_call_us(whole_round, calls, device)
    return costs


def ar_token_us(target, prompt: list, device) -> float:
    """A --compile ar token: a 96-token story's time less a 32-token one's, over the 64 tokens between."""
    fused = FusedSteps(target, 1)

    def story(n: int) -> float:
        start = time.perf_counter()
        multi_step_generate(fused, prompt, n, 0.0, stop_token=None)
        return time.perf_counter() - start  # the loop reads every token back: the device is done

    story(32)  # compiles
    best = {n: min(story(n) for _ in range(5)) for n in (32, 96)}
    return 1e6 * (best[96] - best[32]) / 64


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", help="an ar checkpoint (default: an untrained model of --preset)")
    p.add_argument("--draft", help="an ar draft checkpoint for spec-k4 (default: an untrained 'draft' model)")
    p.add_argument("--drafter", help="a DFlash drafter trained for --ckpt (default: an untrained one, blocks of 16)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--prompt-tokens", type=int, default=16, help="the prompt every timed round follows")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    target = (load_model(args.ckpt, device, kinds=("ar",))[0] if args.ckpt
              else Transformer(preset(args.preset)).to(device)).eval()
    draft = (load_model(args.draft, device, kinds=("ar",))[0] if args.draft
             else Transformer(preset("draft")).to(device)).eval()
    drafter = (drafter_from(load_checkpoint(args.drafter), target, args.drafter) if args.drafter
               else DFlashDrafter(DFlashConfig.for_target(target.config), target)).eval()
    prompt = list(range(100, 100 + args.prompt_tokens))
    with torch.no_grad():
        ar = ar_token_us(target, prompt, device)
        costs = {name: round_costs(*parts, args.calls, device) for name, parts in rounds(target, draft, drafter,
                                                                                          prompt).items()}
    name = args.ckpt or f"untrained {args.preset}"
    print(f"{name} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{args.calls} rounds after a {len(prompt)}-token prompt")
    print(f"ar token {ar:9.1f} us")
    parts = list(next(iter(costs.values())))
    print(f"{'us per round':<13}" + "".join(f"{part:>10}" for part in parts) + f"{'round / ar':>12}")
    for method, row in costs.items():
        print(f"{method:<13}" + "".join(f"{row[part]:10.1f}" for part in parts) + f"{row['round'] / ar:12.2f}")
    from torch._dynamo.utils import counters
    if device.type == "cuda":  # a graph inductor left uncaptured runs its kernels one launch at a time
        print(f"graphs that skipped CUDA graphs: {counters['inductor']['cudagraph_skips']} (TORCH_LOGS=cudagraphs: why)")


if __name__ == "__main__":
    main()
