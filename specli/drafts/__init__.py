"""Draft sources: anything that can propose the next tokens. The engine only sees `DraftSource`."""

from specli.config import SPEC_TYPES
from specli.drafts.adaptive import Adaptive, Batch, VerifyCost
from specli.drafts.base import DraftSource
from specli.drafts.chain import Chain
from specli.drafts.lookup import NgramCache
from specli.drafts.model import ModelDraft
from specli.drafts.ngram import NgramMod, NgramSimple
from specli.drafts.ngram_map import NgramMap

__all__ = ["SPEC_TYPES", "Adaptive", "Batch", "Chain", "DraftSource", "ModelDraft", "NgramCache",
           "NgramMap", "NgramMod", "NgramSimple", "VerifyCost"]
