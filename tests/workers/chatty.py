"""A worker that only prints: long lines of its local rank's digit, each written in two halves
with a flush between (so that a line could be torn), to stdout and to stderr."""

import os
import sys

digit = os.environ["LOCAL_RANK"]
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 100):
    stream = sys.stdout if i % 2 else sys.stderr
    stream.write(digit * 2000)
    stream.flush()
    stream.write(digit * 2000 + "\n")
    stream.flush()
