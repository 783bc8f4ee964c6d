"""Demo sources derived from real offline photos (see `build.build_demo_sources`)."""

from prx_core.demo.build import build_demo_sources
from prx_core.demo.manifest import DemoManifest, Planted, load_manifest

__all__ = ["DemoManifest", "Planted", "build_demo_sources", "load_manifest"]
