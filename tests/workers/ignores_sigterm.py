"""A worker that ignores SIGTERM (a stuck job): writes its pid to argv[1], then waits."""

import os
import signal
import sys
import threading

signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
threading.Event().wait(300)
