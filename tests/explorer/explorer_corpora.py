"""The corpora the explorer tests browse: the demo build's planted entries (`ExplorerCorpus`),
and a small corpus written straight into real Lance tables with the explorer stage's own functions
(`write_small_corpus`, `write_explorer`): every route in seconds, without a pipeline build."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prx_core.store.storage import Storage

CLI = str(Path(sys.executable).with_name("prx-corpus"))
EXPLORER_SOURCES = ("stock_photos", "web_images")


@dataclass(frozen=True)
class ExplorerCorpus:
    root: Path
    demo: Path
    manifest: list[dict[str, Any]]  # planted entries of the built sources, with `sample_id`
    build_output: str = ""  # what `prx-corpus build` printed (stdout, then stderr): test_quickstart.py reads it

    def planted(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.manifest if kind in e["kinds"]]



def sample_id_of(demo: Path, entry: dict[str, Any]) -> str:
    """`<source>/<source_key>`; image-folder keys are paths relative to the folder, no extension."""
    key = entry["key"]
    if entry["source"] == "web_images":
        [path] = [p for p in (demo / "web_images").rglob(f"{key}.*") if p.suffix != ".txt"]
        key = path.relative_to(demo / "web_images").with_suffix("").as_posix()
    return f"{entry['source']}/{key}"



def source_fields(meta: dict[str, str] | None, url: str | None) -> dict[str, Any]:
    """A samples row's `metadata` (a map: a list of pairs for Arrow) and `source_url`."""
    return {"metadata": None if meta is None else list(meta.items()), "source_url": url}



def write_small_corpus(root: Path, n: int = 40,
                       metadata: Callable[[int], tuple[dict[str, str] | None, str | None]] | None = None) -> Storage:
    """`n` bucketed, captioned, embedded samples (one duplicate group of the first five) written
    straight into real Lance tables, with the explorer's rows and facets (`write_explorer`) and
    the pipeline's indexes: every explorer route in seconds, without a pipeline build.
    `metadata(i)` gives sample i's metadata map and source_url."""
    import numpy as np
    import pyarrow as pa

    from prx_core.store import lance_io, schemas

    storage = Storage(str(root))
    words = ["astronaut", "cat", "wallpaper", "river", "city"]
    ids = [f"tiny/{i:03d}" for i in range(n)]
    vectors = np.random.default_rng(0).normal(size=(n, schemas.CAPTION_EMBEDDING_DIM)).astype("float32")
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    tables = {
        "samples": [{"sample_id": s, "content_id": f"c{i}", "source": "tiny", "source_key": s[5:], "width": 640,
                     "height": 480, "original_caption": f"a {words[i % 5]} photo",
                     **(source_fields(*metadata(i)) if metadata else {})}
                    for i, s in enumerate(ids)],
        "buckets": [{"sample_id": s, "source": "tiny", "content_id": f"c{i}", "width": 640, "height": 480,
                     "tier": 512, "bucket": "576x448"} for i, s in enumerate(ids)],
        "duplicates": [{"sample_id": s, "source": "tiny", "group_id": "00000000000000ab", "group_size": 5,
                        "keeper": i == 0, "keeper_sample_id": ids[0]} for i, s in enumerate(ids[:5])],
        "captions": [{"content_id": f"c{i}", "captioner_version": "cap-1", "caption": f"the {words[i % 5]} seen",
                      "word_count": 3, "error": ""} for i in range(n)],
        "caption_embeddings": [{"content_id": f"c{i}", "captioner_version": "cap-1", "embedder_version": "emb-1",
                                "embedding": vectors[i].tolist()} for i in range(n)],
    }
    for name, rows in tables.items():
        lance_io.overwrite(storage.lance_uri(name), pa.Table.from_pylist(rows, schema=schemas.TABLES[name]))
    write_explorer(storage)
    return storage



def write_explorer(storage: Storage, captioner_version: str = "cap-1", labeler_version: str = "lab-1") -> None:
    """The `explorer` rows of every `samples` row (no ingest rejects) and each source's
    `explorer_facets`, made by the stage's own functions (`explore_rows`, `count_facets`,
    `facet_rows`) in one process, then every table's indexes as the pipeline keeps them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from prx_core.stages.explorer.stage import JOINED
    from prx_core.stages.explorer.rows import count_facets, explore_rows, facet_rows, sample_base
    from prx_core.store import lance_io, schemas
    from prx_core.store.maintenance import refresh_table_indexes

    tables = ("samples", *JOINED)
    inputs = {t: lance_io.table_version(storage.lance_uri(t)) for t in tables}
    base = sample_base(lance_io.read_table(storage.lance_uri("samples")))
    rows = explore_rows(storage, inputs, base, {"captioner_version": captioner_version,
                                               "labeler_version": labeler_version})
    sources = sorted(set(rows["source"].to_pylist()))
    facets = pa.concat_tables([facet_rows(s, count_facets(rows.filter(pc.equal(rows["source"], s)))) for s in sources]
                              or [schemas.EXPLORER_FACETS.empty_table()])
    lance_io.overwrite(storage.lance_uri("explorer"), rows)
    lance_io.overwrite(storage.lance_uri("explorer_facets"), facets)
    for table in (*tables, "explorer", "explorer_facets", "caption_embeddings", "source_embeddings"):
        if lance_io.table_exists(storage.lance_uri(table)):
            refresh_table_indexes(storage.lance_uri(table), table)
