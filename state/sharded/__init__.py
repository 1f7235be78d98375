"""Sharded (FSDP2 / HSDP) state in host memory: the layout math, the commit copies and the
N -> M reshard. Knows torch and torch.distributed; never imports ``elastic`` or ``checkpoint``.
"""
