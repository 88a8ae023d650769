"""The only package that imports llama_cpp: models and contexts (model.py), devices and RPC
(devices.py), samplers (samplers.py), chat templates (templates.py), quantization
(quantize.py); _lib.py loads the library once, files.py watches the mapped model files."""

from specli.backend._lib import ll, set_verbose
from specli.backend.devices import (
    SPLIT_MODES,
    Device,
    check_placement,
    connect_rpc,
    kv_type,
    list_devices,
    local_gpu,
    rpc_available,
    start_rpc_server,
    supports_gpu_offload,
)
from specli.backend.ext import require as require_head
from specli.backend.heads import HeadContext, HeadModel
from specli.backend.model import Model, Tokenizer
from specli.backend.protocol import Backend, Branches, Decoder, States, Vocabulary
from specli.backend.quantize import QUANT_TYPES, quantize
from specli.backend.samplers import (
    GRAMMAR_MAX_NESTING,
    GRAMMAR_MAX_RULES,
    Dry,
    Grammar,
    schema_grammar,
    schemas_grammar,
)
from specli.backend.templates import apply_builtin_template, builtin_templates, knows_template

__all__ = ["GRAMMAR_MAX_NESTING", "GRAMMAR_MAX_RULES", "QUANT_TYPES", "SPLIT_MODES", "Backend",
           "Branches", "Decoder", "Device", "States", "Vocabulary",
           "Dry", "HeadContext", "HeadModel", "Grammar", "Model", "Tokenizer",
           "apply_builtin_template",
           "builtin_templates", "check_placement", "connect_rpc", "knows_template",
           "kv_type", "list_devices", "ll", "local_gpu", "quantize", "require_head",
           "rpc_available",
           "schema_grammar", "schemas_grammar", "set_verbose", "start_rpc_server",
           "supports_gpu_offload"]
