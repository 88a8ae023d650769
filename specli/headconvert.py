"""Draft heads from where they are published: a Hugging Face safetensors checkpoint
(config.json and its weights) converted into the GGUF file llama.cpp loads, against the GGUF
target the user already has.

llama.cpp's convert_hf_to_gguf.py --target-model-dir reads the target's Hugging Face directory
for its tokenizer, width, layer count and vocabulary; a GGUF target holds all of them. The
conversion follows that converter (conversion/llama.py in the vendored tree: its tensor names,
q/k permutation, d2t as absolute ids, output types) so that the files match, and reads the
weights with the safetensors package's numpy API (bf16 through ml_dtypes): no torch.

Everything is checked before a byte is written, from the checkpoint's headers and the
target's metadata: the layout, every tensor's name and shape, the vocabulary and widths, and
headmeta's head policy (the one `run` applies); only d2t's values, as it is read. The file
is written to a temporary name beside the output and renamed when complete.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specli.errors import IncompatiblePairError
from specli.headckpt import (
    DSPARK_ARCHS,
    OTHER,
    Checkpoint,
    Source,
    cfg_flag,
    cfg_float,
    cfg_int,
    dflash_settings,
    fail,
    head_kind,
    mismatch,
    read_checkpoint,
    tensor_index,
)

OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
CONVERT_VERSION = 1  # in the cache's file names: a change to the output makes new files

# an EAGLE-3 block's tensors, checkpoint name -> GGUF name (gguf-py's tensor map for llama
# blocks, plus EAGLE-3's hidden_norm)
_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "hidden_norm.weight": "attn_norm_2.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_BLOCK_PREFIXES = ("midlayer.", "model.layers.0.", "layers.0.")  # SpecForge, HF, speculators
_TOP = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",  # norm_before_fc
    "norm.weight": "output_norm.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
    "model.embed_tokens.weight": "token_embd.weight",
    "d2t": "d2t",
}
_SKIP = ("t2d",)  # the target-to-draft map: llama.cpp does not use it
_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama_ftype: general.file_type


@dataclass(frozen=True)
class Converted:
    """What convert_head wrote: the file, its head type, the checkpoint's architecture
    string, the tensors and bytes written, and the seconds it took."""

    path: str
    spec_type: str
    architecture: str
    n_tensors: int
    n_bytes: int
    seconds: float
    outtype: str

    def to_dict(self) -> dict:
        return {"path": self.path, "type": self.spec_type, "architecture": self.architecture,
                "n_tensors": self.n_tensors, "bytes": self.n_bytes, "outtype": self.outtype,
                "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class _Target:
    """What the converter would read from the target's Hugging Face directory, from its GGUF."""

    path: str
    header: object  # ggufmeta.Header, its tokenizer arrays decoded
    arch: str
    width: int
    n_layer: int
    n_vocab: int
    tokenizer: list  # (key, value, GGUFValueType, array item type or None)


def typed_keys(h, keys) -> list[tuple]:
    """(key, value, GGUFValueType, array item type or None) of a header's keys, to write
    them again with gguf's GGUFWriter.add_key_value (arrays decoded in full in h)."""
    import gguf

    T = gguf.GGUFValueType
    return [(k, h.kv[k], T.ARRAY, T[h.arrays[k].element_type]) if k in h.arrays
            else (k, h.kv[k], T[h.types[k]], None) for k in keys]


def _target(path: str) -> _Target:
    from specli.ggufmeta import read_header
    from specli.headmeta import trunk_layers

    h = read_header(path)
    keys = [k for k in h.types if k.startswith("tokenizer.")]
    h = read_header(path, keys)
    arch = h.kv.get("general.architecture")
    width, n_layer = h.kv.get(f"{arch}.embedding_length"), trunk_layers(h)
    tokens = h.kv.get("tokenizer.ggml.tokens")
    if not isinstance(width, int) or n_layer is None or not isinstance(tokens, list):
        raise fail(f"{path}: not a target model (no width, layer count or vocabulary in "
                    "its metadata)")
    return _Target(path, h, arch, width, n_layer, len(tokens), typed_keys(h, keys))


@dataclass
class _Plan:
    """One head's conversion: metadata to write and tensors (GGUF name -> source, or an
    array generated here), checked against the shapes llama.cpp's loader creates."""

    arch: str
    spec_type: str
    kv: list = field(default_factory=list)  # (key, value, GGUFValueType, sub type)
    tensors: dict = field(default_factory=dict)  # gguf name -> Source | np.ndarray
    permute: dict = field(default_factory=dict)  # gguf name -> (n_head, n_head_kv)
    interleaved: dict = field(default_factory=dict)  # gguf name -> head dim (to NeoX order)
    mask: int | None = None  # tokenizer.ggml.mask_token_id


@dataclass(frozen=True)
class _Dims:
    """A head's own sizes, from its config."""

    E: int
    n_head: int
    n_kv: int
    hd: int
    ff: int
    n_layer: int
    n_vocab: int
    n_draft: int
    head_dim_known: bool  # the converter writes the key and value widths (AUTO_HEAD_DIM)


# llama.cpp's converter reads a config.json through transformers' AutoConfig where its
# model_type is one transformers knows, and as it is where not (a speculators config): a
# llama config then has a head_dim (hidden_size / heads), a qwen3 one 128 unless it says
AUTO_HEAD_DIM = {"llama": None, "qwen3": 128}


def _dims(cfg: dict, what: str, tgt: _Target, model_type: object = None) -> _Dims:
    """Also: a head width that rope can rotate (even). model_type: the config.json's own."""
    E = cfg_int(cfg, "hidden_size", what)
    n_head = cfg_int(cfg, "num_attention_heads", what)
    n_kv = cfg_int(cfg, "num_key_value_heads", what, n_head)
    known = isinstance(model_type, str) and model_type in AUTO_HEAD_DIM
    auto = AUTO_HEAD_DIM[model_type] if known else None
    given = cfg.get("head_dim") is not None  # (some configs say null: as absent)
    hd = cfg_int(cfg, "head_dim", what) if given else \
        auto or (E // n_head if E % n_head == 0 else 0)
    ff = cfg_int(cfg, "intermediate_size", what)
    n_layer = cfg_int(cfg, "num_hidden_layers", what, 1, hi=256)
    n_vocab = cfg_int(cfg, "vocab_size", what, tgt.n_vocab, hi=1 << 24)
    n_draft = cfg_int(cfg, "draft_vocab_size", what, n_vocab, hi=1 << 24)
    if n_head % n_kv:
        raise fail(f"{what}: {n_head} attention heads do not divide into {n_kv} key-value heads")
    if hd % 2:
        raise fail(f"{what}: a head width of {hd} (head_dim, or hidden_size / "
                    "num_attention_heads): rope rotates pairs")
    if n_draft > n_vocab:
        raise fail(f"{what}: draft_vocab_size {n_draft:,} is more than vocab_size {n_vocab:,}")
    if n_vocab != tgt.n_vocab:
        raise mismatch(f"{what} has a vocabulary of {n_vocab:,} tokens; {tgt.path} has "
                        f"{tgt.n_vocab:,}", OTHER)
    return _Dims(E, n_head, n_kv, hd, ff, n_layer, n_vocab, n_draft,
                 given or known)


def _base_keys(a: str, cfg: dict, d: _Dims, what: str) -> tuple[list, np.ndarray | None]:
    """The keys llama.cpp's converter writes for any text model (TextModel's), and llama3's
    rope factors if the config asks for them."""
    import gguf

    T = gguf.GGUFValueType
    ctx = cfg.get("max_position_embeddings")
    kv = [("general.type", "model", T.STRING)]
    if isinstance(ctx, int) and not isinstance(ctx, bool) and 0 < ctx < 1 << 31:
        kv.append((f"{a}.context_length", ctx, T.UINT32))
    kv += [(f"{a}.embedding_length", d.E, T.UINT32), (f"{a}.block_count", d.n_layer, T.UINT32),
           (f"{a}.feed_forward_length", d.ff, T.UINT32),
           (f"{a}.attention.head_count", d.n_head, T.UINT32),
           (f"{a}.attention.head_count_kv", d.n_kv, T.UINT32)]
    rope = _rope(cfg, what, d.hd)
    kv += [(f"{a}.{k}", v, t) for k, v, t in rope[0]]
    kv.append((f"{a}.attention.layer_norm_rms_epsilon",
               cfg_float(cfg, "rms_norm_eps", what, 1e-6), T.FLOAT32))
    if d.head_dim_known:
        kv += [(f"{a}.attention.key_length", d.hd, T.UINT32),
               (f"{a}.attention.value_length", d.hd, T.UINT32)]
    return [(k, v, t, None) for k, v, t in kv], rope[1]


def _eagle3(ck: Checkpoint, src: dict[str, Source], tgt: _Target) -> _Plan:
    import gguf

    T = gguf.GGUFValueType
    cfg, raw, what = ck.config, ck.raw, f"{ck.architecture} head"
    if cfg_int(cfg, "num_hidden_layers", what, 1, hi=256) != 1:
        raise fail(f"{what}: {cfg['num_hidden_layers']} layers; an EAGLE-3 head has one")
    d = _dims(cfg, what, tgt, ck.raw.get("model_type"))
    E, n_head, n_kv, hd, ff, n_vocab, n_draft = (d.E, d.n_head, d.n_kv, d.hd, d.ff, d.n_vocab,
                                                 d.n_draft)
    width = raw.get("target_hidden_size")
    width = tgt.width if width is None else cfg_int(raw, "target_hidden_size", what)
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    if layers:
        if not isinstance(layers, list) or len(layers) != 3 or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise fail(f"{what}: eagle_aux_hidden_state_layer_ids = {layers!r} is not three "
                        "layer ids")
    else:  # the converter's default: low, middle and high layers of the target
        layers = [2, tgt.n_layer // 2, tgt.n_layer - 3]
    before_fc = cfg_flag(raw, "norm_before_fc", what)
    plan = _Plan("eagle3", "draft-eagle3")
    a = "eagle3"
    plan.kv, freqs = _base_keys(a, cfg, d, what)
    if cfg.get("is_causal") is False:  # TextModel's
        plan.kv.append((f"{a}.attention.causal", False, T.BOOL, None))
    plan.kv += [(f"{a}.vocab_size", n_vocab, T.UINT32, None),  # LlamaModel's own
                (f"{a}.rope.dimension_count", hd, T.UINT32, None),
                (f"{a}.target_layers", list(layers), T.ARRAY, T.INT32),
                (f"{a}.target_hidden_size", width, T.UINT32, None),
                (f"{a}.norm_before_residual", cfg_flag(raw, "norm_before_residual", what),
                 T.BOOL, None),
                (f"{a}.norm_before_fc", before_fc, T.BOOL, None)]
    _fits(plan, tgt, str(ck.root))  # layers and width, before the tensors' shapes

    if freqs is not None:  # generated first, as the converter does
        plan.tensors["rope_freqs.weight"] = freqs
    for key, s in src.items():
        name = _eagle3_name(key)
        if name is None:
            continue
        if name in plan.tensors:
            raise fail(f"{what}: {key} and another tensor both map to {name}")
        plan.tensors[name] = s
    fc = plan.tensors.get("fc.weight")
    if fc is not None and len(fc.shape) == 2 and fc.shape[1] != 3 * width:
        raise mismatch(f"{what}'s fc reads {fc.shape[1]:,} features (3 layers x "
                        f"{fc.shape[1] / 3:g}); {tgt.path} is {tgt.width} wide", OTHER)
    # the shapes llama.cpp's EAGLE-3 loader creates (src/models/eagle3.cpp), numpy order
    want = {"fc.weight": (E, 3 * width), "output_norm.weight": (E,),
            "blk.0.attn_norm.weight": (E,), "blk.0.attn_norm_2.weight": (E,),
            "blk.0.attn_q.weight": (n_head * hd, 2 * E),
            "blk.0.attn_k.weight": (n_kv * hd, 2 * E),
            "blk.0.attn_v.weight": (n_kv * hd, 2 * E),
            "blk.0.attn_output.weight": (E, n_head * hd), "blk.0.ffn_norm.weight": (E,),
            "blk.0.ffn_gate.weight": (ff, E), "blk.0.ffn_up.weight": (ff, E),
            "blk.0.ffn_down.weight": (E, ff)}
    if before_fc:
        want["enc.output_norm.weight"] = (3 * width,)
    optional = {"output.weight": (n_draft, E), "token_embd.weight": (tgt.n_vocab, E),
                "d2t": (n_draft,), "rope_freqs.weight": (hd // 2,)}
    _check_shapes(plan.tensors, want, optional, what)
    plan.permute = {"blk.0.attn_q.weight": (n_head, n_head),
                    "blk.0.attn_k.weight": (n_head, n_kv)}
    return plan


# a DFlash block's tensors beyond EAGLE-3's (Qwen3's per-head q/k norms)
_DFLASH_BLOCK = {k: v for k, v in _BLOCK.items() if k != "hidden_norm.weight"} | {
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight"}
_DFLASH_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
               "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
               "embed_tokens.weight": "token_embd.weight", "d2t": "d2t",
               "markov_head.markov_w1.weight": "markov_w1.weight",
               "markov_head.markov_w2.weight": "markov_w2.weight",
               "confidence_head.proj.weight": "conf_proj.weight",
               "confidence_head.proj.bias": "conf_proj.bias"}


def _dflash(ck: Checkpoint, src: dict[str, Source], tgt: _Target) -> _Plan:
    """A DFlash or DSpark drafter on Qwen3 blocks (conversion/qwen.py's DFlashModel and
    DSparkModel): the target's layer states through fc into a few non-causal blocks."""
    import gguf

    T = gguf.GGUFValueType
    what = f"{ck.architecture} head"
    dspark = ck.architecture in DSPARK_ARCHS
    cfg = ck.config
    dcfg, anchor = dflash_settings(ck, what)
    if dspark:
        if cfg.get("markov_head_type", "vanilla") != "vanilla":
            raise fail(f"{what}: markov_head_type {cfg.get('markov_head_type')!r}: llama.cpp "
                        "runs the vanilla Markov head only")
    for unsupported in ("conv_kernel_size", "attention_value_scale"):
        if unsupported in dcfg:
            raise fail(f"{what}: dflash_config.{unsupported} (DFlash2's convolution and "
                        "selector) is not converted by specli yet",
                        "llama.cpp's convert_hf_to_gguf.py converts it")
    for pickle in ("mask_embedding.pt",):
        if (ck.root / pickle).exists():
            raise fail(f"{what}: {pickle} is a PyTorch pickle, which specli does not unpickle",
                        "llama.cpp's convert_hf_to_gguf.py converts it")
    d = _dims(cfg, what, tgt, ck.raw.get("model_type"))
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids", []))
    if not isinstance(ids, list) or not ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise fail(f"{what}: target_layer_ids = {ids!r} is not a list of layer ids")
    layers = [i + 1 for i in ids]  # the converter's: the input of the layer after
    mask = dcfg.get("mask_token_id")  # its range, with layers and width: _fits
    if mask is not None and (isinstance(mask, bool) or not isinstance(mask, int)):
        raise fail(f"{what}: mask_token_id = {mask!r} is not a token id")
    block = dcfg.get("block_size", cfg.get("block_size", 16))
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 4096:
        raise fail(f"{what}: block_size = {block!r} is not a block size")
    a = "dflash"
    plan = _Plan(a, "draft-dspark" if dspark else "draft-dflash")
    plan.kv, _ = _base_keys(a, cfg, d, what)  # Qwen3's converter makes no rope_freqs
    partial = _rope_params(cfg, what).get("partial_rotary_factor",
                                          cfg.get("partial_rotary_factor"))
    if partial is not None:
        plan.kv.append((f"{a}.rope.dimension_count",
                        int(d.hd * cfg_float({"partial_rotary_factor": partial},
                                          "partial_rotary_factor", what, 1.0, hi=1.0)),
                        T.UINT32, None))
    plan.kv.append((f"{a}.block_size", block, T.UINT32, None))
    for key, gkey in (("output_multiplier", "logit_scale"),
                      ("final_logit_softcapping", "final_logit_softcapping"),
                      ("input_embedding_scale", "embedding_scale")):
        v = dcfg.get(key, cfg.get(key))
        if v is not None and not (gkey == "final_logit_softcapping" and v == 0):
            plan.kv.append((f"{a}.{gkey}", cfg_float({key: v}, key, what, 1.0), T.FLOAT32, None))
    plan.kv.append((f"{a}.target_layers", layers, T.ARRAY, T.INT32))
    swa = dcfg.get("swa_window_size") or cfg.get("sliding_window")
    if (cfg.get("use_sliding_window") or dcfg.get("use_swa")) and swa:
        kinds = cfg.get("layer_types")
        if not dcfg.get("use_swa") and (not isinstance(kinds, list) or len(kinds) != d.n_layer):
            raise fail(f"{what}: sliding-window attention without layer_types naming each of "
                        f"its {d.n_layer} layers")
        pattern = [True] * d.n_layer if dcfg.get("use_swa") else [
            k == "sliding_attention" for k in kinds]
        plan.kv += [(f"{a}.attention.sliding_window",
                     cfg_int({"w": swa}, "w", what, hi=1 << 24), T.UINT32, None),
                    (f"{a}.attention.sliding_window_pattern", pattern, T.ARRAY, T.BOOL)]
    causal = cfg.get("is_causal")
    if causal is None:
        causal = dcfg.get("causal")
    if causal is not None:  # DFlashModel writes it either way
        plan.kv.append((f"{a}.attention.causal", bool(causal), T.BOOL, None))
    if f"{tgt.arch}.rope.dimension_sections" in tgt.header.types:  # an M-RoPE target: temporal only
        plan.kv.append((f"{a}.rope.dimension_sections", [d.hd // 2, 0, 0, 0], T.ARRAY, T.INT32))
    if dspark:
        plan.kv += [(f"{a}.sample_from_anchor", anchor, T.BOOL, None),
                    (f"{a}.has_confidence_head", any("confidence_head.proj" in k for k in src),
                     T.BOOL, None)]
    plan.mask = mask
    _fits(plan, tgt, str(ck.root))  # layers, width and mask token, before the shapes
    own_head = not dspark or d.n_draft < d.n_vocab  # a full-vocabulary DSpark shares the
    for key, s in src.items():  # target's output rows: its lm_head is dropped
        if key == "t2d" and dspark:
            continue
        name = _dflash_name(key.removeprefix("model."), d.n_layer, what)
        if name is None or (name == "output.weight" and not own_head):
            continue
        if name == "d2t" and not dspark:
            raise fail(f"{what}: a d2t map in a DFlash head (DSpark's only)",
                        "llama.cpp's converter cannot map it either")
        if name in plan.tensors:
            raise fail(f"{what}: {key} and another tensor both map to {name}")
        plan.tensors[name] = s
    if dspark and d.n_draft < d.n_vocab and "d2t" not in plan.tensors:
        raise fail(f"{what}: draft_vocab_size {d.n_draft:,} < vocab_size {d.n_vocab:,} but no "
                    "d2t map")
    E, hd = d.E, d.hd
    want = {"fc.weight": (E, len(layers) * E), "enc.output_norm.weight": (E,),
            "output_norm.weight": (E,)}
    for i in range(d.n_layer):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (E,), b + "attn_q.weight": (d.n_head * hd, E),
                 b + "attn_k.weight": (d.n_kv * hd, E),
                 b + "attn_output.weight": (E, d.n_head * hd),
                 b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,),
                 b + "ffn_norm.weight": (E,), b + "ffn_gate.weight": (d.ff, E),
                 b + "ffn_up.weight": (d.ff, E), b + "ffn_down.weight": (E, d.ff)}
    optional = {f"blk.{i}.attn_v.weight": (d.n_kv * hd, E) for i in range(d.n_layer)} | {
        "output.weight": (d.n_draft, E), "token_embd.weight": (d.n_vocab, E),
        "d2t": (d.n_draft,), "rope_freqs.weight": (hd // 2,)}
    w1 = plan.tensors.get("markov_w1.weight")
    if dspark:
        rank = w1.shape[1] if w1 is not None and len(w1.shape) == 2 else 0
        want |= {"markov_w1.weight": (d.n_vocab, rank), "markov_w2.weight": (d.n_draft, rank)}
        optional |= {"conf_proj.weight": (1, E + rank), "conf_proj.bias": (1,)}
    _check_shapes(plan.tensors, want, optional, what)
    if not cfg.get("rope_is_neox_style", True):  # interleaved rope: per head, even dims first
        plan.interleaved = {n: hd for n in plan.tensors if n.endswith(
            ("attn_q.weight", "attn_k.weight", "attn_q_norm.weight", "attn_k_norm.weight"))}
    return plan


def _dflash_name(key: str, n_layer: int, what: str) -> str | None:
    if key.endswith(".rotary_emb.inv_freq"):
        return None
    if key in _DFLASH_TOP:
        return _DFLASH_TOP[key]
    parts = key.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isascii() and \
            parts[1].isdecimal() and int(parts[1]) < n_layer and parts[2] in _DFLASH_BLOCK:
        return f"blk.{int(parts[1])}.{_DFLASH_BLOCK[parts[2]]}"
    raise fail(f"{what}: cannot map tensor {key!r} to llama.cpp's DFlash graph",
                "a layout llama.cpp's converter does not read either")


def _eagle3_name(key: str) -> str | None:
    if key in _SKIP or key.endswith(".rotary_emb.inv_freq"):
        return None
    if key in _TOP:
        return _TOP[key]
    for p in _BLOCK_PREFIXES:
        if key.startswith(p) and key[len(p):] in _BLOCK:
            return "blk.0." + _BLOCK[key[len(p):]]
    raise fail(f"EAGLE-3 head: cannot map tensor {key!r} to llama.cpp's EAGLE-3 graph",
                "a layout llama.cpp's converter does not read either")


def _check_shapes(have: dict, want: dict, optional: dict, what: str) -> None:
    """Every tensor wanted, of its shape; the optional ones of theirs; nothing else; a d2t
    map of integers."""
    d2t = have.get("d2t")
    if isinstance(d2t, Source) and d2t.dtype not in ("I64", "I32", "I16", "U32", "U16"):
        raise fail(f"{what}: d2t is {d2t.dtype}, not an integer map")
    for name, shape in {**want, **optional}.items():
        t = have.get(name)
        if t is None:
            if name in want:
                raise fail(f"{what}: no {name} tensor in the checkpoint")
            continue
        got = tuple(t.shape)
        if got != shape:
            raise fail(f"{what}: {name} is {list(got)}, llama.cpp expects {list(shape)} from "
                        "config.json and the target")
    extra = sorted(set(have) - set(want) - set(optional))
    if extra:
        raise fail(f"{what}: {extra[0]} is not a tensor llama.cpp's graph loads",
                    f"{len(extra)} such" if len(extra) > 1 else None)


def _rope_params(cfg: dict, what: str) -> dict:
    """The config's rope section (rope_parameters, else rope_scaling; its full_attention
    part where it has one), as the converter reads it."""
    params = cfg.get("rope_parameters", cfg.get("rope_scaling")) or {}
    if not isinstance(params, dict):
        raise fail(f"{what}: rope_scaling in config.json is not an object")
    params = params.get("full_attention", params)
    if not isinstance(params, dict):
        raise fail(f"{what}: rope_scaling.full_attention in config.json is not an object")
    return params


def _rope(cfg: dict, what: str, hd: int):
    """The rope keys ((name, value, type)...) and llama3's frequency factors (or None), as
    the converter writes them (TextModel.set_gguf_parameters, LlamaModel)."""
    import gguf

    T = gguf.GGUFValueType
    params = _rope_params(cfg, what)
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    kind = params.get("rope_type", params.get("type"))
    keys, freqs = [], None
    if theta is not None:
        keys.append(("rope.freq_base", cfg_float({"rope_theta": theta}, "rope_theta", what, 1.0),
                     T.FLOAT32))
    factor = params.get("factor")
    if kind in (None, "default"):
        pass
    elif kind == "linear" and factor is not None:
        keys += [("rope.scaling.type", "linear", T.STRING),
                 ("rope.scaling.factor", cfg_float(params, "factor", what, 1.0), T.FLOAT32)]
    elif kind == "yarn" and factor is not None:
        keys += [("rope.scaling.type", "yarn", T.STRING),
                 ("rope.scaling.factor", cfg_float(params, "factor", what, 1.0), T.FLOAT32),
                 ("rope.scaling.original_context_length",
                  cfg_int(params, "original_max_position_embeddings", what, hi=1 << 30),
                  T.UINT32)]
        for k, g in (("extrapolation_factor", "yarn_ext_factor"),
                     ("attention_factor", "yarn_attn_factor"),
                     ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if params.get(k) is not None:
                keys.append((f"rope.scaling.{g}", cfg_float(params, k, what, 1.0), T.FLOAT32))
    elif isinstance(kind, str) and kind.lower() == "llama3":
        base = cfg_float({"t": theta if theta is not None else 10000.0}, "t", what, 1.0)
        freqs = _llama3_factors(params, what, base, hd)
    else:
        raise fail(f"{what}: rope type {kind!r} in config.json is not one specli converts")
    return keys, freqs


def _llama3_factors(p: dict, what: str, base: float, dim: int) -> np.ndarray:
    """Llama 3's rope frequency factors (the rope_freqs tensor): 1 for short wavelengths,
    `factor` for long ones, a smooth ramp between."""
    factor = cfg_float(p, "factor", what, 8.0)
    low = cfg_float(p, "low_freq_factor", what, 1.0)
    high = cfg_float(p, "high_freq_factor", what, 4.0)
    old = cfg_float(p, "original_max_position_embeddings", what, 8192)
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    wavelen = 2 * math.pi / freqs.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high: no ramp to take
        smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0,
                   np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """Hugging Face's rotary layout of q/k rows to llama.cpp's (LlamaModel.permute)."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _outtype(plan: _Plan, outtype: str) -> str:
    """`auto`: the checkpoint's own type (its first matrix's, as the converter guesses)."""
    if outtype != "auto":
        return outtype
    for t in plan.tensors.values():  # base.py's heuristic: the first bf16 or f16 matrix
        if isinstance(t, Source) and len(t.shape) >= 2 and t.dtype in ("BF16", "F16"):
            return t.dtype.lower()
    return "f16"


def _qtype(name: str, ndim: int, ftype: str):
    import gguf

    Q = gguf.GGMLQuantizationType
    if ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[ftype]


def _load(s: Source) -> np.ndarray:
    # ml_dtypes registers bfloat16 with numpy, which safetensors' numpy API needs to read a
    # bf16 tensor ("data type 'bfloat16' not understood" without it)
    import ml_dtypes  # noqa: F401
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(s.file), framework="np") as st:
            return st.get_tensor(s.key)
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise fail(f"{s.file}: cannot read tensor {s.key}: {str(e)[:200]}") from e


def _data(name: str, t, plan: _Plan, ftype: str, n_vocab: int):
    """The array to write and its GGML type."""
    import gguf

    if isinstance(t, np.ndarray):  # generated here
        return t, gguf.GGMLQuantizationType.F32
    a = _load(t)
    if name == "d2t":  # offsets in the checkpoint, absolute target ids in the GGUF
        ids = a.astype(np.int64).reshape(-1) + np.arange(a.size, dtype=np.int64)
        if np.any((ids < 0) | (ids >= n_vocab)):
            raise mismatch(f"d2t maps to target ids outside the target's {n_vocab:,} tokens",
                            OTHER)
        if np.unique(ids).size != ids.size:
            raise fail("d2t maps two draft tokens to one target token")
        return ids, gguf.GGMLQuantizationType.I64
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise fail(f"{t.file.name}: tensor {t.key} is {t.dtype}, not floating point")
    if name in plan.permute:
        a = _permute(a, *plan.permute[name])
    if name in plan.interleaved:  # per head, the even dims first, then the odd
        hd = plan.interleaved[name]
        a = a.reshape(-1, hd // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    q = _qtype(name, a.ndim, ftype)
    Q = gguf.GGMLQuantizationType
    if q == Q.BF16 and a.dtype.name == "bfloat16":  # bf16 -> f32 -> bf16 is the identity
        return a.view(np.uint16), q
    if a.dtype not in (np.float16, np.float32):
        a = a.astype(np.float32)  # bf16 (ml_dtypes) widens exactly
    if q == Q.F32:
        return a.astype(np.float32, copy=False), q
    if q == Q.F16:
        return a.astype(np.float16, copy=False), q
    try:
        return gguf.quants.quantize(a.astype(np.float32, copy=False), q), q
    except gguf.QuantError:  # a row not a multiple of the block: as the converter does
        return a.astype(np.float16), Q.F16


def plan_head(checkpoint: str | os.PathLike, target: str, within=None):
    """(the checkpoint, its conversion plan, the target): every check made, no weight
    read. HeadCheckpointError naming the first problem."""
    ck = read_checkpoint(checkpoint, within)
    tgt = _target(target)
    kind = head_kind(ck)
    src = tensor_index(ck.files)
    return ck, (_eagle3 if kind == "draft-eagle3" else _dflash)(ck, src, tgt), tgt


def _fits(plan: _Plan, tgt: _Target, path: str) -> None:
    """headmeta's one head policy (what `run` checks before loading: target layers, width,
    mask token, block size) on the head the plan would write, before any byte is."""
    from specli.headmeta import HeadInfo, check_head

    kv = {k: v for k, v, _, _ in plan.kv}
    a = plan.arch
    info = HeadInfo(plan.spec_type, path, tuple(kv.get(f"{a}.target_layers", ())),
                    kv.get(f"{a}.target_hidden_size", kv.get(f"{a}.embedding_length")),
                    kv.get(f"{a}.block_size", 16), plan.mask,
                    kv.get(f"{a}.sample_from_anchor", True))
    try:
        check_head(tgt.header, info)
    except IncompatiblePairError as e:
        raise mismatch(e.message, e.hint) from e


def convert_head(checkpoint: str | os.PathLike, target: str, out: str | os.PathLike, *,
                 outtype: str = "auto", within=None, name: str | None = None,
                 progress: Callable[[int, int, str], None] | None = None) -> Converted:
    """Convert a head checkpoint against a GGUF target into `out`, atomically. progress
    (done, total, tensor name) after each tensor."""
    import gguf

    from specli import loadable

    if outtype not in OUTTYPES:
        raise fail(f"--outtype {outtype}: one of {', '.join(OUTTYPES)}")
    t0 = time.perf_counter()
    ck, plan, tgt = plan_head(checkpoint, target, within)
    ftype = _outtype(plan, outtype)
    out = Path(out)
    if out.is_dir():
        raise fail(f"-o {out} is a directory", "name the .gguf file to write")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise fail(f"-o {out}: the folder {parent} does not exist")
    if out.exists() and any(out.resolve() == Path(p).resolve() for p in (target, *ck.files)):
        raise fail(f"-o {out} is an input of the conversion", "name a new file")
    tmp = parent / f".{out.name}.{os.getpid()}.part"
    written = 0
    try:
        w = gguf.GGUFWriter(str(tmp), plan.arch)
        w.add_name(name or ck.root.resolve().name)
        for k, v, t, sub in plan.kv:
            w.add_key_value(k, v, t, sub_type=sub)
        w.add_uint32("general.file_type", _FILE_TYPES[ftype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for k, v, t, sub in tgt.tokenizer:
            if (plan.mask is not None and k == "tokenizer.ggml.mask_token_id") or v == []:
                continue  # our own mask token; an empty array gguf-py cannot write
            w.add_key_value(k, v, t, sub_type=sub)
        if plan.mask is not None:
            w.add_uint32("tokenizer.ggml.mask_token_id", plan.mask)
        total = len(plan.tensors)
        for i, (tname, t) in enumerate(plan.tensors.items()):
            data, q = _data(tname, t, plan, ftype, tgt.n_vocab)
            w.add_tensor(tname, data, raw_dtype=q)
            written += data.nbytes
            if progress:
                progress(i + 1, total, tname)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        why = loadable.problem(str(tmp))
        if why:  # a bug's net: the plan was checked against headmeta's policy already
            raise fail(f"the converted head would not load: {why}")
        os.replace(tmp, out)
    except OSError as e:
        raise fail(f"cannot write {out}: {e.strerror or e}") from e
    except (ValueError, TypeError, OverflowError, struct.error) as e:  # a value the GGUF
        # writer cannot store: a bug's net, as every value is checked before
        raise fail(f"cannot write {out}: {type(e).__name__}: {str(e)[:200]}") from e
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return Converted(str(out), plan.spec_type, ck.architecture, len(plan.tensors), written,
                     time.perf_counter() - t0, ftype)


def target_sha256(path: str, progress: Callable[[int, int], None] | None = None) -> str:
    """The target file's sha256, remembered by its size, modification time and inode in
    the cache (hashing a 20 GB target at each run would cost a minute)."""
    from specli.defaults import cache_dir
    from specli.ggufmeta import file_sha256

    real, st = os.path.realpath(path), os.stat(path)
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    memo_path = cache_dir() / "heads" / "targets.json"
    try:
        memo = json.loads(memo_path.read_text())
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    hit = memo.get(real)
    if isinstance(hit, list) and len(hit) == 4 and hit[:3] == stamp and isinstance(hit[3], str):
        return hit[3]
    done = [0]

    def step(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], st.st_size)

    sha = file_sha256(path, step)
    memo[real] = [*stamp, sha]
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f".{memo_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    except OSError:
        pass  # a read-only cache: hash again next time
    return sha


def cached_head(checkpoint: Path, within: Path, repo: str, commit: str, target: str, *,
                outtype: str = "auto",
                progress: Callable[[int, int, str], None] | None = None,
                hashing: Callable[[int, int], None] | None = None) -> tuple[Path, bool]:
    """(the head converted against target, whether it was converted now): in the cache,
    keyed by the checkpoint's commit and the target's sha256, reused offline."""
    from specli.defaults import cache_dir

    sha = target_sha256(target, hashing)
    name = f"{commit[:16]}-{sha[:16]}-{outtype}-v{CONVERT_VERSION}.gguf"
    out = cache_dir() / "heads" / repo.replace("/", "--") / name
    if out.is_file():
        return out, False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fail(f"cannot create {out.parent}: {e.strerror or e}",
                    "set SPECLI_CACHE_DIR to a writable folder") from e
    convert_head(checkpoint, target, out, outtype=outtype, within=within,
                 name=repo.rsplit("/", 1)[-1], progress=progress)
    return out, True
