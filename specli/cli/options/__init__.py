"""The commands' flags, with llama.cpp's spellings (older and current), one module per group:
`group` (how a command takes its groups, the help panels, shared one-flag declarations),
`files` (-m/-md, -hf/-hfd), `drafting`, `sampling`, `resources`, `gpu`."""

from specli.cli.options.drafting import (
                                         DRAFTING_FLAGS,
                                         FLAGS,
                                         PLAN_HINTS,
                                         Drafting,
                                         draft_params,
                                         ngram_params,
                                         parse_draft,
                                         plan,
                                         refused,
                                         spec_types,
                                         with_n_seq,
)
from specli.cli.options.files import MODEL_FILES, ModelFiles
from specli.cli.options.gpu import FFN_EXPS_REGEX, GPU_FLAGS, GpuFlags
from specli.cli.options.group import (
                                         DRAFTING,
                                         GPU,
                                         MODELS,
                                         NGRAM,
                                         OUTPUT,
                                         RESOURCES,
                                         SAMPLING,
                                         Group,
                                         Json,
                                         NoSpec,
                                         Verbose,
                                         check_n_predict,
                                         grouped,
)
from specli.cli.options.resources import (
                                         ALL_LAYERS,
                                         RESOURCE_FLAGS,
                                         FlashAttn,
                                         Resources,
                                         parse_ngl,
                                         placement_args,
                                         speed_args,
)
from specli.cli.options.sampling import SAMPLING_FLAGS

__all__ = ["ALL_LAYERS", "DRAFTING", "DRAFTING_FLAGS", "FFN_EXPS_REGEX", "FLAGS", "GPU",
           "GPU_FLAGS", "MODELS", "MODEL_FILES", "NGRAM", "OUTPUT", "PLAN_HINTS", "RESOURCES",
           "RESOURCE_FLAGS", "SAMPLING", "SAMPLING_FLAGS", "Drafting", "FlashAttn", "GpuFlags",
           "Group", "Json", "ModelFiles", "NoSpec", "Resources", "Verbose", "check_n_predict",
           "draft_params", "grouped", "ngram_params", "parse_draft", "parse_ngl",
           "placement_args", "plan", "speed_args", "refused", "spec_types", "with_n_seq"]
