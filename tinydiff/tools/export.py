"""python -m tinydiff.tools.export --ckpt CKPT --out DIR: a model in Hugging Face's folder layout.

A dense AR model (target or draft) becomes a `LlamaForCausalLM` folder: config.json,
model.safetensors, generation_config.json, GPT-2's tokenizer files (rebuilt offline from
tiktoken's ranks, with MASK as <|mask|>) and a model card. transformers, vLLM and SGLang load it
as any Llama. Every other kind (diffusion LMs, the MoE ones, ar-moe too, drafters) is written in
tinydiff's own layout: safetensors weights and a config that says what the model is, since no
stock transformers class runs it. Either folder loads back
anywhere tinydiff takes `--ckpt` (tinydiff/io/hf_format.py reads it). No pickle is written: the
training state (optimizer, RNG, data position) stays in ckpt.pt, read with weights_only=True.
"""
import json
import sys
from dataclasses import fields
from pathlib import Path

from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_checkpoint, model_from
from tinydiff.io.cli import flag, make_parser, run_main
from tinydiff.io.hf_format import CONFIG, LLAMA_KINDS, WEIGHTS, check_layout, write_folder
from tinydiff.tokenizer import EOT, MASK
from tinydiff.tools.hf_tokenizer import MASK_TOKEN, tokenizer_files
from tinydiff.train.run_config import DRAFTERS, RunConfig, migrate

LAYOUTS = ("auto", "llama", "tinydiff")
WHAT = {"ar": "an autoregressive (causal) language model", "mdlm": "a masked-diffusion language model (MDLM)",
        "mdlm-moe": "a masked-diffusion language model with mixture-of-experts feed-forwards (dMoE)",
        "ar-moe": "an autoregressive (causal) language model with mixture-of-experts feed-forwards",
        "dflash": "a DFlash block drafter (it reads an AR target's hidden states, ar or ar-moe)",
        "eagle3": "an EAGLE-3 draft head (it reads an AR target's hidden states, ar or ar-moe)"}


def parse_args(argv=None):
    parser = make_parser("python -m tinydiff.tools.export", __doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by train.py (ckpt.pt)")
    parser.add_argument("--out", required=True, help="the folder to write (new, or empty)")
    parser.add_argument("--layout", choices=LAYOUTS, default="auto",
                        help="llama: LlamaForCausalLM (dense AR models only); tinydiff: our own names; auto: llama for "
                             "a dense AR model, tinydiff for every other kind (ar-moe included)")
    return parser.parse_args(argv)


def training_command(ckpt: dict, path) -> str:
    """The train.py command that reproduces the run: the settings that differ from their defaults."""
    if "args" not in ckpt:
        return "(not recorded in the checkpoint)"
    run, defaults = migrate(dict(ckpt["args"]), path), {f.name: f.default for f in fields(RunConfig)}
    if run.get("min_lr") is not None and run.get("lr") and abs(run["min_lr"] - run["lr"] / 10) < 1e-12:
        run["min_lr"] = None  # train.py's own default: lr / 10
    words = ["python train.py"] + [f"{flag(k)} {v}" for k, v in run.items() if v is not None and v != defaults[k]]
    return " ".join(words)


def model_card(ckpt: dict, path, layout: str, params: int) -> str:
    """README.md: what the model is, how it was trained, how to load it."""
    kind, config = ckpt["kind"], ckpt["config"]
    shape = ", ".join(f"{k} {v}" for k, v in config.items())
    if layout == "llama":
        load = ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                "model = AutoModelForCausalLM.from_pretrained(DIR)\n"
                "tokenizer = AutoTokenizer.from_pretrained(DIR)\n"
                "inputs = tokenizer('<|endoftext|>Once upon a time', return_tensors='pt')  # stories start after EOT\n"
                "out = model.generate(**inputs, max_new_tokens=64, do_sample=True, temperature=0.8)\n"
                "print(tokenizer.decode(out[0]))\n```\n\n"
                f"A Llama in transformers' layout: rotary in halves (tinydiff rotates interleaved pairs; the q and k "
                f"rows are permuted within each head), `rms_norm_eps` {config['norm_eps']}, the head tied to the "
                "embedding.")
    else:
        load = (f"No transformers class runs this model ({WHAT[kind]}); tinydiff loads the folder wherever it takes "
                f"`--ckpt`, e.g. `python generate.py --ckpt DIR` (drafters: `--drafter DIR` beside their target). "
                f"`{WEIGHTS}` holds tinydiff's own tensor names; `{CONFIG}`'s `tinydiff` section, its config.")
    return (f"# tinydiff {kind} model\n\n{WHAT[kind][0].upper() + WHAT[kind][1:]}, {params:,} parameters, trained "
            f"on TinyStories with tinydiff ({ckpt.get('step', '?')} steps).\n\n"
            f"- Shape: {shape}.\n- Tokenizer: GPT-2's BPE (`gpt2`'s vocabulary and merges, in this folder), "
            f"<|endoftext|> = {EOT} starts every prompt and ends every story; id {MASK} is MASK (`{MASK_TOKEN}`), "
            "the diffusion LMs' absorbing state, never produced by the tokenizer from text.\n"
            f"- Trained with: `{training_command(ckpt, path)}`\n"
            "- Pinned evaluation: not measured for this export (docs/RESULTS.md has the project's numbers).\n\n"
            f"## Loading\n\n{load}\n")


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; pass a new folder (nothing is overwritten)")
    ckpt = load_checkpoint(args.ckpt)
    kind = ckpt["kind"]
    layout = ("llama" if kind in LLAMA_KINDS else "tinydiff") if args.layout == "auto" else args.layout
    check_layout(kind, layout)  # before any file is built
    if kind not in DRAFTERS:  # its config one our models read, its weights the ones it builds: before any file
        model_from(ckpt, args.ckpt)
    context = ckpt["config"].get("context", 256)
    files = tokenizer_files(context)
    params = sum(t.numel() for t in ckpt["model"].values())
    files["README.md"] = model_card(ckpt, args.ckpt, layout, params)
    if kind in LLAMA_KINDS:
        files["generation_config.json"] = json.dumps({"bos_token_id": EOT, "eos_token_id": EOT, "pad_token_id": EOT,
                                                      "do_sample": True, "temperature": 0.8}, indent=2) + "\n"
    write_folder(out, ckpt, layout, files)
    print(f"wrote {out}: {kind} model, {params:,} parameters, {layout} layout "
          f"({', '.join(sorted([CONFIG, WEIGHTS, *files]))})")


if __name__ == "__main__":
    sys.exit(run_main(main))
