"""`python -m tinydiff.bench`: every decoding method on the same prompts and checkpoints, one table.

    python -m tinydiff.bench --ckpt out/ar-tiny/ckpt.pt --json bench.json

Each method decodes the same fixed story openings for the same number of new tokens (no stop at
EOT, so every method does the same work) after one untimed warm-up prompt. Columns:
  tokens_per_s               new tokens / wall seconds, over all prompts
  target_forwards_per_token  forward passes of the target model / new tokens
  tau                        new tokens per target forward (1 for plain AR decoding)
  speedup_vs_ar              tokens_per_s / the `ar` row's tokens_per_s
Without --ckpt the target is an untrained `tiny` model: speeds are real, the text is noise.
Methods land here as they are built; this file has the `ar` row.
"""
import argparse
import json
import platform
import sys

import torch
from tqdm import tqdm

from tinydiff.ar import ar_generate
from tinydiff.checkpoint import load_model
from tinydiff.errors import UserError
from tinydiff.model import Transformer, preset
from tinydiff.tokenizer import EOT, Tokenizer

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park.",
    "One day, a big bear found a red ball in the forest.",
    "Sam wanted to help his mom in the kitchen.",
]


def run_ar(models, prompt, args, generator):
    """Plain KV-cached decoding with the target: one forward per token."""
    ids, stats = ar_generate(models["target"], prompt, args.new_tokens, args.temperature,
                             generator=generator, stop_token=None)
    return {"new_tokens": len(ids), "seconds": stats["seconds"], "target_forwards": stats["forwards"]}


METHODS = {"ar": run_ar}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:  # Linux names the CPU model here; platform only knows the architecture
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} CPU, {torch.get_num_threads()} threads"


def measure(method, models, prompts, args) -> dict:
    """Sum a method's counts over all prompts (after one untimed warm-up run)."""
    generator = torch.Generator(args.device).manual_seed(args.seed)
    method(models, prompts[0], args, generator)
    totals = {"new_tokens": 0, "seconds": 0.0, "target_forwards": 0}
    for prompt in prompts:
        generator.manual_seed(args.seed)
        for key, value in method(models, prompt, args, generator).items():
            totals[key] += value
    return {"tokens_per_s": totals["new_tokens"] / totals["seconds"],
            "target_forwards_per_token": totals["target_forwards"] / totals["new_tokens"],
            "tau": totals["new_tokens"] / totals["target_forwards"]}


def load_models(args) -> dict:
    if args.ckpt:
        target, _ = load_model(args.ckpt, args.device, kinds=("ar",))
    else:
        print("notice: no --ckpt, benchmarking an untrained 'tiny' model (speeds are real, text is not)",
              file=sys.stderr)
        torch.manual_seed(args.seed)
        target = Transformer(preset("tiny")).to(args.device).eval()
    return {"target": target}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmark every decoding method on the same prompts.")
    p.add_argument("--ckpt", help="AR target checkpoint (default: an untrained tiny model)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list from: {', '.join(METHODS)}")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, the same text for every method")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the table as JSON to this path")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UserError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(METHODS)}")
    if not 1 <= args.prompts <= len(PROMPTS):
        raise UserError(f"--prompts must lie in [1, {len(PROMPTS)}], got {args.prompts}")
    tokenizer = Tokenizer()
    prompts = [[EOT] + tokenizer.encode(text) for text in PROMPTS[:args.prompts]]
    models = load_models(args)
    rows = []
    for name in tqdm(methods, desc="bench", unit="method", file=sys.stderr):
        rows.append({"method": name, **measure(METHODS[name], models, prompts, args)})
    ar_speed = next((r["tokens_per_s"] for r in rows if r["method"] == "ar"), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar_speed if ar_speed else None
    report = {"device": device_name(args.device), "rows": rows}
    print(f"device: {report['device']} | {len(prompts)} prompts x {args.new_tokens} new tokens | "
          f"temperature {args.temperature}")
    print(f"{'method':<16}{'tokens/s':>10}{'target fwd/token':>18}{'tau':>7}{'speedup vs ar':>15}")
    for r in rows:
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] else "-"
        print(f"{r['method']:<16}{r['tokens_per_s']:>10.1f}{r['target_forwards_per_token']:>18.3f}"
              f"{r['tau']:>7.2f}{speedup:>15}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
