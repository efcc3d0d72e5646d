"""Says whether its stdout and stderr are terminals and their size, writes bytes a terminal
would post-process ("a\\nb\\r\\nc\\n"), waits SECONDS (argv[1]), then says its size again."""

import os
import sys
import time

size = tuple(os.get_terminal_size(1)) if sys.stdout.isatty() else None
print(f"isatty out={sys.stdout.isatty()} err={sys.stderr.isatty()} size={size}", flush=True)
sys.stdout.write("a\nb\r\nc\n")
sys.stdout.flush()
time.sleep(float(sys.argv[1]))
size = tuple(os.get_terminal_size(1)) if sys.stdout.isatty() else None
print(f"size after={size}", flush=True)
