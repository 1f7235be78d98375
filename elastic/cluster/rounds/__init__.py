"""The round protocol: who is in the job, and which round they train in.

Owns membership (leases, fencing), the job's keys and records in etcd, rendezvous and the
coordinator that closes a round, the plan and its seats, the roll call and its verdict, the
news record that tells every member a round broke, and the watch that notices it. Built on the
etcd client (``elastic.cluster.etcd``) only; knows nothing of sockets or process groups, which
the round's links (``elastic.cluster.links``) open once a round is agreed.
"""
