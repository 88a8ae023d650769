"""Draft heads from GGUF metadata alone: which head a file is (llama.cpp's
common_speculative_types_from_gguf, and EAGLE-3 by its architecture) and whether it fits its
target (the checks llama.cpp makes when it builds the head's context, or the asserts it would
hit at the first decode), before any weights load."""

from __future__ import annotations

from dataclasses import dataclass

from specli.errors import IncompatiblePairError
from specli.ggufmeta import Header, tensor_ints

HEAD_TYPES = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")
# each head type as a sentence names it
A_HEAD = {"draft-eagle3": "an EAGLE-3 head", "draft-mtp": "an MTP head",
          "draft-dflash": "a DFlash head", "draft-dspark": "a DSpark head"}
HEAD_ARRAYS = ("eagle3.target_layers", "dflash.target_layers")  # to decode in full
# a Gemma 4 assistant: MTP layers in a file of their own that attend over the target's cache
ASSISTANT = "gemma4-assistant"
HEAD_ARCHS = frozenset({"eagle3", "dflash", ASSISTANT})  # the architectures that are heads alone
# the architectures whose graphs have multi-token-prediction layers (src/llama-model.cpp,
# where ctx_type == LLAMA_CONTEXT_TYPE_MTP), in the llama.cpp llama-cpp-python vendors
MTP_ARCHS = frozenset({"bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4",
                       "glm-dsa", "glm4moe", "glm5-next", "hy_v3", "mimo2", "nemotron_h_moe",
                       "qwen35", "qwen35moe", "qwen3next", "step35"})
# those whose MTP graph runs one prediction layer only (it asserts n_layer_nextn == 1)
MTP_ONE_LAYER = MTP_ARCHS - {"hy_v3", "mimo2", "step35", "glm5-next"}
# the target architectures whose graphs keep each layer's input for a head to read
# (res->t_layer_inp in src/models/*.cpp): another aborts at the head's first decode
LAYER_INPUT_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan-dense", "hunyuan_vl", "lfm2",
    "llama", "llama-embed", "mimo2", "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige",
    "nemotron_h", "nemotron_h_moe", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next",
    "qwen4exp"})
NEXTN = ("eh_proj", "enorm", "hnorm")  # every prediction layer's own tensors
# DSpark's Markov chain adds a few graph nodes per block position: 512 positions overflowed
# a small head's graph (GGML_ASSERT(obj_new)); published DSpark heads use blocks of 7 to 16
DSPARK_BLOCK_MAX = 128


@dataclass(frozen=True)
class HeadInfo:
    """A draft head's parameters: its type; the target layers whose inputs it reads and the
    target width it expects (EAGLE-3, DFlash); DFlash's block size, mask token and whether the
    block's first token drafts (DSpark); the prediction layers an MTP model has."""

    spec_type: str
    path: str = ""
    layers: tuple[int, ...] = ()
    hidden: int | None = None
    block_size: int = 16
    mask: int | None = None
    from_anchor: bool = True
    n_nextn: int = 0

    def text(self) -> str:
        """One line, as `info` and `check-pair` show it."""
        if self.spec_type == "draft-mtp":
            return f"{self.spec_type}: {self.n_nextn} prediction layer" + \
                "s" * (self.n_nextn != 1) + ("" if self.hidden is None else
                                             f", target width {self.hidden}, on the "
                                             "target's own cache (Gemma 4 assistant)")
        out = (f"{self.spec_type}: target layers {', '.join(map(str, self.layers)) or '-'}, "
               f"target width {self.hidden if self.hidden is not None else '?'}")
        if self.spec_type != "draft-eagle3":
            out += (f", block {self.block_size}, mask token "
                    f"{self.mask if self.mask is not None else '-'}")
        return out

    def to_dict(self) -> dict:
        return {"type": self.spec_type, "target_layers": list(self.layers),
                "target_hidden_size": self.hidden,
                **({"block_size": self.block_size, "mask_token_id": self.mask,
                    "sample_from_anchor": self.from_anchor}
                   if self.spec_type in ("draft-dflash", "draft-dspark") else {}),
                **({"nextn_predict_layers": self.n_nextn}
                   if self.spec_type == "draft-mtp" else {})}


def _ints(v) -> tuple[int, ...]:
    items = v if isinstance(v, list | tuple) else [v] if v is not None else []
    return tuple(int(x) for x in items if isinstance(x, int) and not isinstance(x, bool))


def _uint(v) -> int | None:
    """An integer value, or None for a value of another type (loadable refuses those)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _flag(v, default: bool) -> bool:
    return v if isinstance(v, bool) else str(v).lower() == "true" if v is not None else default


def head_info(h: Header) -> HeadInfo | None:
    """The head the file is, or None for a plain model (a draft-simple draft). An EAGLE-3 or
    DFlash head is known by its architecture, DSpark by its Markov head, an MTP model by the
    prediction layers at the end of its blocks."""
    kv, arch = h.kv, h.kv.get("general.architecture")
    names = {t.name for t in h.tensors}
    if arch == "eagle3":
        return HeadInfo("draft-eagle3", h.path, _ints(kv.get("eagle3.target_layers")),
                        _uint(kv.get("eagle3.target_hidden_size")))
    if arch == "dflash":
        return HeadInfo("draft-dspark" if "markov_w1.weight" in names else "draft-dflash",
                        h.path, _ints(kv.get("dflash.target_layers")),
                        _uint(kv.get("dflash.embedding_length")),
                        _uint(kv.get("dflash.block_size", 16)) or 0,
                        _uint(kv.get("tokenizer.ggml.mask_token_id")),
                        _flag(kv.get("dflash.sample_from_anchor"), True))
    if arch == ASSISTANT:  # llama.cpp infers no type from it: it drafts as draft-mtp
        return HeadInfo("draft-mtp", h.path, hidden=_uint(kv.get(f"{arch}.embedding_length_out")),
                        n_nextn=_uint(kv.get(f"{arch}.nextn_predict_layers")) or 0)
    n = n_nextn(h)
    return HeadInfo("draft-mtp", h.path, n_nextn=n) if n else None


def n_nextn(h: Header) -> int:
    """The multi-token-prediction layers a model file carries (0: none)."""
    kv, arch = h.kv, h.kv.get("general.architecture")
    blocks = kv.get(f"{arch}.block_count")
    if not isinstance(blocks, int) or f"blk.{blocks - 1}.nextn.eh_proj.weight" not in {
            t.name for t in h.tensors}:
        return 0
    return _uint(kv.get(f"{arch}.nextn_predict_layers")) or 1


def trunk_layers(target: Header) -> int | None:
    """The layers a head may read: llama.cpp's n_layer() takes the key's count of prediction
    layers off, whether or not their tensors are there (None: no block count)."""
    kv, arch = target.kv, target.kv.get("general.architecture")
    blocks, key_nextn = kv.get(f"{arch}.block_count"), kv.get(f"{arch}.nextn_predict_layers")
    return blocks - max(n_nextn(target), key_nextn if isinstance(key_nextn, int) else 0) \
        if isinstance(blocks, int) else None


def check_head(target: Header, head: HeadInfo, draft: Header | None = None) -> None:
    """IncompatiblePairError (exit 1) naming what does not fit: an EAGLE-3 head needs three
    target layers, and its layers and width must be the target's; a DFlash head's too, and a
    mask token; an MTP draft needs a target with prediction layers, or a draft file (an MTP
    sidecar) with them, of the target's architecture and width."""
    kv, arch = target.kv, target.kv.get("general.architecture")
    name = target.path
    if head.spec_type == "draft-mtp" and draft is not None and (
            draft.kv.get("general.architecture") == ASSISTANT):
        width = kv.get(f"{arch}.embedding_length")
        if arch != "gemma4" or head.hidden != width:
            raise IncompatiblePairError(
                f"draft-mtp: {draft.path} is a Gemma 4 assistant for a gemma4 target "
                f"{head.hidden} wide, and {name} is {arch}, {width} wide", "mtp",
                hint="the assistant was trained for another target")
        why = _shared_cache(target, draft)
        if why:
            raise IncompatiblePairError(f"draft-mtp: the Gemma 4 assistant {draft.path} "
                                        f"cannot read {name}'s cache: {why}", "mtp",
                                        hint="the assistant was trained for another target")
        return
    if head.spec_type == "draft-mtp" and draft is not None:
        d_arch = draft.kv.get("general.architecture")
        if d_arch != arch or draft.kv.get(f"{d_arch}.embedding_length") != kv.get(
                f"{arch}.embedding_length"):
            raise IncompatiblePairError(
                f"draft-mtp: {draft.path} is {d_arch}, "
                f"{draft.kv.get(f'{d_arch}.embedding_length')} wide, and {name} is {arch}, "
                f"{kv.get(f'{arch}.embedding_length')} wide: an MTP file runs beside its own "
                "model", "mtp")
        target = draft  # its prediction layers are what must be there
        kv, name = target.kv, target.path
    if head.spec_type == "draft-mtp":
        if arch not in MTP_ARCHS:
            raise IncompatiblePairError(
                f"draft-mtp: {name} is {arch}, an architecture llama.cpp runs no "
                "multi-token-prediction layers for", "mtp",
                hint="a Gemma 4 model drafts with its assistant file: -md ...assistant.gguf"
                if arch == "gemma4" else "MTP needs a model that ships them: Qwen3.5, "
                "GLM-4.5, DeepSeek-V3, MiMo, Step-3.5, Hunyuan...")
        if not n_nextn(target):
            raise IncompatiblePairError(
                f"draft-mtp: {name} has no multi-token-prediction layers "
                f"({arch}.nextn_predict_layers and blk.N.nextn tensors)", "mtp",
                hint="use a GGUF converted with its MTP layers, or another --spec-type")
        why = _nextn_layers(target)
        if why:
            raise IncompatiblePairError(f"draft-mtp: {name}'s prediction layers cannot run: "
                                        f"{why}", "mtp", hint="the file needs fixing, or "
                                        "another download")
        return
    n_layer = trunk_layers(target)
    width = kv.get(f"{arch}.embedding_length")
    kind = head.spec_type.removeprefix("draft-")
    if arch not in LAYER_INPUT_ARCHS:
        raise IncompatiblePairError(
            f"{kind} head {head.path} reads the target's layer inputs, and {name} is {arch}, "
            "an architecture whose llama.cpp graph does not keep them", "head",
            hint="heads run on llama, qwen3, qwen3.5, gpt-oss, gemma4, lfm2, minimax-m2... "
            "targets")
    if head.spec_type == "draft-eagle3" and len(head.layers) != 3:
        raise IncompatiblePairError(
            f"{kind} head {head.path} reads {len(head.layers)} target layers "
            f"(eagle3.target_layers); llama.cpp's EAGLE-3 takes exactly 3", "head")
    if not head.layers:
        raise IncompatiblePairError(f"{kind} head {head.path} names no target layers "
                                    f"({kind}.target_layers)", "head")
    bad = [lid for lid in head.layers if n_layer is not None and not 0 <= lid < n_layer]
    if bad:
        raise IncompatiblePairError(
            f"{kind} head {head.path} reads target layer {bad[0]}, and {name} has layers "
            f"0 to {n_layer - 1}", "head", hint="the head was trained for another target")
    if head.hidden is not None and width is not None and head.hidden != width:
        raise IncompatiblePairError(
            f"{kind} head {head.path} takes a target width of {head.hidden}, and {name}'s is "
            f"{width}", "head", hint="the head was trained for another target")
    if head.spec_type in ("draft-dflash", "draft-dspark"):
        n_vocab = len(kv.get("tokenizer.ggml.tokens") or ()) or None
        if head.mask is None or (n_vocab is not None and not 0 <= head.mask < n_vocab):
            raise IncompatiblePairError(
                f"{kind} head {head.path} has no usable mask token "
                "(tokenizer.ggml.mask_token_id)", "head")
        if head.block_size < 2 or (kind == "dspark" and head.block_size > DSPARK_BLOCK_MAX):
            raise IncompatiblePairError(
                f"{kind} head {head.path} has a block size of {head.block_size} "
                f"(dflash.block_size): " + ("a block drafts at least one token" if
                                            head.block_size < 2 else
                                            f"DSpark's graph holds {DSPARK_BLOCK_MAX} at most"),
                "head")
    why = _vocabulary(target, draft, head) if draft is not None else None
    if why:
        raise IncompatiblePairError(f"{kind} head {head.path} cannot run with {name}: {why}",
                                    "head", hint="the head was converted for another target")


def _rows(h: Header, name: str) -> int | None:
    """A matrix's row count (its ggml ne[1]), or None where the file has no such tensor."""
    t = next((t for t in h.tensors if t.name == name), None)
    return t.shape[1] if t is not None and len(t.shape) > 1 else None


def _vocabulary(target: Header, draft: Header, head: HeadInfo) -> str | None:
    """What an EAGLE-3 or DFlash head takes from its target, as its graph indexes with it:
    the target's embedding and output rows where it has none of its own, a vocabulary map
    (d2t) onto the target's tokens and as long as the output it maps."""
    t_arch, d_arch = target.kv.get("general.architecture"), draft.kv.get("general.architecture")
    n_vocab = len(target.kv.get("tokenizer.ggml.tokens") or ()) or None
    n_head_vocab = len(draft.kv.get("tokenizer.ggml.tokens") or ()) or None
    t_width, d_width = (target.kv.get(f"{t_arch}.embedding_length"),
                        draft.kv.get(f"{d_arch}.embedding_length"))
    t_out = _rows(target, "output.weight") or _rows(target, "token_embd.weight")
    own_embd = _rows(draft, "token_embd.weight")
    own_out = _rows(draft, "output.weight") or (own_embd if d_arch == "dflash" else None)
    if head.spec_type == "draft-eagle3":
        if own_embd is not None and n_vocab is not None and own_embd < n_vocab:
            return (f"its own token embeddings have {own_embd} rows for a {n_vocab}-token "
                    "vocabulary")
        if (own_embd is None or own_out is None) and d_width != t_width:
            return (f"it is {d_width} wide and uses the target's "
                    f"{'embeddings' if own_embd is None else 'output'}, {t_width} wide")
    d2t = next((t for t in draft.tensors if t.name == "d2t"), None)
    if d2t is None:
        if own_out is None and None not in (t_out, n_head_vocab) and t_out != n_head_vocab:
            return (f"it uses the target's output, {t_out} rows, for its "
                    f"{n_head_vocab}-token vocabulary")
        return None
    if own_out is None and t_out is not None and d2t.shape[0] != t_out:
        return (f"its d2t vocabulary map has {d2t.shape[0]} entries for the target's output "
                f"of {t_out} rows")
    ids = tensor_ints(draft, "d2t")
    if ids is not None and n_vocab is not None and ids.size and int(ids.max()) >= n_vocab:
        return (f"its d2t vocabulary map holds token id {int(ids.max())}, outside the "
                f"target's {n_vocab}-token vocabulary")
    return None


def _nextn_layers(h: Header) -> str | None:
    """Every prediction layer the file says it has, with its tensors, and one only where the
    architecture's MTP graph runs one."""
    kv, arch = h.kv, h.kv.get("general.architecture")
    blocks, k = kv.get(f"{arch}.block_count"), kv.get(f"{arch}.nextn_predict_layers") or 1
    if not isinstance(blocks, int) or not isinstance(k, int):
        return None
    if k > 1 and arch in MTP_ONE_LAYER:
        return (f"{arch}.nextn_predict_layers is {k}, and llama.cpp runs one prediction layer "
                f"for {arch}")
    names = {t.name for t in h.tensors}
    for i in range(max(blocks - k, 0), blocks):
        missing = next((p for p in NEXTN if f"blk.{i}.nextn.{p}.weight" not in names), None)
        if missing:
            return (f"{arch}.nextn_predict_layers says {k}, and block {i} has no "
                    f"nextn.{missing} tensor")
    return None


def _kv_widths(h: Header, n: int) -> list[int]:
    """Each layer's key width (key length times key/value heads), its own length for the
    sliding-window layers."""
    kv, arch = h.kv, h.kv.get("general.architecture")

    def per_layer(v, default):
        v = default if v is None else v
        return list(v) if isinstance(v, list | tuple) else [v] * n

    swa = per_layer(kv.get(f"{arch}.attention.sliding_window_pattern"), False)
    heads_kv = per_layer(kv.get(f"{arch}.attention.head_count_kv"), 1)
    k, k_swa = kv.get(f"{arch}.attention.key_length"), kv.get(f"{arch}.attention.key_length_swa")
    return [(k_swa if i < len(swa) and swa[i] is True else k) *
            (heads_kv[i] if i < len(heads_kv) and isinstance(heads_kv[i], int) else 1)
            if isinstance(k, int) and isinstance(k_swa, int) else -1 for i in range(n)]


def _shared_cache(target: Header, assistant: Header) -> str | None:
    """A Gemma 4 assistant reads the target's last sliding-window layer's keys and values from
    its sliding-window layers, the last global layer's from the others: the same widths."""
    t_arch = target.kv.get("general.architecture")
    n_t = target.kv.get(f"{t_arch}.block_count")
    n_a = assistant.kv.get(f"{ASSISTANT}.block_count")
    if not isinstance(n_t, int) or not isinstance(n_a, int):
        return None
    if n_t < 2:
        return f"the target has {n_t} layer; the assistant reads its last two"
    theirs, mine = _kv_widths(target, n_t), _kv_widths(assistant, n_a)
    pattern = assistant.kv.get(f"{ASSISTANT}.attention.sliding_window_pattern") or ()
    for i, width in enumerate(mine):
        layer = n_t - 2 if i < len(pattern) and pattern[i] is True else n_t - 1
        if width != theirs[layer]:
            return (f"its layer {i} reads keys {width} wide from target layer {layer}, "
                    f"whose keys are {theirs[layer]} wide")
    return None
