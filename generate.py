"""Generate a story from a trained checkpoint.

    python generate.py --ckpt out/ar-tiny/ckpt.pt --prompt "Once upon a time"
    python generate.py --ckpt out/ar-tiny/ckpt.pt --prompt "Tom had a dog" --temperature 0 --json

The prompt is encoded as plain text after an EOT token (every training story follows one, so
EOT is how the model knows a story starts). Text goes to stdout; stats to stderr, or with
--json one JSON object {"text", "prompt_ids", "ids", "stats"} on stdout.
"""
import argparse
import json
import sys

import torch

from tinydiff.ar import ar_generate
from tinydiff.checkpoint import load_model
from tinydiff.errors import UserError
from tinydiff.tokenizer import EOT, Tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint written by train.py")
    p.add_argument("--prompt", required=True, help="the story's opening")
    p.add_argument("--method", default="ar", choices=["ar"], help="decoding method")
    p.add_argument("--max-new-tokens", type=int, help="default: until the story ends or the context is full")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (0 = all)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    tokenizer = Tokenizer()
    model, _ = load_model(args.ckpt, args.device, kinds=("ar",))
    if not args.prompt.strip():
        raise UserError("the prompt is empty; pass some text, e.g. --prompt 'Once upon a time'")
    prompt = [EOT] + tokenizer.encode(args.prompt)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    ids, stats = ar_generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k or None,
                             args.top_p, generator)
    text = tokenizer.decode([i for i in ids if i != EOT])
    if args.json:
        print(json.dumps({"text": args.prompt + text, "prompt_ids": prompt, "ids": ids, "stats": stats}))
    else:
        print(args.prompt + text)
        print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in stats.items()),
              file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
