"""alloc_tensor against the fake ACL: the call sequence, alloc/free pairing, Ascend extras."""

from __future__ import annotations

import gc
import os

import pytest
import torch


def test_alloc_sets_device_then_mallocs_then_frees(native, acl_log):
    cu = native.cuda_utils
    t = cu.alloc_tensor((2, 3), torch.float32, "npu:1")
    calls = acl_log.calls(os.getpid())
    malloc = [c for c in calls if c.name == "aclrtMalloc"]
    assert len(malloc) == 1
    # 24 bytes take a whole page.
    assert malloc[0].args["size"] == "4096" and malloc[0].args["device"] == "1"
    # The device was set on this thread right before the allocation.
    i = calls.index(malloc[0])
    assert calls[i - 1].name == "aclrtSetDevice" and calls[i - 1].args["device"] == "1"
    assert t.data_ptr() == int(malloc[0].args["ptr"], 16)
    assert acl_log.of("aclrtFree") == []
    del t
    gc.collect()
    (free,) = acl_log.of("aclrtFree")
    assert free.args["ptr"] == malloc[0].args["ptr"] and free.rc == 0


def test_every_allocation_is_freed_exactly_once(native, acl_log):
    cu = native.cuda_utils
    tensors = [cu.alloc_tensor((n + 1, 4), torch.int16, n % 2) for n in range(12)]
    views = [t[1:] for t in tensors[::3]]  # views keep their allocation alive
    del tensors
    gc.collect()
    mallocs = {c.args["ptr"] for c in acl_log.of("aclrtMalloc")}
    freed = [c.args["ptr"] for c in acl_log.of("aclrtFree")]
    assert len(mallocs) == 12 and len(freed) == 8 and set(freed) <= mallocs
    del views
    gc.collect()
    freed = [c.args["ptr"] for c in acl_log.of("aclrtFree")]
    assert sorted(freed) == sorted(mallocs)
    assert all(c.rc == 0 for c in acl_log.calls())


def test_empty_tensor_allocates_nothing(native, acl_log):
    t = native.cuda_utils.alloc_tensor((3, 0), torch.float32, 0)
    assert t.numel() == 0 and tuple(t.shape) == (3, 0)
    del t
    assert acl_log.of("aclrtMalloc") == [] and acl_log.of("aclrtFree") == []


def test_capsule_never_consumed_is_still_freed(native, acl_log):
    # The tensor is built from a DLPack capsule; dropping everything frees the memory once.
    for _ in range(3):
        native.cuda_utils.alloc_tensor((8,), torch.uint8, 0)
    gc.collect()
    assert len(acl_log.of("aclrtMalloc")) == len(acl_log.of("aclrtFree")) == 3


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("float16", torch.float16),
        ("torch.bfloat16", torch.bfloat16),
        ("half", torch.float16),
        ("long", torch.int64),
    ],
)
def test_dtype_by_name(native, name, dtype):
    assert native.cuda_utils.alloc_tensor((2,), name, 0).dtype == dtype


def test_unsupported_torch_dtype_is_named(native):
    with pytest.raises(
        TypeError, match=r"dtype=torch.complex64 is not supported \(supported: float32"
    ):
        native.cuda_utils.alloc_tensor((2,), torch.complex64, 0)


def test_error_messages_name_argument_and_value(native):
    cu = native.cuda_utils
    with pytest.raises(ValueError, match=r"^shape\[1\]=-4 is negative$"):
        cu.alloc_tensor((3, -4), torch.float32, 0)
    with pytest.raises(ValueError, match=r"^device=2 is out of range: 2 NPU\(s\) visible$"):
        cu.alloc_tensor((3,), torch.float32, 2)
    with pytest.raises(
        ValueError, match="device='cuda:0': deepinfer-ascend places memory on 'npu' devices only"
    ):
        cu.alloc_tensor((3,), torch.float32, "cuda:0")
    with pytest.raises(ValueError, match="device='npu:x' has no valid device index"):
        cu.alloc_tensor((3,), torch.float32, "npu:x")
    with pytest.raises(ValueError, match="too large"):
        cu.alloc_tensor((1 << 40, 1 << 40), torch.float32, 0)


@pytest.mark.parametrize(
    ("numel", "expected"),
    [(1, 4096), (1024, 4096), (1025, 8192), (512 * 1024, 2 << 20), (512 * 1024 + 1, 4 << 20)],
)
def test_allocations_are_whole_pages(native, acl_log, numel, expected):
    # ACL IPC shares page-aligned memory only: 4 KiB pages, 2 MiB huge pages from 2 MiB on.
    native.cuda_utils.alloc_tensor((numel,), torch.float32, 0)
    (malloc,) = acl_log.of("aclrtMalloc")
    assert int(malloc.args["size"]) == expected


def test_threads_allocate_and_free_concurrently(native, acl_log):
    # Tensors die on other threads than the one that allocated them; every pointer is freed once.
    from concurrent.futures import ThreadPoolExecutor

    cu = native.cuda_utils

    def work(i: int) -> list[torch.Tensor]:
        kept = []
        for j in range(20):
            t = cu.alloc_tensor((64 + i, j + 1), torch.float32, i % 2)
            t.fill_(float(i))
            if j % 2:
                kept.append(t)
        return kept

    with ThreadPoolExecutor(max_workers=4) as pool:
        survivors = [t for batch in pool.map(work, range(8)) for t in batch]
    assert len(survivors) == 80
    assert sorted({float(t[0, 0]) for t in survivors}) == [float(i) for i in range(8)]
    # Hand each worker the only references to a quarter of them: they die on that thread.
    quarters = [survivors[k::4] for k in range(4)]
    survivors.clear()
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(list.clear, quarters))
    gc.collect()
    allocated = [c.args["ptr"] for c in acl_log.of("aclrtMalloc")]
    freed = [c.args["ptr"] for c in acl_log.of("aclrtFree")]
    assert len(allocated) == 160
    assert sorted(freed) == sorted(allocated)
