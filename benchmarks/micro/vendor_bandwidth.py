"""Bandwidth of the vendors' own kernels, by CUPTI kernel time (torch.profiler), the yardsticks
for the bandwidth goals: a device-to-device copy at several sizes (and moving exactly the bytes
of the grid's large shapes), a write-only fill (zero_), a read-only reduction (sum), and torch's
broadcast copy (1 read : K writes, the permute pattern with identity routing).

    python3 benchmarks/micro/vendor_bandwidth.py   # H200 output: vendor-bandwidth-h200.txt
"""
import torch
from torch.profiler import ProfilerActivity, profile


def kernel_us(fn, reps: int = 20) -> tuple[float, list[str]]:
    """Mean summed device time of fn's kernels (and memcpy/memset) over reps calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) / reps, sorted({e.name[:60] for e in events})


def show(label: str, nbytes: int, fn) -> None:
    us, names = kernel_us(fn)
    print(f"{label:40s} {nbytes / 1e6:9.1f} MB {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s  {names[:2]}", flush=True)


def main() -> None:
    bf16 = torch.bfloat16
    for mib in (4096, 1024, 400, 200, 100, 50):
        n = mib * 2**20 // 4  # bf16 elements per buffer: read + write = mib MiB
        a = torch.randn(n, dtype=bf16, device="cuda")
        b = torch.empty_like(a)
        show(f"copy {mib} MiB moved", 4 * n, lambda: b.copy_(a))
        show(f"zero_ (write only) {mib // 2} MiB", 2 * n, lambda: b.zero_())
        show(f"sum (read only) {mib // 2} MiB", 2 * n, lambda: a.sum(dtype=torch.float32))
        del a, b
    for name, K, H, T in (("mixtral", 2, 4096, 4096), ("qwen3", 8, 2048, 4096), ("deepseek", 8, 7168, 4096),
                          ("deepseek", 8, 7168, 16384), ("mixtral", 2, 4096, 32768)):
        nbytes = T * H * 2 * (1 + K)  # what permute and unpermute move at this shape
        x = torch.randn(T, H, dtype=bf16, device="cuda")
        out = torch.empty(T, K, H, dtype=bf16, device="cuda")
        show(f"bcast copy {name} T={T} (1:K)", nbytes, lambda: out.copy_(x[:, None, :].expand(T, K, H)))
        src = torch.randn(T * K, H, dtype=bf16, device="cuda")
        half = nbytes // 4  # bf16 elements copied: read + write = nbytes
        dst_view, src_view = out.view(-1)[:half], src.view(-1)[:half]
        show(f"same-bytes copy {name} T={T}", nbytes, lambda: dst_view.copy_(src_view))
        del x, out, src


if __name__ == "__main__":
    main()
