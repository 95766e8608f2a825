"""ModelStreamInfer on several streams of one connection whose client never reads its
responses: what the connection takes from the client is bounded across its streams
(``max_pending_bytes``), not per stream, so the requests answered and held for the
client stay few."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trio.testing

import trioserve
from trioserve import ServerConfig, TensorSpec
from trioserve._limits import GrpcLimits
from trioserve.grpc import _h2_frames as frames
from trioserve.grpc._generated import grpc_service_pb2 as pb

KiB = 1024
REQUEST = 64 * KiB
STREAMS = 8


def counting_identity() -> tuple[Any, list[int]]:
    answered = [0]

    @trioserve.model(
        name="echo",
        inputs=[TensorSpec("INPUT0", "UINT8", [-1])],
        outputs=[TensorSpec("OUTPUT0", "UINT8", [-1])],
    )
    async def echo(INPUT0: np.ndarray[Any, Any]) -> dict[str, Any]:
        answered[0] += 1
        return {"OUTPUT0": INPUT0}

    return echo, answered


async def test_unread_stream_responses_are_bounded_per_connection(
    h2c: Any, nursery: trio.Nursery
) -> None:
    model, answered = counting_identity()
    limits = GrpcLimits(max_pending_bytes=1024 * KiB, connection_window_bytes=4096 * KiB)
    config = ServerConfig(models=[model], http_port=None, grpc_port=0, grpc_limits=limits)
    server = await nursery.start(trioserve.serve, config)
    request = pb.ModelInferRequest(model_name="echo", raw_input_contents=[bytes(REQUEST)])
    request.inputs.add(name="INPUT0", datatype="UINT8", shape=[REQUEST])
    payload = request.SerializeToString()
    per_stream = 200  # more than a call answers at once (128)
    # A client that reads frames but never acknowledges the data it gets: the server's
    # answers wait on the client's windows.
    async with h2c.RawClient.connect(server.grpc_port, window=65_535) as client:
        await client.until(lambda: frames.MAX_FRAME_SIZE in client.settings)
        path = "/inference.GRPCInferenceService/ModelStreamInfer"
        sids = [client.start_call(path) for _ in range(STREAMS)]
        unsent = dict.fromkeys(sids, per_stream)
        framed = len(payload) + 5

        async def send_what_windows_allow() -> None:
            while any(unsent.values()):
                sent = False
                for sid in sids:  # one message for each stream in turn
                    if unsent[sid] and client.h2.local_flow_control_window(sid) >= framed:
                        client.send_message(sid, payload, end=False)
                        unsent[sid] -= 1
                        sent = True
                await client.flush()
                if not sent:
                    await client.receive()  # window updates, if the server gives any

        async with trio.open_nursery() as sending:
            sending.start_soon(send_what_windows_allow)
            await trio.testing.wait_all_tasks_blocked()
            # The budget's 1 MiB is 16 requests, and a stream owing nothing may take
            # one more; without the bound, each stream's call took 128 at once.
            assert answered[0] <= 16 + STREAMS + STREAMS
            assert sum(unsent.values()) > 0  # the client is held by flow control
            await h2c.probe(server.grpc_port, "/inference.GRPCInferenceService/ServerLive")
            sending.cancel_scope.cancel()
