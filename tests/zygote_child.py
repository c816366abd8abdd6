"""A process the tests start through meshrl.proc_zygote (`-m zygote_child CODE`): prints its pid, its parent's pid
and ZYGOTE_TEST from its environment, then exits with CODE, or sleeps until killed when CODE is 'sleep'."""

import os
import sys
import time

print(os.getpid(), os.getppid(), os.environ.get("ZYGOTE_TEST"), os.getcwd(), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]))
