"""Device-aware timing: CUDA events on a GPU (device work is asynchronous), the host clock on a CPU."""

from __future__ import annotations

import time

import torch


class Timer:
    """``with Timer(device) as t: ...`` then ``t.seconds``; on CUDA the region is timed with events on the stream."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = float("nan")

    def __enter__(self):
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0
        return False
