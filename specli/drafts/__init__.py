"""Draft sources: anything that can propose the next tokens. The engine only sees `DraftSource`."""

from specli.config import SPEC_TYPES
from specli.drafts.base import DraftSource, Proposal
from specli.drafts.chain import Chain
from specli.drafts.model import ModelDraft
from specli.drafts.ngram import NgramMod, NgramSimple

__all__ = ["SPEC_TYPES", "Chain", "DraftSource", "ModelDraft", "NgramMod", "NgramSimple",
           "Proposal"]
