"""python -m tinydiff.bench.hf --target CKPT --draft CKPT: tinydiff against transformers on the same weights.

Both models are exported (tinydiff/tools/export.py's Llama layout) and loaded into `LlamaForCausalLM`;
then each mode runs on the bench's fixed prompts, tinydiff and transformers alternating prompt by
prompt, so drift in the machine's speed hits both alike:
  greedy     ar_generate at T 0            vs generate(do_sample=False)
  sample     ar_generate at T 1            vs generate(do_sample=True, temperature=1)
  spec-kK    speculative_generate, k = K   vs generate(assistant_model=draft, K assistant tokens, constant)
Each row gives both tokens/s, their ratio and whether the tokens are identical (greedy and
speculative: they must be, both are the target's greedy text; sampled ones differ, the RNGs do).
Needs transformers (requirements-hf.txt). Every story runs to --max-new-tokens (no stop at EOT).
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinydiff.ar import ar_generate
from tinydiff.bench.measure import PROMPTS, device_name
from tinydiff.checks import COUNT, SEED, Rule, UserError, number_list
from tinydiff.io.checkpoint import load_model
from tinydiff.io.cli import clamp_drafts, given_flags, make_parser, run_main
from tinydiff.io.hf_format import write_folder
from tinydiff.speculative import speculative_generate
from tinydiff.tokenizer import EOT, Tokenizer

THREADS = Rule(integer=True, lo=1, hi=1024)


def parse_args(argv=None):
    parser = make_parser("python -m tinydiff.bench.hf", __doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("--target", required=True, help="an AR checkpoint (ckpt.pt or an exported folder)")
    parser.add_argument("--draft", required=True, help="its AR draft (ckpt.pt or an exported folder)")
    parser.add_argument("--max-new-tokens", type=COUNT, default=64, help="tokens per story")
    parser.add_argument("--ks", type=number_list(COUNT), default="4,8", help="draft tokens per round of the "
                        "speculative rows (each at most --max-new-tokens - 1: a round drafts no more)")
    parser.add_argument("--threads", type=THREADS, default=1, help="torch threads (both libraries share them)")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the sampled row")
    args = parser.parse_args(argv)
    args.given = given_flags(parser, argv)
    return args


def hf_model(path, ckpt, folder: Path):
    """transformers' LlamaForCausalLM of one AR checkpoint, the same weights: an exported folder as it is, a
    ckpt.pt exported into `folder` first."""
    from transformers import AutoModelForCausalLM
    if not (Path(path) / "config.json").is_file():
        write_folder(folder, ckpt, "llama")
        path = folder
    return AutoModelForCausalLM.from_pretrained(path).eval()


def timed(run):
    start = time.perf_counter()
    ids = run()
    return ids, time.perf_counter() - start


def drafts_per_round(args) -> list[int]:
    """--ks, each clamped to what a round can draft (io/cli.clamp_drafts): a larger k drafts no more but sizes the
    tally's histogram (k + 1 slots). Said only where --ks was given; a row the clamp repeats is dropped."""
    given = "ks" in args.given
    return list(dict.fromkeys(clamp_drafts(k, args.max_new_tokens, "--ks", given) for k in dict.fromkeys(args.ks)))


def modes(target, draft, hf_target, hf_draft, n: int, ks: list[int], seed: int):
    """name -> (ours(prompt) -> ids, theirs(prompt) -> ids)."""
    generator = torch.Generator().manual_seed(seed)

    def hf(prompt, **options):
        x = torch.tensor([prompt])
        torch.manual_seed(seed)
        out = hf_target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, eos_token_id=None,
                                 pad_token_id=EOT, **options)
        return out[0, len(prompt):].tolist()

    def assisted(k):
        hf_draft.generation_config.num_assistant_tokens = k
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
        hf_draft.generation_config.assistant_confidence_threshold = 0.0
        return lambda p: hf(p, do_sample=False, assistant_model=hf_draft)

    table = {"greedy": (lambda p: ar_generate(target, p, n, 0, stop_token=None)[0], lambda p: hf(p, do_sample=False)),
             "sample": (lambda p: ar_generate(target, p, n, 1.0, generator=generator, stop_token=None)[0],
                        lambda p: hf(p, do_sample=True, temperature=1.0, top_k=0))}
    for k in ks:
        table[f"spec-k{k}"] = (lambda p, k=k: speculative_generate(target, draft, p, n, k, 0, stop_token=None)[0],
                               assisted(k))
    return table


def main(argv=None):
    args = parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("this bench needs transformers: pip install -r requirements-hf.txt") from None
    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer()
    prompts = [[EOT] + tokenizer.encode(p) for p in PROMPTS]
    (target, target_ckpt), (draft, draft_ckpt) = (load_model(p, kinds=("ar",)) for p in (args.target, args.draft))
    room = target.config.context - max(map(len, prompts))
    if args.max_new_tokens > room:  # before the export and transformers' load
        raise UserError(f"--max-new-tokens {args.max_new_tokens} passes the target's context: at most {room}")
    ks = drafts_per_round(args)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        hf_target = hf_model(args.target, target_ckpt, Path(tmp) / "target")
        hf_draft = hf_model(args.draft, draft_ckpt, Path(tmp) / "draft")
        print(f"{device_name('cpu')}; transformers {transformers.__version__}; {len(prompts)} prompts x "
              f"{args.max_new_tokens} tokens, alternating")
        print(f"{'mode':<10}{'tinydiff tok/s':>16}{'transformers tok/s':>20}{'ratio':>8}  same tokens")
        for name, (ours, theirs) in modes(target, draft, hf_target, hf_draft, args.max_new_tokens, ks,
                                          args.seed).items():
            ours(prompts[0]), theirs(prompts[0])  # warm-up, untimed
            seconds, same = [0.0, 0.0], True
            for prompt in prompts:
                (a, ta), (b, tb) = timed(lambda: ours(prompt)), timed(lambda: theirs(prompt))
                seconds[0] += ta
                seconds[1] += tb
                same &= a == b
            tokens = len(prompts) * args.max_new_tokens
            verdict = "n/a (sampled)" if name == "sample" else str(same)
            print(f"{name:<10}{tokens / seconds[0]:>16.1f}{tokens / seconds[1]:>20.1f}"
                  f"{seconds[1] / seconds[0]:>7.2f}x  {verdict}")


if __name__ == "__main__":
    sys.exit(run_main(main))
