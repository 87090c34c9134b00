"""A CPU rank's host allocator keeps the memory a step frees: a large tensor comes from the heap, not a mapping of
its own, and the heap is not trimmed when it is freed."""

from __future__ import annotations

import subprocess
import sys

import torch

from mhf_dist.train.host_allocator import keep_freed_host_memory

# glibc's mallinfo2(3) in a fresh interpreter, for a 64 MB tensor allocated and freed with glibc's defaults, then
# after the call: the bytes mapped on their own for it, and what the heap has grown by once it is freed
PROBE = """
import ctypes, torch
from mhf_dist.train.host_allocator import keep_freed_host_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info

def probe():
    before = libc.mallinfo2()
    x = torch.ones(2**24)
    mapped = libc.mallinfo2().hblkhd - before.hblkhd
    del x
    return mapped, libc.mallinfo2().arena - before.arena

default = probe()
assert keep_freed_host_memory(torch.device("cpu"))
print(*default, *probe())
"""
MB64 = 2**26


def test_a_cpu_rank_serves_large_tensors_from_a_heap_it_keeps():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout
    mapped, grown, kept_mapped, kept_grown = map(int, out.split())
    # glibc's default: a mapping of its own, unmapped when freed; kept: the heap grows by it and keeps it
    assert mapped >= MB64 and grown < MB64 // 2
    assert kept_mapped == 0 and kept_grown > MB64 // 2


def test_a_gpu_rank_leaves_the_host_allocator_alone():
    assert keep_freed_host_memory(torch.device("cuda")) is False
