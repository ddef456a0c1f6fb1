"""Cells as token sequences for transformers (Geneformer, scGPT), static shapes."""

from grain_cells.tokens._corpus_stats import CorpusStats, corpus_stats
from grain_cells.tokens._outputs import RankValueTokens, ValueBinTokens
from grain_cells.tokens._vocabulary import GeneVocabulary

__all__ = [
    "CorpusStats",
    "GeneVocabulary",
    "RankValueTokens",
    "ValueBinTokens",
    "corpus_stats",
]
