"""Draft sources: anything that can propose the next tokens. The engine only sees `DraftSource`."""

from specli.drafts.base import DraftSource, Proposal
from specli.drafts.model import ModelDraft

__all__ = ["DraftSource", "ModelDraft", "Proposal"]
