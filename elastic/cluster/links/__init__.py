"""One round's links: what ties the members of an agreed round together, and how it is let go.

Owns the agreement channel (its TCP transport and its admission), the etcd-backed store a
process group is formed on, the process group and its device, the ports they listen on, the
guard against forking with live communicators, the watchdog that releases a blocked
collective, restarting a worker in place, and ``RoundLinks``, which releases them in order.
May read the round protocol's records (``elastic.cluster.rounds``); never decides when a round
ends.
"""
