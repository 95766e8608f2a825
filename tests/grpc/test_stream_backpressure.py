"""A ModelStreamInfer client that sends faster than it reads is held back: a call
answers a bounded number of requests at once and leaves the rest unread, for the
transport's flow control to hold."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio
import trio.testing

import trioserve
from trioserve import ServerConfig, TensorSpec
from trioserve.grpc._generated import grpc_service_pb2 as pb
from trioserve.grpc._stream import MAX_IN_FLIGHT
from trioserve.testing import GatedModel, gated


def held_model() -> GatedModel:
    @trioserve.model(
        name="held",
        inputs=[TensorSpec("INPUT0", "FP32", [1])],
        outputs=[TensorSpec("OUTPUT0", "FP32", [1])],
    )
    def identity(INPUT0: np.ndarray[Any, Any]) -> dict[str, Any]:
        return {"OUTPUT0": INPUT0}

    return gated(identity)


async def test_a_flood_of_stream_requests_is_held_at_the_in_flight_bound(
    h2c: Any, nursery: trio.Nursery
) -> None:
    held = held_model()
    config = ServerConfig(models=[held], http_port=None, grpc_port=0)
    server = await nursery.start(trioserve.serve, config)
    request = pb.ModelInferRequest(model_name="held", raw_input_contents=[b"\0" * 4])
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1])
    payload = request.SerializeToString()
    async with h2c.RawClient.connect(server.grpc_port, window=65_535) as client:
        stream_id = client.start_call("/inference.GRPCInferenceService/ModelStreamInfer")
        for _ in range(3 * MAX_IN_FLIGHT):
            client.send_message(stream_id, payload, end=False)
        await client.flush()
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        load = server.repository.get("held").statistics()
        assert load.queued + load.executing == MAX_IN_FLIGHT  # not 3 * MAX_IN_FLIGHT
        held.release.set()
        # Once released, every request is answered.
        reply = client.replies[stream_id]
        await client.until(lambda: len(h2c.messages(reply.data)) == 3 * MAX_IN_FLIGHT)
