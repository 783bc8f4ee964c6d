"""Dagster resources of the corpus: one interface each, a local and a cluster implementation.

Assets read through these and call `prx_core`; nothing here does image work itself.
"""

from prx_resources.catalog import CatalogResource
from prx_resources.checks import ChecksResource
from prx_resources.explorer import ExplorerResource
from prx_resources.models import CaptionerResource, EmbedderResource, LabelerResource, SkipPolicyResource
from prx_resources.ray import EmbeddedRay, RayCluster
from prx_resources.storage import StorageResource
from prx_resources.text_latents import TextLatentsResource
from prx_resources.training import TrainingResource
from prx_resources.units import UnitsResource

__all__ = [
    "CaptionerResource",
    "CatalogResource",
    "ChecksResource",
    "EmbeddedRay",
    "EmbedderResource",
    "ExplorerResource",
    "LabelerResource",
    "RayCluster",
    "SkipPolicyResource",
    "StorageResource",
    "TextLatentsResource",
    "TrainingResource",
    "UnitsResource",
]
