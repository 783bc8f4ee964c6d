"""The training-side loader: a mosaicml-streaming `StreamingDataset` over the corpus MDS tree with
the skip-lists applied.

One `Stream` per bucket folder `<root>/mds/<source>/<tier>/<w>x<h>` (local or `s3://`), so
`batching_method="per_stream"` (the default here) gives bucket-homogeneous batches. A skipped
index is never dropped: `get_item` reads a deterministic non-skipped sample of the same stream
instead (of the same shard when it has one, which the prefetcher has already brought local).
Streaming's sample-id plan (resampling, partitioning over ranks and workers, per-stream batching,
`state_dict` resumption) comes from the stored sample counts and never sees the skip-lists, so
every rank keeps the epoch length and a resumed run reads exactly what an uninterrupted one would.

Operational notes (mosaicml-streaming 0.13): the tier's corpus manifest
(`prx_core.shards.manifest`) is read once per node, at construction: the streams, their sizes and
their skip positions, memory-mapped and shared by the node's ranks and dataloader workers; no
folder is listed and each index.json is fetched by streaming itself. The loader fails closed: a
stream the manifest refuses (its skip-lists never completed for its current index.json: the
`skip_lists` asset did not run or failed after the stream was published, or they were computed for
another version of it), a stream republished since the manifest (its index.json is not the one
the skips refer to) and a tier without a manifest fail the construction with an error naming the
stream and the fix, rather than training unfiltered or skipping the wrong samples
(`allow_unfiltered=True` for debugging). Resuming under changed skip-lists keeps the plan but not
the substitutes, and a stream that became fully skipped changes the plan. `len()` counts every
sample of the kept streams; per_stream batching then drops each stream's incomplete last batch,
so an epoch yields fewer (prx_core.shards.batching; the warnings name the streams). Batches for
`StreamingDataLoader` must be dicts of columns (`collate`).
A remote root caches under `cache_dir`: one live dataset per cache folder (streaming's registry).
Trainers import only this package: no dagster, no Ray.
"""

from __future__ import annotations

import bisect
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from streaming import Stream, StreamingDataset

from prx_core.shards.batching import (
    align_ranks,
    broadcast_from_rank0,
    naming_dropped_batches,
    stream_weights,
    usable_streams,
    warn_left_out,
)
from prx_core.shards.manifest import Manifest, StreamPlan, check_indexes, current_name, load_manifest
from prx_core.shards.manifest_publish import list_plans
from prx_core.shards.mds.encodings import convert_text_columns, register_encodings
from prx_core.shards.mds.streams import INDEX
from prx_core.shards.node_cache import default_cache_dir
from prx_core.shards.skiplists.records import UnfilteredStream
from prx_core.shards.substitutes import Substitutes
from prx_core.store.storage import is_remote, normalize_root

__all__ = ["CorpusDataset", "StreamPlan", "collate", "plan_streams"]

register_encodings()  # the `bf16` text latents: streaming's reader fails on an encoding it does not know


def plan_streams(root: str, tier: int, sources: Sequence[str] | None = None, storage_options: dict | None = None,
                 cache_dir: str | None = None, allow_unfiltered: bool = False,
                 manifest: str | None = None) -> tuple[list[StreamPlan], Manifest | None]:
    """The tier's trainable streams of `sources` (default: every source) and the manifest they
    come from: one manifest read per node, no folder listed (`prx_core.shards.manifest`).

    Fails closed, with an `UnfilteredStream` naming the stream and the fix: a requested source's
    stream the manifest records as refused (no skip-list record for its current index.json: the
    `skip_lists` asset did not run, failed, or ran before the stream was republished; lists
    computed for another version of it), or a tier without a manifest. `allow_unfiltered` (for
    debugging) reads the folders instead, as they are, and warns for each stream without its
    filter: slow at scale (every stream listed and read per rank).
    """
    root = normalize_root(root)
    cache = cache_dir or default_cache_dir(root)
    if allow_unfiltered:
        plans, refused = list_plans(root, tier, sources, storage_options, cache, allow_unfiltered=True)
        if refused:
            raise UnfilteredStream(next(iter(refused.values())))
        found, loaded = plans, None
    else:
        loaded = load_manifest(root, tier, manifest, storage_options, cache)
        found = loaded.plans(None if sources is None else list(sources))
        refused = {n: why for n, why in loaded.refused.items() if sources is None or n.split("/")[0] in sources}
        if refused:
            why = refused[min(refused)]
            more = f" ({len(refused) - 1} more streams refused)" if len(refused) > 1 else ""
            raise UnfilteredStream(f"{why}{more} [manifest {loaded.name}]")
    for source in sources or []:
        if not any(p.source == source for p in found):
            warnings.warn(f"source {source!r} has no published stream in tier {tier} under {root}", stacklevel=3)
    return found, loaded


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
        allow_unfiltered: for debugging only: read the folders instead of the manifest and accept
            streams whose skip-lists are missing or were computed before the stream's last publish
            (the loader refuses them by default, naming the stream: duplicates, nsfw, text and
            opted-out samples would be trained on).
        manifest: the tier manifest to read (`m-....prxm`, as `manifest_name` reports it), default
            the current one. Pin it when ranks start apart: without torch.distributed each process
            resolves `current.json` itself (with it, rank 0 resolves and broadcasts the name).
        **streaming_kwargs: passed to `StreamingDataset` (batch_size, shuffle, epoch_size, ...).
            Defaults here: `batching_method="per_stream"`, `validate_hash="xxh64"` (remote only).

    Streams left out, with one warning naming them: those whose samples are all skipped, and those
    too small to fill one batch under per_stream / device_per_stream batching (streaming would raise).

    A sample is the dict MDS stores (prx_core.shards.mds.streams): `image` (PIL.Image, RGB JPEG of exactly
    `width` x `height`, the stream's bucket), `caption` (str: the captioner's, or the cleaned source
    caption), `original_caption` (str), `width`, `height`, `original_width`, `original_height` (int:
    the bucket and the source image's upright size), `sample_id` (str, `<source>/<source_key>`) and
    `source` (str). Where text latents are configured, also `latent_caption_<preset>` (torch.bfloat16
    [tokens, hidden], as PRX's `bf16` decoder returns it) and, with masks,
    `attention_mask_caption_<preset>` (1-D torch.bool of the prompt's full length whose sum is the
    latent's token count: PRX's loader zero-pads the latent to the mask's length).
    """

    def __init__(self, root: str, tier: int, sources: Sequence[str] | None = None,
                 proportions: Mapping[str, float] | None = None, storage_options: dict | None = None,
                 cache_dir: str | None = None, allow_unfiltered: bool = False, manifest: str | None = None,
                 **streaming_kwargs: Any) -> None:
        if {"streams", "remote", "local"} & set(streaming_kwargs):
            raise TypeError("CorpusDataset builds its own streams: pass root/tier/sources instead")
        streaming_kwargs.setdefault("batching_method", "per_stream")
        if proportions is not None:
            sources = list(proportions) if sources is None else list(sources)
            missing = [s for s in sources if s not in proportions]
            if missing:
                raise ValueError(f"proportions give no weight for sources {missing}")
        if manifest is None and not allow_unfiltered:
            manifest = broadcast_from_rank0(lambda: current_name(normalize_root(root), tier, storage_options))
        found, self.manifest = plan_streams(root, tier, sources, storage_options, cache_dir, allow_unfiltered,
                                            manifest)
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
        check_indexes(plans, [os.path.join(s.local, INDEX) for s in streams], self.manifest)
        self.plans = plans
        self._epoch = 0
        self._stream_starts = [int(x) for x in self.sample_offset_per_stream]
        self._substitutes = self._map_substitutes()

    @property
    def manifest_name(self) -> str | None:
        """The tier manifest read (None under allow_unfiltered): pass it as `manifest=` to pin it."""
        return None if self.manifest is None else self.manifest.name

    def _map_substitutes(self) -> list[Substitutes | None]:
        out: list[Substitutes | None] = []
        for i, p in enumerate(self.plans):
            first = int(self.shard_offset_per_stream[i])
            sizes = self.samples_per_shard[first:first + int(self.shards_per_stream[i])]
            out.append(Substitutes(p.name, p.count, p.skipped, sizes.tolist()) if len(p.skipped) else None)
        return out

    def __getstate__(self) -> dict[str, Any]:
        """A spawned dataloader worker maps the manifest again instead of receiving copies of it."""
        state = dict(self.__dict__)
        if self.manifest is not None:
            state["plans"] = [replace(p, skipped=np.empty(0, np.int64)) for p in self.plans]
            state["_substitutes"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.manifest is not None:
            mapped = {p.name: p for p in self.manifest.plans([p.source for p in self.plans])}
            self.plans = [mapped[p.name] for p in self.plans]
            self._substitutes = self._map_substitutes()

    @staticmethod
    def _stream(plan: StreamPlan, cache_dir: str | None, proportion: float | None) -> Stream:
        weight = {} if proportion is None else {"proportion": proportion}
        if cache_dir is None:
            return Stream(local=plan.uri, **weight)
        # Keyed by the index digest: a republished stream never reuses another version's shards.
        # Streaming's local leader downloads the index.json (its own path); check_indexes then
        # refuses it unless it is the version the manifest's skips refer to.
        local = os.path.join(cache_dir, plan.name, plan.index_digest[:16])
        os.makedirs(local, exist_ok=True)
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
        return sample_id - j + subs(j, self._epoch)

    def get_item(self, sample_id: int, retry: int = 7) -> Any:
        return convert_text_columns(super().get_item(self.substitute(sample_id), retry))

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
