"""The cluster layer: one worker's view of the job in etcd, and the process group it trains in.

Owns the etcd client, membership (leases, fencing), rendezvous and its plan, the change monitor,
the process group's lifecycle, the agreement channel, the etcd-backed store and the failure
classifier. Knows nothing of ``ElasticState`` or the training state: it is given versions,
settings and timeouts, and hands back topologies and typed failures. Importing it starts nothing.
"""
