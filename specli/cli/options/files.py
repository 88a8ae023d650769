"""Models: -m/-md, or -hf/-hfd through the hub.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated

import typer

from specli.cli.options.group import MODELS, Group


@dataclass(frozen=True)
class ModelFiles:
    """-m/-md or -hf/-hff/-hfd/-hffd (and -hft), as given."""

    model: str | None = None
    model_draft: str | None = None
    hf_repo: str | None = None
    hf_file: str | None = None
    hf_repo_draft: str | None = None
    hf_file_draft: str | None = None
    hf_token: str | None = None

    def resolve(self, quiet: bool = False,
                spec_types: Sequence[str] = ()) -> tuple[str, str | None]:
        """The target's and the draft's paths: downloaded through the hub for -hf/-hfd (a
        draft-head sidecar first, see resolve_models), the embedded SmolLM2 pair when neither
        -m nor -hf is given."""
        from specli.cli.models import resolve_models

        return resolve_models(self.model, self.model_draft, self.hf_repo, self.hf_file,
                              self.hf_repo_draft, self.hf_file_draft, self.hf_token,
                              quiet=quiet, spec_types=spec_types)


def _model_opt(*names: str, help: str, envvar: str | list[str] | None = None):
    return typer.Option(*names, help=help, envvar=envvar, rich_help_panel=MODELS,
                        show_default=False)


def _model_flags(
    model: Annotated[str | None, _model_opt(
        "-m", "--model", envvar="LLAMA_ARG_MODEL",
        help="Target GGUF model. Default: the embedded SmolLM2 pair.")] = None,
    model_draft: Annotated[str | None, _model_opt(
        "-md", "--model-draft", "--spec-draft-model",
        envvar=["LLAMA_ARG_SPEC_DRAFT_MODEL", "LLAMA_ARG_MODEL_DRAFT"],
        help="Draft GGUF model (same tokenizer as the target).")] = None,
    hf_repo: Annotated[str | None, _model_opt(
        "-hf", "-hfr", "--hf-repo", envvar="LLAMA_ARG_HF_REPO",
        help="Target from Hugging Face: owner/name[:QUANT] (like llama.cpp's -hf; Q4_K_M, "
        "then Q8_0, when no quant is given).")] = None,
    hf_file: Annotated[str | None, _model_opt(
        "-hff", "--hf-file", envvar="LLAMA_ARG_HF_FILE",
        help="The target's file in the -hf repository, instead of a quant.")] = None,
    hf_repo_draft: Annotated[str | None, _model_opt(
        "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf",
        envvar="LLAMA_ARG_SPEC_DRAFT_HF_REPO",
        help="Draft from Hugging Face: owner/name[:QUANT].")] = None,
    hf_file_draft: Annotated[str | None, _model_opt(
        "-hffd", "--hf-file-draft",
        help="The draft's file in the -hfd repository.")] = None,
    hf_token: Annotated[str | None, _model_opt(
        "-hft", "--hf-token", envvar="HF_TOKEN",
        help="Hugging Face token (default: the saved login).")] = None,
) -> ModelFiles:
    return ModelFiles(model, model_draft, hf_repo, hf_file, hf_repo_draft, hf_file_draft,
                      hf_token)


MODEL_FILES = Group(_model_flags)
