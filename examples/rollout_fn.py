"""examples/rollout_fn.py: a rollout function of your own (rollout.function).

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        rollout.function=rollout_fn:one_tool_call rollout.env=echo_env:EchoEnv rollout.sampling.max_new_tokens=16

A rollout function is `async def fn(ctx, traj) -> None`, awaited by the rollout process once per trajectory: it
extends `traj` with `await ctx.generate(traj)` (one model turn within the remaining budget: sets traj.status and
returns the finish reason, stop | length | abort) and `ctx.append_env(traj, text)` (environment tokens, loss mask 0;
False when they do not fit). `ctx.make_env()` builds the tool environment (rollout.env, or the task's own:
tasks.make_env) and `await ctx.env_step(env, traj, text)` runs one of its steps within rollout.env_max_concurrent
and rollout.env_step_timeout_s (a step that fails fails the trajectory). ctx also has cfg, task, group (label,
metadata), tokenizer and decode(ids).

one_tool_call: one model turn, then the environment's reply to it and one more model turn. A trajectory restored by
partial rollout (rollout.partial=true) comes back with the tokens it had, so the function first looks at what is
already there. The first call prints a line with the process id.
"""
import os

_said = False


async def one_tool_call(ctx, traj):
    """At most two model turns with one environment observation between them."""
    global _said
    if not _said:
        _said = True
        print(f"rollout_fn: one_tool_call called in pid {os.getpid()}", flush=True)
    if traj.metadata.get("env_spans"):  # restored after the observation: finish the second turn
        await ctx.generate(traj)
        return
    if await ctx.generate(traj) != "stop":  # the first turn (continued, if restored within it)
        return
    env = ctx.make_env()
    observation = await ctx.env_step(env, traj, ctx.decode(traj.response_ids))
    if observation is not None and ctx.append_env(traj, observation):
        await ctx.generate(traj)
