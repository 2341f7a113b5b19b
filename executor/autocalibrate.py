"""Calibrated or says so: measure this machine before predicting for it, when no calibration of it exists.

A prediction for a cluster that this machine stands for (the ``local`` cluster, whose "GPUs" are this
host's CPU processes) is only as good as the figures behind it, and the shipped spec's are generic.
So `validate` (whichever cluster it runs) and `plan`, `simulate` and `compare` on such a cluster first
run `paraplan calibrate` when no calibration of this machine (hardware_specs/identity.py) exists for
the cluster, saying so on stderr. ``--no-calibrate`` (or ``PARAPLAN_NO_CALIBRATE=1`` in the
environment, which the test suite sets) skips that; the predictions are then labelled uncalibrated
(hardware_specs.identity.calibration_status). A cluster spec named by path is the user's choice and is used as given.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from paraplan.hardware_specs import ClusterSpec
from paraplan.hardware_specs.identity import is_this_machine

from .errors import ExecutionError

ENV_NO_CALIBRATE = "PARAPLAN_NO_CALIBRATE"
RANKS = 2  # processes for the collectives and the framework runs (calibrate's default)


def calibration_disabled(flag: bool) -> bool:
    """``--no-calibrate`` given, or ``PARAPLAN_NO_CALIBRATE`` set to a true value."""
    return flag or os.environ.get(ENV_NO_CALIBRATE, "").strip().lower() in ("1", "true", "yes", "on")


def needs_calibration(cluster_ref: str, cluster: ClusterSpec, any_cluster: bool) -> bool:
    """True when ``cluster_ref`` names a cluster (not a spec file), no calibration of this machine applies to
    it, and it is this machine (or ``any_cluster``: validate runs its layouts here, whatever the cluster)."""
    if os.path.exists(cluster_ref) or cluster.calibrated:
        return False
    return any_cluster or is_this_machine(cluster)


def calibrate_first(cluster_ref: str, cluster: ClusterSpec, nodes: int | None, no_calibrate: bool,
                    any_cluster: bool, say: Callable[[str], None]) -> ClusterSpec:
    """The cluster to predict with (``cluster``, loaded from ``cluster_ref``): calibrated now if it needs it
    (one line on stderr before, one after), else ``cluster`` itself."""
    from paraplan.hardware_specs import load_cluster

    if calibration_disabled(no_calibrate) or not needs_calibration(cluster_ref, cluster, any_cluster):
        return cluster
    from .calibrate import calibrate_cluster

    found = f" ({cluster.notes[0]})" if cluster.notes else ""
    say(f"no calibration of this machine for cluster '{cluster_ref}'{found}: calibrating it first "
        f"(about a minute; --no-calibrate skips this and labels predictions uncalibrated)")
    try:
        path, cal, _ = calibrate_cluster(cluster_ref, RANKS, quick=False, out=None)
    except ExecutionError as e:
        raise ExecutionError(f"calibrating this machine failed ({e}); run `paraplan calibrate` to retry, or pass "
                             "--no-calibrate") from None
    say(f"calibrated in {cal.seconds:.0f} s; written to {path}" + (f" ({cal.busy_note})" if cal.busy_note else ""))
    return load_cluster(cluster_ref, nodes=nodes)
