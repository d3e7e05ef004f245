"""Models in Hugging Face's folder layout (config.json + model.safetensors), both ways.

Two layouts:
  - llama: an AR model as transformers' `LlamaForCausalLM` reads it. Our Transformer is a Llama
    (RMSNorm, rotary, SwiGLU, no biases, tied head); the differences are names, and the rotary
    convention: we rotate interleaved pairs (2i, 2i+1) of each head, HF rotates halves (i, i + D/2),
    so the q and k projections' rows are permuted within each head (`HALVES`). `rms_norm_eps` is
    ours (HF's default 1e-6 would move the logits).
  - tinydiff: every other kind (diffusion LMs, MoE, drafters), which no stock transformers class
    runs: our own state dict under our own names, and a config that says what the model is.
Either way config.json carries a "tinydiff" section (kind, our config) so a round trip is exact;
a Llama folder from elsewhere, without it, is read from its Llama fields when they describe a
model our Transformer is (`model_config_of`). `read_folder` returns the checkpoint dict that
checkpoint.load_checkpoint returns for a .pt file, so `--ckpt DIR` works wherever a .pt does.
Leaves out: GQA, rope scaling, untied heads, sharded weight files (all refused with one line).
"""
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from tinydiff.checks import UserError
from tinydiff.io.files import write_atomic
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import EOT, MASK, VOCAB_SIZE

FORMAT, VERSION = "tinydiff-hf", 1
CONFIG, WEIGHTS = "config.json", "model.safetensors"
LLAMA_KINDS = ("ar",)  # the kinds a LlamaForCausalLM computes exactly: causal, no MASK in play
LAYER_NAMES = {  # ours -> HF's, inside block i
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.gate.weight": "mlp.gate_proj.weight", "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight", "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight"}


LLAMA_FIELDS = ("vocab_size", "context", "n_layer", "n_head", "d_model", "d_ff", "rope_base", "norm_eps")  # both say


def halves(n_head: int, head_dim: int):
    """Row order that turns our interleaved rotary pairs into HF's halves: HF row j of a head is our
    row 2j for j < D/2, our row 2(j - D/2) + 1 after. (n_head * head_dim,) indices."""
    one = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))  # (D,)
    return torch.cat([h * head_dim + one for h in range(n_head)])


def llama_config(config: ModelConfig) -> dict:
    """LlamaConfig fields for our AR config (both rope spellings: transformers 4's and 5's)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": config.vocab_size,
            "hidden_size": config.d_model, "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head, "num_key_value_heads": config.n_head,
            "head_dim": config.d_model // config.n_head, "max_position_embeddings": config.context,
            "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base}, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True, "bos_token_id": EOT,
            "eos_token_id": EOT, "torch_dtype": "float32"}


def to_llama(weights: dict, config: ModelConfig) -> dict:
    """Our AR state dict -> LlamaForCausalLM's (the tied head is the embedding: no lm_head tensor)."""
    rows = halves(config.n_head, config.d_model // config.n_head)
    out = {"model.embed_tokens.weight": weights["embed.weight"], "model.norm.weight": weights["norm.weight"]}
    for i in range(config.n_layer):
        for ours, theirs in LAYER_NAMES.items():
            w = weights[f"blocks.{i}.{ours}"]
            out[f"model.layers.{i}.{theirs}"] = w[rows] if ours in ("attn.wq.weight", "attn.wk.weight") else w
    return {name: w.contiguous() for name, w in out.items()}


def from_llama(weights: dict, config: ModelConfig, path) -> dict:
    """LlamaForCausalLM's state dict -> ours; every tensor must be there, and nothing else."""
    rows = torch.argsort(halves(config.n_head, config.d_model // config.n_head))  # the inverse permutation
    head = weights.get("lm_head.weight")
    if head is not None and not torch.equal(head, weights.get("model.embed_tokens.weight", head[:0])):
        raise UserError(f"{path}: its lm_head is not its embedding; tinydiff models tie them (untied heads are "
                        "not supported)")
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    names |= {f"blocks.{i}.{ours}": f"model.layers.{i}.{theirs}"
              for i in range(config.n_layer) for ours, theirs in LAYER_NAMES.items()}
    missing = [theirs for theirs in names.values() if theirs not in weights]
    extra = sorted(set(weights) - set(names.values()) - {"lm_head.weight"})
    if missing or extra:
        raise UserError(f"{path}: {WEIGHTS} does not fit its config ("
                        f"{'missing ' + missing[0] if missing else 'unexpected ' + extra[0]}); export it again")
    return {ours: weights[theirs][rows] if ours.endswith(("wq.weight", "wk.weight")) else weights[theirs]
            for ours, theirs in names.items()}


def model_config_of(hf: dict, path) -> ModelConfig:
    """Our ModelConfig for a Llama config.json from elsewhere, if our Transformer computes that model."""
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in need if key not in hf]
    if missing:
        raise UserError(f"{path}: {CONFIG} lacks {', '.join(missing)}; it is not a Llama config")
    heads, width = hf["num_attention_heads"], hf["hidden_size"]
    refusals = [(hf.get("num_key_value_heads", heads) != heads, "grouped-query attention (num_key_value_heads "
                 f"{hf.get('num_key_value_heads')} != num_attention_heads {heads})"),
                (hf.get("head_dim", width // heads) * heads != width, "head_dim * heads != hidden_size"),
                (hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}, not silu"),
                (bool(hf.get("attention_bias") or hf.get("mlp_bias")), "biases"),
                (hf.get("tie_word_embeddings") is False, "an untied lm_head"),
                (bool(hf.get("rope_scaling")) or (hf.get("rope_parameters") or {}).get("rope_type", "default")
                 != "default", "rope scaling")]
    refused = [what for bad, what in refusals if bad]
    if refused:
        raise UserError(f"{path}: a Llama with {refused[0]}, which tinydiff's Transformer does not have")
    rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    try:
        return ModelConfig(vocab_size=hf["vocab_size"], context=hf.get("max_position_embeddings", 2048),
                           n_layer=hf["num_hidden_layers"], n_head=heads, d_model=width,
                           d_ff=hf["intermediate_size"], rope_base=rope, norm_eps=hf.get("rms_norm_eps", 1e-6))
    except UserError as e:
        raise UserError(f"{path}: {e}") from None


def check_layout(kind: str, layout: str):
    """Only a dense AR model is a Llama: causal attention, no MASK in play, no experts (ar-moe is not one)."""
    if layout == "llama" and kind not in LLAMA_KINDS:
        raise UserError(f"a {kind} model is not a Llama (only a dense AR model is: causal attention, no MASK, no experts); "
                        "export it in tinydiff's layout (drop --layout llama)")


def write_folder(out, ckpt: dict, layout: str, extra_files: dict | None = None):
    """Write a checkpoint's model ({kind, config, model}) as config.json and model.safetensors, and
    `extra_files` ({name: text}), into `out`, all at once: into a new folder beside it, renamed to `out`
    at the end (onto nothing or an empty folder only), so a stopped export leaves no half folder and an
    export that finds `out` filled meanwhile is refused. layout "llama" (AR only) or "tinydiff"."""
    from safetensors.torch import save
    kind, weights = ckpt["kind"], ckpt["model"]
    if "embed.weight" in weights:  # the true vocabulary: the padding rows (model.padded_vocab) stay behind
        weights = {**weights, "embed.weight": weights["embed.weight"][:ckpt["config"]["vocab_size"]]}
    check_layout(kind, layout)
    out = Path(out)
    ours = {"format": FORMAT, "version": VERSION, "kind": kind, "config": ckpt["config"]}
    if layout == "llama":
        config = ModelConfig(**ckpt["config"])
        hf, tensors = llama_config(config) | {"tinydiff": ours}, to_llama(weights, config)
    else:
        hf = {"model_type": f"tinydiff-{kind}", "tinydiff": ours}
        tensors = {name: w.contiguous() for name, w in weights.items()}
    blob = save(tensors, metadata={"format": "pt"})
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"  # a folder's mode, as out.mkdir would give
    shutil.rmtree(partial, ignore_errors=True)  # a killed export's, whose PID this process now has
    partial.mkdir(parents=True)
    try:
        write_atomic(partial / WEIGHTS, lambda f: f.write(blob))
        for name, text in {CONFIG: json.dumps(hf, indent=2) + "\n", **(extra_files or {})}.items():
            write_atomic(partial / name, lambda f, text=text: f.write(text.encode("utf-8")))
        try:
            os.rename(partial, out)
        except OSError:  # out holds files now: another export's, or the user's
            raise UserError(f"--out {out} was filled while this export ran (another export?); it is left as it "
                            "is: pass a new folder") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already once renamed


def read_folder(path) -> dict:
    """{kind, config, model} of an exported folder, the checkpoint dict's model part (load_checkpoint
    adds the rest); a Llama folder without our section is read as an AR model. Every failure is one
    line naming the folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise UserError(f"{path} has no {name}; pass a folder written by `python -m tinydiff.tools.export` "
                            "(config.json + model.safetensors) or a ckpt.pt")
    try:
        hf = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path / CONFIG} is not valid JSON ({e}); export the model again") from None
    try:
        weights = load_file(path / WEIGHTS)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path / WEIGHTS} is not a readable safetensors file ({e}); export the model again") from None
    if not isinstance(hf, dict):
        raise UserError(f"{path / CONFIG} is not a config (a JSON object); export the model again")
    ours = hf.get("tinydiff")
    if ours is not None and not (isinstance(ours, dict) and ours.get("format") == FORMAT):
        raise UserError(f"{path / CONFIG}: its tinydiff section is not {FORMAT}'s; export the model again")
    if ours is not None and ours.get("version") != VERSION:
        raise UserError(f"{path / CONFIG}: tinydiff export version {ours.get('version')!r}, this code reads {VERSION}")
    if ours is None and hf.get("model_type") != "llama":
        raise UserError(f"{path / CONFIG}: a {hf.get('model_type')!r} model, neither a Llama nor a tinydiff export")
    kind = ours.get("kind") if ours else "ar"  # an unknown kind: load_checkpoint's check names it
    if not isinstance(ours.get("config") if ours else {}, dict):
        raise UserError(f"{path / CONFIG}: its tinydiff config is not a JSON object; export the model again")
    if hf.get("model_type") == "llama":
        if ours is None:
            config = model_config_of(hf, path)
        else:
            try:
                config = ModelConfig(**ours["config"])
            except (TypeError, UserError) as e:  # a field this code does not know, a value out of range
                raise UserError(f"{path / CONFIG}: not a model config this code reads ({e})") from None
            said = model_config_of(hf, path)  # what transformers builds from the same file: the same model
            differ = [f for f in LLAMA_FIELDS if getattr(said, f) != getattr(config, f)]
            if differ:
                raise UserError(f"{path / CONFIG}: its Llama fields and its tinydiff section disagree on {differ[0]} "
                                f"({getattr(said, differ[0])!r} against {getattr(config, differ[0])!r}), so "
                                "transformers would build another model; export it again")
        if config.vocab_size != VOCAB_SIZE:
            raise UserError(f"{path}: a vocabulary of {config.vocab_size:,} ids, not the {VOCAB_SIZE:,} of "
                            f"tinydiff's tokenizer (GPT-2's 50,257 and MASK = {MASK}); it cannot read our token ids")
        return {"kind": kind, "config": asdict(config), "model": from_llama(weights, config, path)}
    return {"kind": kind, "config": ours["config"], "model": weights}
