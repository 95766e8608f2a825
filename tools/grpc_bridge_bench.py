"""What hosting grpclib inside trio costs: the gRPC front end on four stacks, side by side.

    asyncio                  grpclib on a plain asyncio loop; the model called inline
    trio-asyncio-direct      the same service hosted through trio-asyncio (as trioserve
                             does); the model still called inline on the asyncio side
    trio-asyncio-crossing    as above, but each request crosses into trio as the
                             bridge does (``loop.trio_as_future``), the model called there
    trioserve                the grpclib front end (``grpc_server="grpclib"``): the
                             whole handler in trio, the inference pipeline, the model
                             behind its batcher queue

All four decode and encode with trioserve's gRPC codec, count load alike, and serve the
zoo's ``simple`` model (two INT32 [1, 16] inputs, raw contents). The server runs in a
child process pinned to one core, the grpc.aio load generator in this process pinned to
another; each concurrency level runs for ``--seconds`` after a one-second warm-up.
``srv us/r`` is the server's CPU time per request, the figure least disturbed by other
load on the machine. The last two columns are the CPU each process used over the
measured window (100% = one core): a client near 100% would mean the load generator,
not the server, is the limit.

    python tools/grpc_bridge_bench.py --seconds 5 --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

# Everything else is imported inside the functions, after ``sched_setaffinity``: threads
# started at import (BLAS pools, grpc's) would not inherit the pinning otherwise.

VARIANTS = ("asyncio", "trio-asyncio-direct", "trio-asyncio-crossing", "trioserve")
METHOD = "/inference.GRPCInferenceService/ModelInfer"
LIMIT = 2**31 - 1


# --- server side (child process) ---------------------------------------------------


def _repository() -> Any:
    from trioserve._served import ModelRepository
    from trioserve.models import reference_zoo
    from trioserve.scheduler._runner import ModelRunner

    return ModelRepository(ModelRunner(m, v) for m in reference_zoo() for v in m.versions)


def _direct_infer() -> Any:
    """The model called inline, after the same validation ``ModelRunner.infer`` does."""
    import inspect

    import numpy as np

    from trioserve import InferenceResponse, OutputTensor
    from trioserve._validation import validate_request

    async def infer(runner: Any, request: Any) -> Any:
        model = runner.model
        validate_request(model, request)
        results = model.execute([request])
        if inspect.isawaitable(results):  # the zoo's arithmetic models are async def
            results = await results
        (outputs,) = results
        tensors = [
            OutputTensor(spec.name, spec.wire_datatype, np.asarray(outputs[spec.name]))
            for spec in model.outputs
        ]
        return InferenceResponse(model.name, runner.version, tensors, id=request.id)

    return infer


def _servable(repository: Any, infer: Any, load: Any) -> Any:
    """grpclib's side of ModelInfer alone, with trioserve's codec and load counting:
    ``infer(served, request)`` is what each variant varies."""
    from grpclib.const import Cardinality, Handler

    from trioserve.grpc._codec import decode_request, encode_response
    from trioserve.grpc._generated import grpc_service_pb2 as pb

    async def model_infer(stream: Any) -> None:
        message = await stream.recv_message()
        served = repository.get(message.model_name, message.model_version)
        request = decode_request(message)
        with load.counting(served):
            response = await infer(served, request)
        await stream.send_message(encode_response(response))

    handler = Handler(
        model_infer, Cardinality.UNARY_UNARY, pb.ModelInferRequest, pb.ModelInferResponse
    )

    class Servable:
        def __mapping__(self) -> dict[str, Any]:
            return {METHOD: handler}

    return Servable()


def _announce(port: int) -> None:
    print(f"PORT {port}", flush=True)


async def _serve_asyncio() -> None:
    from grpclib.server import Server

    from trioserve.grpc._grpclib import _listen
    from trioserve.metrics._orca import LoadReporter

    listener = _listen("127.0.0.1", 0)
    # The same per-request load counting as under trio, on the only clock asyncio has.
    load = LoadReporter(clock=time.monotonic)
    server = Server([_servable(_repository(), _direct_infer(), load)])
    await server.start(sock=listener)
    _announce(listener.getsockname()[1])
    await asyncio.Event().wait()


async def _serve_trio(variant: str) -> None:
    import trio
    import trio_asyncio
    from grpclib.server import Server

    import trioserve
    from trioserve.grpc._grpclib import _listen
    from trioserve.metrics._orca import LoadReporter
    from trioserve.models._zoo import reference_zoo

    if variant == "trioserve":
        config = trioserve.ServerConfig(
            models=reference_zoo(), http_port=None, grpc_port=0, grpc_server="grpclib"
        )
        async with trioserve.open_server(config) as server:
            _announce(server.grpc_port)
            await trio.sleep_forever()
        return

    repository = _repository()
    direct = _direct_infer()
    async with trio_asyncio.open_loop() as loop:
        if variant == "trio-asyncio-direct":

            async def infer(runner: Any, request: Any) -> Any:
                return await direct(runner, request)

        else:

            async def in_trio(runner: Any, request: Any) -> Any:
                return await direct(runner, request)

            def infer(runner: Any, request: Any) -> Any:
                return loop.trio_as_future(in_trio, runner, request)

        listener = _listen("127.0.0.1", 0)
        server = Server([_servable(repository, infer, LoadReporter())])
        await trio_asyncio.aio_as_trio(server.start)(sock=listener)
        _announce(listener.getsockname()[1])
        await trio.sleep_forever()


def serve(variant: str, cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})  # before any thread exists: threads inherit it
    if variant == "asyncio":
        asyncio.run(_serve_asyncio())
    else:
        import trio

        trio.run(_serve_trio, variant)


# --- client side (this process) ----------------------------------------------------


def _request_bytes() -> bytes:
    import numpy as np
    from tritonclient.grpc import service_pb2

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(a.tobytes())
    return request.SerializeToString()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _load(port: int, server_pid: int, concurrency: int, seconds: float) -> str:
    """Drive the server; one result row: req/s, latency percentiles, CPU use of each side."""
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2

    options = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        call = channel.unary_unary(METHOD)  # bytes in, bytes out: no client-side protobuf
        body = _request_bytes()
        reply = service_pb2.ModelInferResponse.FromString(await call(body))
        total = np.frombuffer(reply.raw_output_contents[0], dtype=np.int32)
        assert total.tolist() == (2 * np.arange(16)).tolist(), "wrong answer"

        latencies: list[float] = []

        async def worker(stop_at: float, record: bool) -> None:
            while (now := time.perf_counter()) < stop_at:
                await call(body)
                if record:
                    latencies.append(time.perf_counter() - now)

        async def phase(duration: float, record: bool) -> None:
            stop_at = time.perf_counter() + duration
            await asyncio.gather(*(worker(stop_at, record) for _ in range(concurrency)))

        await phase(1.0, record=False)  # warm-up: connections, caches, the batcher
        wall, client, server = time.perf_counter(), time.process_time(), _cpu_seconds(server_pid)
        await phase(seconds, record=True)
        wall = time.perf_counter() - wall
        client = time.process_time() - client
        server = _cpu_seconds(server_pid) - server

    latencies.sort()
    p50 = statistics.median(latencies) * 1e3
    p99 = latencies[int(len(latencies) * 0.99)] * 1e3
    rate = len(latencies) / wall
    per_request = server / len(latencies) * 1e6
    return (
        f"{concurrency:>4} {rate:>9.0f} {p50:>8.2f} {p99:>8.2f} {per_request:>8.0f}"
        f" {server / wall:>7.0%} {client / wall:>7.0%}"
    )


def _run_variant(variant: str, args: argparse.Namespace) -> None:
    command = [sys.executable, __file__, "--serve", variant, "--server-cpu", str(args.server_cpu)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("PORT "):
            raise RuntimeError(f"{variant}: server did not start ({line!r})")
        port = int(line.split()[1])
        for concurrency in args.concurrency:
            row = asyncio.run(_load(port, server.pid, concurrency, args.seconds))
            print(f"{variant:<22} {row}", flush=True)
    finally:
        server.terminate()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--server-cpu", type=int, default=0)
    parser.add_argument("--client-cpu", type=int, default=1)
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.server_cpu)
        return
    os.sched_setaffinity(0, {args.client_cpu})
    header = f"{'variant':<22} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8}"
    print(f"{header} {'srv us/r':>8} {'server':>7} {'client':>7}", flush=True)
    for variant in args.variants:
        _run_variant(variant, args)


if __name__ == "__main__":
    main()
