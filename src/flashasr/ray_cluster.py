"""Joining a Ray cluster for the doors that scale out (``flashasr transcribe --ray``, ``flashasr serve --ray``).

One place for what both doors need from Ray before their own work starts: the ``ray`` extra being
installed (:func:`require_ray`, a clear error naming the install command otherwise), the address a
user may pass (:func:`check_address`), and :func:`connect`, which calls :func:`ray.init` quietly
(Ray's own INFO lines and progress bars off; the doors print their own figures).

Addresses follow :func:`ray.init`: ``None`` (the ``--ray`` flag alone) joins the cluster named by
``RAY_ADDRESS`` or a cluster started on this machine with ``ray start``, else starts a private
local instance that ends with the process; ``auto`` joins the running local cluster (an error if
there is none); ``local`` always starts a new local instance; ``HOST:PORT`` the GCS of a cluster
(``ray start --head`` prints it); ``ray://HOST:10001`` a Ray Client server.
"""

from __future__ import annotations

import logging
import os
import re

from .errors import FlashASRError

#: The install command named in errors when Ray is missing.
RAY_INSTALL = "pip install 'flashasr[ray]'"

_ADDRESS = re.compile(r"(auto|local|ray://[^\s/]+(:\d+)?/?|\[?[A-Za-z0-9_.:-]+\]?:\d{1,5})")


class RayUnavailableError(FlashASRError):
    """Ray is not installed, or the cluster cannot be reached."""

    code = "ray_unavailable"
    status = 503


def require_ray():
    """The imported ``ray`` module.

    Raises:
        RayUnavailableError (``ray_unavailable``): Ray is not installed here (the message names
            :data:`RAY_INSTALL`).
    """
    try:
        import ray
    except ImportError as e:
        raise RayUnavailableError(f"Ray is not installed ({e}); install it with {RAY_INSTALL}") from None
    return ray


def check_address(address: str | None) -> str | None:
    """``address`` if it is one :func:`ray.init` takes (see the module docstring), else raise.

    Raises:
        FlashASRError (``invalid_request``): anything else, e.g. an input file taken for the address
            (``--ray clip.wav``).
    """
    if address is None or _ADDRESS.fullmatch(address):
        return address
    raise FlashASRError(f"--ray ADDRESS must be auto, local, HOST:PORT or ray://HOST:PORT, got {address!r} (put --ray "
                        "after the inputs, or write --ray=ADDRESS)", code="invalid_request")


def connect(address: str | None = None, *, namespace: str | None = None, quiet: bool = True) -> dict:
    """Join (or start) a Ray cluster for this process, once (a second call reuses the connection).

    Args:
        address: see the module docstring (``local``: a private local instance).
        namespace: Ray namespace for named actors (Serve uses its own).
        quiet: Ray's own INFO logging and Ray Data's progress bars off.
    Returns:
        ``ray.cluster_resources()`` (``CPU``, ``GPU``, ``memory``, ... summed over the nodes).
    Raises:
        RayUnavailableError (``ray_unavailable``): Ray missing, or the cluster cannot be joined.
    """
    ray = require_ray()
    check_address(address)
    if not ray.is_initialized():
        kw = {"namespace": namespace, "logging_level": logging.WARNING if quiet else logging.INFO,
              "log_to_driver": not quiet or os.environ.get("FLASHASR_RAY_WORKER_LOGS") == "1"}
        if address == "local":
            kw["include_dashboard"] = False
        try:
            ray.init(address=address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayUnavailableError(f"cannot join the Ray cluster at {address or 'the default address'}: {e}") from None
    if quiet:
        for name in ("ray", "ray.data", "ray.serve"):
            logging.getLogger(name).setLevel(logging.WARNING)
    return dict(ray.cluster_resources())


def quiet_ray_data() -> None:
    """Ray Data's INFO and WARNING lines off the console (its log file in the session folder keeps
    them; the job reports what went wrong per file)."""
    import ray.data  # noqa: F401 - configures the "ray.data" logger

    for h in logging.getLogger("ray.data").handlers:
        if type(h).__name__ != "SessionFileHandler":
            h.setLevel(logging.ERROR)


__all__ = ["connect", "quiet_ray_data", "check_address", "require_ray", "RayUnavailableError", "RAY_INSTALL"]
