"""Arena: long-lived device memory carved into named segments (landing slots, staging, flags).

A transport supplies the allocator: plain ``torch.empty`` for the reference transport, a
symmetric (peer-mapped) allocation for the CUDA transport. Tensors handed to FSDP2 are rooted at
segment addresses with ``tensor_at``: each has its own storage starting at that address
(``storage_offset() == 0``) and its own version counter, as FSDP2's ``as_strided(...,
storage_offset=0)`` and autograd's saved-tensor checks require; a view into a shared buffer
would break both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

ALIGNMENT = 512  # bytes; keeps 16-byte vector loads and copy-engine descriptors aligned


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


def tensor_at(base: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements whose own storage begins at ``base.data_ptr() + offset``.

    The storage does not own its memory (``base`` must outlive it) and cannot be resized.
    """
    nbytes = numel * dtype.itemsize
    if offset < 0 or offset + nbytes > base.numel() * base.element_size():
        raise ValueError(
            f"offset={offset} + {nbytes} bytes lies outside the {base.numel() * base.element_size()}-byte base"
        )
    if (base.data_ptr() + offset) % dtype.itemsize:
        raise ValueError(f"offset={offset} is not aligned to {dtype}")
    return raw_tensor(base.data_ptr() + offset, numel, dtype, base.device)


def raw_tensor(ptr: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor over ``numel`` elements at device address ``ptr`` that does not own them (the
    memory's owner must outlive it), like the raw addresses recorded stream programs hold."""
    storage = torch._C._construct_storage_from_data_pointer(ptr, device, numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))


@dataclass
class Segment:
    name: str
    nbytes: int
    base: torch.Tensor  # uint8, owns the memory
    peer_ptrs: list[int] | None = None  # base address of the same segment on each peer (symmetric arenas)

    @property
    def ptr(self) -> int:
        return self.base.data_ptr()

    def tensor(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return tensor_at(self.base, offset, numel, dtype)

    def contains(self, ptr: int, nbytes: int = 0) -> bool:
        return self.ptr <= ptr and ptr + nbytes <= self.ptr + self.nbytes


Allocator = Callable[[str, int], tuple[torch.Tensor, "list[int] | None"]]


@dataclass
class Arena:
    allocate: Allocator
    segments: dict[str, Segment] = field(default_factory=dict)

    def segment(self, name: str, nbytes: int) -> Segment:
        """The segment ``name``, allocated on first request. For symmetric arenas this is collective:
        every rank must request the same segments in the same order."""
        seg = self.segments.get(name)
        if seg is not None:
            if nbytes > seg.nbytes:
                raise ValueError(f"segment {name!r} has {seg.nbytes} bytes, {nbytes} requested")
            return seg
        nbytes = align_up(max(nbytes, 1))
        base, peers = self.allocate(name, nbytes)
        seg = Segment(name=name, nbytes=nbytes, base=base, peer_ptrs=peers)
        self.segments[name] = seg
        return seg

    def find(self, ptr: int, nbytes: int = 0) -> tuple[Segment, int]:
        """(segment, offset) of a device address inside the arena."""
        for seg in self.segments.values():
            if seg.contains(ptr, nbytes):
                return seg, ptr - seg.ptr
        raise ValueError(f"address {ptr:#x} (+{nbytes} bytes) is not inside any arena segment")

    @property
    def reserved_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments.values())

    def bytes_by_kind(self) -> dict[str, tuple[int, int]]:
        """(segments, bytes) per kind of segment: the name without its trailing number, so ring0 and
        ring1 are "ring", every dedicated landing "group" and each staging generation "staging"."""
        kinds: dict[str, tuple[int, int]] = {}
        for seg in self.segments.values():
            kind = seg.name.rstrip("0123456789") or seg.name
            count, nbytes = kinds.get(kind, (0, 0))
            kinds[kind] = (count + 1, nbytes + seg.nbytes)
        return kinds


def plain_allocator(device: torch.device) -> Allocator:
    def allocate(name: str, nbytes: int):
        return torch.empty(nbytes, dtype=torch.uint8, device=device), None

    return allocate
