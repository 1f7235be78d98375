"""The etcd client: the only code that speaks to etcd.

Owns the gRPC channel and its TLS, transactions, watches and their streams, keepalives and the
renewal of leases, the encoding of values and key ranges, and the translation of every etcd
failure into a typed error (``EtcdUnavailableError``). Knows nothing of members, rounds or
process groups: it is given endpoints, settings and timeouts, and hands back revisions, values
and events.
"""
