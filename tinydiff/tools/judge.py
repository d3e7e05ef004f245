"""Sample quality under an AR judge: generative perplexity with a bootstrap interval, and distinct-n.

  gen_ppl     exp(mean NLL per token) of the samples under an AR "judge" model: lower = more
              like the judge's idea of TinyStories. Repeating one phrase also scores low, so
  distinct_2  unique bigrams / all bigrams over the samples sits beside it (1.0 = no repeats).
The perplexity comes with a 95% percentile-bootstrap interval over whole samples: at 64 samples it
is wide (dev/LOG.md), so telling two models 5% apart takes several hundred samples.
A story ends at its first EOT (kept, so stopping is judged too). `sample_and_judge` is the loop
every quality number here comes from: N stories from seeds 0..N-1, one torch.Generator each.
Leaves out: MAUVE, human judgement, an external judge model (ours is the project's AR model).
"""
import math
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tinydiff.checks import UserError
from tinydiff.model import wide
from tinydiff.tokenizer import EOT


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
        nlls.append(F.cross_entropy(logits.to(wide(logits.dtype)), seq[0, len(prefix):], reduction="sum").item())
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


def sample_and_judge(sample, judge, n: int, device, desc: str = "samples") -> dict:
    """Draw n stories with sample(prompt, generator) -> (ids, tally.Decoded) after EOT, seeds 0..n-1,
    and judge them. Returns forwards_per_token (forwards of the sampled model, a draft's not
    counted), gen_ppl, gen_ppl_95, distinct_2 and the stories."""
    samples, forwards, tokens = [], 0, 0
    for seed in tqdm(range(n), desc=desc, file=sys.stderr):
        ids, result = sample([EOT], torch.Generator(device).manual_seed(seed))
        samples.append(story(ids))
        forwards += result.forwards
        tokens += len(ids)
    nlls, counts = sample_nlls(judge, samples)
    return {"forwards_per_token": forwards / tokens, "gen_ppl": math.exp(sum(nlls) / sum(counts)),
            "gen_ppl_95": perplexity_interval(nlls, counts), "distinct_2": distinct_n(samples), "stories": samples}
