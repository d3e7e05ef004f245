"""python -m tinydiff.tools.quantize --ckpt CKPT --out CKPT_FP4 [--format mxfp4]: FP4 experts, after training.

Reads a mixture-of-experts LM (an mdlm-moe or ar-moe checkpoint, a .pt or an exported folder),
packs the weights of every expert (routed and shared) in MXFP4 (OCP MX v1.0: E2M1 values, one
power-of-two scale per 32 inputs) or NVFP4, and writes a checkpoint of the quantized model;
attention, router, norms and embedding are copied as they are (tinydiff/fp4.py). The
checkpoint records the format in its config and keeps the source's kind, so generate.py,
`python -m tinydiff.bench --moe` (mdlm-moe) or `--ckpt` (ar-moe, the target its float version's DFlash
drafter drafts for), `python -m tinydiff.bench.quality --mdlm` and `python -m tinydiff.tools.eval --ckpt` take it.
It keeps the source's step count and training settings, not its optimizer or RNG state: it is
for inference, not for --resume. Everything that can be wrong is checked before any work: the
output path (a new file in a writable folder; nothing is overwritten), the checkpoint's kind,
the format, and the block size against the experts' input widths.
"""
import sys
from dataclasses import replace
from pathlib import Path

from tinydiff import fp4
from tinydiff.checks import Rule, UserError
from tinydiff.fp4 import quantize_experts
from tinydiff.io.checkpoint import MOE_KINDS, config_from, load_checkpoint, model_from, save_checkpoint
from tinydiff.io.cli import make_parser, run_main
from tinydiff.io.files import check_output

BLOCK = Rule(integer=True, lo=2, hi=4096)


def parse_args(argv=None):
    parser = make_parser("python -m tinydiff.tools.quantize", __doc__.split("\n")[0].split(": ", 1)[1])
    parser.add_argument("--ckpt", required=True, help="an mdlm-moe or ar-moe checkpoint (train.py --model mdlm-moe "
                                                      "or ar-moe)")
    parser.add_argument("--out", required=True, help="the checkpoint file to write (a new path)")
    parser.add_argument("--format", choices=fp4.FORMATS, default="mxfp4", help="how the expert weights are stored")
    parser.add_argument("--block-size", type=BLOCK, help="values per scale along each expert's input (default: the "
                                                         "format's own, 32 for mxfp4 and 16 for nvfp4)")
    return parser.parse_args(argv)


def check_out(out: Path, ckpt: Path):
    check_output(out, "--out")
    if out.exists() or out.is_symlink():
        same = " (it is --ckpt)" if ckpt.exists() and out.resolve() == ckpt.resolve() else ""
        raise UserError(f"--out {out} exists{same}; pass a new path (nothing is overwritten)")


def main(argv=None):
    args = parse_args(argv)
    out, source = Path(args.out), Path(args.ckpt)
    check_out(out, source)
    ckpt = load_checkpoint(source)  # also refuses NaN or inf weights
    if ckpt["kind"] not in MOE_KINDS:
        raise UserError(f"{source} holds a {ckpt['kind']} model, which has no experts to quantize; pass a "
                        "mixture-of-experts checkpoint (train.py --model mdlm-moe or ar-moe)")
    config = config_from(ckpt, source)
    if config.expert_format != "float":
        raise UserError(f"{source}'s experts are already {config.expert_format}; pass the full-precision checkpoint")
    block = fp4.STANDARD_BLOCK[args.format] if args.block_size is None else args.block_size
    config = replace(config, expert_format=args.format, expert_block=block)  # the block against the widths
    model = quantize_experts(model_from(ckpt, source), args.format, block)
    extra = {key: ckpt[key] for key in ("step", "args") if key in ckpt}
    save_checkpoint(out, kind=ckpt["kind"], config=config, model=model, **extra)
    layer = model.blocks[0].ffn
    before = 4 * 3 * config.d_model * config.expert_d_ff  # one float32 expert
    print(f"wrote {out}: {config.n_experts} experts x {config.n_layer} layers (+ shared: {config.shared_expert}) in "
          f"{args.format}, block {block}: {layer.expert_bytes():,} bytes per expert instead of {before:,} in "
          f"float32 ({before / layer.expert_bytes():.2f}x fewer); attention, router and embedding unchanged")


if __name__ == "__main__":
    sys.exit(run_main(main))
