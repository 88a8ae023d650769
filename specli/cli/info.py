"""`specli info`: what a GGUF file holds, from its header (like llama-gguf-info / gguf-dump)."""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Annotated

import typer

from specli import loadable
from specli.cli import options as o
from specli.cli.console import err, safe
from specli.ggufmeta import ArrayInfo, Header, read_header
from specli.headmeta import HEAD_ARRAYS, head_info
from specli.pairing import TOKENS, model_info, size_text, vocab_type

SCHEMA_VERSION = 1
PREVIEW = 3  # leading elements shown of each array
LONG = 120  # strings longer than this (or multi-line) are shortened in the text output


def info(
    model: Annotated[Path, typer.Argument(help="A GGUF model, or a draft head's safetensors "
                                          "checkpoint folder.", metavar="MODEL",
                                          show_default=False)],
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object on stdout: the summary, every metadata key "
        "(arrays as type, length, first elements and sha256) and the tensors.",
        rich_help_panel=o.OUTPUT)] = False,
    tensors: Annotated[bool, typer.Option(
        "--tensors", help="List every tensor: name, shape, type, size.",
        rich_help_panel=o.OUTPUT)] = False,
) -> None:
    """Show a GGUF file's metadata, tokenizer and tensor summary without loading weights.

    One `key = value` line per metadata key, so `specli info m.gguf | grep tokenizer.ggml.model`
    works as it does with llama-gguf-info.
    """
    if model.is_dir():  # a published head's checkpoint
        return _checkpoint(model, json_out)
    h = read_header(str(model), {TOKENS, *HEAD_ARRAYS}, preview=PREVIEW)
    m = model_info(h)
    head = head_info(h)
    unloadable = loadable.problem(str(model))
    if unloadable:
        err.print(f"warning: llama.cpp would abort on this file: {safe(unloadable)}",
                  markup=False)
    if json_out:
        doc = {"schema_version": SCHEMA_VERSION, "path": h.path, "file_size": h.file_size,
               "version": h.version, "byte_order": h.byte_order, "n_kv": len(h.types),
               "n_tensors": len(h.tensors), "summary": m.to_dict(),
               "loadable": {"ok": unloadable is None, "problem": unloadable},
               "head": head.to_dict() if head else None,
               "metadata": {k: _json_value(h, k) for k in h.types},
               "tensors": _tensor_summary(h, tensors)}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    t = m.tokenizer
    lines = [
        f"file: {h.path}",
        f"format: GGUF v{h.version}, {h.byte_order}-endian, {len(h.types)} metadata keys, "
        f"{len(h.tensors)} tensors, {size_text(h.file_size)}",
        f"model: {m.name or '-'}: {m.architecture or '?'}, {m.size_label} "
        f"({m.n_params:,} parameters), {m.file_type or '?'}, context {m.context_length or '?'}",
        f"tokenizer: {t.model or 'none'} ({vocab_type(t.model) or '-'}), pre {t.pre or '-'}, "
        f"{t.n_vocab} tokens, BOS {_id(t.bos_id, t.add_bos)}, EOS {_id(t.eos_id, t.add_eos)}, "
        f"EOT {_id(t.eot_id)}, PAD {_id(t.pad_id)}, {t.n_merges} merges, chat template "
        f"{'yes' if t.chat_template else 'no'}",
        f"loadable: {'no: ' + unloadable if unloadable else 'yes'}",
        f"draft head: {head.text() if head else 'none'}",
        "",
        f"metadata ({len(h.types)} keys):",
    ]
    lines += [f"{k} = {_text_value(h, k)}" for k in h.types]
    s = _tensor_summary(h, tensors)
    lines += ["", f"tensors ({s['count']}, {s['n_params']:,} parameters, "
              f"{size_text(s['bytes'])} of data at byte {h.data_offset}):"]
    for name, row in s["types"].items():
        n = row["count"]
        lines.append(f"  {name:<8} {n:5d} tensor{'s' if n != 1 else ' '} {row['n_params']:>15,} "
                     f"parameters {size_text(row['bytes']):>12}")
    for tr in s.get("list", []):
        shape = "x".join(map(str, tr["shape"]))
        lines.append(f"  {tr['name']:<40} {shape:<20} {tr['type']:<8} {size_text(tr['bytes']):>12}")
    sys.stdout.write("\n".join(safe(line) for line in lines) + "\n")


def _tensor_summary(h: Header, full: bool) -> dict:
    types: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "n_params": 0,
                                                            "bytes": 0})
    for t in h.tensors:
        row = types[t.type]
        row["count"] += 1
        row["n_params"] += t.n_params
        row["bytes"] += t.n_bytes
    s = {"count": len(h.tensors), "n_params": h.n_params, "bytes": h.tensor_bytes,
         "data_offset": h.data_offset,
         "types": dict(sorted(types.items(), key=lambda kv: -kv[1]["bytes"]))}
    if full:
        s["list"] = [{"name": t.name, "shape": list(t.shape), "type": t.type,
                      "offset": t.offset, "bytes": t.n_bytes} for t in h.tensors]
    return s


def _json_value(h: Header, key: str):
    a = h.arrays.get(key)
    if a is not None:
        return {"type": h.types[key], "count": a.count,
                "preview": [_finite(v) for v in a.preview], "sha256": a.sha256}
    return _finite(h.kv[key])


def _finite(v):
    """JSON has no NaN or infinity: a float that is neither stays a number, others a string."""
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


def _text_value(h: Header, key: str) -> str:
    a: ArrayInfo | None = h.arrays.get(key)
    if a is not None:
        first = ", ".join(_scalar(v) for v in a.preview)
        more = ", ..." if a.count > len(a.preview) else ""
        return f"[{a.element_type} x {a.count}] [{first}{more}]"
    return _scalar(h.kv[key], top=True)


def _scalar(v, top: bool = False) -> str:
    if isinstance(v, float):
        return f"{v:.7g}"
    if isinstance(v, str):
        if top and len(v) <= LONG and "\n" not in v:
            return v
        short = v if len(v) <= 40 else v[:40]
        return repr(short) + (f"... ({len(v)} chars)" if len(v) > 40 else "")
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v[:PREVIEW]) + "]"
    return str(v).lower() if isinstance(v, bool) else str(v)


def _id(token: int | None, add: bool | None = None) -> str:
    if token is None:
        return "-"
    return f"{token}" + ("" if add is None else " (added)" if add else " (not added)")




def _checkpoint(path: Path, json_out: bool) -> None:
    from specli.headckpt import describe

    c = describe(path)
    if json_out:
        sys.stdout.write(json.dumps({"schema_version": SCHEMA_VERSION, "checkpoint": c.to_dict()},
                                    indent=2) + "\n")
        return
    lines = [f"checkpoint: {c.path}", f"draft head: {c.text()}",
             f"tensors ({len(c.tensors)}, {size_text(c.n_bytes)}):"]
    lines += [f"{name:<48} {dtype:<5} {list(shape)}" for name, dtype, shape in c.tensors]
    sys.stdout.write("".join(safe(x) + "\n" for x in lines))
