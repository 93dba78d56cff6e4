"""tasks.py: toy tasks and their splits, rewards, the tool env, dataset files (the tiny model: test_tiny_model.py)."""
import json
import os
import pickle
import re
import shutil
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

import config
import tasks
from standins import tiny_model
from config import DataSourceConfig


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model.make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tok(tiny):
    return AutoTokenizer.from_pretrained(tiny)


# ---------------------------------------------------------------------------------------------------------------
# Toy tasks

def _texts(tok, prompts):
    return [tok.decode(p["prompt_ids"]) for p in prompts]


def test_reverse_digits_prompts_are_deterministic_and_held_out(tok):
    cfg = DataSourceConfig(task="reverse_digits", num_prompts=2000, num_eval_prompts=200, seed=3)
    train, evals = tasks.load_prompts(cfg, tok, "train"), tasks.load_prompts(cfg, tok, "eval")
    assert len(train) == 2000 and len(evals) == 200
    assert tasks.load_prompts(cfg, tok, "train") == train
    assert not set(_texts(tok, train)) & set(_texts(tok, evals))
    for text, p in zip(_texts(tok, train), train):
        assert text.endswith("=") and text[:-1].isdigit() and p["label"] == text[:-1][::-1]
    assert {len(p["label"]) for p in train} == {1, 2, 3, 4, 5}  # variable response lengths
    # The train split does not depend on the eval size; another seed gives other prompts.
    bigger_eval = DataSourceConfig(task="reverse_digits", num_prompts=2000, num_eval_prompts=500, seed=3)
    assert tasks.load_prompts(bigger_eval, tok, "train") == train
    other = DataSourceConfig(task="reverse_digits", num_prompts=2000, num_eval_prompts=200, seed=4)
    assert tasks.load_prompts(other, tok, "train") != train


def test_calc_tool_prompts_are_held_out(tok):
    cfg = DataSourceConfig(task="calc_tool", num_prompts=500, num_eval_prompts=50)
    train, evals = tasks.load_prompts(cfg, tok, "train"), tasks.load_prompts(cfg, tok, "eval")
    assert not set(_texts(tok, train)) & set(_texts(tok, evals))
    for text, p in zip(_texts(tok, train), train):
        a, op, b = re.fullmatch(r"(\d+)([+*])(\d+)=", text).groups()
        assert p["label"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))


def test_add_prompts_go_through_the_chat_template_and_are_held_out(tok):
    cfg = DataSourceConfig(task="add", num_prompts=2000, num_eval_prompts=256)
    train, evals = tasks.load_prompts(cfg, tok, "train"), tasks.load_prompts(cfg, tok, "eval")
    assert len(train) == 2000 and len(evals) == 256
    question = re.compile(r"What is (\d+) \+ (\d+)\? Answer with the number only\.")
    sums = {"train": set(), "eval": set()}
    for split, prompts in (("train", train), ("eval", evals)):
        for p in prompts:
            text = tok.decode(p["prompt_ids"])
            a, b = map(int, question.search(text).groups())
            assert text == tok.apply_chat_template([{"role": "user", "content": question.search(text)[0]}],
                                                   add_generation_prompt=True, tokenize=False)
            assert 1 <= a <= tasks.ADD_MAX and 1 <= b <= tasks.ADD_MAX and p["label"] == str(a + b)
            sums[split].add((a, b))
    assert not sums["train"] & sums["eval"]
    assert len(sums["eval"]) == 256  # each held-out prompt once (reverse_digits' eval repeats its short prompts)
    held_out = sum(tasks._is_eval(f"What is {a} + {b}? Answer with the number only.", 0)
                   for a in range(1, tasks.ADD_MAX + 1) for b in range(1, tasks.ADD_MAX + 1))
    with pytest.raises(ValueError, match=f"num_eval_prompts=400 is more than the {held_out} distinct held-out"):
        tasks.load_prompts(DataSourceConfig(task="add", num_eval_prompts=400), tok, "eval")


def test_unknown_task_and_split_are_named(tok):
    with pytest.raises(ValueError, match="data_source.task 'sort'.*reverse_digits"):
        tasks.load_prompts(DataSourceConfig(task="sort"), tok)
    with pytest.raises(ValueError, match="split must be"):
        tasks.load_prompts(DataSourceConfig(), tok, "test")


# ---------------------------------------------------------------------------------------------------------------
# Rewards

@pytest.mark.parametrize("response,stopped,expected", [
    ("54321", True, 1.0),  # exact and stopped on eos
    ("54321", False, 5 / 6),  # right digits, cut off before the eos
    ("543", True, 3 / 6),  # prefix
    ("543219", True, 5 / 6),  # ran past the end
    ("54021", True, 2 / 6),  # prefix up to the first wrong digit
    ("", True, 0.0),
    ("", False, 0.0),
    ("9", True, 0.0),
])
def test_reverse_digits_reward(response, stopped, expected):
    assert tasks.get_reward_fn("reverse_digits")(response, "54321", stopped) == pytest.approx(expected)


@pytest.mark.parametrize("response,label,expected", [
    ("so the result is \\boxed{\\dfrac{1}{2}}.", "\\frac12", 1.0),
    ("work\nAnswer: 34", "34", 1.0),
    ("Answer: $1,000$.", "1000", 1.0),
    ("Answer: \\boxed{5}", "5", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # equal only to math-verify
    ("\\boxed{5} then Answer: 6", "5", 0.0),  # the later answer counts
    ("Answer: 35", "34", 0.0),
    ("the answer is 34", "34", 0.0),  # no Answer: line, no box
    ("\\boxed{34", "34", 0.0),  # box cut off by truncation
])
def test_math_reward(response, label, expected):
    assert tasks.get_reward_fn("math")(response, label, True) == expected


# Responses of SmolLM2-135M-Instruct to "What is A + B? Answer with the number only." (runs/smollm2, greedy and
# sampled at temperature 1): the last number is the answer, whatever the text around it.
@pytest.mark.parametrize("response,label,stopped,expected", [
    ("28 + 26 = 54", "54", True, 1.0),
    ("16 + 25 = 41.", "41", True, 1.0),  # the sentence's period is not a decimal point
    ("To solve this problem, we need to find the sum of 9 and 4.\n\nThe answer is 13.", "13", True, 1.0),
    ("1 + 19 = 20", "20", True, 1.0),
    ("The sum is 1,234.", "1234", True, 1.0),  # thousands separators
    ("42.0", "42", True, 1.0),
    ("1 + 29 = 29", "30", True, 0.0),  # wrong arithmetic
    ("25 + 3 = 5\n\nThis is a classic example of how math can be used to solve seemingly complex problems. In this "
     "case, the answer is not just 25 + 3, but 5.", "28", True, 0.0),  # the right sum is not the last number
    ("This is a fun math problem. Can we add just eleven to nineteen?", "30", True, 0.0),  # no number
    ("", "30", True, 0.0),
    # cut by max_new_tokens: 0 even when the last number would match ("1" of "18"; a "20" it may go on to correct)
    ("We can do this by adding them together: 4 + 16 = 18.\n\nSo, the answer is 1", "18", False, 0.0),
    ("4 + 16 = 20", "20", False, 0.0),
])
def test_last_number_reward(response, label, stopped, expected):
    assert tasks.get_reward_fn("last_number")(response, label, stopped) == expected


def test_math_reward_works_off_the_main_thread():
    # math-verify's timeouts need the main thread; rollouts may score in a worker thread.
    result = []
    thread = threading.Thread(target=lambda: result.append(tasks.math_reward("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True)))
    thread.start()
    thread.join(30)
    assert result == [1.0]


def test_reward_lookup_and_pickling():
    for task, name in (("reverse_digits", "reverse_digits"), ("calc_tool", "calc_tool"), ("add", "last_number"),
                       ("jsonl", "math"), ("parquet", "math")):
        fn = tasks.get_reward_fn(tasks.default_reward(task))
        assert tasks.default_reward(task) == name and pickle.loads(pickle.dumps(fn)) is fn
    # module:function: config.load_plugins loads it (plugins.load) and registers it under that name in every process
    spec = "tasks:reverse_digits_reward"
    try:
        cfg = config.load_config(None, [f"data_source.reward={spec}"])
        fn = tasks.get_reward_fn(cfg.data_source[0].reward)
        assert fn is tasks.reverse_digits_reward and pickle.loads(pickle.dumps(fn)) is fn
    finally:
        tasks.REWARDS.pop(spec, None)
    with pytest.raises(ValueError, match="data_source.reward 'f1' is unknown"):
        tasks.get_reward_fn("f1")


# ---------------------------------------------------------------------------------------------------------------
# The tool environment

def test_calc_tool_turn_sequence():
    env = tasks.make_env("calc_tool", "2183", {})
    assert env.max_turns == 3
    assert env.step("calc 37*59") == "=2183\n"
    assert env.step("2183") is None  # a turn that is not a tool call is the answer
    transcript = "calc 37*59" + "=2183\n" + "2183"
    reward = tasks.get_reward_fn("calc_tool")
    assert reward(transcript, "2183", True) == 1.0
    assert reward(transcript, "2183", False) == pytest.approx(4 / 5)
    assert reward("calc 37*59=2183\n21", "2183", True) == pytest.approx(2 / 5)
    # Tool calls stop at max_turns: the third turn gets no observation even if it is a call.
    env = tasks.make_env("calc_tool", "3", {})
    assert env.step("calc 1+2") == "=3\n" and env.step(" calc 1+2 ") == "=3\n" and env.step("calc 1+2") is None
    with pytest.raises(ValueError, match="data_source.task 'reverse_digits' has no tool environment"):
        tasks.make_env("reverse_digits", "1", {})


@pytest.mark.skipif(shutil.which("bwrap") is None and os.geteuid() != 0,
                    reason="bubblewrap is not installed (as root: apt-get install bubblewrap)")
def test_calc_py_runs_the_models_code_in_the_sandbox_and_restores_without_running_it_again():
    import asyncio
    import random

    rng = random.Random(0)
    halves = {tiny_model.PRETRAIN_TASKS["py_call"](rng)[1].split(" ")[0] for _ in range(40)}
    assert "py" in halves and any(h.isdigit() for h in halves)  # the call alone, and reading an answer back alone
    assert tiny_model.PRETRAIN_TASK_OF["calc_py"] == "py_call" and tasks.default_reward("calc_py") == "calc_tool"
    text, label = tasks.toy_examples("calc_py", 1, 0, "train")[0]  # calc_tool's prompts
    assert re.fullmatch(r"\d+[+*]\d+=", text) and eval(text[:-1]) == int(label)

    async def episode():
        env = tasks.make_env("calc_py", "2183", {"row": 1})
        first = await env.step("py 37*59")
        bad = await env.step("py 1/0")
        third = await env.step("py 1+1")  # the max_turns-th turn: the answer, whatever it says
        fresh = tasks.make_env("calc_py", "2183", {})
        fresh.restore([["py 37*59", "=2183\n"]])  # as a restored trajectory: its finished turn is not run again
        return env, first, bad, third, fresh, await fresh.step("2183")

    env, first, bad, third, fresh, answer = asyncio.run(episode())
    assert first == "=2183\n" and bad == "=ZeroDivisionError: division by zero\n" and third is None
    assert [c[:2] for c in env.calls] == [["37*59", None], ["1/0", "ZeroDivisionError: division by zero"]]
    assert env.calls[0][2] == "bwrap"
    assert fresh.calls == [] and fresh.turns == 2 and answer is None


# ---------------------------------------------------------------------------------------------------------------
# Dataset files

ROWS = [
    {"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
     "reward_model": {"ground_truth": str(2 * i), "style": "rule"}} for i in range(6)
] + [
    {"problem": "What is 1/2 of 1?", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$."},
    {"question": "Natalia sold 48 clips, then half as many. How many?", "answer": "48/2 = 24\n#### 72"},
    {"prompt": "Plain string prompt", "answer": 7},
]


def _write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


def _check_dataset(tok, cfg):
    train, evals = tasks.load_prompts(cfg, tok, "train"), tasks.load_prompts(cfg, tok, "eval")
    assert len(train) == len(ROWS) - 3 and len(evals) == 3
    assert tasks.load_prompts(cfg, tok, "train") == train
    assert not {p["metadata"]["row"] for p in train} & {p["metadata"]["row"] for p in evals}
    labels = {tok.decode(p["prompt_ids"]): p["label"] for p in train + evals}
    assert labels["<|im_start|>user\nWhat is 3+3?<|im_end|>\n<|im_start|>assistant\n"] == "6"
    assert labels["<|im_start|>user\nWhat is 1/2 of 1?<|im_end|>\n<|im_start|>assistant\n"] == "\\frac{1}{2}"
    assert labels["<|im_start|>user\nNatalia sold 48 clips, then half as many. How many?<|im_end|>\n"
                  "<|im_start|>assistant\n"] == "72"
    assert labels["<|im_start|>user\nPlain string prompt<|im_end|>\n<|im_start|>assistant\n"] == "7"


def test_jsonl_dataset(tok, tmp_path):
    path = _write_jsonl(tmp_path / "math.jsonl", ROWS, raw_lines=[""])  # a blank line is skipped
    _check_dataset(tok, DataSourceConfig(task="jsonl", path=path, num_eval_prompts=3, seed=1))
    first = tasks.load_prompts(DataSourceConfig(task="jsonl", path=path, num_eval_prompts=1, seed=1), tok)[0]
    assert first["metadata"]["row"] in (1, 2)  # 1-based line numbers, file order


def test_slimes_prompt_label_rows_read_as_they_are():
    """slime's math files (its dapo-math-17k.jsonl: `--input-key prompt --label-key label`) give the answer as
    `label`; a row holds one answer field, read in LABEL_FIELDS' order, reduced as the others are."""
    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "label": "\\boxed{5}"}
    assert tasks._parse_row(row, "x line 1") == ([{"role": "user", "content": "What is 2 + 3?"}], "5")
    with pytest.raises(ValueError, match="x line 2: no ground-truth field; accepted: .*solution, label$"):
        tasks._parse_row({"prompt": "hi", "target": "5"}, "x line 2")


def test_parquet_dataset(tok, tmp_path):
    path = str(tmp_path / "math.parquet")
    # One schema for all rows: each row's missing columns are null, which counts as absent.
    rows = ROWS[:7]
    columns = ["data_source", "prompt", "reward_model", "problem", "solution"]
    pq.write_table(pa.table({c: [row.get(c) for row in rows] for c in columns}), path)
    cfg = DataSourceConfig(task="parquet", path=path, num_eval_prompts=2, seed=1)
    train, evals = tasks.load_prompts(cfg, tok, "train"), tasks.load_prompts(cfg, tok, "eval")
    assert len(train) == 5 and len(evals) == 2
    assert sorted(p["label"] for p in train + evals) == sorted(["0", "2", "4", "6", "8", "10", "\\frac{1}{2}"])
    assert sorted(p["metadata"]["row"] for p in train + evals) == list(range(7))


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "hi", "answer": "1"', "line 3: not valid JSON"),
    ('{"answer": "1"}', "line 3: no prompt field; accepted: prompt, problem, question"),
    ('{"prompt": 5, "answer": "1"}', "line 3: field 'prompt' must be"),
    ('{"prompt": [{"role": "user"}], "answer": "1"}', "line 3: field 'prompt' must be"),
    ('{"prompt": "hi"}', "line 3: no ground-truth field"),
    ('{"prompt": "hi", "reward_model": {"ground_truth": null}}', "line 3: no ground-truth field"),
    ('{"prompt": "hi", "reward_model": {"ground_truth": [1]}}', "line 3: field 'reward_model.ground_truth' must be"),
    ('[1, 2]', "line 3: a row must be an object"),
])
def test_malformed_jsonl_row_names_file_line_and_field(tok, tmp_path, line, message):
    path = _write_jsonl(tmp_path / "bad.jsonl", ROWS[:2], raw_lines=[line])
    with pytest.raises(ValueError) as err:
        tasks.load_prompts(DataSourceConfig(task="jsonl", path=path, num_eval_prompts=1), tok)
    assert str(err.value).startswith(f"{path} {message}")


def test_a_math_dataset_whose_shortest_answer_cannot_fit_max_new_tokens_is_refused(tok, tmp_path):
    """tiny.yaml's max_new_tokens 6, inherited by a user's own dataset: no response can hold "Answer:0" (8 tokens of
    the character tokenizer, the shortest scoring answer of ROWS), so every reward would be 0."""
    path = _write_jsonl(tmp_path / "math.jsonl", ROWS)
    ds = DataSourceConfig(task="jsonl", path=path, num_eval_prompts=1)
    with pytest.raises(ValueError) as err:
        tasks.check_answers_fit(ds, tok, 7)
    assert str(err.value).startswith("rollout.sampling.max_new_tokens=7 cannot hold an answer the math reward of "
                                     f"data_source.task 'jsonl' ({path}) scores: its shortest, 'Answer:0', is 8 "
                                     "tokens, so every reward would be 0; set rollout.sampling.max_new_tokens to ")
    tasks.check_answers_fit(ds, tok, 8)  # fits exactly
    # another reward's answers are not the math reward's: nothing to say
    tasks.check_answers_fit(DataSourceConfig(task="jsonl", path=path, reward="reverse_digits"), tok, 1)



def test_malformed_parquet_row_and_bad_paths(tok, tmp_path):
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist([{"problem": "a", "answer": "1"}, {"problem": "", "answer": "2"}]), path)
    with pytest.raises(ValueError, match=r"bad.parquet row 1 \(0-based\): field 'problem' must be"):
        tasks.load_prompts(DataSourceConfig(task="parquet", path=path, num_eval_prompts=1), tok)
    with pytest.raises(FileNotFoundError, match="data_source.path 'nope.jsonl' is not a file"):
        tasks.load_prompts(DataSourceConfig(task="jsonl", path="nope.jsonl"), tok)
    small = _write_jsonl(tmp_path / "small.jsonl", ROWS[:2])
    with pytest.raises(ValueError, match="data_source.num_eval_prompts=64 leaves no training rows"):
        tasks.load_prompts(DataSourceConfig(task="jsonl", path=small), tok)


def test_json_error_gives_the_true_column_and_bad_bytes_are_named(tmp_path):
    """A row cut short (missing closing brace) is reported at the end of ITS line, not "column 1" of the next."""
    good = '{"prompt": "hi", "answer": "1"}'
    path = _write_jsonl(tmp_path / "cut.jsonl", [], raw_lines=[good, good[:-1], good])
    with pytest.raises(ValueError) as err:
        tasks.read_rows("jsonl", path)
    assert str(err.value) == (f"{path} line 2: not valid JSON (Expecting ',' delimiter at column {len(good)}: "
                              "the line ends before the row does)")
    path = _write_jsonl(tmp_path / "comma.jsonl", [], raw_lines=['{"prompt": "hi", "answer": "1",}'])
    with pytest.raises(ValueError, match=r"line 1: not valid JSON \(Expecting property name .* at column 32\)$"):
        tasks.read_rows("jsonl", path)
    (tmp_path / "latin1.jsonl").write_bytes(good.encode() + b"\n" + '{"prompt": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.jsonl line 2: not UTF-8 text \(byte 16 of the line\)"):
        tasks.read_rows("jsonl", str(tmp_path / "latin1.jsonl"))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"bad.parquet: not a readable parquet file"):
        tasks.read_rows("parquet", str(tmp_path / "bad.parquet"))


def test_check_data_source_validates_without_a_tokenizer(tmp_path):
    path = _write_jsonl(tmp_path / "ok.jsonl", ROWS)
    assert tasks.check_data_source(DataSourceConfig(task="jsonl", path=path, num_eval_prompts=1)) == len(ROWS)
    assert tasks.check_data_source(DataSourceConfig(task="reverse_digits")) is None
    with pytest.raises(ValueError, match="num_eval_prompts=64 leaves no training rows"):
        tasks.check_data_source(DataSourceConfig(task="jsonl", path=path))


# ---------------------------------------------------------------------------------------------------------------
# Stops and prompt lengths

def test_stop_token_ids_come_from_the_tokenizer_and_the_generation_config(tiny, tok, tmp_path):
    import shutil

    import buffer
    import config
    import rollout
    import sglang_client

    assert tasks.stop_token_ids(tok, tiny) == [tok.eos_token_id]  # the tiny model: one end token
    chat = str(tmp_path / "chat")
    shutil.copytree(tiny, chat)
    with open(f"{chat}/generation_config.json") as f:
        gen = json.load(f)
    other_end = tok.convert_tokens_to_ids("<|endoftext|>")
    gen["eos_token_id"] = [other_end, tok.eos_token_id]  # a chat model: end of turn and end of document
    with open(f"{chat}/generation_config.json", "w") as f:
        json.dump(gen, f)
    assert tasks.stop_token_ids(tok, chat) == sorted({other_end, tok.eos_token_id})
    # ... and the rollout sends them with every request's sampling params
    cfg = config.load_config(None, [f"model.path={chat}", "data_source.num_prompts=8"])
    sync = sglang_client.SyncFleet(sglang_client.Fleet(["http://127.0.0.1:1"], None))
    buf = buffer.PipelineServer(cfg, [tasks.load_prompts(cfg.data_source[0], tok)])
    try:
        ro = rollout.Rollout(cfg, buf, sync, tok)
        assert ro.sampling_params["stop_token_ids"] == sorted({other_end, tok.eos_token_id})
    finally:
        sync.close()
        buf.close()


def test_prompts_over_max_prompt_tokens_are_refused_with_a_count(tok, tmp_path):
    rows = [{"prompt": "x" * n, "answer": "1"} for n in (5, 50, 60, 6, 7)]
    path = _write_jsonl(tmp_path / "long.jsonl", rows)
    ds = DataSourceConfig(task="jsonl", path=path, num_eval_prompts=1, seed=0)
    everything = tasks.load_prompts(ds, tok, "train") + tasks.load_prompts(ds, tok, "eval")
    lengths = sorted(len(p["prompt_ids"]) for p in everything)
    limit = lengths[2]  # the three short prompts fit, the two long ones (50 and 60 x's) do not
    train = tasks.load_prompts(ds, tok, "train")
    long = [p for p in train if len(p["prompt_ids"]) > limit]
    assert long, "the held-out row must leave a long prompt in the train split"
    longest = max(long, key=lambda p: len(p["prompt_ids"]))
    with pytest.raises(ValueError, match=rf"^{len(long)} of the 4 train prompts of data_source.task 'jsonl' \(.*\) "
                                         rf"are longer than rollout.max_prompt_tokens={limit} tokens \(the longest: "
                                         rf"{len(longest['prompt_ids'])}, e.g. row {longest['metadata']['row']}\)"):
        tasks.load_prompts(ds, tok, "train", max_prompt_tokens=limit)
    assert len(tasks.load_prompts(ds, tok, "train", max_prompt_tokens=lengths[-1])) == 4
    toy = DataSourceConfig(num_prompts=50)
    with pytest.raises(ValueError, match=r"^\d+ of the 50 train prompts of data_source.task 'reverse_digits' are "
                                         r"longer than rollout.max_prompt_tokens=3 tokens"):
        tasks.load_prompts(toy, tok, "train", max_prompt_tokens=3)
