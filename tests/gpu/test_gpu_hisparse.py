"""GPU check of HiSparse swap-in (marker ``gpu``; run by ``benchmarks/gpu_check.sh``): on a CUDA
DSA pool with a pinned host group the swapper copies through the kernels' launcher (Triton,
compiled), and over a random decode loop every selected token's device slot, and every slot
marked resident, holds exactly the latent bytes written at prefill (random bits, compared as
bytes), in every layer."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.device.hisparse_index import HiSparseIndexKeys
from tiered_kv.host.hisparse_swap import HiSparseSwapper
from tiered_kv.host.pool_group import HostPoolGroup

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
CUDA = torch.device("cuda")
PAGE, LAYERS, TOKENS, BUFFER = 4, 3, 61, 16


def test_swap_in_on_cuda_moves_exact_bytes(gen):
    size = 40 * PAGE
    pool = DSATokenToKVPool(size, PAGE, torch.bfloat16, 13, 6, LAYERS, CUDA)
    alloc = HiSparseTokenToKVPoolAllocator(
        size, PAGE, torch.bfloat16, CUDA, pool, host_to_device_ratio=8
    )
    host = HostPoolGroup(pool.host_pool_decls(), alloc, size_tokens=8 * size, reserve_bytes=0)
    keys = HiSparseIndexKeys(alloc, pool)
    for b in pool.buffers():
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen).to(CUDA))
    z = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([TOKENS])
    logical = alloc.alloc_extend(
        z.to(CUDA), z, seq.to(CUDA), seq, torch.tensor([-1], device=CUDA), TOKENS
    )
    dev = alloc.translate_loc(logical)
    want = [pool.kv_buffer[i].view(torch.uint8)[dev].cpu() for i in range(LAYERS)]
    host_slots = host.alloc(-(-TOKENS // PAGE) * PAGE)[:TOKENS]
    sw = HiSparseSwapper.admit(alloc, pool, host, keys, logical, host_slots, BUFFER)
    assert sw is not None and sw._rows.mode == "kernel"
    assert sw._rows._kernels.backend.value == "triton"
    loaded = 0
    for _ in range(20):
        for layer in range(LAYERS):
            k = int(torch.randint(1, BUFFER + 1, (1,), generator=gen))
            sel = torch.randperm(TOKENS, generator=gen)[:k]
            got = sw.swap_in(layer, sel)
            assert got.failed.numel() == 0 and got.device_slots.device.type == "cuda"
            loaded += got.loaded
            rows = pool.kv_buffer[layer].view(torch.uint8)[got.device_slots].cpu()
            assert torch.equal(rows, want[layer][sel]), layer
            for j, pos in enumerate(sw.resident(layer).tolist()):
                if pos >= 0:
                    row = pool.kv_buffer[layer].view(torch.uint8)[sw.buffer[j : j + 1]].cpu()
                    assert torch.equal(row[0], want[layer][pos]), (layer, j, pos)
    assert loaded > 0
    sw.release()
    host.destroy()
