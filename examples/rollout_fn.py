"""examples/rollout_fn.py: a rollout function of your own (rollout.function).

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        rollout.function=rollout_fn:one_tool_call rollout.env=echo_env:EchoEnv rollout.sampling.max_new_tokens=16

A rollout function is `async def fn(ctx, trajs) -> None`, awaited by the rollout process once per prompt group with
the group's unfinished trajectories (rollout_fns.py). `await ctx.generate_batch(trajs)` runs one model turn of each
in one list request (the built-in single_turn); `await ctx.each(trajs, episode)` runs `episode(ctx, traj)` for each
trajectory on its own (its own context; put to the buffer when it ends). An episode extends `traj` with
`await ctx.generate(traj)` (one model turn within the remaining budget: sets traj.status and returns the finish
reason, stop | length | abort) and `ctx.append_env(traj, text)` (environment tokens, loss mask 0; False when they do
not fit). `ctx.make_env()` builds the trajectory's tool environment (rollout.env, or the task's own: tasks.make_env)
and `await ctx.env_step(env, traj, text)` runs one of its steps within rollout.env_max_concurrent and
rollout.env_step_timeout_s (a step that fails fails the trajectory). ctx also has cfg, task, group (label,
metadata), tokenizer and decode(ids).

one_tool_call runs one_episode for each trajectory: one model turn, then the environment's reply to it and one more
model turn. A trajectory restored by partial rollout (rollout.partial=true) comes back with the tokens it had, so the
episode first looks at what is already there. The first call prints a line with the process id.
"""
import os

_said = False


async def one_tool_call(ctx, trajs):
    """Each trajectory of the group on its own (ctx.each): one_episode."""
    global _said
    if not _said:
        _said = True
        print(f"rollout_fn: one_tool_call called in pid {os.getpid()}", flush=True)
    await ctx.each(trajs, one_episode)


async def one_episode(ctx, traj):
    """At most two model turns with one environment observation between them."""
    if traj.metadata.get("env_spans"):  # restored after the observation: finish the second turn
        await ctx.generate(traj)
        return
    if await ctx.generate(traj) != "stop":  # the first turn (continued, if restored within it)
        return
    env = ctx.make_env()
    observation = await ctx.env_step(env, traj, ctx.decode(traj.response_ids))
    if observation is not None and ctx.append_env(traj, observation):
        await ctx.generate(traj)
