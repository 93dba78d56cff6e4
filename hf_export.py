"""hf_export.py: the FSDP2 model in HF checkpoint form, which both the weight sync and the final export write.

- `fsdp_units`: the FSDP2 units model.apply_fsdp made (each decoder layer, then the root) and the parameters each
  all-gathers; `to_checkpoint`: one unit's tensors under the checkpoint's names, as save_pretrained writes them
  (transformers' own conversion; views, never copies). weight_sync.py plans and fills its buckets with these.
- `export_hf`: the whole model as an HF checkpoint directory (config and tokenizer of model.path, safetensors shards
  and their index), from the float32 master shards (not FSDP2's bf16 unshard), in `export_dtype` (trainer.export_dtype);
  train.py's final export (run_dir/hf) and weight_sync.method=disk write it.
It imports no other file of the root, so weight_sync.py and train.py both import it, and checkpoint.py (a run's own
DCP checkpoints, for resuming) needs none of it.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

SHARD_BYTES = 5 * 2 ** 30  # export_hf: safetensors shard size (save_pretrained's default max_shard_size)


def fsdp_units(model) -> list:
    """[(FSDP2 module, [parameter names it all-gathers])]: each decoder layer, then the root (the rest)."""
    layers = list(model.model.layers)
    units, seen = [], set()
    for i, layer in enumerate(layers):
        names = [f"model.layers.{i}.{n}" for n, _ in layer.named_parameters()]
        units.append((layer, names))
        seen.update(names)
    units.append((model, [n for n, _ in model.named_parameters() if n not in seen]))
    return units


class _Views(torch.Tensor):
    """A tensor whose .contiguous() is itself. transformers' Chunk (the reverse of a Qwen3-MoE layer's gate/up
    Concatenate) makes each half of the fused gate_up_proj [E, 2I, H] contiguous: a copy of the whole fused tensor
    (805 MB a layer for Qwen3-30B-A3B in bf16) at every sync, only to be copied again into the bucket, which copies
    from strided views just as well."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def to_checkpoint(model, named: dict) -> dict:
    """One FSDP unit's {parameter name: tensor} -> {checkpoint name: tensor}, as save_pretrained writes them:
    transformers' own core_model_loading.revert_weight_conversion (what save_pretrained calls), applied to this
    unit's tensors only (its converters are per layer: a Qwen3-MoE layer's fused mlp.experts.gate_up_proj /
    down_proj become experts.{i}.gate_proj/up_proj/down_proj.weight), every one a view of the unit's tensors, never a
    copy (_Views). A dense model's names are returned unchanged and in their order."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, {n: t.as_subclass(_Views) for n, t in named.items()})
    return dict(named) if out.keys() == named.keys() else {n: t.as_subclass(torch.Tensor) for n, t in out.items()}


def export_dtype(setting: str, model_path: str) -> torch.dtype:
    """trainer.export_dtype with auto resolved: the dtype model.path's config.json names (transformers 5 writes
    "dtype", 4 "torch_dtype"; a multimodal one under text_config), float32 when it names none. The default, because
    a trained checkpoint is expected in its base's format: Qwen3-30B-A3B's bf16 comes back as 61 GB of bf16, which
    is also what SGLang serves, not as 122 GB of float32; float32 keeps the master weights' bits."""
    if setting != "auto":
        return getattr(torch, setting)
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            c = json.load(f)
    except OSError:
        return torch.float32
    for d in (c, c.get("text_config") or {}):
        name = d.get("dtype") or d.get("torch_dtype")
        if isinstance(name, str) and isinstance(getattr(torch, name.removeprefix("torch."), None), torch.dtype):
            return getattr(torch, name.removeprefix("torch."))
    return torch.float32


def full_parameter(p: torch.Tensor) -> torch.Tensor:
    """Every rank: the whole parameter from its FSDP2 shards in their own dtype (the float32 master weights), not
    the param_dtype copy (bf16 on cuda) that FSDP2's unshard gathers. A shard offloaded to host memory is moved to
    the mesh's device type for the all-gather first (as torch's _gather_state_dict does)."""
    if not hasattr(p, "full_tensor"):
        return p.detach()
    if p.device.type != p.device_mesh.device_type:
        p = p.to(p.device_mesh.device_type)
    return p.detach().full_tensor()


def export_hf(model, model_path: str, path: str, dtype: torch.dtype) -> int:
    """Every rank: the model as an HF checkpoint directory (config and tokenizer files of model_path, safetensors
    shards of at most SHARD_BYTES and their index, in checkpoint names: to_checkpoint), one FSDP2 unit gathered at
    a time from the float32 shards (full_parameter) and cast once to `dtype`; rank 0 writes each shard file as it
    fills, so host memory holds one shard, not the model. Returns the bytes written (0 on the other ranks)."""
    from safetensors.torch import save_file

    rank = dist.get_rank() if dist.is_initialized() else 0
    tmp = path + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model_path, tmp, ignore=shutil.ignore_patterns(
            "*.safetensors", "*.safetensors.index.json", "*.bin", "*.pt"))
    params = dict(model.named_parameters())
    files, weight_map, shard, size, total = [], {}, {}, 0, 0

    def flush():
        nonlocal shard, size
        files.append(f"part-{len(files):05d}.safetensors")
        save_file(shard, os.path.join(tmp, files[-1]), metadata={"format": "pt"})
        weight_map.update((n, files[-1]) for n in shard)
        shard, size = {}, 0

    with torch.no_grad():
        for _, names in fsdp_units(model):
            full = {n: full_parameter(params[n]) for n in names}
            if rank == 0:
                for n, t in to_checkpoint(model, full).items():
                    t = t.to("cpu", dtype).contiguous()
                    if shard and size + t.nbytes > SHARD_BYTES:
                        flush()
                    shard[n], size, total = t, size + t.nbytes, total + t.nbytes
            del full
    if rank != 0:
        return 0
    if shard or not files:
        flush()
    if len(files) == 1:  # as save_pretrained: one file, no index
        os.replace(os.path.join(tmp, files[0]), os.path.join(tmp, "model.safetensors"))
    else:
        names = {f: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files)}
        for f, name in names.items():
            os.replace(os.path.join(tmp, f), os.path.join(tmp, name))
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total},
                       "weight_map": {n: names[f] for n, f in sorted(weight_map.items())}}, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return total
