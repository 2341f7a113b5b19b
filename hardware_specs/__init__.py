"""Hardware as data: GPU, link and cluster specs (YAML beside this module) and their strict loader."""

from .datafile import read_data_file
from .loader import (
    MEASUREMENTS_DIR,
    SPEC_DIR,
    cluster_from_mapping,
    cluster_mapping,
    load_cluster,
    load_gpu,
    load_link,
    measurements_dir,
    names,
)
from .specs import DTYPES, FRAMEWORK_EVENTS, ClusterSpec, Efficiency, GPUSpec, HardwareSpecError, LinkSpec
from .topology import GroupSpan, build_topology, group_span, path_link

__all__ = [
    "DTYPES", "FRAMEWORK_EVENTS", "MEASUREMENTS_DIR", "SPEC_DIR", "ClusterSpec", "Efficiency", "GPUSpec", "GroupSpan",
    "HardwareSpecError", "LinkSpec", "build_topology", "cluster_from_mapping", "cluster_mapping", "group_span",
    "load_cluster", "load_gpu", "load_link", "measurements_dir", "names", "path_link", "read_data_file",
]
