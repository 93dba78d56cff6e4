r"""tasks.py: the prompts, the rewards and the tool environments of a run.

- `load_prompts(ds_cfg, tokenizer, split)`: the prompts of one config.DataSourceConfig, deterministic from its seed,
  with a held-out "eval" split disjoint from "train". Tasks (data_source.task):
    reverse_digits  prompt "12345=" (1-5 digits), target "54321" then eos. Raw text, no chat template.
    calc_tool       prompt "37*59=" (operands 0-99, + or *), multi-turn with a calculator tool:
                    model "calc 37*59" eos | tool "=2183\n" (loss mask 0) | model "2183" eos.
                    Needs rollout.sampling.max_new_tokens >= 24 (all turns and tool tokens together).
    calc_py         the same prompts with a Python tool run in the sandbox (sandbox.py, PyToolEnv):
                    model "py 37*59" eos | tool "=2183\n" (loss mask 0) | model "2183" eos. configs/tiny_agent.yaml.
    add             user message "What is 17 + 25? Answer with the number only." (operands 1-ADD_MAX) through the
                    chat template; label "42", scored by last_number. For a real chat model: configs/smollm2.yaml.
    jsonl, parquet  math-RL rows as dapo-math-17k: the prompt from the first field present of `prompt` (a list of
                    {"role", "content"} messages, or a string), `problem`, `question` (strings, sent as one user
                    message); the ground truth from `reward_model.ground_truth`, `answer`, `ground_truth`,
                    `solution`, `label` (a string or number; a \boxed{X} in it is reduced to X, a GSM8K "#### X"
                    to X).
                    The tokenizer's chat template is applied with add_generation_prompt=True.
- `get_reward_fn(name)(response_text, label, stopped) -> float`: "reverse_digits", "calc_tool", "math",
  "last_number", or any
  "module:function"; `default_reward(task)` names each task's own. A reward is a finite real number (scoring.py
  checks it; anything else fails its trajectory). A reward function whose attribute `may_hang` is true (math's:
  sympy can run for minutes) runs in the worker processes of rollout.reward_pool, killed at its timeout.
- `make_env(task, label, metadata, env)`: the tool environment of a multi-turn task (calc_tool, calc_py), or
  rollout.env's; the interface is in its docstring.
The tiny model the toy tasks train (its character tokenizer, its pretraining) is standins/tiny_model.py's.

Simplifications: a toy prompt belongs to the eval split when a hash of its text says so (1 in 8 of all possible
prompts), so the splits are disjoint whatever their sizes; a dataset file's eval split is num_eval_prompts rows drawn
by the seed. Math answers are compared as normalised strings first and with math-verify only when those differ.

Run:
    python tasks.py show --task reverse_digits [--path FILE] [--split eval] [-n 5]   # print some prompts
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import string
import sys
import threading
import zlib
from typing import Any, Callable, Optional

import plugins

# ---------------------------------------------------------------------------------------------------------------
# Toy tasks

HOLDOUT = 8  # 1 in HOLDOUT of all possible toy prompts belongs to the eval split


def _is_eval(text: str, seed: int) -> bool:
    # A fixed partition of the prompt space (not of the drawn prompts): train never sees an eval prompt, and the
    # train set does not change when num_eval_prompts does.
    return zlib.crc32(f"{seed}:{text}".encode()) % HOLDOUT == 0


def _reverse_digits_example(rng: random.Random) -> tuple[str, str]:
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 5)))
    return f"{digits}=", digits[::-1]


def _calc(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a * b


def _calc_tool_example(rng: random.Random) -> tuple[str, str]:
    a, op, b = rng.randint(0, 99), rng.choice("+*"), rng.randint(0, 99)
    return f"{a}{op}{b}=", str(_calc(a, op, b))


ADD_MAX = 50  # operands of the add task: 2,500 prompts, ~312 of them held out (docs/results/smollm2.md)


def _add_example(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, ADD_MAX), rng.randint(1, ADD_MAX)
    return f"What is {a} + {b}? Answer with the number only.", str(a + b)


TOY_TASKS = {"reverse_digits": _reverse_digits_example, "calc_tool": _calc_tool_example,
             "calc_py": _calc_tool_example, "add": _add_example}
CHAT_TASKS = ("add",)  # toy tasks whose prompt is one user message through the chat template (the others: raw text)
# Toy tasks whose eval split holds each prompt once: add's ~312 held-out prompts, drawn with repeats, would count
# ~80 of a 256-prompt eval twice or more. The others draw theirs with repeats (reverse_digits' few 1- and 2-digit
# prompts recur by design: lengths are uniform), as their measured results were made.
DISTINCT_EVAL = ("add",)
FILE_TASKS = ("jsonl", "parquet")


def toy_examples(task: str, n: int, seed: int, split: str) -> list[tuple[str, str]]:
    """`n` (prompt_text, label) pairs of a toy task, deterministic from (task, seed, split); repeats are allowed,
    except in the eval split of a DISTINCT_EVAL task."""
    rng = random.Random(f"{task}:{seed}:{split}")
    distinct = split == "eval" and task in DISTINCT_EVAL
    out, seen = [], set()
    for _ in range(100 * HOLDOUT * max(n, 1)):  # rejection sampling: ~1 in HOLDOUT draws is an eval prompt
        if len(out) == n:
            return out
        text, label = TOY_TASKS[task](rng)
        if _is_eval(text, seed) == (split == "eval") and not (distinct and text in seen):
            seen.add(text)
            out.append((text, label))
    raise ValueError(f"data_source.num_eval_prompts={n} is more than the {len(out)} distinct held-out prompts of "
                     f"data_source.task '{task}' (seed {seed}); use at most {len(out)}")


class CalcToolEnv:
    """The calculator of the calc_tool task.

    A model turn "calc A+B" or "calc A*B" (the whole turn, then eos) is a tool call, answered with the observation
    "=R\n"; any other turn is the final answer and ends the episode, as does the max_turns-th turn.
    """
    max_turns = 3  # model turns per episode: one or two tool calls, then the answer
    CALL = re.compile(r"calc (\d{1,6})([+*])(\d{1,6})")

    def __init__(self, label: Any = None, metadata: Optional[dict] = None):
        self.turns = 0

    def step(self, turn_text: str) -> Optional[str]:
        self.turns += 1
        call = self.CALL.fullmatch(turn_text.strip())
        if call is None or self.turns >= self.max_turns:
            return None
        return f"={_calc(int(call[1]), call[2], int(call[3]))}\n"

    def restore(self, turns: list) -> None:
        """A restored episode's finished turns ([turn_text, observation] each): only the count matters here."""
        self.turns = len(turns)


class PyToolEnv:
    """The Python tool of the calc_py task: a model turn "py CODE" runs CODE in the sandbox (sandbox.py: each call in
    its own bubblewrap sandbox, with CPU, memory, process, file and output limits, no network, nothing of the host
    writable) and is answered "=OUTPUT\n" (an expression's value, or what the code printed, cut to OUTPUT_CHARS; or
    the error's one line). Any other turn is the final answer and ends the episode, as does the max_turns-th turn.
    `step` is async (an asyncio subprocess: the rollout's event loop and its executor threads go on). What each call
    did is in `calls` ([code, error, isolation] per call), which the rollout does not need; tests read it.

    One SandboxPool per process, made on first use with the class's limits (a subclass may change them; WORKERS is
    the calls at once, as rollout.env_max_concurrent). ISOLATION "bwrap" is the sandbox: where it cannot run (no
    bubblewrap, user namespaces off for a non-root user) every step raises sandbox.SandboxUnavailable, whose one
    sentence says how to install it (the rollout fails the trajectories and stops the run after
    rollout.env_fail_stop_steps of them). A subclass with ISOLATION = "unsafe" (rollout.env=module:YourEnv) runs the
    code as a plain subprocess with the same rlimits and isolates nothing.
    A restored episode's finished turns are not run again (`restore`): their observations are in the trajectory.
    """
    max_turns = 3
    CALL = re.compile(r"py (.+)", re.S)
    WORKERS, CPU_S, MEMORY_MB, OUTPUT_CHARS, ISOLATION = 4, 1.0, 256, 32, "bwrap"
    _pool = None
    _unavailable: Optional[Exception] = None
    _pool_lock = threading.Lock()

    def __init__(self, label: Any = None, metadata: Optional[dict] = None):
        self.turns = 0
        self.calls: list = []

    @classmethod
    def check(cls) -> None:
        """At start-up (checks.check_inputs): the sandbox runs here, or ValueError in its one sentence."""
        import sandbox

        try:
            sandbox.SandboxPool(1, cls.CPU_S, memory_mb=cls.MEMORY_MB, isolation=cls.ISOLATION).close()
        except sandbox.SandboxUnavailable as e:
            raise ValueError(f"the {cls.__name__} environment cannot run: {e}") from None

    @classmethod
    def pool(cls):
        with cls._pool_lock:
            if cls._unavailable is not None:
                raise cls._unavailable  # checked once per process
            if cls._pool is None:
                import sandbox

                try:
                    cls._pool = sandbox.SandboxPool(cls.WORKERS, cls.CPU_S, memory_mb=cls.MEMORY_MB,
                                                    output_chars=cls.OUTPUT_CHARS, isolation=cls.ISOLATION)
                except sandbox.SandboxUnavailable as e:
                    cls._unavailable = e
                    raise
            return cls._pool

    async def step(self, turn_text: str) -> Optional[str]:
        self.turns += 1
        call = self.CALL.fullmatch(turn_text.strip())
        if call is None or self.turns >= self.max_turns:
            return None
        result = await self.pool().arun(call[1])
        self.calls.append([call[1], result.error, result.isolation])
        return f"={result.output.strip() if result.error is None else result.error}\n"

    def restore(self, turns: list) -> None:
        self.turns = len(turns)


ENVS = {"calc_tool": CalcToolEnv, "calc_py": PyToolEnv}


def make_env(task: str, label: Any, metadata: dict, env: Optional[str] = None):
    """A fresh tool environment for one trajectory of a multi-turn task, built as factory(label, metadata): the
    task's own, or `env` (rollout.env: a name of ENVS, or "module:attr" that config.load_plugins registered there).
    The rollout's metadata also holds "trajectory_id": (epoch, seq, index), the same across pauses and resumes.

    The interface (rollout_fns.tool_episode drives it): `max_turns` (model turns per episode, at most) and
    `step(turn_text) -> Optional[str]`, sync or `async def` (the observation, or None to end the episode; the rollout
    runs a sync step in a thread, bounded by rollout.env_max_concurrent, and a step that raises or exceeds
    rollout.env_step_timeout_s fails its trajectory). Optional classmethod `check()`: raises ValueError in one
    sentence where the environment cannot run on this machine (checks.check_inputs calls it at start-up; exit 2).
    Optional `restore(turns)`: a trajectory restored after a pause
    gets a fresh environment and its finished turns as [turn_text, observation] pairs, which step is not called
    for again (their side effects happened once); without restore the fresh environment simply goes on."""
    if env is not None:
        return plugins.lookup(ENVS, env, "rollout.env", also="null (the task's own), ")(label, metadata)
    if task not in ENVS:
        raise ValueError(f"data_source.task '{task}' has no tool environment; multi-turn tasks: {', '.join(ENVS)} "
                         "(or set rollout.env)")
    return ENVS[task](label, metadata)


def check_env(task: str, env: Optional[str] = None) -> None:
    """The start-up check of the tool environment make_env would build for task (its optional `check()`); nothing
    for a single-turn task."""
    cls = ENVS.get(env if env is not None else task)
    if cls is not None and callable(getattr(cls, "check", None)):
        cls.check()


# ---------------------------------------------------------------------------------------------------------------
# Dataset files (jsonl / parquet)

PROMPT_FIELDS = ("prompt", "problem", "question")
LABEL_FIELDS = ("reward_model.ground_truth", "answer", "ground_truth", "solution", "label")  # label: slime's files
_MISSING = object()


def _field(row: dict, dotted: str):
    """row["a"]["b"] for "a.b"; _MISSING when absent or null (parquet files fill other rows' columns with null)."""
    for key in dotted.split("."):
        if not isinstance(row, dict) or row.get(key) is None:
            return _MISSING
        row = row[key]
    return row


def _braced(text: str, i: int) -> Optional[str]:
    """The content of the brace group that starts at text[i] (after spaces); None if there is none or it is open."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def _label(value: Any) -> str:
    r"""The ground-truth answer: a \boxed{X} reduces to X and a GSM8K "... #### X" to X."""
    text = str(value)
    boxed_at = text.rfind("\\boxed")
    boxed = _braced(text, boxed_at + len("\\boxed")) if boxed_at >= 0 else None
    return boxed.strip() if boxed is not None else text.rsplit("####", 1)[-1].strip()


def _parse_row(row: Any, where: str) -> tuple[list[dict], str]:
    """(messages, label) of one dataset row; `where` ("FILE line N") starts every error message."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with a prompt and an answer, got {type(row).__name__}")
    name = next((f for f in PROMPT_FIELDS if _field(row, f) is not _MISSING), None)
    if name is None:
        raise ValueError(f"{where}: no prompt field; accepted: {', '.join(PROMPT_FIELDS)}")
    value = row[name]
    if isinstance(value, str) and value:
        messages = [{"role": "user", "content": value}]
    elif (isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in value)):
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        raise ValueError(f"{where}: field '{name}' must be a non-empty string or a non-empty list of "
                         f"{{\"role\": str, \"content\": str}} messages, got {json.dumps(value, default=str)[:80]}")
    name = next((f for f in LABEL_FIELDS if _field(row, f) is not _MISSING), None)
    if name is None:
        raise ValueError(f"{where}: no ground-truth field; accepted: {', '.join(LABEL_FIELDS)}")
    value = _field(row, name)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or _label(value) == "":
        raise ValueError(f"{where}: field '{name}' must be a non-empty string or a number, "
                         f"got {json.dumps(value, default=str)[:80]}")
    return messages, _label(value)


def read_rows(task: str, path: str) -> list[tuple[list[dict], str, dict]]:
    """Every row of a jsonl / parquet file as (messages, label, metadata), validated; metadata = {"row": N}."""
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"data_source.path '{path}' is not a file (data_source.task '{task}' reads one)")
    rows = []
    if task == "jsonl":
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path} line {lineno}"
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")  # the newline is not part of the row's JSON
                except UnicodeDecodeError as e:
                    raise ValueError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    # e.pos: the character where parsing stopped (the line alone was parsed, so it is the
                    # column); one past the last character means the line ends before the row does
                    cut = ": the line ends before the row does" if e.pos >= len(line) else ""
                    raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.pos + 1}{cut})") from None
                rows.append((*_parse_row(row, where), {"row": lineno}))
    else:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as e:  # pyarrow's errors do not all share a base class; the message names the problem
            raise ValueError(f"{path}: not a readable parquet file ({e})") from None
        for i, row in enumerate(table.to_pylist()):
            rows.append((*_parse_row(row, f"{path} row {i} (0-based)"), {"row": i}))
    return rows


def check_data_source(ds_cfg) -> Optional[int]:
    """Validate a dataset file's every row and its split sizes without a tokenizer (train.py runs this before
    any server starts); returns the row count, None for the toy tasks (generated, nothing to check)."""
    if ds_cfg.task in TOY_TASKS:
        return None
    return len(_file_rows(ds_cfg))


def _file_rows(ds_cfg) -> list[tuple[list[dict], str, dict]]:
    if ds_cfg.task not in FILE_TASKS:
        raise ValueError(f"data_source.task '{ds_cfg.task}' is unknown; accepted: "
                         f"{', '.join([*TOY_TASKS, *FILE_TASKS])}")
    rows = read_rows(ds_cfg.task, ds_cfg.path)
    if ds_cfg.num_eval_prompts >= len(rows):
        raise ValueError(f"data_source.num_eval_prompts={ds_cfg.num_eval_prompts} leaves no training rows in "
                         f"{ds_cfg.path} ({len(rows)} rows); use fewer eval prompts")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Prompts

def load_prompts(ds_cfg, tokenizer, split: str = "train", max_prompt_tokens: Optional[int] = None) -> list[dict]:
    """The prompts of one data source: [{"prompt_ids": list[int], "label": str, "metadata": dict}].

    Toy tasks: num_prompts (train) or num_eval_prompts (eval) generated prompts. Files: num_eval_prompts rows drawn
    by the seed are the eval split, all other rows (in file order) the train split. max_prompt_tokens
    (rollout.max_prompt_tokens): a prompt longer than that is an error naming how many are, not a request the
    server refuses later (a failed trajectory, filtered without a word).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    task = ds_cfg.task
    if task in TOY_TASKS:
        n = ds_cfg.num_prompts if split == "train" else ds_cfg.num_eval_prompts
        examples = toy_examples(task, n, ds_cfg.seed, split)
        if task not in CHAT_TASKS:
            ids = tokenizer([text for text, _ in examples], add_special_tokens=False)["input_ids"] if examples else []
            out = [{"prompt_ids": p, "label": label, "metadata": {}} for p, (_, label) in zip(ids, examples)]
            return _check_prompt_lengths(out, ds_cfg, split, max_prompt_tokens)
        rows = [([{"role": "user", "content": text}], label, {}) for text, label in examples]
    else:
        rows = _file_rows(ds_cfg)
        order = list(range(len(rows)))
        random.Random(f"holdout:{ds_cfg.seed}").shuffle(order)
        held_out = set(order[:ds_cfg.num_eval_prompts])
        rows = [r for i, r in enumerate(rows) if (i in held_out) == (split == "eval")]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer has no chat template, which data_source.task '{task}' needs to format "
                         "chat prompts; use a chat model's tokenizer (the tiny model has one)")
    # Templated to text, then tokenized without special tokens: templates that write a bos themselves get one.
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _, _ in rows]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = [{"prompt_ids": p, "label": label, "metadata": meta} for p, (_, label, meta) in zip(ids, rows)]
    return _check_prompt_lengths(out, ds_cfg, split, max_prompt_tokens)


def _check_prompt_lengths(prompts: list[dict], ds_cfg, split: str, limit: Optional[int]) -> list[dict]:
    long = [p for p in prompts if limit is not None and len(p["prompt_ids"]) > limit]
    if long:
        worst = max(long, key=lambda p: len(p["prompt_ids"]))
        where = f", e.g. row {worst['metadata']['row']}" if "row" in worst["metadata"] else ""
        raise ValueError(f"{len(long)} of the {len(prompts)} {split} prompts of data_source.task '{ds_cfg.task}'"
                         f"{' (' + ds_cfg.path + ')' if ds_cfg.path else ''} are longer than "
                         f"rollout.max_prompt_tokens={limit} tokens (the longest: {len(worst['prompt_ids'])}{where});"
                         " raise rollout.max_prompt_tokens or drop those rows from the dataset")
    return prompts


def check_answers_fit(ds_cfg, tokenizer, max_new_tokens: int) -> None:
    r"""A file task scored by the math reward: refuse a rollout.sampling.max_new_tokens that no label's shortest
    scoring response ("Answer:" + label or \boxed{label}, tokenized alone) fits in, since then every reward is 0
    whatever the model writes (a toy config's 6, inherited by a user's own dataset, is the case this catches). Only
    the certain case is refused: a budget that fits the bare answer but not the reasoning before it is what
    train.py's warning on the share of responses cut by length (rollout/truncation_ratio) is for."""
    reward = ds_cfg.reward or default_reward(ds_cfg.task)
    if ds_cfg.task not in FILE_TASKS or reward != "math":
        return
    labels = sorted({str(label) for _, label, _ in _file_rows(ds_cfg)})
    texts = [t for label in labels for t in (f"Answer:{label}", f"\\boxed{{{label}}}")]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    need, text = min((len(i), t) for i, t in zip(ids, texts))
    if need > max_new_tokens:
        raise ValueError(f"rollout.sampling.max_new_tokens={max_new_tokens} cannot hold an answer the math reward "
                         f"of data_source.task '{ds_cfg.task}' ({ds_cfg.path}) scores: its shortest, {text!r}, is "
                         f"{need} tokens, so every reward would be 0; set rollout.sampling.max_new_tokens to what a "
                         "response of this dataset needs (reasoning included, e.g. 1024 for GSM8K-style problems)")


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """Every end token of the model: the tokenizer's eos and generation_config.json's eos_token_id (an int or a list:
    a chat model ends a turn with one and a document with another). Sent as sampling_params.stop_token_ids with
    every request, so a server stops on all of them whatever it reads from the checkpoint itself."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


# ---------------------------------------------------------------------------------------------------------------
# Rewards: fn(response_text, label, stopped) -> float. Module-level functions, so they pickle.

def _prefix_reward(answer: str, target: str, stopped: bool) -> float:
    matched = 0
    for a, b in zip(answer, target):
        if a != b:
            break
        matched += 1
    # The end token counts as one more character to match: exact and stopped on eos.
    return (matched + (answer == target and stopped)) / (len(target) + 1)


def reverse_digits_reward(response_text: str, label: str, stopped: bool) -> float:
    """(matched prefix characters + 1 if the response is exactly the target and stopped on eos) / (len + 1)."""
    return _prefix_reward(response_text, label, stopped)


def calc_tool_reward(response_text: str, label: str, stopped: bool) -> float:
    r"""The same prefix reward on the final answer: the transcript's last line (after the tool's "=R\n")."""
    return _prefix_reward(response_text.rsplit("\n", 1)[-1], label, stopped)


ANSWER_LINE = re.compile(r"Answer\s*:([^\n]*)")


def extract_answer(text: str) -> Optional[str]:
    r"""The final answer of a math response: the last "Answer: X" line or the last \boxed{X}, whichever is later."""
    lines = list(ANSWER_LINE.finditer(text))
    boxed_at = text.rfind("\\boxed")
    if lines and lines[-1].start() > boxed_at:
        return lines[-1][1].strip()
    return _braced(text, boxed_at + len("\\boxed")) if boxed_at >= 0 else None


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalize_answer(s: str) -> str:
    r"""A cheap canonical form: no $, spaces, \text{}, \left/\right, degree or percent signs, trailing period;
    \dfrac and \tfrac as \frac; thousands separators removed from plain numbers."""
    s = _TEXT_CMD.sub(r"\1", s)
    for old, new in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("^\\circ", ""),
                     ("^{\\circ}", ""), ("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""), ("\\!", ""), ("\\,", ""),
                     ("\\;", ""), ("\\ ", "")):
        s = s.replace(old, new)
    s = "".join(s.split()).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def math_equal(answer: str, truth: str) -> bool:
    """Equal as normalised strings, or equivalent for math-verify (fractions, radicals, intervals, ...)."""
    a, t = normalize_answer(answer), normalize_answer(truth)
    if a == t:
        return True
    if not a or len(a) > 200 or len(t) > 200:  # keep sympy away from long or empty strings
        return False
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere they are off. Neither bounds
    # sympy holding the GIL (9^{9^{9^{9}}}): math_reward runs in rollout.reward_pool=process, killed at its timeout.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold, pred = parse(f"${t}$", parsing_timeout=timeout), parse(f"${a}$", parsing_timeout=timeout)
        return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # a verifier failure on an odd answer is a wrong answer, not a crashed rollout
        return False


def math_reward(response_text: str, label: str, stopped: bool) -> float:
    r"""1.0 if the final answer ("Answer: X" or \boxed{X}) equals the ground truth, else 0.0. `stopped` is ignored:
    a truncated response is scored on what it wrote; for an overlong penalty, wrap it in a reward of your own
    (examples/length_penalty_reward.py)."""
    answer = extract_answer(response_text)
    return float(answer is not None and math_equal(answer, str(label)))


math_reward.may_hang = True  # rollout.reward_pool auto runs it in worker processes, killed at rollout.reward_timeout_s
math_reward.preload = ("math_verify",)  # imported by a worker before its first call (~1 s), outside the timeout


# A number as a chat model writes one: a sign, thousands separators ("1,234"), decimals; a trailing "." ends a
# sentence, not a decimal.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def last_number_reward(response_text: str, label: str, stopped: bool) -> float:
    """1.0 if the response ended on eos and the last number in it equals the label as a number ("17 + 25 = 42."
    and "The answer is 42" score 1 for "42"), else 0.0. A response cut by max_new_tokens scores 0: its last number
    may be cut too ("4" of "42") or be one it would have corrected, so only finished answers are rewarded and the
    policy learns to finish within the budget."""
    numbers = NUMBER.findall(response_text)
    return float(stopped and bool(numbers) and float(numbers[-1].replace(",", "")) == float(label))


REWARDS = {"reverse_digits": reverse_digits_reward, "calc_tool": calc_tool_reward, "math": math_reward,
           "last_number": last_number_reward}
DEFAULT_REWARDS = {"reverse_digits": "reverse_digits", "calc_tool": "calc_tool", "calc_py": "calc_tool",
                   "add": "last_number", "jsonl": "math", "parquet": "math"}


def default_reward(task: str) -> str:
    """The reward function name of a task (used when data_source.reward is None)."""
    if task not in DEFAULT_REWARDS:
        raise ValueError(f"data_source.task '{task}' is unknown; accepted: {', '.join(DEFAULT_REWARDS)}")
    return DEFAULT_REWARDS[task]


def get_reward_fn(name: str) -> Callable[[str, Any, bool], float]:
    """A reward function by name: one of REWARDS, or "module:function" for your own (it must be picklable), which
    config.load_plugins loads (plugins.load) and registers in REWARDS under that name."""
    return plugins.lookup(REWARDS, name, "data_source.reward", "module:function")


# ---------------------------------------------------------------------------------------------------------------
# Command line

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("show", help="print some prompts and labels of a task")
    p.add_argument("--task", default="reverse_digits", help=f"one of {', '.join(DEFAULT_REWARDS)}")
    p.add_argument("--path", default=None, help="dataset file for jsonl / parquet")
    p.add_argument("--split", default="train", choices=["train", "eval"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-n", type=int, default=5)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-tiny-model"]:  # moved with the tiny model
        parser.exit(2, "error: `python tasks.py make-tiny-model` is now `python -m standins.tiny_model` (same "
                       "flags)\n")
    args = parser.parse_args(argv)
    if args.task in TOY_TASKS:
        for text, label in toy_examples(args.task, args.n, args.seed, args.split):
            print(f"{text!r} -> {label!r}")
    else:
        for messages, label, meta in read_rows(args.task, args.path)[:args.n]:
            print(f"{meta} {messages[-1]['content'][:100]!r} -> {label!r}")


if __name__ == "__main__":
    main()
