"""examples/strict_fifo.py: a window strategy of your own (fully_async.sliding_window), kept outside the repository.

    PYTHONPATH=examples torchrun --standalone --nproc_per_node 2 train.py --config configs/tiny.yaml \\
        fully_async.sliding_window=strict_fifo:StrictFifo

StrictFifo keeps the base class's capacity rule for dispatch (R + Q <= C) and collects a complete group only once
every older dispatched group is complete, so groups reach the trainer in the order they were dispatched. The buffer
process asks it (buffer.PipelineServer); config.load_plugins imports this module in every process of the run (the
module must be on PYTHONPATH), and the first question prints one line with the process id to the buffer's log,
run_dir/logs/buffer.log, so you can see where it runs (tests/test_plugins.py checks it).
"""
import os

import strategies

_said = False


class StrictFifo(strategies.Strategy):
    '''Capacity rule for dispatch; collect a group only once every older dispatched group is complete.'''
    def may_collect(self, seq, view):
        _say_once()
        return view.oldest_uncompleted is None or seq < view.oldest_uncompleted


def _say_once():
    global _said
    if not _said:
        _said = True
        print(f"strict_fifo: StrictFifo.may_collect asked in pid {os.getpid()}", flush=True)
