"""A plain torchrun-style script that never calls heartbeat() and idles past the hang timeout."""

import time

time.sleep(4)
print("slow but fine", flush=True)
