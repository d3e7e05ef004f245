"""Lesson 06: why a diffusion LM commits one token per forward, and how self-distillation buys more.

Run: python lessons/06_parallel_decoding.py [--quick] [--teacher CKPT --student CKPT]
Read next: tinydiff/sampler.py (threshold and entropy-bound commits), tinydiff/extras/distill.py (the
teacher's trajectories, the states and the loss); docs/RESULTS.md has the curve of the real models
(`python -m tinydiff.bench.quality --curve`, docs/USAGE.md). Then lessons/07_speculative.py.

A toy language makes the effect visible in seconds: each story is a chain of words where the next
word is the previous word's successor 70% of the time (any other word otherwise). Given a
prefix, the next position is 70% sure, the one after ~50%, then ~35%: certainty fades with the
distance from the committed text, which is what an ELBO-trained diffusion LM learns of real text.
Committing several positions at once samples each from its own marginal, so far positions come
out as guesses. Distillation trains a student on the teacher's own trajectories (here greedy,
temperature 0: always the successor) until it is sure of the whole block at once.
With --teacher/--student (train.py --distill), the same confidences are printed for real stories.
"""
from dataclasses import replace

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import numpy as np
import torch

from tinydiff.ar import ar_loss
from tinydiff.diffusion import mdlm_loss, subs_logits
from tinydiff.extras.distill import PROMPT, DistillConfig, make_loss, sample_rows, write_trajectories
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampler import block_causal_mask, commit, generate_cached
from tinydiff.tokenizer import EOT, MASK, Tokenizer

args = common.setup(__doc__, "fewer training steps (the effect is weaker)",
                    needs={"teacher": "student", "student": "teacher"},
                    teacher=(["out/mdlm-tiny/ckpt.pt", "out/tour-mdlm/ckpt.pt"], "a diffusion LM checkpoint"),
                    student=(["out/mdlm-tiny-distilled/ckpt.pt"], "its distilled student (train.py --distill)"))
tok = Tokenizer()
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
g = torch.Generator().manual_seed(args.seed)


def windows(length, n=16):
    """n random windows of the toy corpus (n, length)."""
    starts = torch.randint(0, len(corpus) - length, (n,), generator=g)
    return torch.stack([torch.from_numpy(corpus[s:s + length]) for s in starts])


# From scratch a diffusion LM sits at the unigram plateau for long; adapted from an AR model (Dream's
# shift, what train.py --init AR_CKPT does) it reads the chain at once, as at full scale. Windows of
# 10 tokens hold the block and its opening: all the context the chain needs.
steps = 30 if args.quick else 100
teacher = Transformer(ModelConfig(context=LENGTH + 1, n_layer=2, n_head=2, d_model=32, d_ff=64))
common.train(teacher, lambda step: ar_loss(teacher, windows(11)), steps, lr=1e-2)  # lesson 04's loop
teacher.config = replace(teacher.config, causal=False, shift=True)
common.train(teacher, lambda step: mdlm_loss(teacher, windows(10), g), steps, lr=1e-3)


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

config = DistillConfig(stories=30 if args.quick else 150, block_length=N, blocks=1, max_opening=1, temperature=0.0)
print(f"\n2. The teacher writes {config.stories} stories one token per step (greedy), from EOT or EOT and a first word,")
print("   recording its reveal order; the student starts from its weights and learns to predict every masked")
print("   position of a block from the teacher's partial canvas, with dParallel's certainty term (beta 2) on the")
print("   positions it has right. It trains on the stories that open with a word, as the curve below does.")
stories = write_trajectories(teacher, corpus, config, seed=0, desc="teacher writes")
stories = stories[(stories[:, 1] == PROMPT).sum(1) == 2]  # row 1 marks the prompt's positions: EOT and a word
student = Transformer(teacher.config)
student.load_state_dict(teacher.state_dict())
loss_fn = make_loss(config)
steps = 30 if args.quick else 400  # the hardest state, a whole block from the opening alone, comes last
_, stats = common.train(student, lambda step: loss_fn(student, sample_rows(stories, 8, args.seed, step), g), steps,
                        lr=4e-3)
print(f"   after {steps} steps: masked CE {float(stats['masked_ce']):.3f}, right {float(stats['acc']):.0%}")
show("teacher", confidences(teacher, prompt, N))
show("student", confidences(student, prompt, N))

prompts = [[EOT, w] for w in WORDS[:4 if args.quick else None]]
print(f"\n3. The curve on the toy, temperature 0, {len(prompts)} openings: tokens per forward (each block of 8 takes")
print("   8 forwards one token per step) against the share of tokens equal to the teacher's one-per-step text.")
print(f"   {'':<8}{'setting':<20}{'tok/fwd':>8}{'agree':>8}")
want = [generate_cached(teacher, p, N, N, N)[0] for p in prompts]  # the cached block sampler, one token a step
for name, m in (("teacher", teacher), ("student", student)):
    for label, rule in (("one per step", {}), ("threshold 0.7", {"threshold": 0.7}),
                        ("threshold 0.3", {"threshold": 0.3}), ("entropy bound 1", {"entropy_bound": 1.0})):
        runs = [generate_cached(m, p, N, N, N, **rule) for p in prompts]  # (ids, stats) each
        same = sum(a == b for reference, (ids, _) in zip(want, runs) for a, b in zip(reference, ids))
        forwards = sum(stats.forwards for _, stats in runs)
        print(f"   {name:<8}{label:<20}{N * len(prompts) / forwards:>8.2f}{same / (N * len(prompts)):>8.2f}")
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

if args.teacher and args.student:
    prompt = [EOT] + tok.encode("Once upon a time, there was a little")
    print("\n5. The real models on 'Once upon a time, there was a little' + 16 MASKs:")
    for name, path in (("teacher", args.teacher), ("student", args.student)):
        show(name, confidences(common.load(path, ("mdlm", "mdlm-moe"), f"   {name}"), prompt, 16))
else:
    print("\n5. (Pass --teacher and --student, or train them as docs/USAGE.md says, to see real stories' confidences.)")
