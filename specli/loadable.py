"""What llama.cpp aborts on instead of refusing: metadata checked before a file is loaded.

llama.cpp's loader throws (and returns no model) for most bad metadata, and specli reports
that in one line. A few values reach a GGML_ASSERT, a division by zero or an exception outside
the loader's try (at tokenization, context creation or the first decode), and those kill the
process with a backtrace. This module refuses them first, from the header alone, for every
command that loads a model and for check-pair. The list comes from reading the vendored
llama.cpp (src/llama-model.cpp load_hparams, llama-vocab.cpp load, models/*.cpp graphs).
"""

from __future__ import annotations

from specli import pairing
from specli.errors import ModelFileError
from specli.ggufmeta import ARCH_ARRAYS, Header, read_header, tensor_ints
from specli.headmeta import ASSISTANT

TOKENS = "tokenizer.ggml.tokens"
MAX_LAYERS = 512  # LLAMA_MAX_LAYERS
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
ROPE_SCALING = {"none", "linear", "yarn", "longrope"}


def check_file(path: str) -> Header:
    """Read the header (tokens included) and check it; returns it for further use."""
    h = read(path)
    pairing.check_types(h)  # the tokenizer keys' types first: a wrong one is its own error
    check(h)
    return h


def read(path: str) -> Header:
    """The header with its tokens and its architecture's per-layer values decoded, in one
    pass where general.architecture comes before them (as writers put it), else two."""
    h = read_header(path, {TOKENS, ARCH_ARRAYS})
    arch = h.kv.get("general.architecture")
    missed = {k for k, t in h.types.items() if t.startswith("ARRAY") and isinstance(arch, str)
              and k.startswith(f"{arch}.") and k not in h.kv}
    if missed:
        h = read_header(path, {TOKENS, ARCH_ARRAYS, *missed})
    return h


def problem(path: str) -> str | None:
    """Why llama.cpp would abort on the file, or None (for `info`, which shows it anyway)."""
    try:
        check_file(path)
    except ModelFileError as e:
        return e.message.split(": ", 1)[-1] if "cannot be loaded" in e.message else e.message
    return None


def check(h: Header) -> None:
    """ModelFileError naming the first value llama.cpp would abort on."""
    why = _problem(h)
    if why:
        raise ModelFileError(f"{h.path} cannot be loaded: {why}",
                             hint="llama.cpp would abort on it or refuse it: the file needs "
                             "fixing, or another download")


def _values(v) -> list[int]:
    """A scalar or per-layer value as a list of ints; values of another type are left to
    llama.cpp, which refuses them with an error of its own."""
    items = list(v) if isinstance(v, list | tuple) else [v]
    return [int(x) for x in items if isinstance(x, int | float) and not isinstance(x, bool)]


def _int(kv: dict, key: str, default: int | None = None) -> int | None:
    v = _values(kv.get(key))
    return v[0] if len(v) == 1 and not isinstance(kv.get(key), list | tuple) else default


def _problem(h: Header) -> str | None:  # noqa: C901 - one flat list of llama.cpp's asserts
    kv = h.kv
    if (_int(kv, "split.count") or 1) > 1:  # llama.cpp loads a split model from part 1
        if h.types.get("split.no") != "UINT16":
            return f"split.no is {h.types.get('split.no', 'missing')}, not UINT16"
        if kv.get("split.no"):
            return (f"it is part {kv['split.no'] + 1} of a split model of "
                    f"{kv['split.count']}: give the first part")
    for t in h.tensors:
        if any(d < 1 for d in t.shape):
            return f"tensor {t.name} has a dimension of {min(t.shape)}"
    problem = _tokenizer(kv) or _arrays(h)
    if problem:
        return problem
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        return None  # llama.cpp refuses it with an error of its own
    key = f"{arch}."
    problem = _key_types(h, key)
    if problem:
        return problem
    n_layer = _int(kv, key + "block_count")
    if n_layer is not None and not 1 <= n_layer <= MAX_LAYERS:
        return f"{key}block_count is {n_layer}: llama.cpp takes 1 to {MAX_LAYERS} layers"
    nextn = _int(kv, key + "nextn_predict_layers")
    if nextn is not None and n_layer is not None and nextn > n_layer:
        return f"{key}nextn_predict_layers ({nextn}) is more than block_count ({n_layer})"
    problem = _experts(kv, key)
    if problem:
        return problem
    scaling = kv.get(key + "rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING:
        return f"{key}rope.scaling.type is '{scaling}' (one of {', '.join(sorted(ROPE_SCALING))})"
    eps = kv.get(key + "attention.layer_norm_rms_epsilon")
    if isinstance(eps, float) and eps < 0:
        return f"{key}attention.layer_norm_rms_epsilon is negative ({eps})"
    return _heads(kv, key, arch) or _head_file(h, key, arch)


def _tokenizer(kv: dict) -> str | None:
    model = kv.get("tokenizer.ggml.model")
    if model in ("none", "no_vocab"):
        return f"its tokenizer is '{model}': it cannot tokenize a prompt"
    tokens = kv.get(TOKENS)
    if tokens is None:
        return None  # llama.cpp refuses a file without a vocabulary
    if not tokens:
        return "its token list is empty"
    seen = set(tokens)
    if len(seen) < len(tokens) or "" in seen:  # look closer only where something is off
        seen = set()
        for i, t in enumerate(tokens):
            t = t or f"[EMPTY_{i}]"  # as llama.cpp renames an empty token
            if t in seen:
                return f"token {i} ({t[:40]!r}) appears twice in the vocabulary"
            seen.add(t)
    if model == "llama":  # SentencePiece: byte fallback looks up every <0xXX> token
        missing = next((b for b in range(256) if f"<0x{b:02X}>" not in seen), None)
        if missing is not None:
            return f"its SentencePiece vocabulary lacks the byte token <0x{missing:02X}>"
    return None


def _arrays(h: Header) -> str | None:
    """Per-token arrays as long as the token list, and merges for a BPE vocabulary (llama.cpp
    refuses these, so `run` would; check-pair must not approve such a file)."""
    tokens = h.arrays.get(TOKENS)
    if tokens is None:
        return None
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        a = h.arrays.get(key)
        if a is not None and a.count < tokens.count:  # longer: llama.cpp reads the head
            return f"{key} has {a.count} entries for {tokens.count} tokens"
    if h.kv.get("tokenizer.ggml.model") == "gpt2" and "tokenizer.ggml.merges" not in h.arrays:
        return "its BPE vocabulary has no merges"
    return None


def _experts(kv: dict, key: str) -> str | None:
    n_expert = _int(kv, key + "expert_count", 0) or 0
    used = max(_values(kv.get(key + "expert_used_count", 0)), default=0)
    groups = _int(kv, key + "expert_group_count", 0) or 0
    groups_used = _int(kv, key + "expert_group_used_count", 0) or 0
    if n_expert > MAX_EXPERTS:
        return f"{key}expert_count is {n_expert}: llama.cpp takes at most {MAX_EXPERTS}"
    if used > n_expert:
        return f"{key}expert_used_count ({used}) is more than expert_count ({n_expert})"
    if n_expert > 0 and used == 0:
        return f"{key}expert_used_count is 0 with {n_expert} experts"
    if n_expert == 0 and groups:
        return f"{key}expert_group_count is {groups} without experts"
    if groups > 1 and (groups >= n_expert or n_expert % groups
                       or not 0 < groups_used < groups):
        return f"{key}expert_group_count ({groups}) and expert_group_used_count " \
               f"({groups_used}) do not fit expert_count ({n_expert})"
    return None


# the architectures whose head size, key/value lengths and rotary dimensions are checked
# here (their graphs assert on them: the draft heads' too)
_ROPE_ARCHS = ("llama", "gemma3", "eagle3", "dflash")


def _heads(kv: dict, key: str, arch: str) -> str | None:
    heads = _values(kv.get(key + "attention.head_count", 1))
    heads_kv = _values(kv.get(key + "attention.head_count_kv", heads))
    if not heads or not heads_kv:
        return None
    # recurrent models (Mamba, RWKV) have no attention heads, and some models skip layers
    # (Deci): only the architectures whose graphs divide by them are held to n >= 1
    if arch in _ROPE_ARCHS and any(n < 1 for n in heads):
        return f"{key}attention.head_count has a value below 1"
    if arch in _ROPE_ARCHS and (len(set(heads)) > 1 or len(set(heads_kv)) > 1):
        return f"{key}attention.head_count(_kv) differs between layers, which {arch} " \
               "does not support"
    for n, n_kv in zip(heads, heads_kv * (len(heads) // max(len(heads_kv), 1) or 1),
                       strict=False):
        if n and n_kv and (n_kv > n or n % n_kv):
            return f"{key}attention.head_count_kv ({n_kv}) does not divide head_count ({n})"
    n_embd = _int(kv, key + "embedding_length")
    if arch in _ROPE_ARCHS and n_embd:
        head = n_embd // heads[0]
        k_len = _int(kv, key + "attention.key_length", head)
        v_len = _int(kv, key + "attention.value_length", head)
        rot = _int(kv, key + "rope.dimension_count", k_len)
        if k_len != v_len:
            return f"{key}attention.key_length ({k_len}) and value_length ({v_len}) differ"
        if arch == "llama" and rot != k_len:
            return f"{key}rope.dimension_count ({rot}) is not the head size ({k_len})"
        if arch != "llama" and (rot > k_len or rot % 2):
            return f"{key}rope.dimension_count ({rot}) does not fit the head size ({k_len})"
    return None


# the types llama.cpp reads a draft head's keys (and a model's prediction layers) as: another
# is refused by its loader, after check-pair said yes, or read by specli as something else
_U32, _IDS = {"UINT32"}, {"ARRAY[INT32]", "ARRAY[UINT32]"}
_HEAD_KEY_TYPES = {"target_layers": _IDS, "target_hidden_size": _U32, "block_size": _U32,
                   "embedding_length_out": _U32, "nextn_predict_layers": _U32,
                   "sample_from_anchor": {"BOOL"}}


def _key_types(h: Header, key: str) -> str | None:
    for name, allowed in (*((key + k, t) for k, t in _HEAD_KEY_TYPES.items()),
                          ("tokenizer.ggml.mask_token_id", {"UINT32", "INT32"})):
        kind = h.types.get(name)
        if kind is not None and kind not in allowed:
            return f"{name} is {kind}, expected {' or '.join(sorted(allowed))}"
    return None


def _head_file(h: Header, key: str, arch: str) -> str | None:
    """A draft head's own facts that its graph asserts on (src/models/eagle3.cpp, dflash.cpp,
    gemma4-assistant.cpp); what it must share with its target is headmeta.check_head's."""
    kv = h.kv
    if arch == ASSISTANT:
        pattern = kv.get(key + "attention.sliding_window_pattern")
        if not (isinstance(pattern, list | tuple) and any(x is True for x in pattern)):
            return (f"{key}attention.sliding_window_pattern marks no sliding-window layer "
                    "(a Gemma 4 assistant needs one)")
        return None
    if arch not in ("eagle3", "dflash"):
        return None
    n_embd, out = _int(kv, key + "embedding_length"), _int(kv, key + "embedding_length_out")
    if out is not None and n_embd is not None and out != n_embd:
        return f"{key}embedding_length_out ({out}) is not its embedding_length ({n_embd})"
    if arch == "eagle3" and _int(kv, key + "block_count", 1) != 1:
        return f"{key}block_count is {_int(kv, key + 'block_count')}: an EAGLE-3 head has 1"
    names = {t.name: t for t in h.tensors}
    if arch == "dflash" and "markov_w1.weight" in names and \
            (_int(kv, "dflash.block_size") or 0) < 1:
        return "it is a DSpark head without a dflash.block_size"
    if arch == "dflash" and (_int(kv, "dflash.hyper_connection.count", 0) or 0) > 0:
        for k in ("attention.output_group_count", "attention.sliding_window"):
            if (_int(kv, key + k, 0) or 0) < 1:
                return f"{key}{k} is missing or 0 in a DeepSeek-V4 DSpark head"
    d2t, out = names.get("d2t"), names.get("output.weight")
    if d2t is not None:
        if d2t.type != "I64" or len(d2t.shape) != 1:
            return (f"its d2t vocabulary map is {d2t.type} of shape {list(d2t.shape)}; "
                    "llama.cpp reads a list of I64 ids")
        if out is not None and len(out.shape) > 1 and out.shape[1] != d2t.shape[0]:
            return (f"its d2t vocabulary map has {d2t.shape[0]} entries for its "
                    f"{out.shape[1]} output rows")
        n_tokens = len(kv.get(TOKENS) or ())
        ids = tensor_ints(h, "d2t")
        bad = ids[(ids < 0) | (ids >= n_tokens)] if n_tokens else ids[ids < 0]
        if bad.size:
            return (f"its d2t vocabulary map holds token id {int(bad[0])}, outside its "
                    f"{n_tokens}-token vocabulary")
    return None
