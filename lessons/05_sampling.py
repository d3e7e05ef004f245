"""Lesson 05: watch the sampler fill the canvas: LLaDA's schedule, threshold decoding, self-correction.

Run: python lessons/05_sampling.py [--quick] [--ckpt out/mdlm-tiny/ckpt.pt]
Read next: tinydiff/sampler.py (this lesson's code: each rule below is a few lines there) and
tinydiff/extras/self_correction.py; then lessons/06_parallel_decoding.py.

The canvas starts as the prompt followed by MASKs. Each step is one forward pass: the model
proposes a token for every masked position with a confidence, and the sampler commits the most
confident ones in the current block. With a trained checkpoint the text is a story; without one
(an untrained model) the words are noise but every rule is the same.
"""
import os
import tempfile

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed

from tinydiff.extras.self_correction import generate_revising
from tinydiff.model import Transformer, preset
from tinydiff.sampler import commit_schedule, generate
from tinydiff.tokenizer import EOT, Tokenizer
from tinydiff.tools.replay import Recorder

args = common.setup(__doc__, "an untrained model, fewer tokens",
                    ckpt=(["out/mdlm-tiny/ckpt.pt", "out/tour-mdlm/ckpt.pt"], "a masked-diffusion checkpoint"))
tok = Tokenizer()
if args.ckpt:
    model = common.load(args.ckpt, ("mdlm",))
else:
    model = Transformer(preset("tiny", causal=False)).eval()
    print("model: untrained (pass --ckpt for real text)")
prompt = [EOT] + tok.encode("Once upon a time")
n = 16 if args.quick else 32


def show(title, sampler=generate, **kwargs):
    print(f"\n{title}")

    def frame(event):
        canvas = tok.decode(event["canvas"][len(prompt):].tolist())
        note = f" (revised {event['revised']})" if event.get("revised") else ""
        print(f"   fwd {event['forward']:2d} block {event['block']} +{len(event['committed'])}{note}: {canvas}")
    ids, stats = sampler(model, prompt, callback=frame, **kwargs)
    print(f"   {stats.forwards} forwards for {stats.new_tokens} tokens "
          f"({stats.tokens_per_forward:.2f} per forward)")


print(f"1. LLaDA's schedule: {n} tokens in blocks of {n // 2}, {n // 2} steps in all, so each block gets")
print(f"   {n // 4} steps committing {commit_schedule(n // 2, n // 4)} tokens. The second block waits for the first.")
show("   low_confidence remasking, temperature 0:", gen_length=n, steps=n // 2, block_length=n // 2)

print("\n2. Threshold decoding (Fast-dLLM): commit every position the model is at least 90% sure of,")
print("   and always the most confident one. Easy stretches go many tokens per forward.")
show("   threshold 0.9:", gen_length=n, steps=n, block_length=n // 2, threshold=0.9)

print("\n3. Self-correction: once a block is full, re-mask its least confident token and predict it")
print("   again, now that the whole block is in view. Two extra forwards per block here.")
show("   revise 2 (tinydiff/extras/self_correction.py):", generate_revising, gen_length=n, steps=n,
     block_length=n // 2, revise=2)

print("\n4. See it: run 1 again, every step recorded by the sampler's callback, written as one page that replays")
print("   it (tinydiff/tools/replay.py; `python generate.py ... --html FILE` does the same for any method):")
recorder = Recorder("diffusion", tok, prompt, "Once upon a time")
generate(model, prompt, gen_length=n, steps=n // 2, block_length=n // 2, callback=recorder)
page = os.path.abspath(recorder.write(os.path.join(tempfile.gettempdir(), "tinydiff-lesson05.html"), overwrite=True))
print(f"   open {page} in any browser: play, step, or drag the slider over the {len(recorder.steps)} steps")
