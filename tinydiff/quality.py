"""`python -m tinydiff.quality`: how good are the samples? Generative perplexity and distinct-2.

    python -m tinydiff.quality --judge out/ar-13m/ckpt.pt --mdlm out/mdlm-13m/ckpt.pt --samples 64

Each sampler writes `--samples` stories from the same start (EOT, then nothing: unconditional)
with seeds 0..N-1. A story ends at its first EOT (kept, so stopping is judged too).
  gen_ppl     exp(mean NLL per token) of the samples under an AR "judge" model: lower = more
              like the judge's idea of TinyStories. Repeating one phrase also scores low, so
  distinct_2  unique bigrams / all bigrams over the samples sits beside it (1.0 = no repeats).
The perplexity comes with a 95% bootstrap interval over the samples: at 64 samples of a small
model it spans about -7..+9%, so telling two models 5% apart takes several hundred samples.
Leaves out: MAUVE, human judgement, an external judge model (ours is the project's AR model).
"""
import argparse
import math
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinydiff.ar import ar_generate
from tinydiff.checkpoint import load_model
from tinydiff.dmoe import ROUTINGS, routing_from_flags
from tinydiff.errors import UserError
from tinydiff.sampler import generate, generate_cached
from tinydiff.tokenizer import EOT, Tokenizer


def story(ids: list[int]) -> list[int]:
    """The ids up to and including the first EOT."""
    return ids[:ids.index(EOT) + 1] if EOT in ids else ids


@torch.no_grad()
def sample_nlls(judge, samples: list[list[int]], prefix=(EOT,)) -> tuple[list[float], list[int]]:
    """The judge's summed NLL of each non-empty sample, scored after `prefix`, and its token count."""
    nlls, counts = [], []
    device = judge.embed.weight.device
    for ids in samples:
        if not ids:
            continue
        seq = torch.tensor([list(prefix) + ids], device=device)  # (1, P + n)
        logits = judge(seq[:, :-1], causal=True)[0, len(prefix) - 1:]  # (n, V): predicts each sample token
        nlls.append(F.cross_entropy(logits.float(), seq[0, len(prefix):], reduction="sum").item())
        counts.append(len(ids))
    if not counts:
        raise UserError("no sample has any tokens to score")
    return nlls, counts


def perplexity_interval(nlls: list[float], counts: list[int], level: float = 0.95, draws: int = 2000,
                        seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap interval for exp(sum NLL / sum tokens), resampling whole samples: the
    tokens of one sample are not independent, the samples are."""
    nll, n = torch.tensor(nlls, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)
    picks = torch.randint(len(nlls), (draws, len(nlls)), generator=torch.Generator().manual_seed(seed))
    ppl = (nll[picks].sum(1) / n[picks].sum(1)).exp()  # (draws,)
    lo, hi = torch.quantile(ppl, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return lo.item(), hi.item()


def distinct_n(samples: list[list[int]], n: int = 2) -> float:
    """Unique n-grams / all n-grams, pooled over the samples (0 when there are none)."""
    grams = [tuple(ids[i:i + n]) for ids in samples for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


SAMPLERS = {  # name -> (model key, sampling function(model, prompt, args, generator) -> (ids, stats))
    "ar": ("ar", lambda m, p, a, g: ar_generate(m, p, a.gen_length, a.temperature, generator=g)),
    "diffusion": ("mdlm", lambda m, p, a, g: generate(m, p, a.gen_length, a.gen_length, a.block_length,
                                                      a.temperature, generator=g)),
    "diffusion-threshold": ("mdlm", lambda m, p, a, g: generate(m, p, a.gen_length, a.gen_length, a.block_length,
                                                                a.temperature, threshold=a.threshold, generator=g)),
    "diffusion-revise": ("mdlm", lambda m, p, a, g: generate(m, p, a.gen_length, a.gen_length, a.block_length,
                                                             a.temperature, revise=a.revise, generator=g)),
    "diffusion-cached": ("mdlm", lambda m, p, a, g: generate_cached(m, p, a.gen_length, a.gen_length,
                                                                    a.block_length, a.temperature, generator=g)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Sample quality of every sampler: generative perplexity and distinct-2.")
    p.add_argument("--judge", required=True, help="AR checkpoint that scores the samples")
    p.add_argument("--mdlm", help="diffusion LM checkpoint, dense or MoE (its samplers are skipped without it)")
    p.add_argument("--routing", choices=ROUTINGS, help="expert routing of an mdlm-moe --mdlm (default: its own)")
    p.add_argument("--route-guard", type=int, help="block routing: at least this many experts (default: its own)")
    p.add_argument("--route-threshold", type=float, help="block routing: coreset mass (default: its own)")
    p.add_argument("--route-mask-vote", type=float, help="block routing: a MASK token's vote, against a "
                   "committed token's 1 (default: its own)")
    p.add_argument("--ar", help="AR checkpoint to sample from as a baseline (skipped without it)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--gen-length", type=int, default=64, help="tokens per sample")
    p.add_argument("--block-length", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--threshold", type=float, default=0.9, help="for diffusion-threshold")
    p.add_argument("--revise", type=int, default=4, help="self-correction steps per block, for diffusion-revise")
    p.add_argument("--samplers", default=",".join(SAMPLERS), help=f"comma list from: {', '.join(SAMPLERS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.samples < 1:
        raise UserError(f"--samples must be >= 1, got {args.samples}")
    wanted = [name.strip() for name in args.samplers.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in SAMPLERS]
    if unknown or not wanted:
        raise UserError(f"unknown sampler(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SAMPLERS)}")
    if not (args.mdlm or args.ar):
        raise UserError("nothing to sample from; pass --mdlm and/or --ar checkpoints")
    judge, _ = load_model(args.judge, args.device, kinds=("ar",))
    models, routing = {}, ""
    if args.mdlm:
        models["mdlm"], ckpt = load_model(args.mdlm, args.device, kinds=("mdlm", "mdlm-moe"))
        config = routing_from_flags(models["mdlm"], ckpt["kind"], args.mdlm, args.routing, args.route_threshold,
                                    args.route_guard, args.route_mask_vote)
        if config is not None:
            routing = f", {config.routing} expert routing"
            if config.routing == "block":
                routing += (f" (threshold {config.route_threshold}, guard {config.route_guard}, "
                            f"mask vote {config.route_mask_vote:g})")
    if args.ar:
        models["ar"], _ = load_model(args.ar, args.device, kinds=("ar",))
    tokenizer = Tokenizer()
    rows = []
    for name in wanted:
        key, sample = SAMPLERS[name]
        if key not in models:
            continue
        samples, forwards, tokens = [], 0, 0
        for seed in tqdm(range(args.samples), desc=name, file=sys.stderr):
            ids, stats = sample(models[key], [EOT], args, torch.Generator(args.device).manual_seed(seed))
            samples.append(story(ids))
            forwards, tokens = forwards + stats["forwards"], tokens + len(ids)
        nlls, counts = sample_nlls(judge, samples)
        rows.append({"sampler": name, "forwards_per_token": forwards / tokens,
                     "gen_ppl": math.exp(sum(nlls) / sum(counts)), "gen_ppl_95": perplexity_interval(nlls, counts),
                     "distinct_2": distinct_n(samples),
                     "example": tokenizer.decode(samples[0]).replace("\n", " ")})
    print(f"{args.samples} samples x {args.gen_length} tokens, temperature {args.temperature}, judge {args.judge}{routing}")
    print(f"{'sampler':<22}{'fwd/token':>10}{'gen ppl':>10}{'95% interval':>18}{'distinct-2':>12}")
    for r in rows:
        interval = "[{:.2f}, {:.2f}]".format(*r["gen_ppl_95"])
        print(f"{r['sampler']:<22}{r['forwards_per_token']:>10.3f}{r['gen_ppl']:>10.2f}{interval:>18}"
              f"{r['distinct_2']:>12.3f}")
    for r in rows:
        print(f"\n{r['sampler']}: {r['example'][:400]}")
    return rows


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        sys.exit(f"error: {e}")
