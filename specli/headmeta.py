"""Draft heads from GGUF metadata alone: which head a file is (llama.cpp's
common_speculative_types_from_gguf, and EAGLE-3 by its architecture) and whether it fits its
target (the checks llama.cpp makes when it builds the head's context, or the asserts it would
hit at the first decode), before any weights load."""

from __future__ import annotations

from dataclasses import dataclass

from specli.errors import IncompatiblePairError
from specli.ggufmeta import Header

HEAD_TYPES = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark")
HEAD_ARRAYS = ("eagle3.target_layers", "dflash.target_layers")  # to decode in full
# a Gemma 4 assistant: MTP layers in a file of their own that attend over the target's cache
ASSISTANT = "gemma4-assistant"
HEAD_ARCHS = frozenset({"eagle3", "dflash", ASSISTANT})  # the architectures that are heads alone
# the architectures whose graphs have multi-token-prediction layers (src/llama-model.cpp,
# where ctx_type == LLAMA_CONTEXT_TYPE_MTP), in the llama.cpp llama-cpp-python vendors
MTP_ARCHS = frozenset({"bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4",
                       "glm-dsa", "glm4moe", "glm5-next", "hy_v3", "mimo2", "nemotron_h_moe",
                       "qwen35", "qwen35moe", "qwen3next", "step35"})


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
                        kv.get("eagle3.target_hidden_size"))
    if arch == "dflash":
        return HeadInfo("draft-dspark" if "markov_w1.weight" in names else "draft-dflash",
                        h.path, _ints(kv.get("dflash.target_layers")),
                        kv.get("dflash.embedding_length"),
                        int(kv.get("dflash.block_size", 16)),
                        kv.get("tokenizer.ggml.mask_token_id"),
                        _flag(kv.get("dflash.sample_from_anchor"), True))
    if arch == ASSISTANT:  # llama.cpp infers no type from it: it drafts as draft-mtp
        return HeadInfo("draft-mtp", h.path, hidden=kv.get(f"{arch}.embedding_length_out"),
                        n_nextn=int(kv.get(f"{arch}.nextn_predict_layers") or 0))
    n = n_nextn(h)
    return HeadInfo("draft-mtp", h.path, n_nextn=n) if n else None


def n_nextn(h: Header) -> int:
    """The multi-token-prediction layers a model file carries (0: none)."""
    kv, arch = h.kv, h.kv.get("general.architecture")
    blocks = kv.get(f"{arch}.block_count")
    if not isinstance(blocks, int) or f"blk.{blocks - 1}.nextn.eh_proj.weight" not in {
            t.name for t in h.tensors}:
        return 0
    return int(kv.get(f"{arch}.nextn_predict_layers") or 1)


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
        return
    blocks = kv.get(f"{arch}.block_count")
    n_layer = blocks - n_nextn(target) if isinstance(blocks, int) else None
    width = kv.get(f"{arch}.embedding_length")
    kind = head.spec_type.removeprefix("draft-")
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
        if head.block_size < 2:
            raise IncompatiblePairError(f"{kind} head {head.path} has a block size of "
                                        f"{head.block_size} (dflash.block_size)", "head")
