"""Gene vocabularies: stable token ids for genes, with special tokens.

Design notes: docs/reference/design.md#tokens-vocabulary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from grain_cells import errors

DEFAULT_SPECIALS = ("<pad>", "<cls>", "<eos>", "<mask>")


@dataclasses.dataclass(frozen=True)
class VocabularyMap:
    """`tokens` int32 per column (-1: none); `dropped`: first 20 names without one."""

    tokens: np.ndarray
    num_dropped: int
    dropped: tuple[str, ...]


class GeneVocabulary:
    """Token ids of genes and special tokens.

    Args:
        tokens: Token name to id; ids must be unique and non-negative.
        specials: Names of the special tokens (must be in `tokens`):
            keys `pad`, `cls`, `eos`, `mask`.
    """

    def __init__(self, tokens: dict[str, int], specials: dict[str, str]):
        ids = np.fromiter(tokens.values(), np.int64, len(tokens))
        if ids.size and (ids.min() < 0 or np.unique(ids).size != ids.size):
            raise ValueError(
                "token ids must be unique and non-negative; got "
                f"{ids.size - np.unique(ids).size} repeated ids, min {ids.min()}"
            )
        for role, name in specials.items():
            if name not in tokens:
                raise ValueError(
                    f"special token {role}={name!r} is not in the vocabulary; "
                    f"add it or pass specials without {role!r}"
                )
        self._tokens = dict(tokens)
        self._specials = dict(specials)
        content = json.dumps([sorted(self._tokens.items()), sorted(specials.items())])
        self._id = hashlib.sha256(content.encode()).hexdigest()[:16]

    @classmethod
    def from_genes(
        cls, genes: Sequence[str], specials: Sequence[str] = DEFAULT_SPECIALS
    ) -> GeneVocabulary:
        """Specials first (ids 0..), then `genes` in order.

        Args:
            genes: Gene names, e.g. `source.var_names`.
            specials: Special token names for pad, cls, eos, mask, in this
                order (an empty string leaves a role out).
        """
        genes = [str(g) for g in genes]
        if len(set(genes)) != len(genes):
            raise ValueError("genes repeat a name; a vocabulary needs unique genes")
        roles = _roles(specials)
        names = list(roles.values()) + genes
        return cls({n: i for i, n in enumerate(names)}, roles)

    @classmethod
    def load(
        cls, path: str | os.PathLike, specials: Sequence[str] = DEFAULT_SPECIALS
    ) -> GeneVocabulary:
        """Reads a vocabulary file (one gene per line, or a JSON object).

        Args:
            path: A `.json` file `{"token": id}` (ids kept as given) or a text
                file with one gene per line.
            specials: Special token names for pad, cls, eos, mask. For a text
                file they are prepended (ids 0..); a JSON file must contain
                them.

        Raises:
            ValueError: The file is malformed or lacks a special token.
        """
        path = os.fspath(path)
        text = pathlib.Path(path).read_text()
        if path.endswith(".json"):
            try:
                tokens = json.loads(text)
                if not isinstance(tokens, dict) or not all(
                    isinstance(v, int) for v in tokens.values()
                ):
                    raise ValueError("expected a JSON object of token name to int id")
                return cls(tokens, _roles(specials))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not JSON ({e})") from e
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from e
        genes = [line.strip() for line in text.splitlines() if line.strip()]
        return cls.from_genes(genes, specials)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the vocabulary as a JSON object `{"token": id}`."""
        with open(path, "w") as f:
            json.dump(self._tokens, f)

    def __len__(self) -> int:
        """One past the largest id (the embedding table's size)."""
        return max(self._tokens.values()) + 1 if self._tokens else 0

    def __contains__(self, name: str) -> bool:
        return name in self._tokens

    def __getitem__(self, name: str) -> int:
        return self._tokens[name]

    def __repr__(self) -> str:
        return f"GeneVocabulary({len(self._tokens)} tokens, sha256:{self._id})"

    def special(self, role: str) -> int:
        """Id of a special token (`"pad"`, `"cls"`, `"eos"`, `"mask"`).

        Raises:
            KeyError: The vocabulary has no such special token.
        """
        if role not in self._specials:
            raise KeyError(
                f"this vocabulary has no {role!r} token; it has "
                f"{sorted(self._specials)}"
            )
        return self._tokens[self._specials[role]]

    def has_special(self, role: str) -> bool:
        """Whether the vocabulary has the special token `role`."""
        return role in self._specials

    def map_genes(self, genes: Sequence[str]) -> VocabularyMap:
        """Token id of each gene (e.g. `source.var_names`), -1 if absent.

        Raises:
            errors.GeneMismatchError: Two gene columns map to one token (a
                repeated var name, or two names of one token): a cell's
                sequence would list that token twice.
        """
        genes = np.asarray(genes).astype(str)
        specials = set(self._specials.values())
        ids = np.array(
            [-1 if g in specials else self._tokens.get(g, -1) for g in genes.tolist()],
            np.int32,
        )
        values, counts = np.unique(ids[ids >= 0], return_counts=True)
        shared = values[counts > 1]
        if shared.size:
            parts = []
            for token in shared[:5].tolist():
                where = np.flatnonzero(ids == token)
                names = sorted(set(genes[where].tolist()))
                parts.append(f"{names} at columns {where.tolist()} (token {token})")
            more = f" and {shared.size - 5} more" if shared.size > 5 else ""
            raise errors.GeneMismatchError(
                f"{shared.size} token(s) would stand for more than one gene column: "
                f"{'; '.join(parts)}{more}. A cell's sequence would list such a "
                "token twice. Keep one column per gene: make var names unique "
                "(adata.var_names_make_unique() before writing) or select genes "
                "with AnnDataSource(..., genes=[...])."
            )
        missing = np.flatnonzero(ids < 0)
        names = tuple(genes[missing[:20]].tolist())
        return VocabularyMap(ids, int(missing.size), names)


def _roles(specials: Sequence[str]) -> dict[str, str]:
    """Role to name, for pad, cls, eos, mask in order; an empty name leaves it out."""
    roles = zip(("pad", "cls", "eos", "mask"), specials, strict=False)
    return {r: n for r, n in roles if n}
