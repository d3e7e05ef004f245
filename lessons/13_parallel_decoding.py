"""Lesson 13: why a diffusion LM commits one token per forward, and how self-distillation buys more.

Run: python lessons/13_parallel_decoding.py [--quick] [--teacher CKPT --student CKPT]
Read next: tinydiff/extras/distill.py (states and loss), tinydiff/sampler.py (threshold and entropy-bound
commits), tinydiff/bench/curve.py; docs/RESULTS.md has the curve of the real models. Then lesson 14
(FP4 experts).

A toy language makes the effect visible in seconds: each story is a chain of words where the next
word is the previous word's successor 70% of the time (any other word otherwise). Given a
prefix, the next position is 70% sure, the one after ~50%, then ~35%: certainty fades with the
distance from the committed text, which is what an ELBO-trained diffusion LM learns of real text.
Committing several positions at once samples each from its own marginal, so far positions come
out as guesses. Distillation trains a student on the teacher's own trajectories (here greedy,
temperature 0: always the successor) until it is sure of the whole block at once.
With --teacher/--student (train.py --distill), the same confidences are printed for real stories.
"""
import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SHARED = Path(__file__).resolve().parents[2] / "shared"
if not os.environ.get("TIKTOKEN_CACHE_DIR") and (SHARED / "tiktoken-cache").is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(SHARED / "tiktoken-cache")  # offline workspaces

from tinydiff.ar import ar_loss  # noqa: E402
from tinydiff.io.checkpoint import load_model  # noqa: E402
from tinydiff.bench.curve import agreement, greedy_texts  # noqa: E402
from tinydiff.diffusion import mdlm_loss, subs_logits  # noqa: E402
from tinydiff.extras.distill import DistillConfig, make_loss, sample_rows, write_trajectories  # noqa: E402
from tinydiff.model import ModelConfig, Transformer  # noqa: E402
from tinydiff.sampler import block_causal_mask, commit, generate_cached  # noqa: E402
from tinydiff.tokenizer import EOT, MASK, Tokenizer  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--quick", action="store_true", help="fewer training steps (the effect is weaker)")
parser.add_argument("--teacher", help="a diffusion LM checkpoint (default: out/mdlm-teacher/ckpt.pt if present)")
parser.add_argument("--student", help="its distilled student (default: out/mdlm-distilled/ckpt.pt if present)")
args = parser.parse_args()
tok = Tokenizer()
torch.manual_seed(0)
WORDS = [tok.encode(w)[0] for w in (" red", " blue", " green", " cat", " dog", " sun", " tree", " ball", " hat",
                                    " cake", " bird", " boat")]
N, LENGTH = 8, 16  # a block of 8 after EOT + the first word; stories of 16 words
rng = np.random.default_rng(0)


def toy_story():
    words = [int(rng.integers(len(WORDS)))]
    for _ in range(LENGTH - 1):
        nxt = (words[-1] + 1) % len(WORDS)
        words.append(nxt if rng.random() < 0.7 else int(rng.choice([w for w in range(len(WORDS)) if w != nxt])))
    return [EOT] + [WORDS[w] for w in words]


corpus = np.array([t for _ in range(2000) for t in toy_story()])
steps = 30 if args.quick else 100
g = torch.Generator().manual_seed(0)


def train(model, loss_fn, steps, window, lr):
    """Lesson 04's loop: AdamW on random windows of the toy corpus."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        starts = torch.randint(0, len(corpus) - window, (16,), generator=g)
        loss, _ = loss_fn(model, torch.stack([torch.from_numpy(corpus[s:s + window]) for s in starts]), g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


# From scratch a diffusion LM sits at the unigram plateau for long; adapted from an AR model (Dream's
# shift, what train.py --init AR_CKPT does) it reads the chain at once, as at full scale.
model = train(Transformer(ModelConfig(context=LENGTH + 1, n_layer=2, n_head=2, d_model=32, d_ff=64)), ar_loss,
              steps, LENGTH + 2, 1e-2)
model.config = replace(model.config, causal=False, shift=True)
teacher = train(model.train(), mdlm_loss, steps, LENGTH + 1, 1e-3)


@torch.no_grad()
def confidences(m, prompt, n):
    """Each masked position's top probability on the canvas prompt + n MASKs, block-causal as cached."""
    canvas = torch.tensor([prompt + [MASK] * n])
    mask = block_causal_mask(torch.tensor([0] * len(prompt) + [1] * n))  # the prompt is the first block
    logits = subs_logits(m(canvas, mask=mask)[0].double())
    first = len(prompt) - int(m.config.shift)  # the output that predicts the first masked position
    return torch.softmax(logits[first:first + n], -1).max(-1).values.tolist()


def show(title, values):
    print(f"   {title:<8}" + " ".join(f"{v:.2f}" for v in values))


prompt = [EOT, WORDS[0]]
print(f"1. A teacher: {steps} AR steps on the toy, then {steps} diffusion steps. Its confidence in each of the {N}")
print("   masked positions after 'EOT red' (the chain's likely text is ' blue green cat dog ...'): sure of the")
print("   next word, barely of the rest.")
show("teacher", confidences(teacher, prompt, N))

config = DistillConfig(stories=30 if args.quick else 300, block_length=N, blocks=1, max_opening=1, temperature=0.0)
print(f"\n2. The teacher writes {config.stories} stories one token per step (greedy), recording its reveal order; the")
print("   student starts from its weights and learns to predict every masked position of a block from the")
print("   teacher's partial canvas, with dParallel's certainty term (beta 2) on the positions it has right.")
stories = write_trajectories(teacher, corpus, config, seed=0, desc="teacher writes")
student = Transformer(teacher.config)
student.load_state_dict(teacher.state_dict())
loss_fn, opt = make_loss(config), torch.optim.AdamW(student.parameters(), lr=3e-3)
distill_steps = 30 if args.quick else 400  # the hardest state, a whole block from the opening alone, comes last
for step in range(distill_steps):
    loss, stats = loss_fn(student.train(), sample_rows(stories, 16, 0, step), g)
    opt.zero_grad()
    loss.backward()
    opt.step()
student.eval()
print(f"   after {distill_steps} steps: masked CE {float(stats['masked_ce']):.3f}, right {float(stats['acc']):.0%}")
show("teacher", confidences(teacher, prompt, N))
show("student", confidences(student, prompt, N))

prompts = [[EOT, w] for w in WORDS[:4 if args.quick else None]]
print(f"\n3. The curve on the toy, temperature 0, {len(prompts)} openings: tokens per forward (each block of 8 takes")
print("   8 forwards one token per step) against the share of tokens equal to the teacher's one-per-step text.")
print(f"   {'':<8}{'setting':<20}{'tok/fwd':>8}{'agree':>8}")
want = greedy_texts(teacher, prompts, N, N)
for name, m in (("teacher", teacher), ("student", student)):
    for label, rule in (("one per step", {}), ("threshold 0.7", {"threshold": 0.7}), ("threshold 0.3", {"threshold": 0.3}),
                        ("entropy bound 1", {"entropy_bound": 1.0})):
        forwards = sum(generate_cached(m, p, N, N, N, **rule)[1].forwards for p in prompts)
        agree = agreement(want, greedy_texts(m, prompts, N, N, rule))
        print(f"   {name:<8}{label:<20}{N * len(prompts) / forwards:>8.2f}{agree:>8.2f}")
print("   The teacher buys parallelism with guesses; the student commits a block in a forward or two and")
print("   keeps writing the teacher's text. At temperature 1 the price moves to diversity: a student sure of")
print("   several tokens at once has learned to pick one of the teacher's continuations (docs/RESULTS.md).")

probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.25, 0.15], [0.4, 0.4, 0.2], [0.7, 0.2, 0.1]], dtype=torch.float64)
print("\n4. Which position a step commits matters at temperature 1. Four masked positions, three tokens each,")
print("   no position's likeliest token above 70%; 1,000 first steps of one token, the share that commit the")
print("   committed position's likeliest token:")
for rule in ("low_confidence", "low_entropy"):
    gen, modes = torch.Generator().manual_seed(0), 0
    for _ in range(1000):
        canvas = torch.full((4,), MASK)
        (where,) = commit(canvas, 0, probs.log(), 1, None, 1.0, rule, gen, torch.ones(4, dtype=torch.float64))
        modes += int(canvas[where]) == int(probs[where].argmax())
    print(f"   {rule:<16}{modes / 1000:.2f}")
print("   Ranked by confidence, a step commits whichever position happened to draw a likely token: a mode.")
print("   Ranked by entropy (or position), the position is chosen before the draw, so its token is a fair")
print("   sample. A student sure of many positions gives the confidence order many modes to pick from.")

found = [Path(p) for p in ("out/mdlm-teacher/ckpt.pt", "out/mdlm-distilled/ckpt.pt")]
paths = [args.teacher or (found[0] if found[0].exists() else None), args.student or (found[1] if found[1].exists() else None)]
if not args.quick and all(paths):
    real = [load_model(p, kinds=("mdlm", "mdlm-moe"))[0] for p in paths]
    prompt = [EOT] + tok.encode("Once upon a time, there was a little")
    print(f"\n5. The real models ({paths[0]}, {paths[1]}) on 'Once upon a time, there was a little' + 16 MASKs:")
    for name, m in zip(("teacher", "student"), real):
        show(name, confidences(m, prompt, 16))
else:
    print("\n5. (Pass --teacher and --student, or train them as docs/USAGE.md says, to see real stories' confidences.)")
