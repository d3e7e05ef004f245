"""GPT-2's tokenizer files for Hugging Face (vocab.json, merges.txt), rebuilt offline from tiktoken's ranks.

tiktoken stores GPT-2's BPE as ranks only (token bytes -> id); transformers' GPT2Tokenizer wants a
vocabulary of printable strings and the ordered list of merges. Both follow from the ranks:
  - vocab: each token's bytes written through GPT-2's byte -> printable-character table
    (`byte_chars`, the one in GPT-2's encoder.py), id = rank;
  - merges: BPE applies merges in rank order, so the merge that makes token t is the last step of
    BPE run on t's bytes with only the ranks below t's (`merge_of`): the two pieces it ends with.
MASK (id 50257) is added as the special token "<|mask|>", after <|endoftext|> (50256).
Leaves out: other encodings, tokenizer.json (transformers builds it from these two files).
"""
import functools
import json

from tinydiff.tokenizer import EOT, MASK

MASK_TOKEN = "<|mask|>"


def byte_chars() -> dict[int, str]:
    """GPT-2's table: printable bytes stand for themselves, the other 68 map to chr(256 + n) in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def merge_of(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two pieces BPE joins last to make `token`, merging only pairs ranked below it."""
    parts, limit = [bytes([b]) for b in token], ranks[token]
    while len(parts) > 2:
        pairs = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank >= limit:
            raise ValueError(f"token {token!r} is not reachable by BPE below its rank")
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def gpt2_ranks() -> dict[bytes, int]:
    """tiktoken's r50k_base ranks (GPT-2's BPE), from its cache or download."""
    from tiktoken_ext.openai_public import r50k_base
    return r50k_base()["mergeable_ranks"]


@functools.cache
def vocab_and_merges() -> tuple[str, str]:
    """vocab.json's and merges.txt's text (built once a process: about a second)."""
    ranks, chars = gpt2_ranks(), byte_chars()
    show = lambda token: "".join(chars[b] for b in token)  # noqa: E731
    vocab = {show(token): rank for token, rank in ranks.items()} | {"<|endoftext|>": EOT, MASK_TOKEN: MASK}
    merges = [merge_of(ranks, token) for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]) if len(token) > 1]
    return (json.dumps(vocab, ensure_ascii=False),
            "#version: 0.2\n" + "".join(f"{show(a)} {show(b)}\n" for a, b in merges))


def tokenizer_files(context: int) -> dict[str, str]:
    """{file name: text} of the GPT-2 tokenizer transformers loads with AutoTokenizer, MASK included."""
    vocab, merges = vocab_and_merges()
    special = {"content": "<|endoftext|>", "special": True, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False}
    config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": context, "add_prefix_space": False,
              "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "mask_token": MASK_TOKEN, "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": {str(EOT): special, str(MASK): {**special, "content": MASK_TOKEN}}}
    return {"vocab.json": vocab, "merges.txt": merges, "tokenizer_config.json": json.dumps(config, indent=2)}
