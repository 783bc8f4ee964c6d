"""A Bloom filter of uint64 keys in NumPy: what an incremental `duplicates` run ships to the tasks
that read every stored key, so that each passes on only the keys a changed source also holds
(~10 bits a key: 1% false positives, which cost a candidate pair each, never a wrong group)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HASHES = 7
BITS_PER_KEY = 10
_SEEDS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93,
                   0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, 0x2545F4914F6CDD1D], np.uint64)


@dataclass(frozen=True)
class Bloom:
    words: np.ndarray  # uint64, a power of two of them

    @classmethod
    def sized(cls, keys: int) -> Bloom:
        words = 1 << max(10, int(np.ceil(np.log2(max(keys, 1) * BITS_PER_KEY / 64))))
        return cls(np.zeros(words, np.uint64))

    def add(self, keys: np.ndarray) -> None:
        for word, bit in self._positions(keys):
            np.bitwise_or.at(self.words, word, bit)

    def union(self, other: Bloom) -> Bloom:
        return Bloom(self.words | other.words)

    def contains(self, keys: np.ndarray) -> np.ndarray:
        found = np.ones(len(keys), bool)
        for word, bit in self._positions(keys):
            found &= (self.words[word] & bit) != 0
        return found

    def _positions(self, keys: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        keys = np.asarray(keys, np.uint64)
        mask = np.uint64(len(self.words) * 64 - 1)
        out = []
        with np.errstate(over="ignore"):
            for seed in _SEEDS[:HASHES]:
                z = (keys ^ seed) * np.uint64(0xBF58476D1CE4E5B9)
                z ^= z >> np.uint64(31)
                position = (z * np.uint64(0x94D049BB133111EB) >> np.uint64(7)) & mask
                out.append(((position >> np.uint64(6)).astype(np.int64), np.uint64(1) << (position & np.uint64(63))))
        return out
