"""The cluster layer: one worker's view of the job in etcd, and the process group it trains in.

Three rooms, imports pointing down: ``etcd`` (the etcd client), ``rounds`` (membership,
rendezvous, the plan and the round tracker) and ``links`` (one round's agreement channel,
store and process group). At this level, ``cluster.py`` puts them together for the run loop
and ``worker_lease_file.py`` reports a worker's leases to its launcher. Knows nothing of
``ElasticState`` or the training state: it is given versions, settings and timeouts, and hands
back topologies and typed failures. Importing it starts nothing.
"""
