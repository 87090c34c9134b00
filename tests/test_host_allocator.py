"""A CPU rank's host allocator keeps the memory a step frees: a large tensor comes from the heap, not a mapping of
its own, and the heap is not trimmed when it is freed."""

from __future__ import annotations

import subprocess
import sys

import torch

from mhf_dist.train.host_allocator import keep_freed_host_memory

# glibc's mallinfo2(3) in a fresh interpreter: bytes mapped on their own by a 64 MB tensor, and what the heap has
# grown by once it is freed
PROBE = """
import ctypes, sys, torch
from mhf_dist.train.host_allocator import keep_freed_host_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "kept":
    assert keep_freed_host_memory(torch.device("cpu"))
before = libc.mallinfo2()
x = torch.ones(2**24)
mapped = libc.mallinfo2().hblkhd - before.hblkhd
del x
print(mapped, libc.mallinfo2().arena - before.arena)
"""
MB64 = 2**26


def probe(mode: str) -> tuple[int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    ).stdout
    mapped, grown = map(int, out.split())
    return mapped, grown


def test_a_cpu_rank_serves_large_tensors_from_a_heap_it_keeps():
    # glibc's default: a mapping of its own, unmapped when freed
    mapped, grown = probe("default")
    assert mapped >= MB64 and grown < MB64
    mapped, grown = probe("kept")
    assert mapped == 0 and grown >= MB64


def test_a_gpu_rank_leaves_the_host_allocator_alone():
    assert keep_freed_host_memory(torch.device("cuda")) is False
