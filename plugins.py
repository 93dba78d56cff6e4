"""plugins.py: the one loader of `module:attr` extension points, so that your own piece runs in every process.

Every extension point takes a built-in name or `module:attr` (a dotted attribute is fine: `module:Class.method`):

    fully_async.sliding_window   a strategies.Strategy subclass           examples/strict_fifo.py, token_staleness.py
    algorithm.policy_loss        fn(batch, settings, denominator)         examples/clipped_loss.py
    data_source.reward           fn(response_text, label, stopped)        examples/length_penalty_reward.py
    rollout.function             async fn(ctx, trajs) -> None             examples/rollout_fn.py
    rollout.env                  a tool environment class or factory      examples/echo_env.py

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        fully_async.sliding_window=strict_fifo:StrictFifo

A run is several processes (the trainer ranks, the buffer process, the rollout process), each a fresh interpreter
that loads the resolved config. config.load_plugins calls `load` for every `module:attr` value in each of them and
registers what it gets in the role's own registry under the spec string itself (strategies.REGISTRY,
losses.POLICY_LOSSES, tasks.REWARDS, tasks.ENVS, rollout_fns.ROLLOUT_FUNCTIONS), so the role code looks the name
up as it looks up a built-in one (`lookup`: the name, or one sentence naming the key and its built-in names).
strategies.py and losses.py, which copy into another repository alone, never import this module and look their names
up themselves (strategies.lookup, losses.check_policy_loss). The module must therefore be importable
in every process: on PYTHONPATH (which the child processes inherit) or inside the repository.

Errors are one sentence naming the config key: a module that is not found, an attribute it does not have, or the
first line of the error the module itself raised while importing (chained, so its traceback is kept).
Imports only the standard library.
"""
from __future__ import annotations

import importlib


def is_spec(value) -> bool:
    """Whether a config value names a plugin (`module:attr`) rather than a built-in name."""
    return isinstance(value, str) and ":" in value


def builtin_names(registry: dict) -> str:
    """The built-in names of a role's registry, for an error: its entries without the `module:attr` ones that
    config.load_plugins registered."""
    return ", ".join(name for name in registry if not is_spec(name))


def lookup(registry: dict, name: str, key: str, form: str = "module:attr", also: str = "") -> object:
    """registry[name] for config key `key`: a built-in name, or a `module:attr` spec config.load_plugins registered;
    else one sentence naming the key, its built-in names (after `also`, any other value it takes) and `form`."""
    if name in registry:
        return registry[name]
    raise ValueError(f"{key} '{name}' is unknown; accepted: {also}{builtin_names(registry)} or {form}")


def load(spec: str, key: str, accepted: str = "a built-in name") -> object:
    """The object `spec` ("module:attr", attr may be dotted) names, for config key `key`; `accepted` says what else
    the key takes (the built-in names) in the error."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr or not all(attr.split(".")):
        raise ValueError(f"{key} '{spec}' must be {accepted} or module:attr (e.g. my_module:MyClass)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{key} '{spec}': no module named '{module_name}' in this process; put its directory "
                             f"on PYTHONPATH (every process of the run imports it), or use {accepted}") from None
        raise ValueError(f"{key} '{spec}': importing module '{module_name}' failed: "
                         f"{type(e).__name__}: {_first_line(e)}") from e
    except Exception as e:  # the user's module raised while importing: say so, keep its traceback chained
        raise ValueError(f"{key} '{spec}': importing module '{module_name}' failed: "
                         f"{type(e).__name__}: {_first_line(e)}") from e
    obj = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            where = ".".join([module_name, *attr.split(".")[:i]])
            raise ValueError(f"{key} '{spec}': '{where}' has no attribute '{part}' (module file "
                             f"{getattr(module, '__file__', '?')}); accepted: {accepted} or module:attr")
        obj = getattr(obj, part)
    return obj


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else "(no message)"
