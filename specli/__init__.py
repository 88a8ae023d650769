"""specli: speculative decoding of local GGUF models, on llama.cpp."""

__version__ = "0.1.0"

from specli.config import DraftParams, ModelParams, SamplingParams  # noqa: E402
from specli.errors import SpecliError  # noqa: E402
from specli.stats import Stats, format_llama  # noqa: E402

__all__ = [
    "DraftParams",
    "Engine",
    "ModelParams",
    "SamplingParams",
    "SpecliError",
    "Stats",
    "__version__",
    "format_llama",
]


def __getattr__(name: str):
    # the engine loads llama.cpp; import it only when asked for
    if name == "Engine":
        from specli.engine import Engine

        return Engine
    raise AttributeError(name)
