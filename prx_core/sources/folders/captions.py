"""What an image of an image folder carries besides its bytes: its caption, its metadata, its label.

Captions, in order: the image's sidecar `<stem>.txt` / `<stem>.caption` file, then its row in
the nearest covering metadata file (`caption_column`, default `text`; HF's `imagefolder`
convention, `prx_core.sources.folders.metadata`). A (non-empty) sidecar wins: it is per image, the metadata
file is a table for the whole dataset (a caption tool run over a HF dataset writes sidecars next
to the images); the row's caption is then kept in `samples.metadata` under its column name,
so nothing is lost. The row's other columns are metadata too.

Labels follow HF's `imagefolder`: an image's class is the name of the folder holding it, when no
metadata file covers it (with one, the file's own `label` column, if any, is the label, as in
HF). Unlike HF, which decides for the whole dataset at once, the rule is per folder (a worker sees
one folder): an image directly in the source root has no label (HF: none either), but a dataset
of one class folder, or of class folders at different depths, still gets labels (HF: none).
"""

from __future__ import annotations

import posixpath
from typing import Any

from prx_core.sources.folders.metadata import MetadataFile, Row, covering_files, folder_rows
from prx_core.sources.sample_metadata import CAPTION_ERROR, LABEL, caption_value, other_fields

DEFAULT_CAPTION_COLUMN = "text"  # HF's


class FolderCaptions:
    """The metadata-file rows of one folder's images (read once per folder), and per image its
    caption and metadata (`describe`)."""

    def __init__(self, fs: Any, remote: bool, uri: str, caption_column: str | None, rel: str,
                 entries: dict[str, dict[str, Any]], images: set[str]) -> None:
        self.rel, self.column = rel, caption_column or DEFAULT_CAPTION_COLUMN
        self.files = covering_files(fs, remote, uri, rel, entries)
        self.tables: list[tuple[MetadataFile, dict[str, Row], str]] = []  # file, rows, its refused lines
        self.notes: list[str] = []  # about every image of the folder: a metadata file not read
        for meta in self.files:
            if meta.problem:
                self.notes.append(f"{meta.rel}: {meta.problem}")
                continue
            try:
                rows, index = folder_rows(fs, remote, meta, rel, images)
            except (OSError, ValueError) as exc:
                self.notes.append(f"{meta.rel}: not read ({type(exc).__name__}: {exc})")
                continue
            refused = f" ({index.bad} of its rows unreadable, first {index.first_bad})" if index.bad else ""
            self.tables.append((meta, rows, refused))

    def describe(self, name: str, sidecar: str | None) -> tuple[str | None, dict[str, str]]:
        """(caption, metadata) of image file `name`, given its sidecar caption (None: no sidecar;
        an empty one does not hide the metadata row's caption)."""
        notes, metadata, caption = list(self.notes), {}, sidecar
        found = next(((meta, rows[name]) for meta, rows, _ in self.tables if name in rows), None)
        if found is not None:
            meta, row = found
            metadata = other_fields(row, {"file_name"} if sidecar else {"file_name", self.column})
            if not sidecar:
                caption = caption_value(row.get(self.column))
                if caption is None:
                    caption = sidecar
                    notes.append(f"{meta.rel}: the row of {name} has no {self.column!r} text")
        elif self.tables and not sidecar:
            where = ", ".join(f"{meta.rel}{refused}" for meta, _, refused in self.tables)
            notes.append(f"no row for {name} in {where}")
        if not self.files and self.rel:
            metadata[LABEL] = posixpath.basename(self.rel)
        if notes:
            metadata[CAPTION_ERROR] = "; ".join(notes)[:300]
        return caption, metadata
