"""plugins.py and examples/: every extension point taken as `module:attr` by config.load_plugins, in every process.

One `torchrun train.py` run selects an example of every extension point at once (window strategy, policy loss,
reward, rollout function, tool environment), the strategy and the environment (examples/slow_flaky_env.py: async,
slow, failing a random share of its calls) from modules copied outside the repository, and checks that each ran in the process it
belongs to: the strategy in the buffer process, the rollout function, environment and reward in the rollout process,
the loss in the trainer ranks; and that the environment never saw more than rollout.env_max_concurrent=4 steps at
once and its failures were counted (issue 35's acceptance, on the calc_tool task). The loader's errors are checked
one sentence each.

Run: .venv/bin/python -m pytest -q tests/test_plugins.py
"""
import importlib
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

import config
import plugins
import strategies
from services import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
ALL_FIVE = ["algorithm.policy_loss=clipped_loss:symmetric_ppo", "data_source.reward=length_penalty_reward:reward",
            "rollout.function=rollout_fn:one_tool_call", "rollout.env=echo_env:EchoEnv"]
EXAMPLES_ALL = ["strict_fifo", "token_staleness", "clipped_loss", "length_penalty_reward", "rollout_fn", "echo_env",
                "slow_flaky_env"]




def _pid(text: str, line: str) -> int:
    m = re.search(re.escape(line) + r" (\d+)", text)
    assert m, f"'{line}' not found in:\n{text[-3000:]}"
    return int(m.group(1))


# ---------------------------------------------------------------------------------------------------------------
# An example of every extension point in one run of train.py (the acceptance of issue 33's item 3 and 35's first)

def test_every_example_runs_through_train_py_in_its_own_process(tmp_path):
    outside = tmp_path / "outside"  # modules outside the repository, found through PYTHONPATH alone
    outside.mkdir()
    shutil.copy(os.path.join(EXAMPLES, "strict_fifo.py"), outside / "my_fifo.py")
    # the flaky environment as a user adapts a copy: failing 30% of its calls (the model, untrained, calls the tool
    # in ~15 steps of this run; 30% makes failures there, at a random rate)
    with open(os.path.join(EXAMPLES, "slow_flaky_env.py")) as f:
        flaky = f.read()
    assert "FAIL_RATE, SEED = 0.05, 0" in flaky
    (outside / "my_flaky_env.py").write_text(flaky.replace("FAIL_RATE, SEED = 0.05, 0", "FAIL_RATE, SEED = 0.3, 0"))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(outside), EXAMPLES])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "train.py",
           "--config", TINY, f"run_dir={run_dir}", f"model.path={tmp_path / 'model'}", "model.tiny_pretrain_steps=0",
           f"rollout.base_port={free_port()}", f"weight_sync.master_port={free_port()}",
           "data_source.num_prompts=32", "data_source.num_eval_prompts=8", "data_source.num_prompts_per_step=4",
           "data_source.num_trajectories_per_prompt=4", "trainer.mini_batch_size=8", "trainer.total_steps=4",
           "trainer.eval_freq=0", "trainer.save_freq=0", "trainer.export_hf=false", "rollout.filter=[failed]",
           "rollout.sampling.max_new_tokens=16", "buffer.get_timeout_s=120", "rollout.startup_timeout_s=120",
           "fully_async.sliding_window=my_fifo:StrictFifo", "data_source.task=calc_tool", *ALL_FIVE[:3],
           "rollout.env=my_flaky_env:SlowFlakyEnv", "rollout.env_max_concurrent=4"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    logs = run_dir / "logs"
    buffer_log, rollout_log = (logs / "buffer.log").read_text(), (logs / "rollout.log").read_text()
    trainer_out = p.stdout + p.stderr
    # the strategy was asked in the buffer process, which is neither a trainer rank nor the rollout process
    asked = _pid(buffer_log, "strict_fifo: StrictFifo.may_collect asked in pid")
    losses_in = {int(pid) for pid in re.findall(r"clipped_loss: symmetric_ppo called in pid (\d+)", trainer_out)}
    assert len(losses_in) == 2, trainer_out[-3000:]  # each trainer rank computes its share of the loss
    rollout_pid = _pid(rollout_log, "rollout_fn: one_tool_call called in pid")
    assert asked not in losses_in and asked != rollout_pid
    assert "StrictFifo.may_collect asked" not in trainer_out + rollout_log
    assert _pid(rollout_log, "length_penalty_reward: reward called in pid") == rollout_pid
    # the slow, flaky environment: stepped in the rollout process, never more than 4 steps at once (as it counts
    # them, and as the rollout does), its failures (a random 30% of its calls) counted and the run went on
    seen = [(int(n), int(pid)) for n, pid in re.findall(r"slow_flaky_env: (\d+) steps at once in pid (\d+)",
                                                          rollout_log)]
    assert seen and {pid for _, pid in seen} == {rollout_pid} and max(n for n, _ in seen) <= 4, rollout_log[-3000:]
    # its failures are the draws of random.Random(SEED) < FAIL_RATE, one per call in call order; the metrics are
    # taken after each step's pause, which waits for every step in progress: all env_steps counted drew and ended
    rate, seed = re.search(r"FAIL_RATE, SEED = ([\d.]+), (\d+)", (outside / "my_flaky_env.py").read_text()).groups()
    env_steps = sum(r["rollout/env_steps"] for r in steps)
    errors = sum(r["rollout/env_error_count"] for r in steps)
    draws = random.Random(int(seed))
    assert errors >= 1 and errors == sum(draws.random() < float(rate) for _ in range(env_steps)), (env_steps, errors)
    assert max(r["rollout/env_in_use_max"] for r in steps) in range(1, 5)
    assert sum(r["rollout/env_timeout_count"] for r in steps) == 0
    assert "first environment error" in rollout_log and "ConnectionError" in rollout_log


# ---------------------------------------------------------------------------------------------------------------
# The loader: one sentence naming the key; the built-ins are looked up as before

@pytest.fixture
def on_path(tmp_path, monkeypatch):
    """A PYTHONPATH of the examples and of a folder with a module whose import fails and one that raises; the roles'
    registries are restored afterwards (other tests compare them with the built-in names)."""
    import losses
    import rollout_fns
    import tasks

    (tmp_path / "broken_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising.py").write_text("raise RuntimeError('bad setting in raising.py\\nsecond line')\n")
    (tmp_path / "ten_argument_loss.py").write_text(  # a policy loss written for the 10-argument call of before
        "def loss(log_probs, old_log_probs, rollout_log_probs, advantages, loss_mask, versions, current_version, algo,"
        " loss_denominator, entropy=None):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(EXAMPLES)
    registries = [strategies.REGISTRY, losses.POLICY_LOSSES, tasks.REWARDS, tasks.ENVS, rollout_fns.ROLLOUT_FUNCTIONS]
    saved = [dict(r) for r in registries]
    yield
    for registry, before in zip(registries, saved):
        registry.clear()
        registry.update(before)
    for name in ("broken_dep", "raising", "ten_argument_loss"):
        sys.modules.pop(name, None)


def _error(overrides) -> ValueError:
    with pytest.raises(ValueError) as e:
        config.load_config(TINY, overrides)
    return e.value


@pytest.mark.parametrize("key", ["fully_async.sliding_window", "algorithm.policy_loss", "data_source.reward",
                                 "rollout.function", "rollout.env"])
def test_a_missing_module_or_attribute_is_one_sentence_naming_the_key(on_path, key):
    multi_turn = ["rollout.function=multi_turn_tool"] if key == "rollout.env" else []  # env: used by multi-turn only
    e = _error([f"{key}=no_such_module_xyz:thing", *multi_turn])
    assert str(e).startswith(f"{key} 'no_such_module_xyz:thing': no module named 'no_such_module_xyz'")
    assert "PYTHONPATH" in str(e)
    e = _error([f"{key}=echo_env:NoSuchThing", *multi_turn])
    assert str(e).startswith(f"{key} 'echo_env:NoSuchThing': 'echo_env' has no attribute 'NoSuchThing'")
    assert "module:attr" in str(e)
    e = _error([f"{key}=echo_env:EchoEnv.nested", *multi_turn])  # a dotted attribute names the part that is missing
    assert "'echo_env.EchoEnv' has no attribute 'nested'" in str(e)


def test_an_error_inside_the_users_module_is_named_with_its_first_line_and_kept(on_path):
    e = _error(["algorithm.policy_loss=broken_dep:f"])
    assert str(e) == ("algorithm.policy_loss 'broken_dep:f': importing module 'broken_dep' failed: "
                      "ModuleNotFoundError: No module named 'no_such_dependency_xyz'")
    assert isinstance(e.__cause__, ModuleNotFoundError)
    e = _error(["data_source.reward=raising:f"])
    assert str(e) == ("data_source.reward 'raising:f': importing module 'raising' failed: RuntimeError: bad setting "
                      "in raising.py")
    assert isinstance(e.__cause__, RuntimeError)


@pytest.mark.parametrize("override,fragment", [
    ("fully_async.sliding_window=echo_env:EchoEnv", "must name a subclass of strategies.Strategy"),
    ("algorithm.policy_loss=length_penalty_reward:PENALTY", "must name a function (batch: losses.TokenBatch, "
                                                            "settings, denominator) -> (loss, metrics)"),
    ("algorithm.policy_loss=ten_argument_loss:loss", "algorithm.policy_loss 'ten_argument_loss:loss' must name a "
                                                     "function (batch: losses.TokenBatch, settings, denominator)"),
    ("rollout.function=length_penalty_reward:reward", "must name an async function (ctx, trajs) -> None"),
    ("rollout.env=length_penalty_reward:PENALTY rollout.function=multi_turn_tool", "must name a class or factory"),
    ("rollout.env=calculator rollout.function=multi_turn_tool", "rollout.env 'calculator' is unknown; accepted: "
                               "null (the task's own), calc_tool, calc_py or module:attr"),
    ("rollout.env=plugins:is_spec rollout.function=multi_turn_tool", "must name a class or factory that builds one "
                                                                    "tool environment from (label, metadata)"),
    ("fully_async.sliding_window=strict-fifo", "choose one of: no-window, window-gated, windowed-fifo"),
    ("rollout.env=calc_tool", "rollout.env=calc_tool is used by multi-turn rollout functions only; set "
                              "rollout.function=multi_turn_tool"),
])
def test_an_object_of_the_wrong_kind_is_refused_naming_the_key(on_path, override, fragment):
    assert fragment in str(_error(override.split()))


def test_plugins_are_registered_under_their_spec_for_the_role_code(on_path):
    import losses
    import rollout_fns
    import tasks

    specs = {"fully_async.sliding_window": "strict_fifo:StrictFifo", **dict(o.split("=") for o in ALL_FIVE)}
    cfg = config.load_config(TINY, [f"{k}={v}" for k, v in specs.items()])
    assert strategies.REGISTRY[cfg.fully_async.sliding_window].__name__ == "StrictFifo"
    assert losses.POLICY_LOSSES[cfg.algorithm.policy_loss].__name__ == "symmetric_ppo"
    assert tasks.get_reward_fn(cfg.data_source[0].reward)("321", "321", True) == 1.0
    assert rollout_fns.resolve_rollout_function(cfg.rollout.function).__name__ == "one_tool_call"
    env = tasks.make_env(cfg.data_source[0].task, "321", {}, cfg.rollout.env)
    assert env.step(" 123 ") == "=123\n" and env.step("321") is None
    assert tasks.make_env("calc_tool", "3", {}).max_turns == 3  # unset: the task's own environment


def test_a_declared_constraint_of_a_plugin_loss_is_enforced_by_config_validation(on_path):
    """examples/clipped_loss.py declares with @losses.register that its symmetric clip range must not be empty:
    validation, which every process of a run does, refuses a config that breaks it, in one sentence naming the
    setting; the same config with the built-in ppo loads."""
    import losses

    e = _error(["algorithm.policy_loss=clipped_loss:symmetric_ppo", "algorithm.clip_low=0"])
    assert str(e) == ("algorithm.policy_loss=clipped_loss:symmetric_ppo clips the ratio to [1 - algorithm.clip_low, "
                      "1 + algorithm.clip_low], which needs algorithm.clip_low > 0, got 0.0")
    assert config.load_config(TINY, ["algorithm.clip_low=0"]).algorithm.clip_low == 0.0
    cfg = config.load_config(TINY, ["algorithm.policy_loss=clipped_loss:symmetric_ppo", "algorithm.clip_low=0.1"])
    assert losses.declaration(losses.POLICY_LOSSES[cfg.algorithm.policy_loss]).check is not None


@pytest.mark.parametrize("name", EXAMPLES_ALL)
def test_each_examples_docstring_command_selects_it(on_path, name):
    """The command at the top of each example's docstring is valid as written, and selects that example."""
    doc = " ".join(importlib.import_module(name).__doc__.replace("\\\n", " ").split())
    m = re.search(r"PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train\.py "
                  r"--config (\S+)((?: \S+=\S+)+)", doc)
    assert m, f"examples/{name}.py's docstring has no command"
    overrides = m.group(2).split()
    assert any(o.split("=", 1)[1].startswith(f"{name}:") for o in overrides), overrides
    config.load_config(os.path.join(ROOT, m.group(1)), overrides)


def test_load_takes_dotted_attributes_and_refuses_a_spec_without_both_parts():
    assert plugins.load("strategies:Strategy.may_collect", "k") is strategies.Strategy.may_collect
    for bad in (":Strategy", "strategies:", "strategies:a..b"):
        with pytest.raises(ValueError, match=f"k '{re.escape(bad)}' must be a built-in name or module:attr"):
            plugins.load(bad, "k")


def test_lookup_finds_a_built_in_or_a_registered_spec_and_names_only_the_built_ins_otherwise():
    """plugins.lookup, the one name check of tasks.REWARDS, tasks.ENVS and rollout.ROLLOUT_FUNCTIONS (what
    config.load_plugins registered under its spec is found, and left out of the names an error lists)."""
    registry = {"one": 1, "two": 2, "my_module:thing": 3}
    assert plugins.lookup(registry, "two", "k") == 2 and plugins.lookup(registry, "my_module:thing", "k") == 3
    with pytest.raises(ValueError, match=r"^k 'three' is unknown; accepted: null \(default\), one, two or "
                                         r"module:function$"):
        plugins.lookup(registry, "three", "k", "module:function", also="null (default), ")
