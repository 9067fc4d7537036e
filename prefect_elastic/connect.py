"""The old home of the cluster side, kept while callers move to `prefect_elastic.cluster` (remove then)."""

from .cluster import *  # noqa: F403
from .cluster import __all__ as __all__
