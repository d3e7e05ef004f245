"""python -m tinydiff.tools.eval --ckpt CKPT [--data FILE] [--judge JUDGE]: the pinned evaluation.

The same 1,000 stories for every model and every user: the first 1,000 of TinyStories' own
validation split (on Hugging Face, `roneneldan/TinyStories`'s validation split; in this project's
workspace, ../shared/data/tinystories-valid-1000.txt, the same stories as a file). They are
tokenised as training text is (each story, then EOT) into one stream, cut into consecutive
windows of the model's context; the tail shorter than a window is left out. On them:
  - an AR model (ar, ar-moe): the exact NLL per token (every token of a window but its first is predicted);
  - a diffusion LM: the ELBO bound per token (block diffusion's for a --noise-block model), an
    upper bound on its NLL, averaged over --mc noise draws with their standard error;
  - bits per byte: the same total over the UTF-8 bytes of the scored tokens' text;
  - with --judge (an AR model): generative perplexity (95% bootstrap interval) and distinct-2 of
    --samples unconditional stories, as `python -m tinydiff.bench.quality` scores them.
Every number is deterministic (fixed windows, noise seeded), so two runs print the same.
Leaves out: per-story scoring (a window may start mid-story), other splits.
"""
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinydiff.ar import ar_generate
from tinydiff.checks import COUNT, Rule, UserError
from tinydiff.diffusion import diffusion_elbo, scored_tokens
from tinydiff.io.checkpoint import AR_KINDS, DIFFUSION_KINDS, load_model
from tinydiff.io.cli import add_device, check_device, flag, given_flags, make_parser, run_main
from tinydiff.io.files import check_output, write_atomic
from tinydiff.io.tokens import SEPARATOR, read_stories, text_file
from tinydiff.model import wide
from tinydiff.sampler import generate_cached
from tinydiff.tokenizer import EOT, Tokenizer
from tinydiff.tools.judge import sample_and_judge

STORIES = 1000
MC = Rule(integer=True, lo=2, hi=10**4)  # noise draws: two at least, for a standard error
# Judged stories: each is held until the bootstrap, which draws 2,000 resamples of them at once (judge.py), about
# 50 KB a story; 10,000 pin the perplexity's interval to a twelfth of 64 stories' width (quality.py shares it).
SAMPLES = Rule(integer=True, lo=1, hi=10**4)
LOGITS_BUDGET = 2**30  # bytes: one scoring batch's float32 logits (B x context x vocabulary), whatever --batch-size


def parse_args(argv=None):
    parser = make_parser("python -m tinydiff.tools.eval", __doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("--ckpt", required=True, help="the model to evaluate (ar, ar-moe, mdlm or mdlm-moe; ckpt.pt "
                                                      "or an exported folder)")
    parser.add_argument("--data", help="a TinyStories-format file whose first 1,000 stories are scored (default: "
                                       "Hugging Face's validation split, downloaded)")
    parser.add_argument("--mc", type=MC, default=4, help="noise draws of a diffusion LM's bound")
    parser.add_argument("--batch-size", type=COUNT, default=8, help="windows per forward (at most what 1 GiB of "
                                                                     "logits holds; past the windows, all of them)")
    parser.add_argument("--judge", help="an AR model: adds generative perplexity and distinct-2 of --samples stories")
    parser.add_argument("--samples", type=SAMPLES, default=64, help="stories the judge scores")
    parser.add_argument("--gen-length", type=COUNT, default=128, help="tokens per judged story")
    parser.add_argument("--block-length", type=COUNT, default=32,
                        help="a diffusion LM's judged stories: the cached sampler's block, one token per step")
    parser.add_argument("--json", help="also write the numbers to this file")
    add_device(parser)
    args = parser.parse_args(argv)
    args.given = given_flags(parser, argv)
    return args


JUDGED = ("samples", "gen_length", "block_length")  # the judged stories' settings: read only with --judge


def pinned_stories(data: str | None) -> list[str]:
    """The first 1,000 stories of --data (stories separated by lines `<|endoftext|>`), or of Hugging
    Face's validation split."""
    if data is None:
        try:
            import datasets  # lazily: only this branch needs it, and some machines lack it
            rows = datasets.load_dataset("roneneldan/TinyStories", split=f"validation[:{STORIES}]")
        except ImportError:
            raise UserError("the default evaluation downloads TinyStories and needs `datasets` (pip install "
                            "datasets); or pass --data FILE (here: ../shared/data/tinystories-valid-1000.txt)"
                            ) from None
        except Exception as e:  # offline, hub down: all mean "use the local file"
            raise UserError(f"could not download TinyStories' validation split ({type(e).__name__}); pass --data "
                            "FILE (here: ../shared/data/tinystories-valid-1000.txt)") from None
        return [s.strip() for s in rows["text"] if s.strip()]
    path = text_file(data)  # e.g. ../shared/data/tinystories-valid-1000.txt
    stories = []
    for chunk in read_stories(path, data, tqdm(disable=True)):
        stories += chunk
        if len(stories) >= STORIES:
            break
    if not stories:
        raise UserError(f"evaluation file {data} holds no stories (separated by lines `{SEPARATOR}`)")
    return stories[:STORIES]


def eval_windows(stories: list[str], context: int, tokenizer) -> torch.Tensor:
    """(W, context) consecutive windows of the stream story + EOT, story + EOT, ..."""
    stream = [t for s in stories for t in tokenizer.encode(s) + [EOT]]
    n = len(stream) // context
    if n == 0:
        raise UserError(f"the evaluation text holds {len(stream)} tokens, less than one {context}-token window")
    return torch.tensor(stream[:n * context]).view(n, context)


def scoring_batch(batch_size: int, windows, vocab_size: int) -> int:
    """The windows a scoring forward takes: --batch-size, or every window where it asks for more (the same
    one batch, so the same numbers; said once); refused where its logits would pass LOGITS_BUDGET."""
    n, length = windows.shape
    per_window = length * vocab_size * 4  # a window's float32 logits
    fits = max(1, LOGITS_BUDGET // per_window)
    if min(batch_size, n) > fits:
        raise UserError(f"--batch-size {batch_size}: a batch of {min(batch_size, n):,} windows of {length} tokens "
                        f"holds {min(batch_size, n) * per_window / 2**30:.1f} GiB of logits; pass at most {fits}")
    if batch_size > n:
        print(f"notice: --batch-size {batch_size} is more than the {n} windows; scoring them in one batch",
              file=sys.stderr)
    return min(batch_size, n)


@torch.no_grad()
def score(model, kind: str, windows, mc: int, batch_size: int, tokenizer) -> dict:
    """nll (nats/token: exact for AR, the bound for diffusion, with its MC stderr), bits_per_byte, tokens."""
    scored = windows[:, 1:] if kind in AR_KINDS or model.config.shift else windows  # the tokens a row predicts
    n_bytes = sum(len(tokenizer.decode(row).encode("utf-8")) for row in scored.tolist())
    if kind in AR_KINDS:
        total = 0.0
        for i in range(0, len(windows), batch_size):
            x = windows[i:i + batch_size]
            logits = model(x[:, :-1], causal=True)  # (B, T-1, V)
            logits = logits.flatten(0, 1).to(wide(logits.dtype))  # half precisions widened, float64 kept
            total += F.cross_entropy(logits, x[:, 1:].flatten(), reduction="sum").item()
        nll, stderr = total / scored.numel(), 0.0
    else:
        # The whole set's bound is the token-weighted mean of the batches' bounds; their noise draws are
        # independent, so the variances of the weighted parts add.
        generator = torch.Generator(windows.device).manual_seed(0)
        nll, variance = 0.0, 0.0
        for i in range(0, len(windows), batch_size):
            x = windows[i:i + batch_size]
            part = diffusion_elbo(model, x, mc=mc, generator=generator)
            weight = scored_tokens(model, x) / scored.numel()
            nll, variance = nll + weight * part["bound"], variance + (weight * part["stderr"]) ** 2
        stderr = math.sqrt(variance)
    return {"nll": nll, "stderr": stderr, "bits_per_byte": nll * scored.numel() / (n_bytes * math.log(2)),
            "tokens": scored.numel(), "windows": len(windows)}


def main(argv=None):
    args = parse_args(argv)
    check_device(args.device)
    check_output(args.json, "--json")
    for dest in JUDGED if args.judge is None else ():
        if dest in args.given:
            raise UserError(f"{flag(dest)} sets the judged stories, which only --judge writes; add "
                            "--judge AR_CKPT or drop it")
    stories = pinned_stories(args.data)
    model, ckpt = load_model(args.ckpt, args.device, kinds=(*AR_KINDS, *DIFFUSION_KINDS))
    for dest in ("mc", "block_length") if ckpt["kind"] in AR_KINDS else ():
        if dest in args.given:  # an AR model's NLL is exact and its stories are written token by token
            raise UserError(f"{flag(dest)} applies to a diffusion LM; {args.ckpt} holds a "
                            f"{ckpt['kind']} model: drop it")
    judge = load_model(args.judge, args.device, kinds=("ar",))[0] if args.judge else None
    if judge is not None and ckpt["kind"] not in AR_KINDS and args.gen_length % args.block_length:
        raise UserError(f"--gen-length {args.gen_length} must be a multiple of --block-length {args.block_length}")
    if judge is not None and args.gen_length >= model.config.context:
        raise UserError(f"--gen-length {args.gen_length} leaves no room after the opening EOT in the model's "
                        f"context of {model.config.context}; pass at most {model.config.context - 1}")
    tokenizer = Tokenizer()
    windows = eval_windows(stories, model.config.context, tokenizer).to(args.device)
    batch_size = scoring_batch(args.batch_size, windows, model.config.vocab_size)
    result = {"ckpt": str(args.ckpt), "kind": ckpt["kind"], "stories": len(stories),
              **score(model, ckpt["kind"], windows, args.mc, batch_size, tokenizer)}
    what = "NLL" if ckpt["kind"] in AR_KINDS else f"ELBO bound ({args.mc} noise draws, +- MC stderr)"
    print(f"{args.ckpt}: {result['stories']} stories, {result['windows']} windows of {model.config.context}, "
          f"{result['tokens']:,} tokens scored")
    error = f" +- {result['stderr']:.4f}" if ckpt["kind"] not in AR_KINDS else ""
    print(f"{what}: {result['nll']:.4f}{error} nats/token | bits/byte {result['bits_per_byte']:.4f}")
    if judge is not None:
        if ckpt["kind"] in AR_KINDS:
            sample = lambda p, g: ar_generate(model, p, args.gen_length, 1.0, generator=g)  # noqa: E731
        else:
            sample = lambda p, g: generate_cached(model, p, args.gen_length, args.gen_length,  # noqa: E731
                                                  args.block_length, 1.0, generator=g)
        judged = sample_and_judge(sample, judge, args.samples, args.device, "samples")
        result |= {key: judged[key] for key in ("gen_ppl", "gen_ppl_95", "distinct_2")}
        print(f"judge {args.judge}: generative perplexity {judged['gen_ppl']:.2f} "
              f"[{judged['gen_ppl_95'][0]:.2f}, {judged['gen_ppl_95'][1]:.2f}] | distinct-2 {judged['distinct_2']:.3f} "
              f"({args.samples} stories of {args.gen_length} tokens at T 1)")
    if args.json:
        text = json.dumps(result, indent=2) + "\n"
        write_atomic(Path(args.json), lambda f: f.write(text.encode("utf-8")))
    return result


if __name__ == "__main__":
    sys.exit(run_main(main))
