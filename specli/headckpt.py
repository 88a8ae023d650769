"""A published draft head's checkpoint, read and checked: its config.json, the safetensors
index of its tensors (headers only, no data), which layout it is, and what it describes.
Hostile input is refused here, in one line, before anything is converted
(headconvert.py)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from specli.errors import SpecliError

# the EAGLE-3 layouts llama.cpp's converter reads (conversion/__init__.py, llama.py)
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator",
                "Eagle3DraftModel")
# plain llama architecture strings under which the converter still finds an EAGLE-3 head
LLAMA_ARCHS = ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM", "LlamaModel")
# block-diffusion drafters on Qwen3 blocks (conversion/qwen.py: DFlashModel, DSparkModel)
DFLASH_ARCHS = ("DFlashDraftModel", "DFlash2DraftModel")
DSPARK_ARCHS = ("Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator")
# known to llama.cpp's converter, not converted here yet
LATER_ARCHS = ("Lfm2DSparkDraftModel", "LingDSparkModel", "DeepseekV4DSparkModel",
               "Gemma4DSparkModel")
CONFIG_MAX = 4 << 20  # bytes of config.json (published ones are a few KB)
INDEX_MAX = 64 << 20  # bytes of model.safetensors.index.json
WIDTH_MAX = 1 << 20  # any width, head count or vocabulary a config may state


class HeadCheckpointError(SpecliError):
    """A head checkpoint that cannot be converted: an unknown layout, a malformed or
    hostile file, or a head made for another target. Exit code 2."""


class HeadMismatch(HeadCheckpointError):
    """A well-formed head made for another target (its width, vocabulary or layers):
    convert-head's exit 2, check-pair's verdict "incompatible" (exit 1)."""


OTHER = "the head was trained for another target"


def fail(message: str, hint: str | None = None) -> HeadCheckpointError:
    return HeadCheckpointError(message, hint)


def mismatch(message: str, hint: str | None = None) -> HeadMismatch:
    return HeadMismatch(message, hint)


def _inside(path: Path, root: Path, what: str) -> Path:
    """path resolved, refused if it (or a link it follows) leads outside root."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as e:  # missing, or a symlink loop
        raise fail(f"{what}: cannot open {path}: {getattr(e, 'strerror', None) or e}") from e
    if not real.is_relative_to(root):
        raise fail(f"{what}: {path.name} leads outside the checkpoint ({real})",
                    "a symlink out of the repository is refused")
    if not real.is_file():
        raise fail(f"{what}: {path.name} is not a regular file")
    return real


def _read_json(path: Path, limit: int, what: str) -> dict:
    if path.stat().st_size > limit:
        raise fail(f"{what} is {path.stat().st_size:,} bytes, more than the {limit:,} a "
                    "checkpoint's needs")
    try:
        doc = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise fail(f"{what} is not valid JSON: {str(e)[:200]}") from e
    if not isinstance(doc, dict):
        raise fail(f"{what} is not a JSON object")
    return doc


@dataclass(frozen=True)
class Checkpoint:
    """A head checkpoint's directory: its config (nested configs merged, as the converter
    does), the raw config.json, its architecture string and its safetensors files."""

    root: Path
    raw: dict
    config: dict
    architecture: str
    files: tuple[Path, ...]


def read_checkpoint(directory: str | os.PathLike, within: str | os.PathLike | None = None
                    ) -> Checkpoint:
    """The checkpoint in directory; every file it names must lie inside `within` (default:
    the directory itself; a Hugging Face cache's snapshot links into the repository's
    blobs, so the hub passes the repository's folder)."""
    d = Path(directory)
    if not d.is_dir():
        raise fail(f"head checkpoint not found: {d} is not a directory",
                    "pass the folder that holds config.json and *.safetensors")
    root = Path(within or d).resolve()
    cfg_path = d / "config.json"
    if not cfg_path.exists():
        raise fail(f"{d}: no config.json", "a published head's folder holds config.json "
                    "and its *.safetensors")
    raw = _read_json(_inside(cfg_path, root, str(d)), CONFIG_MAX, f"{cfg_path}")
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    config = dict(raw)
    for nested in ("transformer_layer_config", "text_config"):  # speculators, multimodal
        if isinstance(raw.get(nested), dict):
            config = {**config, **raw[nested]}
    if arch is None:
        raise fail(f"{cfg_path}: no architectures list naming the head's architecture")
    return Checkpoint(d, raw, config, arch, _weights(d, root))


def _weights(d: Path, root: Path) -> tuple[Path, ...]:
    index = d / "model.safetensors.index.json"
    if index.exists():
        doc = _read_json(_inside(index, root, str(d)), INDEX_MAX, str(index))
        wmap = doc.get("weight_map")
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise fail(f"{index}: no weight_map of tensor names to files")
        names = sorted(set(wmap.values()))
        for n in names:
            if Path(n).name != n or not n.endswith(".safetensors"):
                raise fail(f"{index}: names {n!r}, which is not a safetensors file beside it")
    else:
        names = sorted(p.name for p in d.glob("model*.safetensors"))  # the converter's parts
    if not names:
        pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
        raise fail(f"{d}: no *.safetensors weights" + (
            f" ({', '.join(pickles)} is a PyTorch pickle, which specli does not unpickle)"
            if pickles else ""), "specli converts safetensors checkpoints only")
    return tuple(_inside(d / n, root, str(d)) for n in names)


@dataclass(frozen=True)
class Source:
    file: Path
    key: str
    dtype: str  # safetensors dtype: BF16, F16, F32, I64, ...
    shape: tuple[int, ...]


def tensor_index(files: tuple[Path, ...]) -> dict[str, Source]:
    """Every tensor's file, dtype and shape, from the files' headers (no data read; the
    safetensors library checks the header's size, offsets and overlaps)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, Source] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="np") as st:
                for key in st.keys():
                    sl = st.get_slice(key)
                    if key in out:
                        raise fail(f"{f.name}: tensor {key} is also in {out[key].file.name}")
                    out[key] = Source(f, key, sl.get_dtype(), tuple(sl.get_shape()))
        except SafetensorError as e:
            raise fail(f"{f}: not a valid safetensors file: {str(e)[:200]}") from e
        except OSError as e:
            raise fail(f"{f}: cannot read: {e.strerror or e}") from e
    return out


def cfg_int(cfg: dict, key: str, what: str, default: int | None = None, lo: int = 1,
         hi: int = WIDTH_MAX) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise fail(f"{what}: {key} = {v!r} in config.json is not an integer in [{lo}, {hi}]")
    return v


def cfg_float(cfg: dict, key: str, what: str, default: float, hi: float = 1e30) -> float:
    """A positive finite number that fits the float32 GGUF stores (a 400-digit integer or
    1e39 would not)."""
    v = cfg.get(key, default)
    try:
        ok = not isinstance(v, bool) and isinstance(v, int | float) and 0 < float(v) <= hi
    except OverflowError:
        ok = False
    if not ok:
        raise fail(f"{what}: {key} = {str(v)[:40]} in config.json is not a positive number "
                    f"up to {hi:g}")
    return float(v)


def cfg_flag(cfg: dict, key: str, what: str) -> bool:
    v = cfg.get(key, False)
    if not isinstance(v, bool):
        raise fail(f"{what}: {key} = {v!r} in config.json is not true or false")
    return v


def dflash_settings(ck: Checkpoint, what: str) -> tuple[dict, bool]:
    """(the head's dflash_config, whether its block's first token drafts): DSpark's two
    flat schemas turned into DFlash's nested one, as DSparkModel.__init__ does."""
    cfg, raw = ck.config, ck.raw
    dcfg = cfg.get("dflash_config", {})
    if not isinstance(dcfg, dict):
        raise fail(f"{what}: dflash_config in config.json is not an object")
    if ck.architecture not in DSPARK_ARCHS:
        return dcfg, True
    anchor = raw.get("sample_from_anchor", "transformer_layer_config" not in raw
                     and "aux_hidden_state_layer_ids" not in raw)
    if not isinstance(anchor, bool):
        raise fail(f"{what}: sample_from_anchor = {anchor!r} is not true or false")
    if "aux_hidden_state_layer_ids" in cfg:
        aux = cfg["aux_hidden_state_layer_ids"]
        if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux):
            raise fail(f"{what}: aux_hidden_state_layer_ids = {aux!r} is not layer ids")
        return {"mask_token_id": cfg.get("mask_token_id"),
                "target_layer_ids": [i - 1 for i in aux], **dcfg}, anchor
    return {k: cfg[k] for k in ("target_layer_ids", "mask_token_id") if k in cfg} | dcfg, anchor


@dataclass(frozen=True)
class CheckpointInfo:
    """What a head checkpoint is, from its config and headers alone (no target): `info`
    and `check-pair` show it."""

    path: str
    architecture: str
    spec_type: str
    width: int | None  # the head's own
    target_width: int | None  # None: the target's, whatever it is
    layers: tuple[int, ...] | None  # None: the converter's default for the target
    n_vocab: int | None
    n_draft: int | None  # its own output vocabulary (through d2t), if it has one
    variants: tuple[str, ...]
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape)
    n_bytes: int

    def text(self) -> str:
        layers = ", ".join(map(str, self.layers)) if self.layers else "the target's default"
        out = (f"{self.spec_type}: {self.architecture}, width {self.width}, target layers "
               f"{layers}, target width {self.target_width or 'the target' + chr(39) + 's'}")
        if self.n_draft is not None and self.n_vocab is not None and self.n_draft != self.n_vocab:
            out += f", {self.n_draft:,} of {self.n_vocab:,} tokens through d2t"
        return out + "".join(f", {v}" for v in self.variants)

    def to_dict(self) -> dict:
        return {"path": self.path, "architecture": self.architecture, "type": self.spec_type,
                "hidden_size": self.width, "target_hidden_size": self.target_width,
                "target_layers": list(self.layers) if self.layers else None,
                "vocab_size": self.n_vocab, "draft_vocab_size": self.n_draft,
                "variants": list(self.variants), "bytes": self.n_bytes,
                "tensors": [{"name": n, "dtype": d, "shape": list(sh)}
                            for n, d, sh in self.tensors]}


def head_kind(ck: Checkpoint) -> str:
    """The head type a checkpoint's architecture is; HeadCheckpointError for another."""
    arch = ck.architecture
    if arch in EAGLE3_ARCHS or (  # the converter's test for a llama-named head
            arch in LLAMA_ARCHS and "draft_vocab_size" in ck.config
            and ck.config.get("num_hidden_layers") == 1):
        return "draft-eagle3"
    if arch in DFLASH_ARCHS or arch in DSPARK_ARCHS:
        return "draft-dspark" if arch in DSPARK_ARCHS else "draft-dflash"
    if arch in LATER_ARCHS:
        raise fail(f"{arch}: specli does not convert this head yet",
                    "llama.cpp's convert_hf_to_gguf.py --target-model-dir converts it")
    raise fail(f"{arch}: not a draft-head architecture specli knows",
                "EAGLE-3: " + ", ".join(EAGLE3_ARCHS) + "; DFlash and DSpark: "
                + ", ".join(DFLASH_ARCHS + DSPARK_ARCHS))


def describe(checkpoint: str | os.PathLike, within=None) -> CheckpointInfo:
    """The checkpoint in a folder, from its config and safetensors headers."""
    ck = read_checkpoint(checkpoint, within)
    kind = head_kind(ck)
    src = tensor_index(ck.files)
    cfg, raw = ck.config, ck.raw

    def num(d: dict, k: str) -> int | None:
        v = d.get(k)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    if kind == "draft-eagle3":
        layers = raw.get("eagle_aux_hidden_state_layer_ids")
    else:  # DFlash's ids name the layer before the one whose input is read
        ids = dflash_settings(ck, f"{ck.architecture} head")[0].get(
            "target_layer_ids", cfg.get("target_layer_ids"))
        layers = [i + 1 for i in ids if isinstance(i, int)] if isinstance(ids, list) else None
    layers = tuple(layers) if isinstance(layers, list) and all(
        isinstance(i, int) for i in layers) and layers else None
    variants = tuple(k for k in ("norm_before_residual", "norm_before_fc") if raw.get(k) is True)
    if "embed_tokens.weight" in src or "model.embed_tokens.weight" in src:
        variants += ("its own token embeddings",)
    n = sum(math.prod(t.shape) * _BYTES.get(t.dtype, 4) for t in src.values())
    width = num(raw, "target_hidden_size") if kind == "draft-eagle3" else num(cfg, "hidden_size")
    return CheckpointInfo(str(ck.root), ck.architecture, kind, num(cfg, "hidden_size"),
                          width, layers, num(cfg, "vocab_size"),
                          num(cfg, "draft_vocab_size"), variants,
                          tuple((t.key, t.dtype, t.shape) for t in src.values()), n)


_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
          "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
