"""What a stored caption is keyed by: the content it describes, or the sample text it copies.

A model's caption is a function of the pixels (same bytes, same model, same prompt: same caption),
so the shared caption tables (`captions`, `caption_labels`, `caption_embeddings`, `text_latents`)
key it by `content_id` and every source holding those bytes shares it. A source caption is not:
it belongs to the sample that carries it, and two sources holding the same bytes under different
texts must each train on their own. Under the `source` captioner the same column therefore holds a
*caption key*: the content id, then a hash of the content id and the sample's own (ingest-cleaned)
caption. Identical bytes with identical text still share a row, different texts never do; and the
keys of a content sort beside it, so a content unit's keys (a range of content ids) sit on the few
index pages that range covers in every shared table, under this captioner too (docs/scale.md).
A key that was the hash alone scattered them: each unit's lookups touched nearly every page.

Which rule applies is part of the captioner version: the `source` captioner's version carries
`SOURCE_VERSION_PREFIX`, so every stage that is handed a captioner version (`mds_shards`,
`skip_lists`, the model stages over captions, the explorer) keys its lookups the same way
without a setting of its own, and a corpus captioned under the earlier rule (keyed by content,
version without the prefix) is never read as if it followed this one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SOURCE_VERSION_PREFIX = "source-"  # the `source` captioner's versions: captions keyed by (content, text)
KEY_DOMAIN = b"prx-source-caption\0"
KEY_SEPARATOR = "."  # content id, separator, text hash: never equal to a content id, sorted by it
TEXT_HASH_CHARS = 32  # 128 bits: two texts of one content never share a key


def keyed_by_text(captioner_version: str) -> bool:
    """Whether captions of this captioner version are keyed per (content, source text)."""
    return captioner_version.startswith(SOURCE_VERSION_PREFIX)


def source_caption_key(content_id: str, original_caption: str | None) -> str:
    """The key of a sample's source caption: its content and its own caption text ("" for none),
    prefixed by the content id so that keys sort by content."""
    digest = hashlib.sha256(KEY_DOMAIN)
    digest.update(content_id.encode())
    digest.update(b"\0")
    digest.update((original_caption or "").encode("utf-8", errors="surrogatepass"))
    return f"{content_id}{KEY_SEPARATOR}{digest.hexdigest()[:TEXT_HASH_CHARS]}"


def caption_keys(captioner_version: str, content_ids: Sequence[str],
                 original_captions: Sequence[str | None]) -> list[str]:
    """Each sample's caption key under `captioner_version`: its content id for a model captioner,
    the (content, source caption) key for the `source` captioner."""
    if len(content_ids) != len(original_captions):
        raise ValueError(f"{len(content_ids)} content ids but {len(original_captions)} original captions")
    if not keyed_by_text(captioner_version):
        return [str(c) for c in content_ids]
    return [source_caption_key(str(c), o) for c, o in zip(content_ids, original_captions)]
