"""batching.py: a mini-batch of groups -> the micro-batches each trainer rank runs: one sequence per trajectory with its
GRPO advantage (make_sequences), a split over ranks balanced by tokens (split_balanced), micro-batches of at most
trainer.micro_batch_tokens (plan_micro_batches) and their tensors, packed or padded (collate; DUMMY pads a rank
with fewer micro-batches)."""
from __future__ import annotations

import itertools

import torch


def make_sequences(groups: list, cfg) -> list[dict]:
    """Groups -> one dict per trajectory (plain lists: cheap to sort, split and collate) with its GRPO advantage,
    taken over the trajectories the group holds: all N, or the survivors of failures (buffer.Group), whose mean and
    std are then the baseline and the scale. A non-finite reward is refused (ValueError naming the group): it would
    turn the group's advantages to NaN, whose tokens the loss leaves out without a word."""
    import losses

    out = []
    for g in groups:
        rewards = torch.tensor([[t.reward for t in g.trajectories]], dtype=torch.float32)
        if not rewards.isfinite().all():  # one would make every advantage of the group NaN, which the loss drops
            raise ValueError(f"group {g.prompt_id} reached the trainer with rewards {rewards[0].tolist()}: a reward "
                             "must be a finite number, and the rollout fails a trajectory whose reward is not "
                             "(scoring.reward_value): these came another way, e.g. a saved rollout edited by hand")
        adv = losses.compute_advantages(rewards, cfg.algorithm.adv.std_normalize, cfg.algorithm.adv.eps)[0]
        for t, a in zip(g.trajectories, adv.tolist()):
            out.append({"prompt": t.prompt_ids.tolist(), "response": t.response_ids.tolist(),
                        "mask": t.loss_mask.tolist(), "rollout_lp": t.rollout_log_probs.tolist(),
                        "versions": t.versions.tolist(), "adv": a,
                        **({"routes": t.routed_experts} if t.routed_experts.numel() else {})})
    return out


def _length(s: dict) -> int:
    return len(s["prompt"]) + len(s["response"])


def split_balanced(seqs: list[dict], parts: int) -> list[list[dict]]:
    """Longest-first greedy: each sequence to the part with the fewest tokens so far."""
    shares, load = [[] for _ in range(parts)], [0] * parts
    for s in sorted(seqs, key=_length, reverse=True):
        i = load.index(min(load))
        shares[i].append(s)
        load[i] += _length(s)
    return shares


def plan_micro_batches(share: list[dict], max_tokens: int, packing: bool = False) -> list[list[dict]]:
    """packing: first-fit decreasing, each micro-batch at most max_tokens real tokens (a longer sequence alone);
    padded: consecutive length-sorted sequences while rows x longest row <= max_tokens (at least one row each)."""
    out: list = []
    if packing:
        load: list = []
        for s in sorted(share, key=_length, reverse=True):
            i = next((i for i, n in enumerate(load) if n + _length(s) <= max_tokens), len(out))
            if i == len(out):
                out.append([])
                load.append(0)
            out[i].append(s)
            load[i] += _length(s)
        return out
    cur: list = []
    for s in sorted(share, key=_length, reverse=True):
        if cur and (len(cur) + 1) * _length(cur[0]) > max_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    return out + ([cur] if cur else [])


# A placeholder row for a rank with fewer micro-batches than another: a real forward/backward, loss exactly 0.
DUMMY = {"prompt": [0], "response": [0], "mask": [0], "rollout_lp": [0.0], "versions": [0], "adv": 0.0}


def collate(seqs: list[dict], mask_offpolicy: bool = False, packing: bool = False) -> dict:
    """The loss tensors are [b, L - 1] on the target positions (position j predicts token j + 1), so a response
    token at index P + t sits at position P + t - 1; mask_offpolicy: loss mask 0 on tokens older than their
    trajectory's newest version (rollout.mask_offpolicy_in_partial_rollout). The model's input:
      padded: right-padded ids [b, L] and attn [b, L];
      packing: ids [1, n] of the sequences back to back with pos [1, n] restarting at 0 for each (the attention
        keeps each sequence to itself: tests/test_packing.py), no padding; index [b, L - 1] maps each loss
        position to its position in the packed row (-1 off the sequence), see unpack."""
    import losses

    L = max(_length(s) for s in seqs)
    b = len(seqs)
    # Rows as Python lists, one tensor per field: per-row tensor writes cost more than the forward on small models.
    ids, attn, mask, rlp, ver = [], [], [], [], []
    for s in seqs:
        P, T = len(s["prompt"]), len(s["response"])
        pad, lead = [0] * (L - P - T), [0] * (P - 1)
        ids.append(s["prompt"] + s["response"] + pad)
        attn.append([1] * (P + T) + pad)
        mask.append(lead + s["mask"] + pad)
        rlp.append(lead + s["rollout_lp"] + pad)
        ver.append(lead + s["versions"] + pad)
    ids, attn, ver = (torch.tensor(x, dtype=torch.long) for x in (ids, attn, ver))
    mask, rlp = torch.tensor(mask, dtype=torch.float32), torch.tensor(rlp, dtype=torch.float32)
    if mask_offpolicy:
        mask = losses.offpolicy_token_mask(ver, mask)
    out = {"mask": mask, "rollout_lp": rlp, "versions": ver,
           "adv": torch.tensor([s["adv"] for s in seqs], dtype=torch.float32)}
    kind = next((s["routes"] for s in seqs if "routes" in s), None)
    if kind is not None:  # routing replay: the server's experts per input position, where `routed` (else the
        # routers' own choice). Kept in the trajectories' dtype (uint8 up to 256 experts: a quarter of int32's bytes
        # through the scatter and on the device); moe.py widens one layer's ids at a time, in the forward.
        routes = torch.zeros((b, L, *kind.shape[1:]), dtype=kind.dtype)
        routed = torch.zeros((b, L), dtype=torch.bool)
        for i, s in enumerate(seqs):
            if "routes" in s:
                routes[i, :s["routes"].shape[0]] = s["routes"]
                routed[i, :s["routes"].shape[0]] = True
        out["routes"], out["routed"] = routes, routed
    if not packing:
        return {"ids": ids, "attn": attn, **out}
    lengths = [_length(s) for s in seqs]
    index = torch.full((b, L - 1), -1, dtype=torch.long)
    off = 0
    for i, n in enumerate(lengths):
        index[i, :n - 1] = torch.arange(off, off + n - 1)
        off += n
    # sequence boundaries for flash-attention's varlen kernel, made here once per micro-batch: without them
    # transformers recomputes them from position_ids in every layer, with a host sync each time
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    if kind is not None:  # the packed row's positions, as ids
        out["routes"], out["routed"] = out["routes"][attn > 0][None], out["routed"][attn > 0][None]
    return {"ids": ids[attn > 0][None], "pos": torch.cat([torch.arange(n) for n in lengths])[None],
            "index": index, "cu": cu, "max_len": max(lengths), **out}
