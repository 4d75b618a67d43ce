"""The cluster tier: Mooncake Store below the node-local pool (``docs/cluster.md``).

A mount started with ``--cluster mooncake://HOST:PORT?metadata=URL`` is a client of a
Mooncake Store master. Keys are paths inside the mount, so nodes that mount the same
layout share names; kvfs adds no protocol of its own between nodes. The tier
subscribes to the store's events (:mod:`kvfs.store.hooks`); the store knows nothing of
it.

- :mod:`kvfs.cluster.config`: the ``--cluster`` URL and its knobs, the key scheme;
- :mod:`kvfs.cluster.client`: the Mooncake client (blocking C++, never closed);
- :mod:`kvfs.cluster.link`: calls under deadlines, up/down, the prober;
- :mod:`kvfs.cluster.tier`: the subscriber: publish queue, deletes;
- :mod:`kvfs.cluster.fetch`: fetch on a lookup's miss;
- :mod:`kvfs.cluster.statistics`: what it counts.
"""

from kvfs.cluster.client import check_client, clients_made
from kvfs.cluster.config import parse_url
from kvfs.cluster.tier import Cluster

__all__ = ["Cluster", "check_client", "clients_made", "parse_url"]  # what the cli uses
