"""The cost of `specli convert-head` on a head of a published size: a random-weight EAGLE-3
checkpoint shaped like yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's (width 4096, 32 heads, 8 KV
heads, FFN 14336, a 32,000-token draft vocabulary; about 0.85 GB of bf16), converted against a
metadata-only llama target 4096 wide (SmolLM2's tokenizer: the conversion reads no target
weights for EAGLE-3).

    python scripts/bench_convert_head.py [DIR] [--outtype auto]

Prints the seconds, the bytes written and the peak resident memory (one process).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

E, HEADS, KV, FF, DRAFT = 4096, 32, 8, 14336, 32000


def checkpoint(d: Path, n_vocab: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    hd = E // HEADS

    def m(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def v(n: int) -> np.ndarray:
        return np.ones(n, ml_dtypes.bfloat16)

    t = {"fc.weight": m(E, 3 * E), "norm.weight": v(E), "lm_head.weight": m(DRAFT, E),
         "d2t": np.zeros(DRAFT, np.int64),
         "midlayer.input_layernorm.weight": v(E), "midlayer.hidden_norm.weight": v(E),
         "midlayer.self_attn.q_proj.weight": m(HEADS * hd, 2 * E),
         "midlayer.self_attn.k_proj.weight": m(KV * hd, 2 * E),
         "midlayer.self_attn.v_proj.weight": m(KV * hd, 2 * E),
         "midlayer.self_attn.o_proj.weight": m(E, HEADS * hd),
         "midlayer.post_attention_layernorm.weight": v(E),
         "midlayer.mlp.gate_proj.weight": m(FF, E), "midlayer.mlp.up_proj.weight": m(FF, E),
         "midlayer.mlp.down_proj.weight": m(E, FF)}
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": E,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "intermediate_size": FF,
        "num_hidden_layers": 1, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "vocab_size": n_vocab, "draft_vocab_size": DRAFT,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}))


def target(path: Path, src: str) -> int:
    """A llama GGUF 4096 wide with 32 blocks and no tensors: what the converter reads."""
    import gguf
    import head_models

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value, vtype, sub in head_models._tokenizer(src)[0]:
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.add_uint32("llama.embedding_length", E)
    w.add_uint32("llama.block_count", 32)
    head_models._done(w)
    return head_models._n_vocab(src)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--outtype", default="auto")
    a = ap.parse_args()
    from specli.defaults import smollm2_q4_1
    from specli.headconvert import convert_head

    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        d = Path(tmp)
        n_vocab = target(d / "target.gguf", smollm2_q4_1())
        checkpoint(d / "head", n_vocab)
        size = (d / "head" / "model.safetensors").stat().st_size
        t0 = time.perf_counter()
        r = convert_head(d / "head", str(d / "target.gguf"), d / "head.gguf", outtype=a.outtype)
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"checkpoint {size / 2**30:.2f} GiB -> {r.outtype} {r.n_bytes / 2**30:.2f} GiB, "
              f"{r.n_tensors} tensors: {dt:.1f} s ({size / 2**20 / dt:.0f} MiB/s); "
              f"peak RSS of the process {peak:.2f} GiB")


if __name__ == "__main__":
    main()
