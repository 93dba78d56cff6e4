"""model.py: the policy on the trainer ranks: the HF causal LM at model.path sharded by FSDP2 over its decoder layers
(apply_fsdp, load_model), AdamW with warmup (build_optimizer), its log-probs of a collated micro-batch
(token_logprobs, with the lm_head fused into the chunked log-softmax) and of the step-start weights (OldPolicy)."""
from __future__ import annotations

from typing import Optional

import contextlib
import math
import os

import torch
import torch.distributed as dist


def apply_fsdp(model, mesh, param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype],
               cpu_offload: bool = False) -> None:
    """FSDP2: fully_shard each decoder layer, then the root. The last layer is not resharded after forward (its
    backward comes right away). A MoE decoder layer (attention, router and all its experts) is one unit: transformers
    5 keeps a layer's experts as two fused parameters [E, ...], each sharded over the ranks along E like any other
    parameter, and a batch's tokens are routed to most experts, so they are all-gathered together (units per
    expert would add collectives and gather the same bytes; expert parallelism is not implemented).
    param_dtype/reduce_dtype None = no mixed precision (CPU, float32). cpu_offload: the shards, their gradients and
    so the optimizer state stay in host memory (pinned on cuda; pinning needs an accelerator), copied to the device
    per layer for forward and backward."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    off = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    layers = model.model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=off)


def reshard(model) -> None:
    """Free all-gathered parameters. Needed after a no-grad forward: the unresharded last layer and root would
    otherwise keep stale full copies (and hide the sharded parameters) until the next backward."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def load_model(cfg, mesh, device: torch.device, rank: int, group):
    """The HF causal LM at model.path, sharded: built on the meta device, FSDP2-wrapped, then rank 0's weights are
    broadcast into the shards (one full copy in CPU memory, on rank 0 only). group: a gloo group with a long
    timeout (train.py's control group), for the wait on rank 0's load and the buffers' broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = torch.float32 if device.type == "cpu" else getattr(torch, cfg.model.dtype)
    hf_config = AutoConfig.from_pretrained(cfg.model.path)
    impl = attn_implementation(cfg, device)
    if rank == 0:
        print(f"[train] attention: {impl} (model.attn_implementation={cfg.model.attn_implementation})", flush=True)
    with torch.device("meta"):
        # experts_implementation: as standins/engine.py's scheduler.load_model (eager on CPU: grouped_mm is ~10x slower
        # there)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=impl,
                                                 experts_implementation="eager" if device.type == "cpu" else None)
    if cfg.model.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gpu = device.type == "cuda"
    apply_fsdp(model, mesh, torch.bfloat16 if gpu else None, torch.float32 if gpu else None, cfg.trainer.cpu_offload)
    model.to_empty(device="cpu" if cfg.trainer.cpu_offload else device)
    full, buffers = {}, [None]
    if rank == 0:
        ref = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=dtype)
        full, buffers = ref.state_dict(), [{k: v.cpu() for k, v in ref.named_buffers()}]
    # The other ranks wait for rank 0's load (minutes for a 30B from disk) here, under the control group's long
    # timeout, not inside the broadcast below, whose group times out (NCCL: kills) after weight_sync.timeout_s.
    dist.barrier(group=group)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-persistent buffers (rotary inv_freq) are not in a state dict: rank 0's, on the device (also when the
    # parameters are offloaded: FSDP2 moves only those).
    dist.broadcast_object_list(buffers, src=0, group=group)
    for prefix, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            mod._buffers[name] = buffers[0][f"{prefix}.{name}" if prefix else name].to(device)
    return model, hf_config


def attn_implementation(cfg, device: torch.device) -> str:
    """model.attn_implementation with auto resolved to the best kernel installed: on cuda flash_attention_2 (varlen
    over packed rows) when transformers itself accepts it (flash_attn_2_available), else flex_attention (ships with
    torch: a block-sparse mask of the packed sequences, with GQA), not sdpa's dense [n, n] mask; sdpa on CPU."""
    name = cfg.model.attn_implementation
    if name != "auto":
        return name
    if device.type != "cuda":
        return "sdpa"
    return "flash_attention_2" if flash_attn_2_available() else "flex_attention"


def flash_attn_2_available() -> bool:
    """Whether transformers' from_config accepts attn_implementation="flash_attention_2": its own check,
    is_flash_attn_2_available (a `flash_attn` module of the `flash-attn` distribution, >= 2.3.3, with CUDA). Not
    find_spec("flash_attn"): sglang 0.5.23 requires flash-attn-4, whose wheel ships flash_attn/cute/ without a
    flash_attn/__init__.py, a namespace package that find_spec finds and from_config refuses (ImportError on every
    rank). A transformers without that function: the `flash-attn` distribution's metadata, >= 2.3.3."""
    try:
        from transformers.utils import is_flash_attn_2_available
    except ImportError:
        import importlib.metadata

        from packaging.version import InvalidVersion, Version

        try:
            return Version(importlib.metadata.version("flash-attn")) >= Version("2.3.3")
        except (importlib.metadata.PackageNotFoundError, InvalidVersion):
            return False
    return bool(is_flash_attn_2_available())


def lr_factor(u: int, t, updates: int) -> float:
    """The learning rate of optimizer update u (0-based) as a fraction of trainer.lr: linear warmup over
    trainer.warmup_steps updates, then trainer.lr_decay (constant, or linear / cosine from 1 at the warmup's end to
    trainer.min_lr_ratio at the run's last update, `updates` = total_steps x calls_per_step; held there after)."""
    warm = t.warmup_steps
    if u < warm:
        return (u + 1) / warm
    if t.lr_decay == "constant" or updates <= warm + 1:
        return 1.0
    x = min(1.0, (u - warm) / (updates - 1 - warm))  # 0 at the first update after the warmup, 1 at the last
    shape = 1 - x if t.lr_decay == "linear" else 0.5 * (1 + math.cos(math.pi * x))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape


def build_optimizer(model, t, impl: str = "foreach", updates: int = 0):
    """AdamW (impl: fused / foreach / for_loop, see optimizer_impl) and its learning-rate schedule (lr_factor) over
    the run's `updates` optimizer updates; the scheduler steps once an update and is checkpointed."""
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay,
                            fused=impl == "fused", foreach=impl == "foreach")
    if t.lr_decay != "constant" and updates <= 0:
        raise ValueError(f"trainer.lr_decay={t.lr_decay} needs the run's number of optimizer updates, got {updates}")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: lr_factor(u, t, updates))
    return opt, sched


def unpack(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-token values of the packed row [1, n - 1] -> the padded loss layout [b, L - 1] (0 off the sequences);
    differentiable, so the loss (losses.py, one sequence per row) and its gradient are the padded path's."""
    flat = packed[0][index.clamp(min=0)]
    return torch.where(index >= 0, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))


# flex_attention's compiled training forward fails for a packed row shorter than about one of its 128-token blocks
# (torch 2.11 on an H200: 110 tokens raise InductorError NoValidChoicesError, 200 and 1,100 compile; docs/gpu.md),
# which a step's last micro-batch or a DUMMY placeholder row can be: such rows are padded to this length.
FLEX_MIN_TOKENS = 256


def pad_packed(b: dict, min_tokens: int) -> dict:
    """A packed micro-batch whose row is shorter than min_tokens, with a padding sequence appended (token 0,
    positions restarting at 0, so the attention keeps it to itself; no routes): the loss index does not reach it,
    so the log-probs are unchanged (tests/test_packing.py)."""
    n = b["ids"].shape[1]
    if n >= min_tokens:
        return b
    k = min_tokens - n
    out = dict(b, ids=torch.cat([b["ids"], b["ids"].new_zeros(1, k)], 1),
               pos=torch.cat([b["pos"], torch.arange(k, device=b["pos"].device)[None]], 1),
               cu=torch.cat([b["cu"], b["cu"][-1:] + k]), max_len=max(b["max_len"], k))
    if "routes" in b:
        out["routes"] = torch.cat([b["routes"], b["routes"].new_zeros(1, k, *b["routes"].shape[2:])], 1)
        out["routed"] = torch.cat([b["routed"], b["routed"].new_zeros(1, k)], 1)
    return out


def forward_inputs(model, b: dict) -> tuple[dict, dict]:
    """(the micro-batch, the model's keyword arguments besides input_ids) for a forward of a collated micro-batch:
    a packed one runs as one row with restarting position_ids and no attention mask (use_cache=False: transformers
    derives the per-sequence mask from position_ids only when there is no cache; flash_attention_2 runs varlen from
    its boundaries; flex_attention gets a row of at least FLEX_MIN_TOKENS). Sets the MoE routes to replay (moe.py;
    none recorded: the routers' own)."""
    import moe

    if "pos" in b and model.config._attn_implementation == "flex_attention":
        b = pad_packed(b, FLEX_MIN_TOKENS)
    moe.set_routes(model, b.get("routes"), b.get("routed"))
    kwargs = ({"position_ids": b["pos"]} if "pos" in b else {"attention_mask": b["attn"]}) | {"use_cache": False}
    if "pos" in b and model.config._attn_implementation == "flash_attention_2":  # FlashAttentionKwargs
        kwargs |= {"cu_seq_lens_q": b["cu"], "cu_seq_lens_k": b["cu"], "max_length_q": b["max_len"],
                   "max_length_k": b["max_len"]}
    return b, kwargs


@contextlib.contextmanager
def _output_layer(head: torch.nn.Module, forward):
    """head.forward replaced by `forward` for the run of model(...) inside the block (an instance attribute over
    the class's method, removed after)."""
    head.forward = forward
    try:
        yield
    finally:
        del head.forward


@torch.no_grad()
def position_logits(model, b: dict) -> torch.Tensor:
    """The logits [n, V], as the model returns them (bf16 on cuda, float32 on CPU), of the n loss positions of
    a collated micro-batch where b["mask"] > 0, in row-major order: the output layer runs on those positions' last
    hidden states only (its forward wrapped for the run of model(...), as in token_logprobs), so [tokens, vocab]
    logits of the whole micro-batch never exist. Every rank of the FSDP mesh calls it at once (a forward)."""
    b, kwargs = forward_inputs(model, b)
    head, keep = model.get_output_embeddings(), b["mask"] > 0
    rows = b["index"][keep] if "pos" in b else None  # positions of the packed row
    forward = head.forward

    def head_forward(hidden):  # the last hidden states [rows, L, H] -> the kept positions' logits [1, n, V]
        return forward((hidden[0, rows] if rows is not None else hidden[:, :-1][keep])[None])

    with _output_layer(head, head_forward):
        return model(input_ids=b["ids"], **kwargs).logits[0]


def token_logprobs(model, b: dict, temperature: float, chunk_tokens: int, with_entropy: bool = False,
                   support=None) -> tuple:
    """log-probs (and entropy, or None) of a collated micro-batch in the loss layout [b, L - 1]. A packed one runs
    as one row with restarting position_ids and no attention mask (use_cache=False: transformers derives the
    per-sequence mask from position_ids only when there is no cache; flash_attention_2 runs varlen from them).
    With a logprobs.Support (the sampler's top_k / top_p), log-probs and entropy over the kept tokens and a third
    output, the log of the probability mass they hold (None when the support does not truncate), as
    logprobs.token_logprobs gives them.

    The [tokens, vocab] logits are never built: for the run of model(...) its output layer's forward is swapped
    for logprobs.linear_token_logprobs on the last hidden states (lm_head fused into the chunked log-softmax), so
    .logits comes back as the log-probs. The swap sits inside model(...) because FSDP2 gathers the root unit's
    parameters (lm_head, embeddings, final norm) in the root's forward and again for its backward. A head that is
    not a bias-free Linear, or logits that the model post-processes (final_logit_softcapping), take the unfused
    path (logprobs.token_logprobs on the logits)."""
    import logprobs

    b, kwargs = forward_inputs(model, b)
    head, targets = model.get_output_embeddings(), b["ids"][:, 1:]
    fused = (isinstance(head, torch.nn.Linear) and head.bias is None
             and not getattr(model.config, "final_logit_softcapping", None))
    extra = {} if support is None else {"support": support}
    if fused:
        def head_forward(hidden):  # the model's output: FSDP2's pre-backward hook is registered on it
            logp, *rest = logprobs.linear_token_logprobs(hidden[:, :-1], head.weight, targets, temperature,
                                                         chunk_tokens, with_entropy, **extra)
            rest = [t for t in rest if t is not None]  # entropy, log-mass
            return torch.stack([logp, *rest], -1) if rest else logp

        with _output_layer(head, head_forward):
            out = model(input_ids=b["ids"], **kwargs).logits
        parts = out.unbind(-1) if out.dim() > targets.dim() else (out,)
        logp, ent = parts[0], parts[1] if with_entropy else None
        mass = parts[-1].detach() if len(parts) > 1 + with_entropy else None  # (a slice of the model's output)
    else:
        logits = model(input_ids=b["ids"], **kwargs).logits[:, :-1]
        logp, ent, *mass = logprobs.token_logprobs(logits, targets, temperature, chunk_tokens, with_entropy, **extra)
        mass = mass[0] if mass else None
    if "pos" in b:
        logp, ent, mass = (None if t is None else unpack(t, b["index"]) for t in (logp, ent, mass))
    return (logp, ent) if support is None else (logp, ent, mass)


class OldPolicy:
    """log pi_old per micro-batch: the step-start weights, fixed for the whole step (docs/design.md, the step
    boundary). At the step's first training call they are the live weights; with more calls to come, a copy of this
    rank's shards is kept (take), and later calls copy it into the shards, compute, and put the live shards back.
    Those wait in a clone meanwhile, in the memory this call's gradients take later (the last update's zero_grad
    freed it), so the peak is not raised by a full copy. The copy is in the compute dtype: bfloat16 on cuda, which is
    what FSDP2's mixed precision casts the shards to before the all-gather, so a forward from it is the step-start
    forward exactly, at half the size of float32 master weights; on the device, or in host memory (host=True:
    trainer.snapshot=cpu, pinned on cuda)."""

    def __init__(self, model, device: torch.device, host: bool):
        self.model, self.device, self.host = model, device, host
        self.shards: Optional[list] = None  # the step-start local shards
        self.step = -1  # the step they are of
        # Nothing random in the training forward (no dropout): at a step's first call it is the old policy's forward
        # too, so its log-probs, detached, are the old log-probs and the separate no-grad forward is skipped.
        self.train_forward_is_old = not (getattr(model.config, "attention_dropout", 0.0) or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()))

    @torch.no_grad()
    def log_probs(self, batches: list[dict], step: int, more_calls: bool, forward) -> list:
        """forward(batch) -> (log-probs, entropy[, log-mass]) of the live model on each batch, with the step-start
        weights in place; None for each batch of the step's first call when the training forward is the old
        policy's."""
        first = step != self.step
        reshard(self.model)  # first: the unsharded parameters of the last layer and root would be listed instead
        params = [p.to_local() for p in self.model.parameters()]
        live = None
        if first and more_calls:
            self.take(params, step)
        elif not first:
            live = [p.clone() for p in params]
            for p, s in zip(params, self.shards):
                p.copy_(s)
        if first and self.train_forward_is_old:
            return [None] * len(batches)
        self.model.eval()
        out = [forward(b) for b in batches]
        reshard(self.model)
        for p, x in zip(params, live or []):
            p.copy_(x)
        return out

    def take(self, params: list, step: int) -> None:
        if self.shards is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else None
            self.shards = [torch.empty_like(p, dtype=dtype, device="cpu" if self.host else None,
                                            pin_memory=self.host and self.device.type == "cuda") for p in params]
        for p, s in zip(params, self.shards):
            s.copy_(p)
        self.step = step

    def drop(self) -> None:
        """Free the copy (colocate: before the servers take the memory back); the next step takes a new one."""
        self.shards = None


def memory_now(device: torch.device) -> float:
    """GiB this process holds now: the CUDA caching allocator's reserved bytes on GPU (what another process on
    the GPU cannot have), the resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device) / 2 ** 30
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 30


def memory_metrics(device: torch.device) -> dict:
    """perf/train_memory_*_max in GiB: CUDA allocator peaks on GPU; on CPU the process's peak RSS for both."""
    if device.type == "cuda":
        return {"perf/train_memory_allocated_max": torch.cuda.max_memory_allocated(device) / 2 ** 30,
                "perf/train_memory_reserved_max": torch.cuda.max_memory_reserved(device) / 2 ** 30}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB -> GiB
    return {"perf/train_memory_allocated_max": rss, "perf/train_memory_reserved_max": rss}
