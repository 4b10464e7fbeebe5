"""Benchmark of the paged attention kernels.

On a GPU: achieved memory bandwidth of the Triton decode kernel (bytes of K/V read / time) for a
few batch/context sizes in bfloat16, against the device's copy bandwidth (a large tensor copy,
bytes read + written / time), timed with CUDA events.

On the CPU: the fp32 torch attention backend (``radixkv.model.attention.base.torch_decode_attention`` /
``torch_extend_attention``) and the bf16 native kernel (``radixkv.model.attention.native_backend``, the CPU
default) against a naive attention over contiguous per-request K/V (torch SDPA, same dtype), with
the time ratio.

The shared-prefix decode burst (:func:`bench_cpu_groups`) also times both native kernels over the
same K/V stored as quantized pages (``int8`` and ``fp8_e4m3`` rows of :mod:`radixkv.model.kv_quant`,
dequantized in registers) against bf16 pages, and the bf16 kernel with the caches flushed before
each call (as in a decode step, where the linears evict the K/V between two layers' attention);
``--groups-only`` runs that section alone.

The sliding-window decode (:func:`bench_cpu_window`, ``--window-only``): one layer of decodes over a
4,096-token context with a window of 256 (Mistral's heads: Hq=32, Hkv=8, D=128) through the
float32-math kernel, against the same kernel with full attention and against the torch gather of
:mod:`radixkv.model.attention.window` that windowed layers ran through before the kernels took
windows. ``--process-time`` times the CPU this process used (``time.process_time``) instead of
the wall clock: steadier on a shared host, and with ``OMP_NUM_THREADS=1`` the kernel's own time.

Run from the repository root: ``python bench/bench_kernels.py`` (``--iters N`` to change repeats).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixkv.kernels import (
    choose_num_kv_splits,
    decode_attention,
    decode_attention_ref,
    extend_attention_ref,
)
from radixkv.model.kv_quant import dequantize, quantize


@dataclass
class Problem:
    """A batch of requests laid out in a paged cache under shuffled page ids."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    lens: list[int]
    ks: list[torch.Tensor]  # contiguous per-request K [L, Hkv, D] (views of a copy, for naive)
    vs: list[torch.Tensor]


def make_problem(
    lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Problem:
    """Random K/V for requests of ``lens`` tokens, paged through a shuffled page table."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_req = [math.ceil(n / page_size) for n in lens]
    num_pages = sum(pages_per_req)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_pages, generator=gen, device=device)
    page_table = torch.zeros(len(lens), max(pages_per_req), dtype=torch.int32, device=device)
    ks, vs = [], []
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    used = 0
    for b, (n, n_pages) in enumerate(zip(lens, pages_per_req, strict=True)):
        pages = perm[used : used + n_pages]
        used += n_pages
        page_table[b, :n_pages] = pages.to(torch.int32)
        pos = torch.arange(n, device=device)
        slots = pages[pos // page_size] * page_size + pos % page_size
        ks.append(flat_k[slots].contiguous())
        vs.append(flat_v[slots].contiguous())
    return Problem(k_cache, v_cache, page_table, lens, ks, vs)


# ----------------------------------------------------------------------------- GPU


def cuda_time_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median time of ``fn`` in milliseconds, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, iters: int) -> float:
    """Device copy bandwidth (GB/s), counting bytes read plus bytes written."""
    n_bytes = 1 << 30
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters)
    return 2 * n_bytes / (ms * 1e-3) / 1e9


def bench_gpu(iters: int) -> None:
    device = torch.device("cuda")
    dtype = torch.bfloat16
    hkv, group, d, page_size = 8, 4, 128, 16
    hq = hkv * group
    props = torch.cuda.get_device_properties(device)
    copy_bw = copy_bandwidth_gbs(device, iters)
    print(f"device: {props.name}, {props.multi_processor_count} SMs")
    print(f"copy bandwidth (read + write): {copy_bw:8.1f} GB/s")
    print(f"decode_attention, bf16, Hq={hq}, Hkv={hkv}, D={d}, page_size={page_size}")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'time us':>9} {'GB/s':>8} {'% of copy':>9}")
    for batch, ctx in [(1, 8192), (1, 32768), (8, 4096), (32, 2048), (64, 4096), (128, 1024)]:
        lens = [ctx] * batch
        prob = make_problem(lens, page_size, hkv, d, dtype, device)
        q = torch.randn(batch, hq, d, device=device, dtype=dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        splits = choose_num_kv_splits(ctx, batch, hkv, device)

        def run(
            q: torch.Tensor = q,
            prob: Problem = prob,
            seq_lens: torch.Tensor = seq_lens,
            out: torch.Tensor = out,
            ctx: int = ctx,
        ) -> None:
            decode_attention(
                q,
                prob.k_cache,
                prob.v_cache,
                prob.page_table,
                seq_lens,
                d**-0.5,
                out=out,
                max_seq_len=ctx,
            )

        ms = cuda_time_ms(run, iters)
        kv_bytes = 2 * sum(lens) * hkv * d * prob.k_cache.element_size()
        bw = kv_bytes / (ms * 1e-3) / 1e9
        print(
            f"{batch:>6} {ctx:>8} {splits:>6} {ms * 1e3:>9.1f} {bw:>8.1f} {100 * bw / copy_bw:>8.1f}%"
        )
        ref = decode_attention_ref(
            q[:1], prob.k_cache, prob.v_cache, prob.page_table[:1], seq_lens[:1], d**-0.5
        )
        err = (out[:1].float() - ref.float()).abs().max().item()
        assert err < 3e-2, f"decode kernel disagrees with the oracle (max abs err {err})"
        for name, storage in (("int8", torch.int8), ("fp8_e4m3", torch.uint8)):
            qk, qv = quantize(prob.k_cache, storage), quantize(prob.v_cache, storage)

            def run_q(
                qk: torch.Tensor = qk,
                qv: torch.Tensor = qv,
                q: torch.Tensor = q,
                table: torch.Tensor = prob.page_table,
                seq_lens: torch.Tensor = seq_lens,
                out: torch.Tensor = out,
                ctx: int = ctx,
            ) -> None:
                decode_attention(q, qk, qv, table, seq_lens, d**-0.5, out=out, max_seq_len=ctx)

            q_ms = cuda_time_ms(run_q, iters)
            q_bytes = 2 * sum(lens) * hkv * qk.shape[-1] * qk.element_size()
            q_bw = q_bytes / (q_ms * 1e-3) / 1e9
            ref = decode_attention_ref(
                q[:1],
                dequantize(qk, dtype),
                dequantize(qv, dtype),
                prob.page_table[:1],
                seq_lens[:1],
                d**-0.5,
            )
            err = (out[:1].float() - ref.float()).abs().max().item()
            assert err < 3e-2, f"{name} decode kernel disagrees with the oracle ({err})"
            print(
                f"{'':>6} {name:>8} {'':>6} {q_ms * 1e3:>9.1f} {q_bw:>8.1f} "
                f"{100 * q_bw / copy_bw:>8.1f}%  {q_ms / ms:.2f}x bf16 pages' time"
            )
            del qk, qv
        del prob


# ----------------------------------------------------------------------------- CPU


#: the CPU timings' clock: wall time, or the process's CPU time (``--process-time``)
CLOCK: dict[str, Callable[[], float]] = {"now": time.perf_counter}


def cpu_time_ms(
    fn: Callable[[], object],
    iters: int,
    warmup: int = 1,
    before: Callable[[], object] | None = None,
) -> float:
    """Median time of ``fn`` in milliseconds on ``CLOCK`` (``before``, untimed, ahead of each
    call)."""
    now = CLOCK["now"]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = now()
        fn()
        times.append((now() - t0) * 1e3)
    return statistics.median(times)


def naive_decode(q: torch.Tensor, prob: Problem, scale: float) -> torch.Tensor:
    """SDPA over each request's contiguous K/V (the baseline: no paging at all)."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        out[b] = F.scaled_dot_product_attention(
            q[b].unsqueeze(1),  # [Hq, 1, D]
            prob.ks[b].transpose(0, 1),
            prob.vs[b].transpose(0, 1),
            scale=scale,
            enable_gqa=True,
        ).squeeze(1)
    return out


def naive_extend(
    q: torch.Tensor, prob: Problem, prefix: list[int], ext: list[int], scale: float
) -> torch.Tensor:
    """Causal SDPA of each request's new tokens over its contiguous K/V."""
    out = torch.empty_like(q)
    row = 0
    for b, (p, e) in enumerate(zip(prefix, ext, strict=True)):
        n = p + e
        allowed = torch.arange(n)[None, :] <= torch.arange(p, n)[:, None]
        out[row : row + e] = F.scaled_dot_product_attention(
            q[row : row + e].transpose(0, 1),
            prob.ks[b].transpose(0, 1),
            prob.vs[b].transpose(0, 1),
            attn_mask=allowed,
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
        row += e
    return out


Backend = tuple[str, torch.dtype, Callable[..., torch.Tensor], Callable[..., torch.Tensor]]


def load_cpu_backends() -> list[Backend]:
    """(name, dtype, decode_fn, extend_fn) of each CPU paged-attention path to time."""
    try:
        from radixkv.model.attention.torch_backend import (
            torch_decode_attention,
            torch_extend_attention,
        )
    except ImportError as exc:
        print(
            f"note: radixkv.model.attention.base unavailable ({exc}); timing the torch oracles instead"
        )
        return [
            ("radixkv.kernels.*_ref", torch.float32, decode_attention_ref, extend_attention_ref)
        ]
    backends: list[Backend] = [
        (
            "radixkv.model.attention.base.torch_* (fp32)",
            torch.float32,
            torch_decode_attention,
            torch_extend_attention,
        )
    ]
    from radixkv.model import native
    from radixkv.model.attention.native_backend import native_paged_attention

    if native.load() is None:
        print(f"note: native CPU kernels unavailable ({native.build_error()})")
        return backends

    def native_decode(q, k_cache, v_cache, table, seq_lens, scale):  # noqa: ANN001, ANN202
        lens = [int(x) for x in seq_lens.tolist()]
        b = len(lens)
        return native_paged_attention(
            q, k_cache, v_cache, table, [n - 1 for n in lens], [1] * b, list(range(b)), scale
        )

    def native_extend(q, k_cache, v_cache, table, prefix, ext, starts, scale):  # noqa: ANN001, ANN202
        as_list = lambda t: [int(x) for x in t.tolist()]  # noqa: E731
        return native_paged_attention(
            q, k_cache, v_cache, table, as_list(prefix), as_list(ext), as_list(starts), scale
        )

    backends.append(
        ("radixkv native paged_attention (bf16)", torch.bfloat16, native_decode, native_extend)
    )
    return backends


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def bench_cpu(iters: int, groups_only: bool = False, window_only: bool = False) -> None:
    if groups_only or window_only:
        (bench_cpu_groups if groups_only else bench_cpu_window)(iters)
        return
    for backend in load_cpu_backends():
        bench_cpu_backend(iters, *backend)
    print("ratio = paged backend time / naive contiguous time (lower is better; 1.0 = parity)")
    bench_cpu_groups(iters)
    bench_cpu_window(iters)


def bench_cpu_window(iters: int, window: int = 256, context: int = 4096) -> None:
    """Decode attention of one layer, ``batch`` requests at ``context`` tokens, Mistral's heads,
    bf16 and float32 pages: the float32-math kernel under a ``window`` (reads the last
    ``window`` keys), the same kernel over the whole context, and window.py's torch gather."""
    from radixkv.model import native
    from radixkv.model.attention.base import ForwardBatch
    from radixkv.model.attention.window import plan_window, windowed_attention

    module = native.load()
    if module is None:
        return
    hq, hkv, d, page = 32, 8, 128, 16
    print()
    print(
        f"sliding-window decode, one layer: context {context}, window {window}, Hq={hq}, "
        f"Hkv={hkv}, D={d}, page {page}, float32-math kernel ({module.kernel_isa()}), "
        f"{torch.get_num_threads()} threads; hot caches; "
        f"{'process CPU' if CLOCK['now'] is time.process_time else 'wall'} time"
    )
    for dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 16):
            prob = make_problem([context] * batch, page, hkv, d, dtype, torch.device("cpu"))
            q = torch.randn(batch, hq, d)
            lens = ([context - 1] * batch, [1] * batch, list(range(batch)), d**-0.5, [], [], [])
            table = prob.page_table

            def kernel(w: int, table=table, prob=prob, q=q, lens=lens) -> torch.Tensor:
                return module.paged_attention_f32(q, prob.k_cache, prob.v_cache, table, *lens, w)

            full = cpu_time_ms(lambda kernel=kernel: kernel(0), iters)
            windowed = cpu_time_ms(lambda kernel=kernel: kernel(window), iters)
            # window.py: the step's plan once, then per layer the gather and SDPA (it stores the
            # new rows first: here the last token's, already in place)
            pos = torch.full((batch,), context - 1)
            flat = table.long()[torch.arange(batch), pos // page] * page + pos % page
            fb = ForwardBatch(pos, pos, [1] * batch, [context - 1] * batch, table, flat, page)
            plan = plan_window(fb, window)
            assert plan is not None
            kv = [c.view(-1, hkv, d)[flat] for c in (prob.k_cache, prob.v_cache)]
            qd = q.to(dtype)

            def gather(plan=plan, kv=kv, prob=prob, qd=qd) -> torch.Tensor:
                return windowed_attention(qd, *kv, prob.k_cache, prob.v_cache, plan, d**-0.5)

            torch_ms = cpu_time_ms(gather, iters)
            err = (kernel(window) - gather().float()).abs().max().item()
            print(
                f"{str(dtype).removeprefix('torch.'):>9} pages, batch {batch:>2}: full "
                f"{full:.3f} ms, window {windowed:.3f} ms ({full / windowed:.1f}x faster); "
                f"torch gather {torch_ms:.3f} ms ({torch_ms / windowed:.1f}x the kernel's; "
                f"max |diff| {err:.1e})"
            )


def bench_cpu_groups(iters: int) -> None:
    """The shared-prefix decode burst (issue 31's shape, SmolLM2's heads): 64 decodes on 4
    prefixes of 768 shared tokens + 80 own each, one layer, with and without the step's
    shared-prefix groups, for the bf16 kernel (AVX512-BF16 path where the build has it) and the
    float32-math kernel over the same bf16 pages; then both kernels over those K/V quantized
    (int8, fp8 e4m3: about half the bytes), with and without the groups."""
    from radixkv.model import native
    from radixkv.model.kv_quant import quantize

    module = native.load()
    if module is None:
        return
    hq, hkv, d, page, batch, shared, own = 9, 3, 64, 16, 64, 768, 80
    shared_pages, own_pages = shared // page, -(-own // page)
    gen = torch.Generator().manual_seed(0)
    num_pages = 4 * shared_pages + batch * own_pages
    k = torch.randn(num_pages, page, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_pages, page, hkv, d, generator=gen).to(torch.bfloat16)
    table = torch.zeros(batch, shared_pages + own_pages, dtype=torch.int32)
    for b in range(batch):
        g = b % 4
        table[b, :shared_pages] = torch.arange(g * shared_pages, (g + 1) * shared_pages)
        first = 4 * shared_pages + b * own_pages
        table[b, shared_pages:] = torch.arange(first, first + own_pages)
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16)
    lens = ([shared + own - 1] * batch, [1] * batch, list(range(batch)), d**-0.5)
    members = [b for g in range(4) for b in range(g, batch, 4)]
    groups = (members, [0, 16, 32, 48, 64], [shared] * 4)
    none: tuple[list[int], list[int], list[int]] = ([], [], [])
    print()
    print(
        f"shared-prefix decode burst, one layer: {batch} decodes, 4 x {shared} shared + {own} own "
        f"tokens, Hq={hq}, Hkv={hkv}, D={d}, bf16 pages, kernel ISA {module.kernel_isa()}"
    )
    qf = q.float()
    cases = [
        ("bf16 kernel", lambda gr: module.paged_attention(q, k, v, table, *lens, *gr)),
        ("float32-math kernel", lambda gr: module.paged_attention_f32(qf, k, v, table, *lens, *gr)),
    ]
    for name, run in cases:
        plain = cpu_time_ms(lambda run=run: run(none), iters)
        grouped = cpu_time_ms(lambda run=run: run(groups), iters)
        err = (run(groups).float() - run(none).float()).abs().max().item()
        print(
            f"{name:>20}: no groups {plain:.3f} ms, groups {grouped:.3f} ms, "
            f"{plain / grouped:.2f}x (max |diff| {err:.1e})"
        )
    # In a decode step the linears run between two layers' attention and evict its K/V: the
    # same call with the caches flushed (a 96 MiB write, untimed) before each one.
    flush = torch.empty(96 << 20, dtype=torch.uint8)
    hot = cpu_time_ms(lambda: cases[0][1](groups), 3 * iters)
    cold = cpu_time_ms(lambda: cases[0][1](groups), 3 * iters, before=lambda: flush.add_(1))
    print(
        f"{cases[0][0]:>20}: groups, caches flushed before each call {cold:.3f} ms, "
        f"hot {hot:.3f} ms ({cold / hot:.2f}x)"
    )
    print(
        "quantized pages (ratio = quantized time / bf16-page time of the same kernel and groups; "
        "max |diff| against the kernel over bf16 pages)"
    )
    pools = [
        (label, quantize(k, storage), quantize(v, storage))
        for label, storage in (("int8", torch.int8), ("fp8_e4m3", torch.uint8))
    ]
    kernels = [
        ("bf16 kernel", lambda k, v, gr: module.paged_attention(q, k, v, table, *lens, *gr)),
        (
            "float32-math kernel",
            lambda k, v, gr: module.paged_attention_f32(qf, k, v, table, *lens, *gr),
        ),
    ]
    for name, run in kernels:
        for gr_label, gr in (("groups", groups), ("no groups", none)):
            base = cpu_time_ms(lambda run=run, gr=gr: run(k, v, gr), iters)
            ref = run(k, v, gr).float()
            for label, kq, vq in pools:
                ms = cpu_time_ms(lambda run=run, gr=gr, kq=kq, vq=vq: run(kq, vq, gr), iters)
                err = (run(kq, vq, gr).float() - ref).abs().max().item()
                print(
                    f"{name:>20}, {gr_label:>9}: bf16 pages {base:.3f} ms, {label:>8} pages "
                    f"{ms:.3f} ms, ratio {ms / base:.2f} (max |diff| {err:.1e})"
                )


def bench_cpu_backend(
    iters: int,
    name: str,
    dtype: torch.dtype,
    decode_fn: Callable[..., torch.Tensor],
    extend_fn: Callable[..., torch.Tensor],
) -> None:
    """One paged backend against SDPA over contiguous K/V of the same dtype."""
    device = torch.device("cpu")
    hkv, group, d, page_size = 4, 4, 64, 16
    hq = hkv * group
    scale = d**-0.5
    print()
    print(
        f"CPU ({torch.get_num_threads()} threads), {dtype}, Hq={hq}, Hkv={hkv}, D={d}, page={page_size}"
    )
    print(f"paged backend: {name}; baseline: SDPA over contiguous per-request K/V")
    print(
        f"{'kind':>7} {'batch':>6} {'context':>12} {'paged ms':>9} {'naive ms':>9} {'ratio':>6} {'max err':>8}"
    )
    for batch, ctx in [(1, 2048), (8, 512), (8, 2048), (32, 1024)]:
        lens = [ctx] * batch
        prob = make_problem(lens, page_size, hkv, d, dtype, device)
        q = torch.randn(batch, hq, d).to(dtype)
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        args = (q, prob.k_cache, prob.v_cache, prob.page_table, seq_lens, scale)
        paged_ms = cpu_time_ms(lambda args=args: decode_fn(*args), iters)
        naive_ms = cpu_time_ms(lambda q=q, prob=prob: naive_decode(q, prob, scale), iters)
        err = (decode_fn(*args).float() - naive_decode(q, prob, scale).float()).abs().max().item()
        print(
            f"{'decode':>7} {batch:>6} {ctx:>12} {paged_ms:>9.2f} {naive_ms:>9.2f}"
            f" {paged_ms / naive_ms:>6.2f} {err:>8.1e}"
        )
    for batch, prefix_len, ext_len in [(1, 0, 512), (1, 0, 1024), (2, 512, 256), (4, 1024, 64)]:
        prefix = [prefix_len] * batch
        ext = [ext_len] * batch
        prob = make_problem(
            [p + e for p, e in zip(prefix, ext, strict=True)], page_size, hkv, d, dtype, device
        )
        q = torch.randn(sum(ext), hq, d).to(dtype)
        starts = [sum(ext[:i]) for i in range(batch)]
        args = (
            q,
            prob.k_cache,
            prob.v_cache,
            prob.page_table,
            _i32(prefix),
            _i32(ext),
            _i32(starts),
            scale,
        )
        paged_ms = cpu_time_ms(lambda args=args: extend_fn(*args), iters)
        naive_ms = cpu_time_ms(
            lambda q=q, prob=prob, prefix=prefix, ext=ext: naive_extend(
                q, prob, prefix, ext, scale
            ),
            iters,
        )
        ref = naive_extend(q, prob, prefix, ext, scale).float()
        err = (extend_fn(*args).float() - ref).abs().max().item()
        ctx = f"{prefix_len}+{ext_len}"
        print(
            f"{'extend':>7} {batch:>6} {ctx:>12} {paged_ms:>9.2f} {naive_ms:>9.2f}"
            f" {paged_ms / naive_ms:>6.2f} {err:>8.1e}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=None, help="timed repeats per case")
    parser.add_argument("--cpu", action="store_true", help="run the CPU comparison even on a GPU")
    parser.add_argument(
        "--groups-only",
        action="store_true",
        help="CPU: only the shared-prefix decode burst (bf16 vs quantized pages)",
    )
    parser.add_argument(
        "--window-only",
        action="store_true",
        help="CPU: only the sliding-window decode (window 256 over 4,096 tokens vs full)",
    )
    parser.add_argument(
        "--process-time",
        action="store_true",
        help="CPU: time the process's CPU time, not the wall clock (a shared host)",
    )
    args = parser.parse_args()
    if args.process_time:
        CLOCK["now"] = time.process_time
    torch.manual_seed(0)
    if torch.cuda.is_available() and not args.cpu:
        bench_gpu(args.iters or 20)
    else:
        bench_cpu(args.iters or 5, args.groups_only, args.window_only)


if __name__ == "__main__":
    main()
