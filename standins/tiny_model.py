r"""standins/tiny_model.py: the tiny model that stands in for a pretrained LM, so that a run learns on a CPU.

- `make_tiny_model(out_dir)`: a Qwen3 (transformers.Qwen3Config, ~0.1M parameters at width 64 and 2 layers; or,
  num_experts > 0, a Qwen3-MoE: configs/tiny_moe.yaml) with a character-level tokenizer built with the `tokenizers`
  library, random init and optionally `pretrain`ed on a toy task (PRETRAIN_TASK_OF: each RL task's base), saved
  with `save_pretrained` (safetensors) so that AutoModelForCausalLM / AutoTokenizer and any engine load the
  directory.
- `make_tiny_for(cfg)` / `check_tiny_base(cfg)`: the base a run's config asks for (model.make_tiny), made once at
  model.path and held to that recipe afterwards.
- `make_sharp_model(out_dir)`: the same model with random RMSNorm gains, for tests and benches that compare the
  engine's outputs with the trainer's (a random-init model's outputs are nearly uniform).

Simplifications: the tokenizer is one token per printable ASCII character; any other character becomes <|unk|>
(a special token, so decoding drops it): round trips are exact on ASCII text only.

Run (from the repository root):
    python -m standins.tiny_model --out runs/tiny-base [--hidden-size 64 --num-layers 2 --seed 0]
                                  [--num-experts 8 --experts-per-token 2]   # a Qwen3-MoE
                                  [--pretrain-task copy_digits --pretrain-steps 300]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
from typing import Optional

import tasks

# Special tokens. The end of an assistant turn is the eos token, as in Qwen chat models; the toy tasks end their
# targets with it too, so "stopped on eos" is the same event for raw and chat prompts.
PAD, EOS, BOS_TURN, UNK = "<|endoftext|>", "<|im_end|>", "<|im_start|>", "<|unk|>"
SPECIAL_TOKENS = [PAD, EOS, BOS_TURN, UNK]
# Every printable ASCII character is one token; anything else (\r, \x0b, \x0c, non-ASCII) is <|unk|>.
CHARS = [c for c in string.printable if c not in "\r\x0b\x0c"]

# Qwen-style chat template: <|im_start|>role\ncontent<|im_end|>\n per message, then the assistant header.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():
    """A character-level PreTrainedTokenizerFast: the special tokens, then one token per character.

    A BPE model with no merges is exactly character-level. The vocabulary is kept small on purpose: a random-init
    model samples every token about equally at first, so RL finds the digits sooner the fewer tokens there are
    (reverse_digits, GRPO 16x8, lr 1e-3: mean reward 0.27 after 300 steps with these 101 tokens, 0.07 with 256
    byte-fallback tokens added).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK,
                                 clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_tiny_model(out_dir: str, hidden_size: int = 64, num_layers: int = 2, seed: int = 0,
                    pretrain_task: Optional[str] = None, pretrain_steps: int = 0, num_experts: int = 0,
                    experts_per_token: int = 2, made_by: Optional[str] = None) -> str:
    """Write a Qwen3ForCausalLM + character tokenizer to `out_dir`; returns `out_dir`. num_experts > 0: a
    Qwen3MoeForCausalLM instead, every layer sparse with `num_experts` experts of width hidden_size // 2, top
    `experts_per_token` (renormalised, as Qwen3-30B-A3B's norm_topk_prob), so that its active MLP width equals
    the dense model's at top-2 and the two bases are of one size class.

    Random init, then (pretrain_steps > 0) `pretrain_steps` supervised steps on the toy task `pretrain_task`
    (PRETRAIN_TASKS), with the loss curve written to `out_dir/pretrain.json`. Training happens in a temporary
    directory renamed into place at the end, so an interrupted run never leaves a half-made model at `out_dir`.
    The arguments are recorded in `out_dir/tiny_recipe.json` (tiny_recipe, plus `made_by`: "model.make_tiny" when
    a run made it as its cache, which check_tiny_base then holds to the run's config).
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if hidden_size % 16 != 0:
        raise ValueError(f"hidden_size must be a multiple of 16 (head_dim 16), got {hidden_size}")
    tokenizer = build_tokenizer()
    num_heads = hidden_size // 16
    moe = dict(num_experts=num_experts, num_experts_per_tok=experts_per_token, moe_intermediate_size=hidden_size // 2,
               decoder_sparse_step=1, norm_topk_prob=True) if num_experts else {}
    config = (Qwen3MoeConfig if num_experts else Qwen3Config)(
        **moe,
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
    model = (Qwen3MoeForCausalLM if num_experts else Qwen3ForCausalLM)(config).float()
    if num_experts:
        model.set_experts_implementation("eager")  # a matmul per expert: transformers' grouped_mm is ~10x slower on CPU
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=tokenizer.pad_token_id)
    record = pretrain(model, tokenizer, pretrain_task, pretrain_steps, seed) if pretrain_steps > 0 else None
    tmp = out_dir.rstrip("/") + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    # transformers 5 writes its own tokenizer class name (TokenizersBackend), which transformers 4.x cannot resolve;
    # PreTrainedTokenizerFast loads in both (SGLang 0.5.23 pins transformers 5.19.0, but older servers and
    # downstream tools still run 4.x).
    path = os.path.join(tmp, "tokenizer_config.json")
    with open(path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tok_cfg, f, indent=2)
    if record is not None:
        with open(os.path.join(tmp, "pretrain.json"), "w") as f:
            json.dump(record, f, indent=1)
    with open(os.path.join(tmp, RECIPE_FILE), "w") as f:
        json.dump({**tiny_recipe(hidden_size, num_layers, seed, pretrain_task, pretrain_steps, num_experts,
                                 experts_per_token), "made_by": made_by}, f, indent=1)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# Supervised pretraining of the tiny base. Real RL post-training starts from a model that knows the format of its
# answers; from random init the reverse_digits policy never samples a whole answer, never sees the reward of
# stopping, and plateaus near 0.45 with eos probability collapsed. Each RL task's base is therefore trained on a
# *different* task over the same format, so that RL still has to learn the task itself:
#   reverse_digits <- copy_digits: "4711=" -> "4711" eos. Teaches digits, answer length and stopping, not the
#                     reversal: greedy reverse_digits reward of the base is ~0.26 (1-digit prompts, palindromes and
#                     first digits that happen to match).
#   calc_tool      <- calc_call:   "37*59=" -> "calc 37*59" eos, the tool-call turn alone. Teaches the call syntax;
#                     reading the tool's answer back and stopping after it is left to RL.
#   calc_py        <- py_call:     "37*59=" -> "py 37*59" eos, and apart "=2183\n" -> "2183" eos: each turn alone,
#                     never a whole episode (from calc_call's base RL barely starts: the greedy eval is ~0.01 and
#                     97% of the groups have 8 equal rewards). Chaining them in one context is left to RL.

def make_sharp_model(out_dir: str, seed: int = 0, num_experts: int = 0) -> str:
    """make_tiny_model (no pretraining; num_experts > 0: the tiny Qwen3-MoE, top-2) with random RMSNorm gains
    (2 x N(0, 1), a generator seeded with `seed`): a random-init model with tied embeddings greedily repeats its
    last input token and attends almost uniformly, which would make engine-vs-trainer and weight-change checks
    vacuous. For tests and benches, not training."""
    import torch
    from transformers import AutoModelForCausalLM

    make_tiny_model(out_dir, seed=seed, num_experts=num_experts, made_by="make_sharp_model")
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return out_dir


def _copy_digits_example(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 5)))
    return f"{digits}=", digits


def _calc_call_example(rng: random.Random) -> tuple[str, str]:
    text, _ = tasks.TOY_TASKS["calc_tool"](rng)
    return text, f"calc {text[:-1]}"


def _py_call_example(rng: random.Random) -> tuple[str, str]:
    """Half the time calc_py's tool call alone, half reading a tool's answer back alone ("=2183\n" -> "2183")."""
    if rng.random() < 0.5:
        text, _ = tasks.TOY_TASKS["calc_tool"](rng)
        return text, f"py {text[:-1]}"
    digits = str(rng.randint(0, 9999))
    return f"={digits}\n", digits


PRETRAIN_TASKS = {"copy_digits": _copy_digits_example, "calc_call": _calc_call_example, "py_call": _py_call_example}
PRETRAIN_TASK_OF = {"reverse_digits": "copy_digits", "calc_tool": "calc_call", "calc_py": "py_call"}  # RL task: base
PRETRAIN_BATCH, PRETRAIN_LR = 64, 3e-3


RECIPE_FILE = "tiny_recipe.json"
# a recipe's fields and the config keys that set them (make_tiny_for)
RECIPE_KEYS = {"pretrain_task": "data_source.task (its base's pretraining task)",
               "pretrain_steps": "model.tiny_pretrain_steps", "seed": "seed", "hidden_size": "model.tiny_hidden_size",
               "num_layers": "model.tiny_num_layers", "num_experts": "model.tiny_num_experts",
               "experts_per_token": "model.tiny_experts_per_token"}


def tiny_recipe(hidden_size: int, num_layers: int, seed: int, pretrain_task: Optional[str], pretrain_steps: int,
                num_experts: int, experts_per_token: int) -> dict:
    """What makes a tiny base what it is, normalised: no pretraining task without steps, no top-k without experts."""
    return {"pretrain_task": pretrain_task if pretrain_steps > 0 else None,
            "pretrain_steps": pretrain_steps, "seed": seed, "hidden_size": hidden_size,
            "num_layers": num_layers, "num_experts": num_experts,
            "experts_per_token": experts_per_token if num_experts else None}


def _recipe_args(cfg) -> tuple:
    m = cfg.model
    return (m.tiny_hidden_size, m.tiny_num_layers, cfg.seed, PRETRAIN_TASK_OF.get(cfg.data_source[0].task),
            m.tiny_pretrain_steps, m.tiny_num_experts, m.tiny_experts_per_token)


def make_tiny_for(cfg) -> str:
    """The tiny model a run's config asks for (config.Config: model.tiny_*, seed, the first data source's task's
    base), made at model.path as the run's cache (made_by "model.make_tiny": check_tiny_base holds later runs to
    its recipe)."""
    return make_tiny_model(cfg.model.path, *_recipe_args(cfg), made_by="model.make_tiny")


def check_tiny_base(cfg) -> None:
    """model.make_tiny reuses the base at model.path only when it is the one this config would make: a base that a
    run made (its tiny_recipe.json says made_by "model.make_tiny") with another recipe is refused in one sentence,
    naming the fields that differ. Otherwise a first run with model.tiny_pretrain_steps=0 would leave an untrained
    base that every later default run silently trains from. Refused rather than remade in place: another run may
    be reading it, and the user chose that directory. A base made otherwise (tasks.py make-tiny-model, a test's
    make_tiny_model, an HF checkpoint) is used as given."""
    path = os.path.join(cfg.model.path, RECIPE_FILE)
    if not cfg.model.make_tiny or not os.path.isfile(path):
        return
    with open(path) as f:
        made = json.load(f)
    if made.get("made_by") != "model.make_tiny":
        return
    want = tiny_recipe(*_recipe_args(cfg))
    diff = [f"{RECIPE_KEYS[k]}: {made.get(k)!r} there, {want[k]!r} in this config" for k in RECIPE_KEYS
            if made.get(k) != want[k]]
    if diff:
        raise ValueError(f"model.path '{cfg.model.path}' holds a tiny base made by model.make_tiny with another "
                         f"recipe ({'; '.join(diff)}); delete that directory to have it made again for this config, "
                         "set model.path to another directory, or set model.make_tiny=false to use it as it is")


def pretrain(model, tokenizer, task: str, steps: int, seed: int = 0) -> dict:
    """`steps` Adam steps of next-token cross-entropy on the response tokens ("answer" + eos) of `task`, batches
    of PRETRAIN_BATCH examples; returns {"task", "steps", "loss": [per step], "seconds"}."""
    import time

    import torch

    if task not in PRETRAIN_TASKS:
        raise ValueError(f"pretraining task '{task}' is unknown; accepted: {', '.join(PRETRAIN_TASKS)}")
    rng = random.Random(f"pretrain:{task}:{seed}")
    opt = torch.optim.Adam(model.parameters(), lr=PRETRAIN_LR)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    losses, t0 = [], time.perf_counter()
    model.train()
    for _ in range(steps):
        pairs = [PRETRAIN_TASKS[task](rng) for _ in range(PRETRAIN_BATCH)]
        ids_p, ids_a = (tokenizer(list(texts), add_special_tokens=False)["input_ids"] for texts in zip(*pairs))
        rows = [p + a + [eos] for p, a in zip(ids_p, ids_a)]  # one batched call each: a third of the time per call
        masks = [[0] * len(p) + [1] * (len(a) + 1) for p, a in zip(ids_p, ids_a)]
        width = max(map(len, rows))
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 5))
    model.eval()
    return {"task": task, "steps": steps, "batch": PRETRAIN_BATCH, "lr": PRETRAIN_LR, "loss": losses,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-experts", type=int, default=0, help="> 0: a Qwen3-MoE with this many experts per layer")
    parser.add_argument("--experts-per-token", type=int, default=2, help="top-k of the Qwen3-MoE")
    parser.add_argument("--pretrain-task", default=None, choices=sorted(PRETRAIN_TASKS),
                        help="supervised pretraining task of the base (default: random init)")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="steps of --pretrain-task")
    args = parser.parse_args(argv)
    steps = args.pretrain_steps if args.pretrain_task else 0
    out = make_tiny_model(args.out, args.hidden_size, args.num_layers, args.seed, args.pretrain_task, steps,
                          args.num_experts, args.experts_per_token)
    print(f"wrote tiny model to {out}" + (f" ({steps} steps of {args.pretrain_task})" if steps else ""))


if __name__ == "__main__":
    main()
