"""The shared vocabulary of every ``elastic`` layer: typed errors, the one timeout table, the
settings read from the environment, the event log and the signal relay.

Everything above imports these modules; they import none of the layers (only each other and
the standard library), so a name here means the same in the launcher, the run loop and the
cluster layer. Importing it starts nothing and imports neither torch nor the etcd client.
"""
