"""tasks.py: the tiny model, the prompts, the rewards and the tool environments.

- `make_tiny_model(out_dir)`: a random-init Qwen3 (transformers.Qwen3Config, ~0.1M parameters at width 64 and 2
  layers) with a character-level tokenizer built with the `tokenizers` library, saved with `save_pretrained`
  (safetensors) so that AutoModelForCausalLM / AutoTokenizer and any engine load the directory.

Simplifications: the tokenizer is one token per printable ASCII character (other characters fall back to their
UTF-8 bytes), so it is lossless but long-winded on real text.

Run:
    python tasks.py make-tiny-model --out runs/tiny-model [--hidden-size 64 --num-layers 2 --seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import string

# Special tokens. The end of an assistant turn is the eos token, as in Qwen chat models; the toy tasks end their
# targets with it too, so "stopped on eos" is the same event for raw and chat prompts.
PAD, EOS, BOS_TURN, UNK = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, EOS, BOS_TURN, UNK]
# Every printable ASCII character is one token (\r, \x0b, \x0c are left to the byte fallback).
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]

# Qwen-style chat template: <|im_start|>role\ncontent<|im_end|>\n per message, then the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast: specials, then one token per character, then 256 byte tokens.

    A BPE model with no merges is exactly character-level; byte_fallback turns any other character into its
    UTF-8 bytes (<0xNN> tokens), so encode/decode round-trips every string.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS + [f"<0x{b:02X}>" for b in range(256)])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_tiny_model(out_dir: str, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> str:
    """Write a random-init Qwen3ForCausalLM + character tokenizer to `out_dir`; returns `out_dir`."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if hidden_size % 16 != 0:
        raise ValueError(f"hidden_size must be a multiple of 16 (head_dim 16), got {hidden_size}")
    tokenizer = build_tokenizer()
    num_heads = hidden_size // 16
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),  # grouped-query attention, as the real Qwen3 models
        head_dim=16,
        max_position_embeddings=4096,  # character-level math prompts run to a few thousand tokens
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=tokenizer.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes its own class name, which the transformers 4.x that SGLang pins cannot resolve; the
    # 4.x name loads in both.
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tok_cfg, f, indent=2)
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make-tiny-model", help="write a random-init tiny Qwen3 + character tokenizer")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "make-tiny-model":
        out = make_tiny_model(args.out, args.hidden_size, args.num_layers, args.seed)
        print(f"wrote tiny model to {out}")


if __name__ == "__main__":
    main()
