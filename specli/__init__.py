"""specli: speculative decoding of local GGUF models, on llama.cpp.

Importing the package loads no native library and reads nothing of the process: what a
process loads is decided by its entry point (specli/__main__.py for the command line).
"""

__version__ = "0.1.0"

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
    # the engine module (and llama.cpp's libraries with it) is imported only when asked for
    if name == "Engine":
        from specli.engine import Engine

        return Engine
    raise AttributeError(name)
