"""standins/tiny_model.py: the tiny model and its character tokenizer, its pretraining, the recipe a run's cache is
held to, and the old names in tasks.py refused with the new ones."""
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import config
import tasks
from standins import tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    tiny_model.main(["--out", out])
    return out


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny)

# ---------------------------------------------------------------------------------------------------------------
# The tiny model and tokenizer

def test_tiny_model_reloads_with_the_same_logits(tiny, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny)
    n_params = sum(p.numel() for p in model.parameters())
    assert type(model).__name__ == "Qwen3ForCausalLM" and 50_000 < n_params < 200_000
    ids = torch.tensor([[5, 6, 7, 8, 9, 14]])
    logits = model(ids).logits
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(again(ids).logits, logits)
    # Same seed, same weights; another seed, other weights.
    same = AutoModelForCausalLM.from_pretrained(tiny_model.make_tiny_model(str(tmp_path / "same")))
    other = AutoModelForCausalLM.from_pretrained(tiny_model.make_tiny_model(str(tmp_path / "other"), seed=1))
    assert torch.equal(same(ids).logits, logits) and not torch.allclose(other(ids).logits, logits)


def test_tiny_model_config_names_eos_and_pad(tiny, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.eos_token_id != tok.pad_token_id
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tok.pad_token_id
    assert model.config.vocab_size == len(tok) == 101
    with open(f"{tiny}/tokenizer_config.json") as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x too


def test_tokenizer_is_character_level_and_round_trips(tok):
    text = "".join(tiny_model.CHARS) + " Answer: \\boxed{\\frac{1}{2}}\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    eos = tok.eos_token_id
    assert tok.decode(tok("54321", add_special_tokens=False)["input_ids"] + [eos], skip_special_tokens=True) == "54321"
    assert tok.decode(tok("a\u00e9b", add_special_tokens=False)["input_ids"]) == "a<|unk|>b"
    assert tok.decode(tok("a\u00e9b", add_special_tokens=False)["input_ids"], skip_special_tokens=True) == "ab"


def _greedy_exact(model, tok, examples) -> float:
    hits = 0
    for text, label in examples:
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:].tolist()
        hits += out[:len(label) + 1] == tok(label, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return hits / len(examples)


def test_pretrained_base_knows_its_pretraining_task_and_not_the_rl_task(tmp_path):
    out = tiny_model.main(["--out", str(tmp_path / "base"), "--pretrain-task", "copy_digits",
                           "--pretrain-steps", "200"]) or str(tmp_path / "base")
    with open(f"{out}/pretrain.json") as f:
        rec = json.load(f)
    assert rec["task"] == "copy_digits" and rec["steps"] == len(rec["loss"]) == 200
    assert rec["loss"][-1] < 0.2 * rec["loss"][0]
    assert not any(p.name.startswith("base.tmp") for p in tmp_path.iterdir())  # made in a temp dir, renamed
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    reverse = tasks.toy_examples("reverse_digits", 32, 0, "eval")
    copy = [(text, text[:-1]) for text, _ in reverse]
    # It copies; it reverses only where copying is reversing (1 digit, palindromes): RL has the task to learn.
    assert _greedy_exact(model, tok, copy) > 0.6
    assert _greedy_exact(model, tok, reverse) < 0.45
    assert tiny_model.PRETRAIN_TASK_OF["reverse_digits"] == "copy_digits"
    text, answer = tiny_model.PRETRAIN_TASKS["calc_call"](__import__("random").Random(0))
    assert answer == f"calc {text[:-1]}" and tasks.CalcToolEnv("1", {}).step(answer) is not None  # a valid call


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"




def _tiny_cfg(tmp_path, *overrides):
    return config.load_config("configs/tiny.yaml", [f"model.path={tmp_path / 'base'}", *overrides])


def test_a_cached_tiny_base_of_another_recipe_is_refused(tmp_path):
    """model.make_tiny made an untrained base (tiny_pretrain_steps=0); a later default run is refused in one sentence
    naming what differs instead of silently training from it; a run of the same recipe reuses it."""
    import checks

    untrained = _tiny_cfg(tmp_path, "model.tiny_pretrain_steps=0")
    tiny_model.make_tiny_for(untrained)
    with open(tmp_path / "base" / tiny_model.RECIPE_FILE) as f:
        assert json.load(f) == {"pretrain_task": None, "pretrain_steps": 0, "seed": 0, "hidden_size": 64,
                                "num_layers": 2, "num_experts": 0, "experts_per_token": None,
                                "made_by": "model.make_tiny"}
    checks.check_launch(untrained, 2)  # the same recipe: reused
    default = _tiny_cfg(tmp_path)
    with pytest.raises(ValueError) as err:
        checks.check_launch(default, 2)
    assert str(err.value) == (
        f"model.path '{tmp_path / 'base'}' holds a tiny base made by model.make_tiny with another recipe "
        "(data_source.task (its base's pretraining task): None there, 'copy_digits' in this config; "
        "model.tiny_pretrain_steps: 0 there, 300 in this config); delete that directory to have it made again for "
        "this config, set model.path to another directory, or set model.make_tiny=false to use it as it is")
    with pytest.raises(ValueError, match=r"\(seed: 0 there, 1 in this config; model.tiny_hidden_size: 64 there, 32 "):
        tiny_model.check_tiny_base(_tiny_cfg(tmp_path, "model.tiny_pretrain_steps=0", "seed=1", "model.tiny_hidden_size=32"))
    tiny_model.check_tiny_base(_tiny_cfg(tmp_path, "model.make_tiny=false"))  # not the cache: used as it is


def test_a_base_made_by_hand_is_used_as_given(tiny):
    with open(f"{tiny}/{tiny_model.RECIPE_FILE}") as f:
        assert json.load(f)["made_by"] is None  # python -m standins.tiny_model: recorded, never held to a config
    tiny_model.check_tiny_base(config.load_config("configs/tiny.yaml", [f"model.path={tiny}"]))


# ---------------------------------------------------------------------------------------------------------------
# The names the tiny model had in tasks.py

def test_the_tiny_models_old_command_is_refused_naming_the_new_one():  # its names: tests/test_layout.py
    r = subprocess.run([sys.executable, "tasks.py", "make-tiny-model", "--out", "x"], capture_output=True, text=True)
    assert r.returncode == 2 and "python -m standins.tiny_model" in r.stderr, r.stderr
