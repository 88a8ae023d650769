"""Tiny random-weight GGUF models for the draft heads (MTP, EAGLE-3, DFlash, DSpark), written
with the gguf package in llama.cpp's tensor layout (src/models/{llama,hy-v3,eagle3,dflash}.cpp
and the load_tensors of src/llama-model.cpp, in the llama.cpp that llama-cpp-python vendors).

Every file carries SmolLM2's tokenizer (copied from the embedded model), so prompts and text
are real. The weights are random, but each target speaks only the live tokens (a few dozen
ordinary words): its output rows for every other token are near zero, and the heads' output
(their own, through d2t, or the target's) covers the same tokens. So the heads' drafts are accepted
now and then, and the rewinds after a partial acceptance are exercised too.

    python scripts/head_models.py DIR    # writes every file into DIR and prints their paths

Used by the tests (tests/conftest.py) and scripts/bench_run.py; no test depends on a
particular random draw, only on the files being the same for specli and native llama.cpp.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import gguf
import numpy as np

T = gguf.GGUFValueType

# the live vocabulary: common English words in SmolLM2's tokenizer (ids looked up at write time)
WORDS = (" the of and to in a is that for it as with was on be by at this from are or an "
         "not have but they which one you were all we her can there has been if more when "
         "will would who so no").split(" ")[1:]
E, HEADS, HEADS_KV, FF = 64, 4, 2, 128  # the targets' widths (head dim 16)
N_LAYER = 4  # the llama target's blocks
MASK = 49151  # DFlash's mask token (the last id; never live)


@functools.cache
def _tokenizer(src: str) -> tuple[list[tuple[str, object, T, T | None]], list[int]]:
    """SmolLM2's tokenizer keys (name, value, type, array item type) and the live ids."""
    from specli.ggufmeta import read_header  # seconds faster than gguf's GGUFReader
    from specli.headconvert import typed_keys

    keys = [k for k in read_header(src).types
            if k.startswith("tokenizer.") and k != "tokenizer.chat_template"]
    h = read_header(src, keys)
    kv = typed_keys(h, keys)
    tokens = h.kv["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(tokens)}
    live = sorted({index["Ġ" + w.strip()] for w in WORDS if "Ġ" + w.strip() in index})
    return kv, live


def _writer(path: Path, arch: str, src: str, template: str | None = None) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    for key, value, vtype, sub in _tokenizer(src)[0]:
        w.add_key_value(key, value, vtype, sub_type=sub)
    if template:
        w.add_chat_template(template)
    return w


def _finish(x: _Weights, path: Path, live: list[int], n_vocab: int) -> str:
    """A target's last tensors (its output norm and rows), then the file written."""
    x.norm("output_norm.weight", E)
    x.rows("output.weight", E, live, n_vocab)
    _done(x.w)
    return str(path)


def _done(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class _Weights:
    """Random tensors, each from its own name's seed (the same file every time)."""

    def __init__(self, w: gguf.GGUFWriter, seed: int, dtype=np.float16, std: float = 0.1):
        self.w, self.seed, self.dtype, self.std = w, seed, dtype, std

    def _rng(self, name: str) -> np.random.Generator:
        return np.random.default_rng([self.seed, *name.encode()])

    def mat(self, name: str, ne0: int, ne1: int, std: float | None = None) -> None:
        """A matrix of ggml shape {ne0, ne1} (numpy's (ne1, ne0))."""
        a = self._rng(name).normal(0.0, std or self.std, (ne1, ne0)).astype(self.dtype)
        self.w.add_tensor(name, a)

    def norm(self, name: str, n: int) -> None:
        self.w.add_tensor(name, (1.0 + self._rng(name).normal(0.0, 0.1, n)).astype(np.float32))

    def rows(self, name: str, ne0: int, live: list[int], n_vocab: int, std: float = 0.5,
             add: bool = True) -> np.ndarray:
        """An output matrix {ne0, n_vocab} whose rows are near zero but for the live tokens'
        (not zero: a row of equal logits makes every top-k selection slow); add=False: only
        the array, the same one."""
        rng = self._rng(name)
        a = rng.normal(0.0, 0.002, (n_vocab, ne0)).astype(np.float32)
        a[live] = rng.normal(0.0, std, (len(live), ne0))
        if add:
            self.w.add_tensor(name, a.astype(self.dtype))
        return a


def _n_vocab(src: str) -> int:
    return len(next(v for k, v, _, _ in _tokenizer(src)[0] if k == "tokenizer.ggml.tokens"))


def _block(x: _Weights, i: int, qk_norm: bool = False) -> None:
    hd = E // HEADS
    x.norm(f"blk.{i}.attn_norm.weight", E)
    x.mat(f"blk.{i}.attn_q.weight", E, HEADS * hd)
    x.mat(f"blk.{i}.attn_k.weight", E, HEADS_KV * hd)
    x.mat(f"blk.{i}.attn_v.weight", E, HEADS_KV * hd)
    x.mat(f"blk.{i}.attn_output.weight", HEADS * hd, E)
    if qk_norm:
        x.norm(f"blk.{i}.attn_q_norm.weight", hd)
        x.norm(f"blk.{i}.attn_k_norm.weight", hd)
    x.norm(f"blk.{i}.ffn_norm.weight", E)
    x.mat(f"blk.{i}.ffn_gate.weight", E, FF)
    x.mat(f"blk.{i}.ffn_up.weight", E, FF)
    x.mat(f"blk.{i}.ffn_down.weight", FF, E)


def _dims(w: gguf.GGUFWriter, arch: str, n_block: int, width: int = E) -> None:
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", width)
    w.add_uint32(f"{arch}.block_count", n_block)
    w.add_uint32(f"{arch}.feed_forward_length", FF)
    w.add_uint32(f"{arch}.attention.head_count", HEADS)
    w.add_uint32(f"{arch}.attention.head_count_kv", HEADS_KV)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)


def llama_target(path: Path, src: str, seed: int = 1) -> str:
    """A llama-architecture target (the EAGLE-3 and DFlash heads' target)."""
    live, n_vocab = _tokenizer(src)[1], _n_vocab(src)
    w = _writer(path, "llama", src)
    _dims(w, "llama", N_LAYER)
    w.add_uint32("llama.rope.dimension_count", E // HEADS)
    w.add_uint32("llama.vocab_size", n_vocab)
    x = _Weights(w, seed)
    x.mat("token_embd.weight", E, n_vocab, std=1.0)
    for i in range(N_LAYER):
        _block(x, i)
    return _finish(x, path, live, n_vocab)


def mtp_target(path: Path, src: str, n_nextn: int = 1, seed: int = 2) -> str:
    """An hy_v3 target (dense) with n_nextn multi-token-prediction blocks after its two
    trunk blocks: one head (llama.cpp's single-head mode) or a head per draft step (chained)."""
    live, n_vocab = _tokenizer(src)[1], _n_vocab(src)
    n_trunk = 2
    w = _writer(path, "hy_v3", src)
    _dims(w, "hy_v3", n_trunk + n_nextn)
    w.add_uint32("hy_v3.nextn_predict_layers", n_nextn)
    w.add_uint32("hy_v3.expert_feed_forward_length", FF)
    x = _Weights(w, seed)
    x.mat("token_embd.weight", E, n_vocab, std=1.0)
    for i in range(n_trunk):
        _block(x, i, qk_norm=True)
    for i in range(n_trunk, n_trunk + n_nextn):
        # a head that mostly passes the target's hidden state through: it predicts what the
        # target predicted one position before, so it is right whenever the target repeats
        # itself (random targets fall into such loops), and acceptance is not all chance
        _block(_Weights(w, seed + i, std=0.01), i, qk_norm=True)
        eh = np.random.default_rng([seed, i]).normal(0.0, 0.01, (E, 2 * E))
        eh[:, E:] += np.eye(E)
        w.add_tensor(f"blk.{i}.nextn.eh_proj.weight", eh.astype(np.float16))
        x.norm(f"blk.{i}.nextn.enorm.weight", E)
        x.norm(f"blk.{i}.nextn.hnorm.weight", E)
    return _finish(x, path, live, n_vocab)


def eagle3_head(path: Path, src: str, layers: tuple[int, ...] = (0, 2, 3), seed: int = 3,
                norm_before_residual: bool = False, norm_before_fc: bool = False,
                own_embd: bool = False) -> str:
    """An EAGLE-3 head for llama_target: one decoder block over [embedding; fc(features of
    three target layers)], its own small output vocabulary (the live tokens, through d2t),
    the target's token embeddings (own_embd: its own, as Llama 3.3 70B's head has); the
    RedHat (norm_before_residual) and EAGLE-3.1 (norm_before_fc) variants."""
    live = _tokenizer(src)[1]
    w = _writer(path, "eagle3", src)
    _dims(w, "eagle3", 1)
    w.add_array("eagle3.target_layers", list(layers))
    w.add_uint32("eagle3.target_hidden_size", E)
    if norm_before_residual:
        w.add_bool("eagle3.norm_before_residual", True)
    if norm_before_fc:
        w.add_bool("eagle3.norm_before_fc", True)
    x = _Weights(w, seed)
    w.add_tensor("d2t", np.array(live, np.int64))
    x.mat("fc.weight", 3 * E, E)
    if norm_before_fc:
        x.norm("enc.output_norm.weight", 3 * E)
    if own_embd:
        x.mat("token_embd.weight", E, _n_vocab(src), std=1.0)
    x.norm("output_norm.weight", E)
    x.mat("output.weight", E, len(live), std=0.5)
    hd = E // HEADS
    x.norm("blk.0.attn_norm.weight", E)
    x.norm("blk.0.attn_norm_2.weight", E)
    x.mat("blk.0.attn_q.weight", 2 * E, HEADS * hd)
    x.mat("blk.0.attn_k.weight", 2 * E, HEADS_KV * hd)
    x.mat("blk.0.attn_v.weight", 2 * E, HEADS_KV * hd)
    x.mat("blk.0.attn_output.weight", HEADS * hd, E)
    x.norm("blk.0.ffn_norm.weight", E)
    x.mat("blk.0.ffn_gate.weight", E, FF)
    x.mat("blk.0.ffn_up.weight", E, FF)
    x.mat("blk.0.ffn_down.weight", FF, E)
    _done(w)
    return str(path)


# Published EAGLE-3 checkpoint layouts (llama.cpp's conversion/llama.py reads them all):
# architecture string, where the block's tensors live, the d2t map's integer type, the
# output norm's name, whether the config nests the block's settings (RedHat speculators),
# the variant flags and extra tensors the layout carries, and the weights' type
EAGLE3_LAYOUTS = {
    "specforge": dict(arch="LlamaForCausalLMEagle3", block="midlayer.", d2t=np.int64,
                      norm="norm.weight", nested=False, t2d=True),
    "vllm": dict(arch="Eagle3LlamaForCausalLM", block="model.layers.0.", d2t=np.int32,
                 norm="model.norm.weight", nested=False, t2d=False),
    "speculators": dict(arch="Eagle3Speculator", block="layers.0.", d2t=np.int64,
                        norm="norm.weight", nested=True, t2d=True, norm_before_residual=True,
                        own_embd=True),
    "draftmodel": dict(arch="Eagle3DraftModel", block="midlayer.", d2t=np.int64,
                       norm="norm.weight", nested=False, t2d=False, norm_before_fc=True,
                       dtype="bf16"),
}
_E3_BLOCK = {"attn_norm": "input_layernorm", "attn_norm_2": "hidden_norm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order back to Hugging Face's rotary halves."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
       "I32": np.int32}


def read_gguf(path: str) -> tuple[dict, dict[str, tuple[str, np.ndarray]]]:
    """A GGUF file's metadata (arrays in full) and tensors, {name: (type, array in numpy's
    order)}, for the unquantized types; seconds faster than gguf's GGUFReader, which makes an
    object of every token of a tokenizer."""
    from specli.ggufmeta import read_header

    h = read_header(path)
    h = read_header(path, [k for k, kind in h.types.items() if kind.startswith("ARRAY")])
    data = np.memmap(path, np.uint8, "r")
    ts = {}
    for t in h.tensors:
        start = h.data_offset + t.offset
        raw = np.array(data[start:start + t.n_bytes])
        ts[t.name] = (t.type, raw.view(_NP[t.type]).reshape(tuple(reversed(t.shape))))
    return h.kv, ts


def eagle3_checkpoint(out: Path, head: str, layout: str, src: str) -> Path:
    """The EAGLE-3 head file `head` (eagle3_head's) as a Hugging Face checkpoint in one of
    EAGLE3_LAYOUTS: config.json and model.safetensors, the tensors under the layout's
    names, q/k rows in Hugging Face's order, d2t as offsets (draft id + d2t = target id)."""
    from safetensors.numpy import save_file

    spec = EAGLE3_LAYOUTS[layout]
    kv, typed = read_gguf(head)
    ts = {name: a for name, (_, a) in typed.items()}
    dtype = spec.get("dtype", "f16")
    import ml_dtypes

    def cast(a: np.ndarray) -> np.ndarray:
        if a.dtype.kind != "f":
            return a
        return a.astype(ml_dtypes.bfloat16 if dtype == "bf16" else
                        np.float32 if a.ndim == 1 else np.float16)

    t: dict[str, np.ndarray] = {}
    for name, a in ts.items():
        if name == "d2t":
            t["d2t"] = (a - np.arange(a.size)).astype(spec["d2t"])
        elif name.startswith("blk.0."):
            part = name.removeprefix("blk.0.").removesuffix(".weight")
            if part in ("attn_q", "attn_k"):
                a = _unpermute(a, HEADS if part == "attn_q" else HEADS_KV)
            t[spec["block"] + _E3_BLOCK[part] + ".weight"] = cast(a)
        else:
            t[{"fc.weight": "fc.weight", "output_norm.weight": spec["norm"],
               "output.weight": "lm_head.weight", "token_embd.weight": "embed_tokens.weight",
               "enc.output_norm.weight": "input_norm.weight"}[name]] = cast(a)
    if spec["t2d"]:  # the target-to-draft map (llama.cpp does not use it)
        t2d = np.zeros(_n_vocab(src), bool)
        t2d[np.asarray(ts["d2t"])] = True
        t["t2d"] = t2d
    n_draft = int(ts["d2t"].size)
    layer = {"architectures": ["LlamaForCausalLM"], "hidden_size": kv["eagle3.embedding_length"],
             "intermediate_size": kv["eagle3.feed_forward_length"],
             "num_attention_heads": kv["eagle3.attention.head_count"],
             "num_key_value_heads": kv["eagle3.attention.head_count_kv"],
             "num_hidden_layers": 1, "max_position_embeddings": kv["eagle3.context_length"],
             "rms_norm_eps": float(kv["eagle3.attention.layer_norm_rms_epsilon"]),
             "rope_theta": float(kv["eagle3.rope.freq_base"]), "vocab_size": _n_vocab(src),
             "hidden_act": "silu", "torch_dtype": "bfloat16" if dtype == "bf16" else "float16"}
    config: dict = {"architectures": [spec["arch"]], "draft_vocab_size": n_draft,
                    "eagle_aux_hidden_state_layer_ids": [int(i) for i in
                                                         kv["eagle3.target_layers"]]}
    if spec["nested"]:
        config |= {"transformer_layer_config": layer, "speculators_model_type": "eagle3",
                   "target_hidden_size": kv["eagle3.target_hidden_size"]}
    else:
        config |= layer | {"architectures": [spec["arch"]], "model_type": "llama"}
    for flag in ("norm_before_residual", "norm_before_fc"):
        if kv.get(f"eagle3.{flag}"):
            config[flag] = True
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dflash_head(path: Path, src: str, layers: tuple[int, ...] = (1, 3), block: int = 8,
                markov: int = 0, seed: int = 4, sample_from_anchor: bool | None = None) -> str:
    """A DFlash block-diffusion drafter for llama_target (two blocks, non-causal, the
    target's embeddings and output); markov > 0: DSpark, with a Markov head of that rank
    (sample_from_anchor=False: the block's first token is the bonus, as EAGLE-3-style
    DSpark exports draft)."""
    live, n_vocab = _tokenizer(src)[1], _n_vocab(src)
    w = _writer(path, "dflash", src)
    _dims(w, "dflash", 2)
    w.add_array("dflash.target_layers", list(layers))
    w.add_uint32("dflash.block_size", block)
    w.add_uint32("tokenizer.ggml.mask_token_id", MASK)
    if sample_from_anchor is not None:
        w.add_bool("dflash.sample_from_anchor", sample_from_anchor)
    x = _Weights(w, seed)
    x.mat("fc.weight", len(layers) * E, E)
    x.norm("enc.output_norm.weight", E)
    x.norm("output_norm.weight", E)
    for i in range(2):
        _block(x, i, qk_norm=True)
    if markov:
        x.mat("markov_w1.weight", markov, n_vocab, std=0.5)
        x.rows("markov_w2.weight", markov, live, n_vocab, std=0.5)
    _done(w)
    return str(path)


# Published DFlash and DSpark layouts (llama.cpp's conversion/qwen.py): Qwen3 blocks under
# layers.N, the target-layer ids in dflash_config (DFlash), at the top (DSpark), or as 1-based
# aux ids in a speculators config
DFLASH_LAYOUTS = {
    "dflash": dict(arch="DFlashDraftModel", markov=0),
    "dspark": dict(arch="Qwen3DSparkModel", markov=8),
    "dspark-speculators": dict(arch="DSparkSpeculator", markov=8, sample_from_anchor=False),
}
_DF_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def layout_head(path: Path, src: str, layout: str) -> str:
    """The head a layout of EAGLE3_LAYOUTS or DFLASH_LAYOUTS is written from, as GGUF."""
    if layout in EAGLE3_LAYOUTS:
        spec = EAGLE3_LAYOUTS[layout]
        return eagle3_head(path, src, norm_before_residual=spec.get("norm_before_residual",
                                                                    False),
                           norm_before_fc=spec.get("norm_before_fc", False),
                           own_embd=spec.get("own_embd", False))
    spec = DFLASH_LAYOUTS[layout]
    return dflash_head(path, src, markov=spec["markov"],
                       sample_from_anchor=spec.get("sample_from_anchor"))


def layout_checkpoint(out: Path, head: str, layout: str, src: str) -> Path:
    """That head as a checkpoint in its layout."""
    return (eagle3_checkpoint if layout in EAGLE3_LAYOUTS else dflash_checkpoint)(
        out, head, layout, src)


def dflash_checkpoint(out: Path, head: str, layout: str, src: str) -> Path:
    """The DFlash/DSpark head file `head` (dflash_head's) as a Hugging Face checkpoint in one
    of DFLASH_LAYOUTS (Qwen3's q/k rows need no reordering)."""
    from safetensors.numpy import save_file

    spec = DFLASH_LAYOUTS[layout]
    kv, typed = read_gguf(head)
    t: dict[str, np.ndarray] = {}
    for name, (_, a) in typed.items():
        if name.startswith("blk."):
            _, i, part, _ = name.split(".")
            t[f"layers.{i}.{_DF_BLOCK[part]}.weight"] = a
        else:
            t[{"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
               "output_norm.weight": "norm.weight",
               "markov_w1.weight": "markov_head.markov_w1.weight",
               "markov_w2.weight": "markov_head.markov_w2.weight"}[name]] = a
    ids = [int(i) - 1 for i in kv["dflash.target_layers"]]  # the converter adds one
    layer = {"hidden_size": kv["dflash.embedding_length"],
             "intermediate_size": kv["dflash.feed_forward_length"],
             "num_attention_heads": kv["dflash.attention.head_count"],
             "num_key_value_heads": kv["dflash.attention.head_count_kv"],
             "num_hidden_layers": kv["dflash.block_count"],
             "max_position_embeddings": kv["dflash.context_length"],
             "rms_norm_eps": float(kv["dflash.attention.layer_norm_rms_epsilon"]),
             "rope_theta": float(kv["dflash.rope.freq_base"]), "vocab_size": _n_vocab(src),
             # Qwen3 configs give it (without it transformers' Qwen3Config, and so llama.cpp's
             # converter, takes 128)
             "head_dim": kv["dflash.embedding_length"] // kv["dflash.attention.head_count"],
             "hidden_act": "silu", "model_type": "qwen3"}
    mask, block = int(kv["tokenizer.ggml.mask_token_id"]), int(kv["dflash.block_size"])
    config: dict = {"architectures": [spec["arch"]]}
    if layout == "dflash":
        config |= layer | {"block_size": block,
                           "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids}}
    elif layout == "dspark":
        config |= layer | {"block_size": block, "mask_token_id": mask, "target_layer_ids": ids,
                           "markov_head_type": "vanilla"}
    else:
        config |= {"transformer_layer_config": layer, "block_size": block,
                   "mask_token_id": mask, "aux_hidden_state_layer_ids": [i + 1 for i in ids]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


G_SWA = (True, True, True, False)  # gemma4: sliding-window layers, the last one global
G_WINDOW = 512
A_E = 32  # the gemma4 assistant's own width (its input and output rows are the target's, E)


def _gemma4_dims(w: gguf.GGUFWriter, arch: str, width: int, n_block: int,
                 swa: tuple[bool, ...]) -> None:
    _dims(w, arch, n_block, width)
    hd = E // HEADS
    for key in ("key_length", "value_length", "key_length_swa", "value_length_swa"):
        w.add_uint32(f"{arch}.attention.{key}", hd)
    w.add_uint32(f"{arch}.attention.sliding_window", G_WINDOW)
    w.add_array(f"{arch}.attention.sliding_window_pattern", list(swa))
    w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)


def gemma4_target(path: Path, src: str, seed: int = 5) -> str:
    """A gemma4 target: three sliding-window blocks and a global one, each with its own keys
    and values (no shared-KV layers, no per-layer embeddings), for gemma4_assistant."""
    live, n_vocab = _tokenizer(src)[1], _n_vocab(src)
    w = _writer(path, "gemma4", src)
    _gemma4_dims(w, "gemma4", E, len(G_SWA), G_SWA)
    w.add_uint32("gemma4.embedding_length_per_layer_input", 0)
    x = _Weights(w, seed)
    hd = E // HEADS
    x.mat("token_embd.weight", E, n_vocab, std=1.0 / np.sqrt(E))
    w.add_tensor("rope_freqs.weight", np.ones(hd // 2, np.float32))
    for i in range(len(G_SWA)):
        _block(x, i, qk_norm=True)
        x.norm(f"blk.{i}.post_attention_norm.weight", E)
        x.norm(f"blk.{i}.post_ffw_norm.weight", E)
    return _finish(x, path, live, n_vocab)


def gemma4_assistant(path: Path, src: str, n_layer: int = 2, seed: int = 6,
                     target_seed: int = 5) -> str:
    """A gemma4 assistant for gemma4_target (llama.cpp's gemma4-assistant): its blocks have
    queries only and attend over the target's own keys and values (the last sliding-window
    and the last global layer's), llama.cpp's shared-KV MTP mode."""
    live, n_vocab = _tokenizer(src)[1], _n_vocab(src)
    arch = "gemma4-assistant"
    swa = G_SWA[-n_layer:]
    w = _writer(path, arch, src)
    _gemma4_dims(w, arch, A_E, n_layer, swa)
    w.add_uint32(f"{arch}.embedding_length_out", E)
    w.add_uint32(f"{arch}.nextn_predict_layers", n_layer)
    x = _Weights(w, seed, std=0.01)
    hd = E // HEADS
    # an assistant that mostly passes the target's state through, as mtp_target's head: its
    # input is the state's first A_E values, its output rows the target's, cut to them; so
    # it predicts what the target predicted one position before (right where it repeats)
    out = _Weights(w, target_seed).rows("output.weight", E, live, n_vocab, add=False)
    w.add_tensor("token_embd.weight", out[:, :A_E].astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(A_E, np.float32))
    pre = np.random.default_rng([seed, 0]).normal(0.0, 0.01, (A_E, 2 * E))
    pre[:, E:E + A_E] += np.eye(A_E)
    w.add_tensor("nextn.pre_projection.weight", pre.astype(np.float16))
    post = np.random.default_rng([seed, 1]).normal(0.0, 0.01, (E, A_E))
    post[:A_E] += np.eye(A_E)
    w.add_tensor("nextn.post_projection.weight", post.astype(np.float16))
    w.add_tensor("rope_freqs.weight", np.ones(hd // 2, np.float32))
    for i in range(n_layer):
        x.norm(f"blk.{i}.attn_norm.weight", A_E)
        x.mat(f"blk.{i}.attn_q.weight", A_E, HEADS * hd)
        x.mat(f"blk.{i}.attn_output.weight", HEADS * hd, A_E)
        x.norm(f"blk.{i}.attn_q_norm.weight", hd)
        for norm in ("post_attention_norm", "post_ffw_norm"):  # small: each block adds
            w.add_tensor(f"blk.{i}.{norm}.weight", np.full(A_E, 0.01, np.float32))  # little
        w.add_tensor(f"blk.{i}.layer_output_scale.weight", np.ones(1, np.float32))
        x.norm(f"blk.{i}.ffn_norm.weight", A_E)
        x.mat(f"blk.{i}.ffn_gate.weight", A_E, FF)
        x.mat(f"blk.{i}.ffn_up.weight", A_E, FF)
        x.mat(f"blk.{i}.ffn_down.weight", FF, A_E)
    _done(w)
    return str(path)


def write_all(out: Path, src: str) -> dict[str, str]:
    """Every head model into out: {name: path}."""
    out.mkdir(parents=True, exist_ok=True)
    return {
        "llama": llama_target(out / "tiny-llama.gguf", src),
        "mtp": mtp_target(out / "tiny-mtp.gguf", src, 1),
        "mtp2": mtp_target(out / "tiny-mtp2.gguf", src, 2),
        "eagle3": eagle3_head(out / "tiny-eagle3.gguf", src),
        "dflash": dflash_head(out / "tiny-dflash.gguf", src),
        "dspark": dflash_head(out / "tiny-dspark.gguf", src, markov=8),
        "gemma4": gemma4_target(out / "tiny-gemma4.gguf", src),
        "assistant": gemma4_assistant(out / "tiny-gemma4-assistant.gguf", src),
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from specli.defaults import smollm2_q4_1

    for name, p in write_all(Path(sys.argv[1]), smollm2_q4_1()).items():
        print(name, p)
