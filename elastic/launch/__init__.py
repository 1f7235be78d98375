"""The launch layer: the ``elastic`` CLI and what runs on each node around the workers.

Owns the CLI, the per-node launcher and its worker processes, plain-DDP mode, the job's
configuration record, ``elastic status``, ``elastic report`` and the embedded etcd. It may use
every layer below; nothing below imports it.
"""
