"""specli: speculative decoding of local GGUF models, on llama.cpp."""

__version__ = "0.1.0"

import os  # noqa: E402
import sys  # noqa: E402

# llama.cpp's libraries are loaded first, before any other native extension brings its own C++
# runtime: on a CUDA host, sentencepiece (which gguf imports) loaded first made every model
# load segfault. The exceptions load no model: the audit's namespace shim, which must stay
# single-threaded (numpy's BLAS starts a thread), and the auditor of `specli audit` (its
# first process and the one it re-executes; the audited run, which loads models, keeps the
# rule).
# (boot.ROLE_ENV; audit_boot.early() re-executes on the same test)
AUDITOR = sys.argv[1:2] == ["audit"] and os.environ.get("SPECLI_AUDIT_ROLE") != "audited"
# `specli --version`, `specli --help` and `specli CMD --help` load no model either: they print
# without llama.cpp's libraries, as llama.cpp's own do at once
QUICK = sys.argv[1:] == ["--version"] or (len(sys.argv) <= 3 and sys.argv[-1] in ("--help",
                                                                                  "-h"))
# nor does `specli download`: the hub and the files' headers, a fifth of a second sooner
FETCH = sys.argv[1:2] == ["download"]
# nor do the processes that never load one: netguard's and the chat templates' (-P -m ...)
CHILD = any(m in sys.orig_argv[1:4] for m in ("specli.netguard", "specli.template_host"))
if not (CHILD or AUDITOR or QUICK or FETCH):
    from specli import backend as _backend  # noqa: E402, F401

from specli.config import DraftParams, DraftPolicy, ModelParams, SamplingParams  # noqa: E402
from specli.errors import SpecliError  # noqa: E402
from specli.stats import Stats, format_llama  # noqa: E402

__all__ = [
    "DraftParams",
    "DraftPolicy",
    "Engine",
    "ModelParams",
    "SamplingParams",
    "SpecliError",
    "Stats",
    "__version__",
    "format_llama",
]


def __getattr__(name: str):
    # the engine module is imported only when asked for
    if name == "Engine":
        from specli.engine import Engine

        return Engine
    raise AttributeError(name)
