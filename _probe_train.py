import atexit, os, sys, threading
sys.argv = ["train.py"] + sys.argv[1:]
import train
def dump():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    print(f"RANK {os.environ.get('RANK')} native threads at exit: {names}", file=sys.stderr, flush=True)
atexit.register(dump)
sys.exit(train.main())
