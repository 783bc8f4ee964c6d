"""The explorer latency benchmark's table: a synthetic captions-like table written the way the
pipeline writes it, so the benchmark needs no real corpus and its queries have known answers.

Columns: `content_id` (64 hex characters), `source` (three demo-like sources, 50 / 35 / 15%),
`caption` (100-200 words drawn from a fixed vocabulary with a Zipf distribution, plus rare
`qx...` words planted in a known number of rows) and `embedding` (fixed_size_list<float32, 384>,
unit vectors around 1024 clusters nested in 64 topics, so nearest neighbours are meaningful).
The exact nearest neighbours of the query vectors are computed while generating (for recall).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance import LanceDataset, LanceOperation

from prx_core.stages.source_embeddings import fixed_size_vectors
from prx_core.store.lance_io import write_fragments

DIM = 384
K = 50
SEED = 20240606
ZIPF_S = 1.05
VOCAB_SIZE = 30_000
CAPTION_WORDS = (100, 200)
TOPICS, CLUSTERS_PER_TOPIC = 64, 16
SUBCENTER_SPREAD, ROW_NOISE = 0.6, 0.035  # relative spreads, see `EmbeddingModel`
SOURCES = (("stock_photos", 0.50), ("web_images", 0.35), ("crawl_wds", 0.15))
FILTER_SOURCE = "crawl_wds"
PLANTED = {"qxalder": 5, "qxbrimolo": 10, "qxcorvat": 20, "qxdelune": 30, "qxfenmoor": 40, "qxgavotin": 50}
# Ranked by frequency: stop words first (the INVERTED index drops them), then caption words.
HEAD_WORDS = """
a the of and with in on is at an its by from for are this that to as
photo image white background black view man woman people red blue close up green light
wooden small large street table water sky tree building old city two front standing sitting
dark top side yellow person group young child dog cat car house window room wall grass field
road snow night sunset beach mountain river flowers food plate bowl hand face hair shirt dress
sign text logo illustration drawing painting vector art design pattern texture stock portrait
interior exterior modern vintage kitchen bedroom garden park bridge boat train bus bike horse
bird sea ocean lake forest hill cloud rain summer winter autumn spring morning evening shadow
reflection glass metal stone brick paper fabric leather gold silver orange purple pink brown
gray bright soft blurry sharp detailed wide angle shot aerial macro landscape silhouette crowd
market store restaurant coffee cup bottle book desk chair sofa lamp door floor ceiling roof
fence path stairs tower church castle statue fountain bench umbrella hat glasses phone laptop
screen keyboard camera guitar ball toy baby girl boy family couple friends smiling looking
walking running holding wearing playing eating drinking reading working old-fashioned rustic
minimal abstract geometric floral striped checkered wet dry frozen sunny cloudy foggy misty
""".split()
COMMON_TERMS = ("photo", "image", "white", "background", "black", "view", "man", "woman", "people", "red")
CONSONANTS = "bcdfghjklmnprtvwz"  # no q or x: the planted words start with "qx"
VOWELS = "aeiou"
CODAS = ("", "", "", "n", "r", "l", "m", "t")  # no "s": the stemmer would merge plurals




def build_vocabulary(size: int = VOCAB_SIZE, seed: int = SEED) -> list[str]:
    """HEAD_WORDS, then distinct pronounceable pseudo-words of 2-4 syllables, in rank order."""
    rng = np.random.default_rng(seed)
    words, seen = list(HEAD_WORDS), set(HEAD_WORDS)
    while len(words) < size:
        syllables = int(rng.integers(2, 5))
        word = "".join(CONSONANTS[rng.integers(len(CONSONANTS))] + VOWELS[rng.integers(len(VOWELS))]
                       + CODAS[rng.integers(len(CODAS))] for _ in range(syllables))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def zipf_cdf(size: int = VOCAB_SIZE, s: float = ZIPF_S) -> np.ndarray:
    """Cumulative Zipf word probabilities by rank: word frequencies like real captions'."""
    weights = 1.0 / np.arange(1, size + 1) ** s
    return np.cumsum(weights / weights.sum())


def document_frequency(rank: int, cdf: np.ndarray, words: float = sum(CAPTION_WORDS) / 2) -> float:
    """Expected fraction of captions holding the word of this (0-based) rank."""
    p = cdf[rank] - (cdf[rank - 1] if rank else 0.0)
    return 1.0 - (1.0 - p) ** words


def medium_terms(vocab: Sequence[str], cdf: np.ndarray, count: int = 10,
                 band: tuple[float, float] = (0.004, 0.015)) -> list[str]:
    """`count` pseudo-words (never head words) whose expected document frequency is in `band`."""
    ranks = [r for r in range(len(HEAD_WORDS), len(vocab)) if band[0] <= document_frequency(r, cdf) <= band[1]]
    picks = np.linspace(0, len(ranks) - 1, count).round().astype(int)
    return [vocab[ranks[i]] for i in picks]


class EmbeddingModel:
    """Unit vectors around `TOPICS * CLUSTERS_PER_TOPIC` cluster centres.

    A topic is a random unit direction; its clusters lie around it (spread `SUBCENTER_SPREAD` of
    the topic's norm); a row is its cluster centre plus isotropic noise (`ROW_NOISE` per dimension,
    ~0.7 of the centre's norm in 384-d), normalized. Cosine similarity: ~0.65 within a cluster,
    ~0.45 within a topic, ~0 across topics: neighbours are mostly in the query's cluster, some
    in its topic."""

    def __init__(self, seed: int = SEED) -> None:
        rng = np.random.default_rng(seed + 1)
        topics = _unit(rng.normal(size=(TOPICS, DIM)))
        noise = _unit(rng.normal(size=(TOPICS, CLUSTERS_PER_TOPIC, DIM))) * SUBCENTER_SPREAD
        self.centres = _unit((topics[:, None, :] + noise).reshape(-1, DIM)).astype(np.float32)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        clusters = rng.integers(0, len(self.centres), n)
        rows = self.centres[clusters] + rng.normal(0.0, ROW_NOISE, size=(n, DIM)).astype(np.float32)
        return _unit(rows).astype(np.float32)


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length: cosine similarity becomes a dot product."""
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@dataclass
class TopK:
    """Exact top-k by cosine similarity of each query, kept up to date chunk by chunk."""

    queries: np.ndarray
    k: int = K
    scores: np.ndarray = field(init=False)
    ids: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.scores = np.full((len(self.queries), 0), -np.inf, dtype=np.float32)
        self.ids = np.empty((len(self.queries), 0), dtype=object)

    def update(self, embeddings: np.ndarray, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        sims = self.queries @ embeddings.T
        scores = np.concatenate([self.scores, sims], axis=1)
        all_ids = np.concatenate([self.ids, np.broadcast_to(ids, sims.shape)], axis=1)
        keep = np.argsort(-scores, axis=1, kind="stable")[:, : self.k]
        self.scores = np.take_along_axis(scores, keep, axis=1)
        self.ids = np.take_along_axis(all_ids, keep, axis=1)


@dataclass
class Workload:
    """What the queries need to know about the table: its words, query vectors and exact answers."""

    vocab: list[str]
    cdf: np.ndarray
    common: list[str]
    medium: list[str]
    queries: np.ndarray  # NN query vectors (warm-ups first)
    exact: TopK
    exact_filtered: TopK


def make_workload(queries: int, seed: int = SEED) -> Workload:
    """The vocabulary, the query terms and `queries` NN query vectors; exact top-k still empty."""
    vocab = build_vocabulary(seed=seed)
    if set(PLANTED) & set(vocab):
        raise AssertionError("a planted word is in the vocabulary")
    cdf = zipf_cdf(len(vocab))
    vectors = EmbeddingModel(seed).sample(np.random.default_rng(seed + 2), queries)
    return Workload(vocab=vocab, cdf=cdf, common=list(COMMON_TERMS), medium=medium_terms(vocab, cdf),
                    queries=vectors, exact=TopK(vectors), exact_filtered=TopK(vectors))


def schema() -> pa.Schema:
    """The captions table's columns the explorer queries."""
    return pa.schema([
        pa.field("content_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("caption", pa.string()),
        pa.field("embedding", pa.list_(pa.float32(), DIM)),
    ])


def generate_chunks(rows: int, chunk_rows: int, work: Workload, seed: int = SEED) -> Iterator[pa.Table]:
    """The table in chunks of `chunk_rows` (deterministic for a seed), updating the exact top-k."""
    rng = np.random.default_rng(seed + 3)
    model = EmbeddingModel(seed)
    vocab = pa.array(work.vocab + list(PLANTED), pa.string())
    planted_ids = np.arange(len(work.vocab), len(work.vocab) + len(PLANTED))
    # the rows holding each planted word, distinct across words, spread over the whole table
    total = sum(PLANTED.values())
    if total > rows:
        raise ValueError(f"{rows} rows cannot hold the {total} planted rows")
    planted_rows = np.random.default_rng(seed + 4).choice(rows, total, replace=False)
    planted_word = np.repeat(planted_ids, list(PLANTED.values()))
    source_names = np.array([s for s, _ in SOURCES])
    source_p = np.array([p for _, p in SOURCES])
    for start in range(0, rows, chunk_rows):
        n = min(chunk_rows, rows - start)
        lengths = rng.integers(CAPTION_WORDS[0], CAPTION_WORDS[1] + 1, n)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        words = np.searchsorted(work.cdf, rng.random(offsets[-1]), side="right").clip(0, len(work.vocab) - 1)
        here = (planted_rows >= start) & (planted_rows < start + n)
        for row, word in zip(planted_rows[here] - start, planted_word[here]):
            words[offsets[row] + rng.integers(lengths[row])] = word
        captions = pc.binary_join(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()),
                                                           vocab.take(pa.array(words))), " ")
        ids = _hex_ids(rng, n)
        sources = source_names[rng.choice(len(SOURCES), n, p=source_p)]
        embeddings = model.sample(rng, n)
        work.exact.update(embeddings, ids)
        mask = sources == FILTER_SOURCE
        work.exact_filtered.update(embeddings[mask], ids[mask])
        yield pa.table({
            "content_id": pa.array(ids, pa.string()),
            "source": pa.array(sources, pa.string()),
            "caption": captions,
            "embedding": fixed_size_vectors(embeddings),
        }, schema=schema())


def hex_strings(rng: np.random.Generator, n: int, nbytes: int) -> pa.Array:
    """`n` random hex strings of `nbytes` bytes each, vectorized (no Python loop per row)."""
    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    raw = np.frombuffer(rng.bytes(n * nbytes), np.uint8).reshape(n, nbytes)
    chars = np.empty((n, 2 * nbytes), np.uint8)
    chars[:, 0::2], chars[:, 1::2] = digits[raw >> 4], digits[raw & 15]
    return pa.array(chars.view(f"S{2 * nbytes}").ravel()).cast(pa.string())


def _hex_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` random 64-hex-character ids, like content hashes."""
    return np.array(hex_strings(rng, n, 32).to_pylist(), dtype=object)


def write_table(uri: str, rows: int, chunk_rows: int, work: Workload) -> None:
    """One commit per chunk, as repeated partition writes do: each adds one small fragment."""
    table_schema = schema()
    version = 0
    for chunk in generate_chunks(rows, chunk_rows, work):
        fragments = write_fragments(uri, chunk, table_schema)
        if version == 0:
            ds = LanceDataset.commit(uri, LanceOperation.Overwrite(table_schema, fragments), max_retries=0)
        else:
            ds = LanceDataset.commit(uri, LanceOperation.Append(fragments), read_version=version)
        version = ds.version
