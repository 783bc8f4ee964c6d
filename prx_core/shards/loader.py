"""The training-side loader: a mosaicml-streaming `StreamingDataset` over the corpus MDS tree with
the skip-lists applied.

One `Stream` per bucket folder `<root>/mds/<source>/<tier>/<w>x<h>` (local or `s3://`), so
`batching_method="per_stream"` (the default here) gives bucket-homogeneous batches. A skipped
index is never dropped: `get_item` reads a deterministic non-skipped sample of the same stream
instead (of the same shard when it has one, which the prefetcher has already brought local).
Streaming's sample-id plan (resampling, partitioning over ranks and workers, per-stream batching,
`state_dict` resumption) comes from the stored sample counts and never sees the skip-lists, so
every rank keeps the epoch length and a resumed run reads exactly what an uninterrupted one would.

Operational notes (mosaicml-streaming 0.13): skip-lists are read once, at construction, only the
requested tier's, memory-mapped and shared by a node's ranks. The loader fails closed: a stream
whose skip-lists were never completed for its current index.json (no completion record: the
`skip_lists` asset did not run or failed after the stream was published) or that was computed for
another version of its stream fails the construction with an error naming the stream, rather
than training unfiltered or skipping the wrong samples (`allow_unfiltered=True` for debugging). Resuming under changed skip-lists keeps the plan but not the
substitutes, and a stream that became fully skipped changes the plan. `len()` counts every
sample of the kept streams; per_stream batching then drops each stream's incomplete last batch,
so an epoch yields fewer (prx_core.shards.batching; the warnings name the streams). Batches for
`StreamingDataLoader` must be dicts of columns (`collate`).
A remote root caches under `cache_dir`: one live dataset per cache folder (streaming's registry).
Trainers import only this package: no dagster, no Ray.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from streaming import Stream, StreamingDataset

from prx_core.shards.batching import align_ranks, naming_dropped_batches, stream_weights, usable_streams, warn_left_out
from prx_core.shards.mds import INDEX, list_streams
from prx_core.shards.node_cache import default_cache_dir, skip_union
from prx_core.shards.skip_records import UnfilteredStream, check_record, read_record
from prx_core.shards.skiplists import SUFFIX, list_skip_files, stream_folder, stream_key
from prx_core.store.storage import filesystem_for, is_remote

_STREAM = re.compile(r".*/([^/]+)/(\d+)/(\d+)x(\d+)/?$")
_MULTIPLIER = 2654435761  # a prime larger than any shard or stream: x -> A*x + B mod m is a bijection


@dataclass(frozen=True)
class StreamPlan:
    """One published bucket folder, its stored sample count and the union of its skip-lists."""

    source: str
    tier: int
    width: int
    height: int
    uri: str
    count: int
    skipped: np.ndarray  # sorted unique stream-local indices (int64)
    index: bytes  # the index.json read, so a remote cache uses exactly this version

    @property
    def name(self) -> str:
        return stream_key(self.source, self.tier, self.width, self.height)


def plan_streams(root: str, tier: int, sources: Sequence[str] | None = None, storage_options: dict | None = None,
                 cache_dir: str | None = None, allow_unfiltered: bool = False) -> list[StreamPlan]:
    """The tier's published streams of `sources` (default: every source), skip-lists unioned.

    Only the tier's skip-lists are read, once per node: they are memory-mapped from the root (a
    local one) or from a copy under `cache_dir` shared by the node's ranks (a remote one), and a
    stream's union of reasons is cached there too. Fails closed, with a ValueError naming the
    stream and the fix: a stream without a skip-list completion record for its current index.json
    (`skip_lists` never ran, failed, or ran before the stream was republished) is refused unless
    `allow_unfiltered` (then it is read with the lists it has, and a warning names it), and a
    skip-list computed for another version of its stream (its `index_digest` or size differs) is
    always refused, since training on it would skip the wrong samples and keep the ones it was
    meant to skip.
    """
    root = root.rstrip("/") if is_remote(root) else os.path.abspath(os.path.expanduser(root))
    fs = filesystem_for(root, storage_options)
    cache = cache_dir or default_cache_dir(root)
    plans = []
    for source in sources if sources is not None else [None]:
        skips: dict[str, list[str]] = {}
        for uri in list_skip_files(root, source, tier, storage_options):
            src, t, w, h = _STREAM.fullmatch(uri.rsplit("/", 1)[0]).groups()  # type: ignore[union-attr]
            skips.setdefault(stream_key(src, int(t), int(w), int(h)), []).append(uri)
        found = []
        for uri in list_streams(root, source, storage_options):  # sorted by (source, tier, w, h)
            src, t, w, h = _STREAM.fullmatch(uri).groups()  # type: ignore[union-attr]
            if int(t) != int(tier):
                continue
            index = fs.cat_file(f"{uri}/{INDEX}")
            count = sum(int(s["samples"]) for s in json.loads(index)["shards"])
            name = stream_key(src, int(t), int(w), int(h))
            digest = hashlib.sha256(index).hexdigest()
            lists = skips.get(name, [])
            reasons = [u.rsplit("/", 1)[-1].removesuffix(SUFFIX) for u in lists]
            try:
                check_record(read_record(fs, stream_folder(root, src, int(t), int(w), int(h))), name, count, digest,
                             reasons)
            except UnfilteredStream as exc:
                if not allow_unfiltered:
                    raise
                warnings.warn(f"allow_unfiltered: training on {name} without its filter: {exc}", stacklevel=3)
            skipped = skip_union(fs, lists, name, count, digest, cache)
            found.append(StreamPlan(src, int(t), int(w), int(h), uri, count, skipped, index))
        if source is not None and not found:
            warnings.warn(f"source {source!r} has no published stream in tier {tier} under {root}", stacklevel=3)
        plans += found
    return plans


class _Substitutes:
    """Maps a skipped stream-local index to a kept one of the same stream.

    The r-th skipped index of a shard goes to kept rank (A*(r + epoch*s) + B) mod m of that shard
    (m kept, s skipped): a bijection, so substitutes spread evenly over the shard and rotate with
    the epoch instead of over-sampling the same images every epoch; staying in the shard means the
    substitute is already local when streaming prefetched the skipped sample. A shard with nothing
    kept falls back to the whole stream. `B` comes from the stream's name only, so the choice does
    not depend on where the corpus lives (local or s3://), nor on ranks or workers.
    Hot path (every sample of the stream): one bit of a bitmap. A skipped sample: its rank from
    per-64 block counts, then a per-epoch table built once, vectorized. Memory ~n/4 bytes plus
    24 bytes per skipped sample (a Python set would take ~60 bytes per skipped sample).
    """

    def __init__(self, plan: StreamPlan, shard_sizes: Sequence[int]) -> None:
        self.skipped = plan.skipped
        self.gaps = plan.skipped - np.arange(len(plan.skipped))  # kept rank k -> k + #(gaps <= k)
        self.shard_starts = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
        self.kept = plan.count - len(plan.skipped)
        self.offset = int.from_bytes(hashlib.blake2b(plan.name.encode(), digest_size=4).digest(), "little")
        mask = np.zeros(-(-plan.count // 64) * 64, bool)
        mask[plan.skipped] = True
        self.bits = np.packbits(mask, bitorder="little").tobytes()
        self.block_rank = np.searchsorted(plan.skipped, np.arange(0, len(mask), 64))
        self._epoch, self._table = -1, np.empty(0, np.int64)

    def table(self, epoch: int) -> np.ndarray:
        """Substitute of every skipped index (aligned with `skipped`) for `epoch`."""
        skipped, n = self.skipped, len(self.skipped)
        shard = np.searchsorted(self.shard_starts, skipped, "right") - 1
        a, b = self.shard_starts[shard], self.shard_starts[shard + 1]
        lo, hi = np.searchsorted(skipped, a), np.searchsorted(skipped, b)
        in_shard = (b - a) > (hi - lo)
        m = np.where(in_shard, (b - a) - (hi - lo), self.kept)
        r = np.where(in_shard, np.arange(n) - lo, np.arange(n))
        period = np.where(in_shard, hi - lo, n)
        x = (r + (epoch % m) * (period % m)) % m  # modular all the way: no int64 overflow
        rank = np.where(in_shard, a - lo, 0) + ((_MULTIPLIER % m) * x + self.offset % m) % m
        return rank + np.searchsorted(self.gaps, rank, "right")

    def __call__(self, j: int, epoch: int) -> int:
        j = int(j)  # streaming passes numpy ints: 1 << 63 would overflow
        return self.hit(j, epoch) if (self.bits[j >> 3] >> (j & 7)) & 1 else j

    def hit(self, j: int, epoch: int) -> int:
        """Substitute of `j`, known to be skipped (its rank from the bitmap, then the table)."""
        if epoch != self._epoch:
            self._table, self._epoch = self.table(epoch), epoch
        word = int.from_bytes(self.bits[(j >> 6) << 3:((j >> 6) << 3) + 8], "little")
        return int(self._table[int(self.block_rank[j >> 6]) + (word & ((1 << (j & 63)) - 1)).bit_count()])


class CorpusDataset(StreamingDataset):
    """`StreamingDataset` over one tier of the corpus, skip-lists applied by substitution.

    Args:
        root: corpus root (folder or `s3://bucket/prefix`).
        tier: the resolution tier to train on (512, 1024, ...).
        sources: source names to include (default: all sources with streams in the tier, or the
            keys of `proportions`).
        proportions: relative weight per source, split over its streams by sample count; None
            means every stored sample once per epoch (streaming's default).
        storage_options: s3fs options for listing and reading index.json and skip-lists. Shards
            are downloaded by streaming's boto3 client, which reads `S3_ENDPOINT_URL` and the
            usual AWS variables; an `endpoint_url` here sets `S3_ENDPOINT_URL` when it is unset.
        cache_dir: local cache of a remote root (default: `$TMPDIR/prx-loader/<hash of root>`).
        allow_unfiltered: for debugging only: accept streams whose skip-lists are missing or were
            computed before the stream's last publish (the loader refuses them by default, naming
            the stream: duplicates, nsfw, text and opted-out samples would be trained on).
        **streaming_kwargs: passed to `StreamingDataset` (batch_size, shuffle, epoch_size, ...).
            Defaults here: `batching_method="per_stream"`, `validate_hash="xxh64"` (remote only).

    Streams left out, with one warning naming them: those whose samples are all skipped, and those
    too small to fill one batch under per_stream / device_per_stream batching (streaming would raise).

    A sample is the dict MDS stores (prx_core.shards.mds): `image` (PIL.Image, RGB JPEG of exactly
    `width` x `height`, the stream's bucket), `caption` (str: the captioner's, or the cleaned source
    caption), `original_caption` (str), `width`, `height`, `original_width`, `original_height` (int:
    the bucket and the source image's upright size), `sample_id` (str, `<source>/<source_key>`) and
    `source` (str).
    """

    def __init__(self, root: str, tier: int, sources: Sequence[str] | None = None,
                 proportions: Mapping[str, float] | None = None, storage_options: dict | None = None,
                 cache_dir: str | None = None, allow_unfiltered: bool = False, **streaming_kwargs: Any) -> None:
        if {"streams", "remote", "local"} & set(streaming_kwargs):
            raise TypeError("CorpusDataset builds its own streams: pass root/tier/sources instead")
        streaming_kwargs.setdefault("batching_method", "per_stream")
        if proportions is not None:
            sources = list(proportions) if sources is None else list(sources)
            missing = [s for s in sources if s not in proportions]
            if missing:
                raise ValueError(f"proportions give no weight for sources {missing}")
        found = plan_streams(root, tier, sources, storage_options, cache_dir, allow_unfiltered)
        plans, self.left_out = usable_streams(found, proportions, streaming_kwargs)
        warn_left_out(self.left_out, tier, len(plans))
        if not plans:
            largest = max((p.count for p in found), default=0)
            raise ValueError(f"no usable stream in tier {tier} of {root}: all {len(found)} are left out, the largest "
                             f"holds {largest} samples (lower batch_size or choose another tier): {self.left_out}")
        remote = is_remote(root)
        if remote:
            streaming_kwargs.setdefault("validate_hash", "xxh64")
            _set_s3_endpoint(storage_options)
            cache_dir = cache_dir or default_cache_dir(root)
        weights = stream_weights(plans, proportions)
        streams = [self._stream(p, cache_dir if remote else None, None if weights is None else weights[i])
                   for i, p in enumerate(plans)]
        align_ranks()  # streaming's ranks each scan /dev/shm for a free prefix before its own first barrier
        super().__init__(streams=streams, **streaming_kwargs)
        self.plans = plans
        self._epoch = 0
        self._stream_starts = [int(x) for x in self.sample_offset_per_stream]
        self._substitutes: list[_Substitutes | None] = []
        for i, p in enumerate(plans):
            first = int(self.shard_offset_per_stream[i])
            sizes = self.samples_per_shard[first:first + int(self.shards_per_stream[i])]
            self._substitutes.append(_Substitutes(p, sizes.tolist()) if len(p.skipped) else None)

    @staticmethod
    def _stream(plan: StreamPlan, cache_dir: str | None, proportion: float | None) -> Stream:
        weight = {} if proportion is None else {"proportion": proportion}
        if cache_dir is None:
            return Stream(local=plan.uri, **weight)
        # Keyed by the index digest: a republished stream never reuses another version's shards.
        local = os.path.join(cache_dir, plan.name, hashlib.blake2s(plan.index, digest_size=8).hexdigest())
        os.makedirs(local, exist_ok=True)
        if not os.path.exists(os.path.join(local, INDEX)):
            tmp = os.path.join(local, f".{INDEX}.{os.getpid()}.tmp")
            with open(tmp, "wb") as handle:
                handle.write(plan.index)
            os.replace(tmp, os.path.join(local, INDEX))
        return Stream(remote=plan.uri, local=local, **weight)

    @property
    def stream_names(self) -> list[str]:
        return [p.name for p in self.plans]

    def substitute(self, sample_id: int) -> int:
        """The global sample index actually read for `sample_id` (itself unless skipped)."""
        sample_id = int(sample_id)  # a numpy int from streaming's plan: Python ints are faster here
        stream = bisect.bisect_right(self._stream_starts, sample_id) - 1
        subs = self._substitutes[stream]
        if subs is None:
            return sample_id
        j = sample_id - self._stream_starts[stream]
        return sample_id - j + subs.hit(j, self._epoch) if (subs.bits[j >> 3] >> (j & 7)) & 1 else sample_id

    def get_item(self, sample_id: int, retry: int = 7) -> Any:
        return super().get_item(self.substitute(sample_id), retry)

    def _get_work(self, epoch: int, sample_in_epoch: int) -> np.ndarray:
        # Runs in every iterating process before any sample is read; resumption restores epoch.
        self._epoch = int(epoch)
        with naming_dropped_batches(self.stream_names, self.batch_size):
            return super()._get_work(epoch, sample_in_epoch)


def _set_s3_endpoint(storage_options: dict | None) -> None:
    endpoint = ((storage_options or {}).get("client_kwargs") or {}).get("endpoint_url")
    if endpoint and os.environ.setdefault("S3_ENDPOINT_URL", endpoint) != endpoint:
        warnings.warn(f"S3_ENDPOINT_URL={os.environ['S3_ENDPOINT_URL']} differs from storage_options' "
                      f"endpoint {endpoint}: streaming downloads shards from the former", stacklevel=3)


def collate(batch: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Column -> list. A dict batch is what `StreamingDataLoader` counts correctly for its
    `state_dict` (a list of dicts is counted as the number of columns of the first sample)."""
    return {key: [sample[key] for sample in batch] for key in batch[0]} if batch else {}
