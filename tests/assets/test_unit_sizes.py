"""Every unit size a stage declares is a setting of the `units` resource, with the declared default
and description, and reaches the stage's run."""

from __future__ import annotations

from prx_core.stages.entry import STAGES
from prx_resources.units import FIELDS, UnitsResource


def test_every_declared_unit_size_is_an_operator_setting() -> None:
    declared = {(name, u.setting) for name, stage in STAGES.items() for u in stage.unit_sizes}
    assert declared == set(FIELDS.values())
    fields = UnitsResource.model_fields
    for field, (stage, setting) in FIELDS.items():
        size = next(u for u in STAGES[stage].unit_sizes if u.setting == setting)
        assert fields[field].default == STAGES[stage].defaults()[setting]
        assert fields[field].description == size.description


def test_a_configured_size_reaches_its_stage_only() -> None:
    units = UnitsResource(buckets_rows=7, mds_chunk_rows=11)
    assert units.settings("buckets") == {"unit_rows": 7}
    assert units.settings("mds_shards") == {"route_rows": STAGES["mds_shards"].defaults()["route_rows"],
                                            "chunk_rows": 11}
    assert units.settings("phashes") == {"unit_rows": STAGES["phashes"].defaults()["unit_rows"]}
    assert set(units.settings("samples")) == {"unit_bytes", "unit_seconds", "unit_rows", "unit_files"}
