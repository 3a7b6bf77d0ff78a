"""The CUDA code paths one GPU can exercise (no second GPU for NCCL between ranks).

    python benchmarks/gpu_checks/single_gpu.py --out results.md

Checks, each printed as one line ``PASS|FAIL name: detail`` and written to --out:

1. stage compute on CUDA: a Pipeline on a one-rank NCCL group (1F1B, m = 4) gives the loss and
   gradients of the unsplit model on the GPU (float32, TF32 off);
2. bf16: the same pipeline with bf16 parameters and inputs agrees with float32 to bf16 rounding;
3. freed outputs on CUDA: ``Stage.deallocate_outputs`` returns the output's memory to the
   allocator and the gradients stay bitwise equal;
4. peak memory: the bytes held by k micro-batches in flight, and ``torch.cuda.max_memory_allocated``
   from two on, grow by one micro-batch's activations each (what the simulator's peak count
   multiplies);
5. comm stream: ``P2PComm.wait`` on CUDA only orders the current stream after the NCCL stream
   (no host sync, even with a deadline set): this waits on an all-reduce whose input comes from
   a long kernel chain; the host must return long before the GPU is done;
6. batched send to self: after a first exchange (the group's first P2P; the runtime's warm-up
   is one), one ``batch_isend_irecv`` (isend to rank 0 and irecv from it, on the
   one-rank NCCL group) posted while the compute stream is still busy with the kernels that
   make the sent tensor: the host does not block, the received values are the sent ones, and
   the sent tensor, freed at once and its memory handed to a new tensor that is overwritten,
   still arrives intact (the NCCL work holds it until the transfer is done); the deadline
   watchdog, on this GPU, watches the wait and does not fire; it stops and joins;
7. CUDA-event timing: ``CudaEventClock`` times a kernel chain as the GPU ran it (within 20 % of
   the synchronised wall time), while the host clock sees only its launch.

Exits non-zero if any check fails; without CUDA it says so and exits 2.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tree's root: its pipeflow, benchmarks.runner

from pipeflow.runtime.events import CudaEventClock, EventRecorder, HostClock  # noqa: E402
from pipeflow.runtime.transport import DeadlineWatchdog, P2PComm  # noqa: E402
from pipeflow.runtime.pipeline import Pipeline  # noqa: E402
from pipeflow.schedules import build_schedule  # noqa: E402
from pipeflow.runtime.stage import Stage  # noqa: E402
from benchmarks.runner import benchmark_parser, mse  # noqa: E402

DEVICE = torch.device("cuda", 0)


def layers(dtype: torch.dtype, hidden: int = 256, count: int = 4) -> list[nn.Module]:
    """Linear + GELU layers, seeded."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(hidden, hidden), nn.GELU()).to(DEVICE, dtype) for _ in range(count)]


def pipelined(dtype: torch.dtype, m: int = 4) -> tuple[float, list[torch.Tensor]]:
    """Loss and grads of one 1F1B step on a one-rank pipeline (every stage on this GPU)."""
    schedule = build_schedule("1f1b", 1, m)
    stage = Stage(0, 1, layers(dtype), mse)
    pipe = Pipeline({0: stage}, schedule, P2PComm(None, DEVICE))
    x, y = batch(dtype)
    loss = pipe.run([(mb,) for mb in x.chunk(m)], list(y.chunk(m)))
    return float(loss), [p.grad.float() for p in stage.parameters()]


def batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same inputs and targets every time."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    return x.to(DEVICE, dtype), y.to(DEVICE, dtype)


def check_stage_compute() -> str:
    loss, grads = pipelined(torch.float32)
    model = nn.Sequential(*layers(torch.float32))
    x, y = batch(torch.float32)
    ref = mse(model(x), y)
    ref.backward()
    worst = max(float((g - p.grad).abs().max() / p.grad.abs().max()) for g, p in zip(grads, model.parameters()))
    assert abs(loss - float(ref)) <= 1e-5 * abs(float(ref)) and worst <= 1e-4, (loss, float(ref), worst)
    return f"loss {loss:.6f} vs unsplit {float(ref):.6f}, worst grad rel. diff {worst:.1e}"


def check_bf16() -> str:
    loss32, grads32 = pipelined(torch.float32)
    loss16, grads16 = pipelined(torch.bfloat16)
    worst = max(float((a - b).norm() / b.norm()) for a, b in zip(grads16, grads32))
    assert abs(loss16 - loss32) <= 0.02 * abs(loss32) and worst <= 0.05, (loss16, loss32, worst)
    return f"bf16 loss {loss16:.5f} vs fp32 {loss32:.5f}, worst grad rel. norm diff {worst:.3f}"


def check_freed_outputs() -> str:
    results, freed = [], 0
    for free in (False, True):
        stage = Stage(0, 2, layers(torch.float32))
        x = torch.randn(512, 256, device=DEVICE, requires_grad=True)
        (out,) = stage.forward(0, (x,))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if free:
            stage.deallocate_outputs(0)
            freed = before - torch.cuda.memory_allocated()
        (gx,) = stage.backward(0, (torch.ones(512, 256, device=DEVICE),))
        results.append([gx] + [p.grad for p in stage.parameters()])
        del out
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert freed >= 512 * 256 * 4, freed
    return f"freed {freed} bytes of a {512 * 256 * 4}-byte output; grads bitwise equal"


def check_peak_memory(k: int = 6) -> str:
    stage = Stage(0, 2, layers(torch.float32))
    peaks, held_bytes = [], []
    for held in range(1, k + 1):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for i in range(held):
            x = torch.randn(256, 256, device=DEVICE, requires_grad=True)
            stage.forward(i, (x,))
        del x
        held_bytes.append(torch.cuda.memory_allocated() - base)
        peaks.append(torch.cuda.max_memory_allocated() - base)
        for i in range(held):
            grads = tuple(torch.ones_like(t) for t in stage._outputs[i])
            stage.backward(i, grads)
        for p in stage.parameters():
            p.grad = None
    held_steps = [b - a for a, b in zip(held_bytes, held_bytes[1:])]
    # The allocator's peak at one held micro-batch may include a transient that later held tensors
    # cover (512 KiB on the first H200 run, none on the second): its growth is checked from two on.
    peak_steps = [b - a for a, b in zip(peaks[1:], peaks[2:])]
    for steps in (held_steps, peak_steps):
        assert (max(steps) - min(steps)) / max(steps) <= 0.1, (held_bytes, peaks)
    return (f"held bytes grow {'/'.join(map(str, held_steps))} per micro-batch; the allocator's peak grows "
            f"{'/'.join(map(str, peak_steps))} from 2 held on (1 held: {peaks[0]} bytes, "
            f"{peaks[0] - held_bytes[0]} of them transient)")


def check_stream_wait() -> str:
    a = torch.randn(4096, 4096, device=DEVICE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(40):  # a long chain on the current stream that the collective's input needs
        a = a @ a / 4096
    work = dist.all_reduce(a.sum().reshape(1), async_op=True)  # NCCL stream waits for the chain
    queued = time.perf_counter()
    P2PComm(None, DEVICE, timeout_s=60).wait([work])  # a deadline is given: still no host block
    host = time.perf_counter() - queued
    torch.cuda.synchronize()
    gpu = time.perf_counter() - start
    assert host < gpu / 4, (host, gpu)
    return f"wait returned after {host * 1e3:.2f} ms, the GPU work after {gpu * 1e3:.1f} ms"


def busy_chain(n: int = 4096, links: int = 40) -> torch.Tensor:
    """A long chain of matrix products queued on the current stream (the host returns at once)."""
    a = torch.randn(n, n, device=DEVICE)
    for _ in range(links):
        a = a @ a / n
    return a


def _exchange_behind_busy_stream(comm: P2PComm) -> tuple[float, float, float, bool]:
    """Post one batched send-to-self + receive behind a busy compute stream, wait, free the sent
    tensor and reuse its memory; (post s, wait s, GPU s, values equal)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    chain = busy_chain()
    send = chain[:256, :256].contiguous() + 1.0  # made by the chain: NCCL must wait for it
    expected = send.clone()  # queued on the compute stream too
    recv = torch.empty_like(send)
    posted = time.perf_counter()
    works = comm.post([(0, send)], [(0, recv)])
    waited = time.perf_counter()
    comm.wait(works, "send to self and receive from self")
    done = time.perf_counter()
    del send, chain  # freed while the transfer may still be queued...
    reuse = torch.empty(256, 256, device=DEVICE).fill_(-7.0)  # ...and its memory handed out again
    result = recv * 1.0  # ordered after the recv by the wait
    torch.cuda.synchronize()
    gpu = time.perf_counter() - start
    del reuse
    return waited - posted, done - waited, gpu, torch.equal(result, expected)


def check_self_exchange() -> str:
    fired: list[Exception] = []
    watchdog = DeadlineWatchdog(fired.append, poll_s=0.05, device=DEVICE)
    comm = P2PComm(None, DEVICE, timeout_s=60, watchdog=watchdog)
    first = _exchange_behind_busy_stream(comm)  # the group's first P2P (the runtime's warm-up is one)
    post, wait, gpu, equal = _exchange_behind_busy_stream(comm)
    plain = _exchange_behind_busy_stream(P2PComm(None, DEVICE))  # no deadline, no watchdog
    time.sleep(0.2)  # the watchdog polls the completed works and drops them
    watchdog.stop()
    told = (f"first exchange: post {first[0] * 1e3:.1f} ms + wait {first[1] * 1e3:.1f} ms of {first[2] * 1e3:.1f} ms "
            f"on the GPU; then post {post * 1e3:.2f} ms + wait {wait * 1e3:.2f} ms of {gpu * 1e3:.1f} ms; "
            f"without deadline or watchdog post {plain[0] * 1e3:.2f} ms + wait {plain[1] * 1e3:.2f} ms")
    assert post + wait < gpu / 4, f"the host blocked: {told}"
    assert first[3] and equal and plain[3], f"received values differ: {told}"
    assert not fired and not watchdog.alive, (fired, watchdog.alive)
    return f"{told}; values equal; watchdog quiet, stopped"


def check_event_timing() -> str:
    torch.cuda.synchronize()
    times = {}
    for name, clock in (("events", CudaEventClock(DEVICE)), ("host", HostClock())):
        recorder = EventRecorder(clock)
        recorder.start()
        t0 = recorder.mark()
        busy_chain()
        recorder.record("F", "0F0", t0, recorder.mark())
        (event,) = recorder.stop()
        times[name] = event.end - event.start
    torch.cuda.synchronize()
    wall_start = time.perf_counter()
    busy_chain()
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall_start
    assert abs(times["events"] - wall) <= 0.2 * wall, (times, wall)
    assert times["host"] < wall / 4, (times, wall)
    return (f"chain: CUDA events {times['events'] * 1e3:.1f} ms, synchronised wall {wall * 1e3:.1f} ms, "
            f"host clock (launch only) {times['host'] * 1e3:.2f} ms")


def main() -> None:
    parser = benchmark_parser(__file__, __doc__)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("single_gpu.py needs a CUDA device; none here, nothing checked", flush=True)
        sys.exit(2)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(DEVICE)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=DEVICE)
    lines, failed = [f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}"], 0
    checks = [("stage compute on CUDA", check_stage_compute), ("bf16", check_bf16),
              ("freed outputs on CUDA", check_freed_outputs), ("peak memory", check_peak_memory),
              ("comm wait is a stream wait", check_stream_wait),
              ("batched send to self while the compute stream is busy", check_self_exchange),
              ("CUDA-event timing", check_event_timing)]
    for name, check in checks:
        try:
            lines.append(f"PASS {name}: {check()}")
        except Exception as exc:  # noqa: BLE001 - report every check
            failed += 1
            lines.append(f"FAIL {name}: {type(exc).__name__}: {exc}")
        print(lines[-1], flush=True)
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
