"""A worker still busy before it reaches ElasticState (a long import): writes its pid to
argv[1], then waits, with SIGTERM's default action (the process dies of it)."""

import os
import sys
import threading

with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
threading.Event().wait(300)
