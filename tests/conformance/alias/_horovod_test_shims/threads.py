"""``horovod.runner.util.threads.in_thread``: imported by Horovod's test/utils/common.py."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs ``target(*args)`` in a started background thread and returns the thread."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, for a single argument use "
                         f"(arg,)")
    fn = target
    if silent:
        def fn(*a):
            try:
                target(*a)
            except Exception:
                pass
    thread = threading.Thread(target=fn, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
