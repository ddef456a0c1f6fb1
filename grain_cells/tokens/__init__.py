"""Cells as token sequences for transformers (Geneformer, scGPT), static shapes."""

from grain_cells.tokens._corpus_stats import CorpusStats, corpus_stats
from grain_cells.tokens._rank_value import RankValueTokens
from grain_cells.tokens._value_bins import ValueBinTokens
from grain_cells.tokens._vocabulary import GeneVocabulary

__all__ = [
    "CorpusStats",
    "GeneVocabulary",
    "RankValueTokens",
    "ValueBinTokens",
    "corpus_stats",
]
