"""Run a script (argv[1], with the rest of argv) and, as the interpreter exits, print how many gloo threads are
still alive. A process group destroyed with nothing holding it joins its threads; one held past
destroy_process_group keeps them, and one releasing a collective while the interpreter finalises aborts the
process ("terminate called without an active exception", 1 run in ~10 of examples/train_torchrun.py on 2 cores).
A script that leaves its group up has it destroyed by autoshard.init_distributed's exit handler."""
import atexit
import os
import runpy
import sys


def _gloo_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return sum(name.startswith(("pt_gloo", "gloo_")) for name in names)


# Registered before the script imports autoshard: atexit runs it after autoshard's own exit handlers.
atexit.register(lambda: print(f"gloo threads at exit: {_gloo_threads()}", flush=True))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
