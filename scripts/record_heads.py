"""Record what llama.cpp's own converter makes of the tests' head checkpoints, so that the tests
can hold `specli convert-head` to it without torch (issue 57, point 5).

    python scripts/record_heads.py --python /path/to/venv-with-torch/bin/python \\
        [--llama-cpp DIR] [--out tests/data/native_heads.json]

For each layout of scripts/head_models.py (EAGLE3_LAYOUTS, DFLASH_LAYOUTS) it writes the tiny
random-weight checkpoint the tests write (the same bytes: every tensor comes from a fixed
seed), and a Hugging Face directory for their target (tiny-llama.gguf): its config.json and
SmolLM2's tokenizer as tokenizer.json, rebuilt from the GGUF's vocabulary and merges (the
converter's pre-tokenizer check hashes to "smollm", as for the real SmolLM2). Then it runs
`convert_hf_to_gguf.py CHECKPOINT --target-model-dir TARGET` of the vendored llama.cpp (the
tree scripts/build_native.sh unpacks) with the given Python, which needs torch, transformers
and safetensors (a CPU torch in a throwaway venv will do), and records each output's
fingerprint: every metadata key (long arrays as a digest) and every tensor's type, shape and
sha256. tests/test_convert_head.py converts the same checkpoints with specli and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import head_models  # noqa: E402
from head_models import DFLASH_LAYOUTS, EAGLE3_LAYOUTS  # noqa: E402

LLAMA_CPP = Path.home() / ".cache/specli/native/llama_cpp_python-0.3.36/vendor/llama.cpp"
OUT = ROOT / "tests/data/native_heads.json"
# keys the converter names from the checkpoint's directory and config (not the head's facts)
NAMING = {"general.name", "general.basename", "general.finetune", "general.size_label",
          "general.version"}


def fingerprint(path: str | Path) -> dict:
    """A GGUF file's metadata (an array of more than 64 items as its length and digest) and
    its tensors as [type, shape, sha256 of the bytes]."""
    from specli.ggufmeta import read_header

    h = read_header(str(path))
    h = read_header(str(path), [k for k, kind in h.types.items() if kind.startswith("ARRAY")])
    keys = {}
    for k, v in sorted(h.kv.items()):
        if k in NAMING:
            continue
        if isinstance(v, (list, tuple)) and len(v) > 64:
            v = {"n": len(v), "sha256": hashlib.sha256(json.dumps(
                [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in v]
            ).encode()).hexdigest()}
        elif isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif isinstance(v, tuple):
            v = list(v)
        keys[k] = v
    tensors = {}
    with open(path, "rb") as f:
        for t in h.tensors:
            f.seek(h.data_offset + t.offset)
            tensors[t.name] = [t.type, list(t.shape),
                               hashlib.sha256(f.read(t.n_bytes)).hexdigest()]
    return {"keys": keys, "tensors": dict(sorted(tensors.items()))}


def checkpoints(where: Path, src: str) -> dict[str, Path]:
    """layout -> its checkpoint (as the tests write it), and "target" -> the heads' target."""
    out = {"target": Path(head_models.llama_target(where / "tiny-llama.gguf", src))}
    for layout in (*EAGLE3_LAYOUTS, *DFLASH_LAYOUTS):
        direct = head_models.layout_head(where / f"direct-{layout}.gguf", src, layout)
        out[layout] = head_models.layout_checkpoint(where / f"ckpt-{layout}", direct, layout,
                                                    src)
    return out


def hf_target(target: Path, out: Path) -> Path:
    """The target GGUF as the Hugging Face directory the converter reads: config.json and a
    byte-level BPE tokenizer.json of its vocabulary and merges (SmolLM's pre-tokenizer)."""
    from specli.ggufmeta import read_header

    h = read_header(str(target))
    h = read_header(str(target), [k for k, kind in h.types.items() if kind.startswith("ARRAY")])
    kv = h.kv

    def text(v) -> str:
        return v.decode("utf-8") if isinstance(v, bytes) else v

    tokens = [text(t) for t in kv["tokenizer.ggml.tokens"]]
    types = list(kv["tokenizer.ggml.token_type"])
    merges = [text(m).split(" ", 1) for m in kv["tokenizer.ggml.merges"]]
    a = kv["general.architecture"]
    out.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": kv[f"{a}.embedding_length"],
              "intermediate_size": kv[f"{a}.feed_forward_length"],
              "num_attention_heads": kv[f"{a}.attention.head_count"],
              "num_key_value_heads": kv[f"{a}.attention.head_count_kv"],
              "num_hidden_layers": kv[f"{a}.block_count"],
              "max_position_embeddings": kv[f"{a}.context_length"],
              "rms_norm_eps": float(kv[f"{a}.attention.layer_norm_rms_epsilon"]),
              "rope_theta": float(kv[f"{a}.rope.freq_base"]), "vocab_size": len(tokens),
              "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "float16",
              "bos_token_id": kv["tokenizer.ggml.bos_token_id"],
              "eos_token_id": kv["tokenizer.ggml.eos_token_id"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == 3]
    (out / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True}, byte_level]},
        "post_processor": {**byte_level, "trim_offsets": False},
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}},
        ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False,
        "bos_token": tokens[kv["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[kv["tokenizer.ggml.eos_token_id"]],
        "unk_token": tokens[kv["tokenizer.ggml.unknown_token_id"]],
        "pad_token": tokens[kv["tokenizer.ggml.padding_token_id"]],
        "add_bos_token": kv["tokenizer.ggml.add_bos_token"],
        "chat_template": kv.get("tokenizer.chat_template"),
        "model_max_length": 8192, "clean_up_tokenization_spaces": False}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="a Python with torch, transformers, "
                    "safetensors (the converter's)")
    ap.add_argument("--llama-cpp", default=str(LLAMA_CPP), help="the vendored llama.cpp tree")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    from specli.defaults import smollm2_q4_1

    converter = Path(args.llama_cpp) / "convert_hf_to_gguf.py"
    record: dict = {}
    with tempfile.TemporaryDirectory(prefix="specli-heads-") as tmp:
        where = Path(tmp)
        made = checkpoints(where, smollm2_q4_1())
        target = hf_target(made.pop("target"), where / "target-hf")
        for layout, ckpt in made.items():
            out = where / f"native-{layout}.gguf"
            r = subprocess.run([args.python, str(converter), str(ckpt), "--target-model-dir",
                                str(target), "--outfile", str(out)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{layout}: the converter failed:\n{r.stderr[-3000:]}")
            record[layout] = fingerprint(out)
            print(f"{layout}: {len(record[layout]['tensors'])} tensors, "
                  f"{len(record[layout]['keys'])} keys", file=sys.stderr)
    version = subprocess.run([args.python, "-c", "import torch, transformers; "
                              "print(torch.__version__, transformers.__version__)"],
                             capture_output=True, text=True).stdout.split()
    Path(args.out).write_text(json.dumps({
        "converter": "convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendored llama.cpp",
        "torch": version[0] if version else None,
        "transformers": version[1] if len(version) > 1 else None,
        "layouts": record}, indent=1) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
